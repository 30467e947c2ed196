"""bench/quant_bench.py's perplexity windows are lm-eval's loglikelihood_rolling windows
(issue 39): the same (context, scored tokens) pairs as lm-eval's own functions give its
local-completions and hf models at their max_length in LM_EVAL_MAX_LENGTH, for texts shorter than a window,
of whole windows, and with a short last window. (That both give the same perplexity through
the API: tests/service/test_lm_eval.py.)"""

from __future__ import annotations

import pytest
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from bench.quant_bench import LM_EVAL_MAX_LENGTH, WINDOW, rolling_windows


def lm_eval_windows(ids: list[int], prefix: int, max_length: int) -> list:
    """As lm-eval's local-completions scores a loglikelihood_rolling request (its
    api_models.loglikelihood_rolling: max_length - 1 kept, max_seq_len one less)."""
    windows = get_rolling_token_windows(
        token_list=ids, prefix_token=prefix, max_seq_len=max_length - 1 - 1, context_len=1
    )
    return [make_disjoint_window(w) for w in windows]


@pytest.mark.parametrize("length", [1, 5, 126, 127, 252, 400, 1000])
def test_the_windows_are_lm_evals(length):
    ids = list(range(100, 100 + length))
    ours = rolling_windows(ids, 7, scored=126)
    assert [tuple(w) for w in ours] == lm_eval_windows(ids, 7, 128)
    assert [t for _, tokens in ours for t in tokens] == ids  # every token once
    assert all(len(c) + len(t) <= 127 for c, t in ours)


def test_the_bench_windows_match_its_stated_max_length():
    ids = list(range(3 * WINDOW + 5))
    ours = rolling_windows(ids, 0)
    assert [tuple(w) for w in ours] == lm_eval_windows(
        ids, 0, LM_EVAL_MAX_LENGTH["local-completions"]
    )
    # its hf model: max_seq_len is its max_length
    hf = get_rolling_token_windows(ids, 0, LM_EVAL_MAX_LENGTH["hf"], context_len=1)
    assert [tuple(w) for w in ours] == [make_disjoint_window(w) for w in hf]
    assert [len(t) for _, t in ours] == [WINDOW, WINDOW, WINDOW, 5]
