"""Waiting-queue admission: round-robin across tenants (API keys) when the queue is contended,
plain FIFO with one tenant, preempted sequences first; pure bookkeeping, no model."""

from __future__ import annotations

import asyncio

import pytest

from inference import AsyncLLMEngine
from inference.block_manager import BlockManager
from inference.sampling_params import SamplingParams
from inference.scheduler import Scheduler
from inference.sequence import Sequence, SequenceStatus
from inference.waiting_queue import WaitingQueue

BLOCK = 4


def _seq(name: str, tenant: str | None, prompt_len: int = 4) -> Sequence:
    return Sequence(
        name, name, 0, list(range(1, prompt_len + 1)), SamplingParams(), None, None, tenant
    )


def _admitted(sched: Scheduler) -> list[str]:
    return [seq.seq_id for seq, _ in sched.schedule().scheduled]


def _scheduler(max_num_seqs: int, num_blocks: int = 64) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BLOCK, False), max_num_seqs, 1024)


def test_a_flooding_tenant_does_not_hold_back_the_others():
    sched = _scheduler(max_num_seqs=4)
    for i in range(6):
        sched.add(_seq(f"a{i}", "flood"))
    sched.add(_seq("b0", "team-b"))
    sched.add(_seq("b1", "team-b"))
    sched.add(_seq("c0", "team-c"))
    # first-come would admit a0..a3; in turn: a, b, c, then a again
    assert _admitted(sched) == ["a0", "b0", "c0", "a1"]
    assert [s.seq_id for s in sched.running] == ["a0", "b0", "c0", "a1"]
    # slots freed later go on in turn: b's next one comes before a's third
    for seq in list(sched.running):
        sched.finish(seq, "stop")
    assert _admitted(sched) == ["b1", "a2", "a3", "a4"]


def test_turns_carry_over_between_steps():
    """One slot a step: the tenants alternate even though all of a's requests came first."""
    sched = _scheduler(max_num_seqs=1)
    for i in range(3):
        sched.add(_seq(f"a{i}", "a"))
    for i in range(3):
        sched.add(_seq(f"b{i}", "b"))
    order = []
    while sched.has_work:
        (seq,) = [s for s, _ in sched.schedule().scheduled]
        order.append(seq.seq_id)
        sched.finish(seq, "stop")
    assert order == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_a_tenant_just_served_goes_behind_a_newcomer():
    """The flood was alone and had a turn; a request of another key is next, not the flood's."""
    sched = _scheduler(max_num_seqs=1)
    for i in range(4):
        sched.add(_seq(f"a{i}", "flood"))
    assert _admitted(sched) == ["a0"]
    sched.add(_seq("b0", "b"))
    sched.add(_seq("c0", "c"))
    sched.finish(sched.running[0], "stop")
    order = []
    while sched.has_work:
        (seq,) = [s for s, _ in sched.schedule().scheduled]
        order.append(seq.seq_id)
        sched.finish(seq, "stop")
    assert order == ["b0", "c0", "a1", "a2", "a3"]


@pytest.mark.parametrize("tenant", [None, "only-key"])
def test_one_tenant_is_first_come_first_served(tenant):
    sched = _scheduler(max_num_seqs=3)
    for i in range(5):
        sched.add(_seq(f"s{i}", tenant))
    assert _admitted(sched) == ["s0", "s1", "s2"]
    sched.finish(sched.running[1], "stop")
    assert _admitted(sched)[-1] == "s3"


def test_preempted_sequences_resume_before_any_tenant():
    # 6 blocks: two 8-token prompts take 2 each; growing them forces a preemption
    sched = _scheduler(max_num_seqs=4, num_blocks=5)
    sched.add(_seq("a0", "a", prompt_len=8))
    sched.add(_seq("b0", "b", prompt_len=8))
    assert _admitted(sched) == ["a0", "b0"]
    for seq in sched.running:
        seq.num_computed_tokens = seq.num_tokens
        seq.token_ids += [1, 2, 3, 4, 5]  # each now needs 2 more blocks: only 1 is free
    sched.add(_seq("c0", "c"))
    out = sched.schedule()
    assert out.num_preempted == 1
    assert sched.waiting.peek().seq_id == "b0"  # the preempted one is next, ahead of c0
    assert sched.waiting.peek().status is SequenceStatus.WAITING
    assert len(sched.waiting) == 2


def test_abort_while_waiting_leaves_the_turns_intact():
    q = WaitingQueue()
    seqs = {name: _seq(name, name[0]) for name in ("a0", "a1", "b0", "c0")}
    for seq in seqs.values():
        q.append(seq)
    q.remove(seqs["b0"])  # b's only request: b leaves the rotation
    q.remove(seqs["a0"])
    assert len(q) == 2 and bool(q)
    assert [q.popleft().seq_id for _ in range(2)] == ["a1", "c0"]
    assert not q
    with pytest.raises(ValueError):
        q.remove(seqs["a0"])
    with pytest.raises(IndexError):
        q.peek()


async def test_the_tenant_reaches_the_engine_core(tiny_model_dir):
    """Through AsyncLLMEngine and the core process: one sequence at a time, three requests of
    tenant a queued before one of b; b's is scheduled right after a's first."""
    engine = AsyncLLMEngine.from_pretrained(
        tiny_model_dir, device="cpu", dtype="float32", kv_cache_tokens=1024, max_num_seqs=1
    )
    engine.start()
    try:
        params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
        requests = [("a1", "a"), ("a2", "a"), ("a3", "a"), ("b1", "b")]
        outputs = await asyncio.gather(
            *(engine.generate("hello", params, request_id=rid, tenant=t) for rid, t in requests)
        )
    finally:
        await engine.shutdown()
    scheduled = sorted(outputs, key=lambda out: out.outputs[0].times.first_scheduled)
    assert [out.request_id for out in scheduled] == ["a1", "b1", "a2", "a3"]
