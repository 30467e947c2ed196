"""executor/prompt_scores.py's three ways to score a chunk's rows, each against torch's float32
log-softmax of the very logits the model gives for those rows: the lm_head and the scoring
fused in C (a bf16 model on the CPU kernels), the C passes over logits already made (a float32
model with the kernels on), and torch's logsumexp (kernels off: MOESERVE_BF16_KERNELS=0, as on
a GPU)."""

from __future__ import annotations

import pytest
import torch

from inference import LLMEngine
from inference.executor.prompt_scores import score_rows
from inference.kernels import cpu as cpu_kernels
from inference.kernels.modules import CpuLinear


def model_of(path, dtype: str):
    eng = LLMEngine.from_pretrained(path, device="cpu", dtype=dtype, kv_cache_tokens=256)
    return eng.executor.model


def check(model, rows: int, top_n: int) -> None:
    g = torch.Generator().manual_seed(rows)
    hidden = torch.randn(rows, model.args.hidden_size, generator=g).to(model.dtype)
    targets = torch.randint(0, model.args.vocab_size, (rows,), generator=g).tolist()
    got = score_rows(model, hidden, targets, top_n)
    with torch.inference_mode():
        logits = model.logits(hidden).float()
    ref = logits.log_softmax(-1)
    assert [e.token_id for e in got] == targets
    for i, e in enumerate(got):
        row, t = ref[i], targets[i]
        assert e.logprob == pytest.approx(row[t].item(), abs=1e-5)
        assert e.rank == (logits[i] > logits[i, t]).sum().item() + 1
        assert len(e.top) == top_n
        assert [x.logprob for x in e.top] == pytest.approx(
            row.topk(top_n).values.tolist(), abs=1e-5
        )
        assert all(row[x.token_id].item() == pytest.approx(x.logprob, abs=1e-5) for x in e.top)


@pytest.mark.parametrize("rows", [1, 300])  # 300: more than one of torch's pieces of rows
def test_each_way_scores_the_models_own_logits(model_dirs, rows):
    path = model_dirs("mixtral")
    try:
        chosen = cpu_kernels.enable()
        if chosen is None:
            pytest.skip("no CPU kernels on this machine")
        fused = model_of(path, "bfloat16")
        assert isinstance(fused.lm_head, CpuLinear)  # the fused lm_head and scoring
        check(fused, rows, 3)
        check(model_of(path, "float32"), rows, 2)  # the C passes over float32 logits
        cpu_kernels.enable(None)  # kernels off: torch's logsumexp, bf16 and float32
        check(model_of(path, "bfloat16"), rows, 3)
        check(model_of(path, "float32"), rows, 0)
    finally:
        cpu_kernels.enable()


def test_no_rows_and_a_top_larger_than_the_vocabulary(model_dirs):
    model = model_of(model_dirs("mixtral"), "bfloat16")
    hidden = torch.zeros(0, model.args.hidden_size, dtype=model.dtype)
    assert score_rows(model, hidden, [], 3) == []
    [entry] = score_rows(model, torch.ones(1, model.args.hidden_size, dtype=model.dtype), [5], 5000)
    assert len(entry.top) == model.args.vocab_size
