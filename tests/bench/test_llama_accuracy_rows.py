"""bench/peers/llama_accuracy.py's rows: perplexity change and passage agreement against the
bf16 GGUF's own, as quant_bench's rows are against our bf16 (the llama.cpp worker itself needs
the llamacpp peer: `python -m bench.peers.llama_accuracy`)."""

from __future__ import annotations

import pytest

from bench.peers.llama_accuracy import rows_against_bf16


def row(perplexity: float, continuations: list[list[int]]) -> dict:
    return {
        "perplexity": perplexity,
        "file_bytes": 1000,
        "tensor_types": {"Q5_0": 3},
        "continuations": continuations,
    }


def test_rows_against_the_bf16_gguf():
    reference = [[1, 2, 3, 4], [5, 6, 7, 8]]
    rows = rows_against_bf16(
        {
            "rows": {
                "bf16": row(10.0, reference),
                "q4_k_m": row(11.0, [[1, 2, 0, 4], [0, 6, 7, 8]]),
            },
            "version": "llama-cpp-python 0.3.36",
        }
    )
    assert rows["bf16"]["ppl_increase"] == 0.0
    assert rows["bf16"]["passage_tokens_before_first_difference"] == 4.0
    assert rows["q4_k_m"]["ppl_increase"] == pytest.approx(0.1)
    assert rows["q4_k_m"]["passage_tokens_before_first_difference"] == 1.0  # (2 + 0) / 2
    assert rows["q4_k_m"]["passage_identical"] == 0
    assert all("continuations" not in r and r["version"] for r in rows.values())
