"""Offline batch generation over an LLMEngine (vLLM's LLM.generate): the prompts' requests
added, then steps until every one has finished."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import structlog

from inference.heap import collector_skips_existing
from inference.outputs import RequestOutput
from inference.prompts import Prompt
from inference.sampling_params import SamplingParams

if TYPE_CHECKING:
    from inference.engine import LLMEngine

log = structlog.get_logger("inference.engine")


def generate_offline(
    engine: LLMEngine, prompts: Prompt | list[Prompt], params: SamplingParams
) -> list[RequestOutput]:
    """The final output of each prompt (a text, a list of token ids, or a list of either), in
    order. A grammar that fails to compile aborts the batch and raises its error."""
    if isinstance(prompts, str) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        prompts = [prompts]
    ids = [f"offline-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    final: dict[str, RequestOutput] = {}
    with collector_skips_existing():
        _run_until_finished(engine, ids, final)
    return [final[rid] for rid in ids]


def _run_until_finished(engine: LLMEngine, ids: list[str], final: dict) -> None:
    while len(final) < len(ids):
        rejected = engine.take_rejected()
        mine = [error for request_id, error in rejected if request_id in ids]
        # someone else's: kept for them
        engine.pending_grammars.rejected.extend(r for r in rejected if r[0] not in ids)
        if mine:
            for rid in ids:
                engine.abort(rid)
            raise mine[0]
        if engine.is_only_compiling:
            engine.pending_grammars.wait()
            continue
        outputs, _ = engine.step()
        for out in outputs:
            if out.finished:
                final[out.request_id] = out


def warm_up(engine: LLMEngine) -> None:
    """Compiles the decode graphs before any request: one sequence, then a batch (the dynamic
    graph). Prompt lengths keep the batch and context sizes distinct, so no shape is
    specialised by coincidence."""
    started = time.monotonic()
    log.info("compiling decode steps")
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for batch in (1, 3):
        generate_offline(engine, [[1] * 11] * batch, params)
    log.info("decode steps compiled", seconds=round(time.monotonic() - started, 1))
