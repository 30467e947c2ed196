"""Requests whose grammar is still compiling off the step path (it took longer than the
structured-output manager's sync_compile_s): they join the scheduler once it is done, or
leave the engine with its error (LLMEngine.take_rejected)."""

from __future__ import annotations

from concurrent import futures

import structlog

from inference.errors import InvalidParameterError
from inference.sequence import Sequence
from inference.structured import CompileJob, StructuredOutputManager

log = structlog.get_logger("inference.engine")


class PendingGrammars:
    def __init__(self, structured: StructuredOutputManager) -> None:
        self.structured = structured
        self.jobs: dict[str, tuple[CompileJob, list[Sequence]]] = {}
        self.on_done = None  # called (from the compiler thread) as such a compile ends
        self.rejected: list[tuple[str, InvalidParameterError]] = []

    def __bool__(self) -> bool:
        return bool(self.jobs)

    @property
    def num_sequences(self) -> int:
        return sum(len(seqs) for _, seqs in self.jobs.values())

    def add(self, request_id: str, job: CompileJob, seqs: list[Sequence]) -> None:
        self.jobs[request_id] = (job, seqs)
        done = self.on_done
        if done is not None:
            job.future.add_done_callback(lambda _: done())

    def discard(self, request_id: str) -> bool:
        """Forgets a request (aborted); whether it was waiting here."""
        return self.jobs.pop(request_id, None) is not None

    def poll(self, admit) -> list[str]:
        """Requests whose grammar is done leave this list: those that compiled go to
        `admit(seqs, job)`, those it failed for are kept for take_rejected() and their ids
        returned (the engine forgets them)."""
        failed = []
        for request_id, (job, seqs) in list(self.jobs.items()):
            try:
                if not self.structured.finish(job):
                    continue
            except InvalidParameterError as exc:
                self.rejected.append((request_id, exc))
                failed.append(request_id)
                log.info("request rejected", param=exc.param, **seqs[0].log_context)
            else:
                admit(seqs, job)
            del self.jobs[request_id]
        return failed

    def take_rejected(self) -> list[tuple[str, InvalidParameterError]]:
        """(request_id, error) of each request whose grammar failed since the last call."""
        rejected, self.rejected = self.rejected, []
        return rejected

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until one of the pending grammars is compiled (or `timeout` seconds)."""
        pending = [job.future for job, _ in self.jobs.values()]
        if pending:
            futures.wait(pending, timeout, return_when=futures.FIRST_COMPLETED)
