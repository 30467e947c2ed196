"""The scheduler's waiting sequences, admitted round-robin across tenants.

A tenant is whatever the caller tags a request with (the service: the API key's name). While
the queue is contended, one tenant with a hundred queued requests must not hold back another
tenant's one: admission takes the head of each tenant's queue in turn, and the tenant served
last always comes last, behind a tenant that has just arrived. Preempted sequences
come first, ahead of every tenant (they were running; their cache is being recomputed), in the
order the scheduler put them back. With a single tenant (untagged requests, one key) this is
the plain FIFO it replaces, at the same cost: deque operations and one dict lookup.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from inference.sequence import Sequence


class WaitingQueue:
    def __init__(self) -> None:
        self._resume: deque[Sequence] = deque()  # preempted, to be recomputed first
        # tenant -> its sequences in arrival order; the tenant whose turn it is comes first
        self._tenants: OrderedDict[str | None, deque[Sequence]] = OrderedDict()
        self._served: str | None = None  # the tenant whose sequence was admitted last
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def append(self, seq: Sequence) -> None:
        """A new sequence, behind the others of its tenant (a new tenant takes the last turn)."""
        queue = self._tenants.get(seq.tenant)
        if queue is None:
            queue = self._tenants[seq.tenant] = deque()
            if self._served in self._tenants and self._served != seq.tenant:
                self._tenants.move_to_end(self._served)  # it has just had its turn
        queue.append(seq)
        self._len += 1

    def appendleft(self, seq: Sequence) -> None:
        """A preempted sequence: it is the next one out."""
        self._resume.appendleft(seq)
        self._len += 1

    def peek(self) -> Sequence:
        """The next sequence out (IndexError when empty)."""
        if self._resume:
            return self._resume[0]
        for queue in self._tenants.values():
            return queue[0]
        raise IndexError("the waiting queue is empty")

    def popleft(self) -> Sequence:
        """Removes and returns `peek()`; its tenant's turn passes to the next tenant."""
        if self._resume:
            self._len -= 1
            return self._resume.popleft()
        tenant, queue = next(iter(self._tenants.items()))
        seq = queue.popleft()
        if not queue:
            del self._tenants[tenant]
        elif len(self._tenants) > 1:
            self._tenants.move_to_end(tenant)
        self._served = tenant
        self._len -= 1
        return seq

    def remove(self, seq: Sequence) -> None:
        """Takes out a sequence wherever it waits (an abort); ValueError if it is not here."""
        if seq in self._resume:
            self._resume.remove(seq)
        else:
            queue = self._tenants.get(seq.tenant)
            if queue is None:
                raise ValueError(f"{seq.seq_id} is not waiting")
            queue.remove(seq)
            if not queue:
                del self._tenants[seq.tenant]
        self._len -= 1
