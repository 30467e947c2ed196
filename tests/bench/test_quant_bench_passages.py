"""bench/quant_bench.py's greedy-agreement passages (issue 40), which llama.cpp's rows
(bench/peers/llama_accuracy.py) share: text no other measure reads, and the agreement count."""

from __future__ import annotations

from bench.quant_bench import (
    PASSAGE_PROMPT,
    PASSAGES,
    PROMPT_LEN,
    PROMPTS,
    TOKENS,
    passage_agreement,
    passages,
)


def test_passages_read_text_no_other_measure_reads():
    ids = list(range(TOKENS + PROMPTS * PROMPT_LEN + 5000))
    chosen = passages(ids)
    assert len(chosen) == PASSAGES and all(len(p) == PASSAGE_PROMPT for p in chosen)
    first_free = TOKENS + PROMPTS * PROMPT_LEN  # after the windows and the 16 prompts
    assert chosen[0][0] == first_free and ids[-1] - chosen[-1][-1] < PASSAGES  # to the end
    starts = [p[0] for p in chosen]
    assert starts == sorted(starts) and len({*(t for p in chosen for t in p)}) == 8 * 64


def test_passage_agreement_counts_tokens_before_the_first_difference():
    reference = [[1, 2, 3, 4], [5, 6, 7, 8]]
    outputs = [[1, 2, 9, 4], [5, 6, 7, 8]]
    assert passage_agreement(outputs, reference) == {
        "passage_tokens_before_first_difference": 3.0,
        "passage_identical": 1,
    }
    assert (
        passage_agreement([[0, 2, 3, 4]] * 2, reference)["passage_tokens_before_first_difference"]
        == 0
    )
