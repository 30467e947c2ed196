"""Bounded in-memory incident store and alert de-duplication."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from .schemas import Incident


class IncidentStore:
    """The most recent ``maxlen`` incidents, newest last; O(1) insert and lookup."""

    def __init__(self, maxlen: int = 500) -> None:
        assert maxlen > 0
        self.maxlen = maxlen
        self._items: OrderedDict[str, Incident] = OrderedDict()
        self._by_fingerprint: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._items)

    def add(self, incident: Incident) -> None:
        self._items[incident.id] = incident
        self._by_fingerprint[incident.fingerprint] = incident.id
        while len(self._items) > self.maxlen:
            _, old = self._items.popitem(last=False)
            if self._by_fingerprint.get(old.fingerprint) == old.id:
                del self._by_fingerprint[old.fingerprint]

    def get(self, incident_id: str) -> Incident | None:
        return self._items.get(incident_id)

    def recent(self, limit: int | None = None) -> list[Incident]:
        """Newest first."""
        items = list(reversed(self._items.values()))
        return items if limit is None else items[:limit]

    def mark_resolved(self, fingerprint: str, resolved_at: float) -> bool:
        incident_id = self._by_fingerprint.get(fingerprint)
        incident = self._items.get(incident_id) if incident_id else None
        if incident is None:
            return False
        incident.status = "resolved"
        incident.resolved_at = resolved_at
        return True


class Deduplicator:
    """Remembers keys for ``ttl_s`` seconds (at most ``maxlen`` of them).

    Alertmanager re-sends every firing alert of a group at each group_interval; the
    webhook analyses an alert once per ``ttl_s``.
    """

    def __init__(
        self, ttl_s: float, maxlen: int = 10_000, clock: Callable[[], float] | None = None
    ) -> None:
        self.ttl_s = ttl_s
        self.maxlen = maxlen
        self._clock = clock or time.monotonic
        self._seen: OrderedDict[str, float] = OrderedDict()

    def seen(self, key: str) -> bool:
        """True when ``key`` was seen within the ttl; otherwise remember it."""
        now = self._clock()
        while self._seen:
            oldest_key, t = next(iter(self._seen.items()))
            if now - t < self.ttl_s:
                break
            del self._seen[oldest_key]
        if key in self._seen:
            return True
        self._seen[key] = now
        if len(self._seen) > self.maxlen:
            self._seen.popitem(last=False)
        return False

    def forget(self, key: str) -> None:
        self._seen.pop(key, None)
