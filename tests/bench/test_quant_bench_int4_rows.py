"""quant_bench's int4 rows (issue 40): each row's switches build the int4 engine it names (its
choices read back off the quantized model), and a row's perplexity runs through the engine."""

from __future__ import annotations

import math

import pytest

from bench import quant_bench
from inference.quantization.qweight import QWeight

INT4_ROWS = [
    n for n in quant_bench.ACCURACY_CONFIGS if n.startswith("int4_") and n.endswith("_weights")
]


def quantized(engine, name: str) -> QWeight:
    return dict(engine.executor.model.named_modules())[name].weight


@pytest.mark.parametrize("row", INT4_ROWS)
def test_each_int4_row_builds_the_engine_it_names(tiny_model_dir, row):
    options = dict(quant_bench.ACCURACY_CONFIGS[row])
    with quant_bench.patched_environ(options.pop("env", {})):
        engine = quant_bench.accuracy_engine(tiny_model_dir, options)
    # the tiny model's 2 layers: use_more_bits widens layer 1 (the last eighth)
    first, last = quantized(engine, "layers.0.attn.wqkv"), quantized(engine, "layers.1.attn.wqkv")
    narrow = ("int4_all_4bit_weights", "int4_symmetric_weights", "int4_wide_layers_weights")
    assert first.fmt == ("int4" if row in narrow else "int8")  # the default: every layer's
    if first.fmt == "int8":  # every layer's q/k/v int8: the output projection is the int4 one
        first = quantized(engine, "layers.0.attn.wo")
    group = 32 if "group32" in row else 128  # (the tiny model's 64 inputs: one group of 128)
    assert first.group in (group, min(group, first.in_features))
    assert first.rotated == ("unrotated" not in row)
    assert (first.zero is None) == ("symmetric" in row)
    keeps_int8 = row not in ("int4_all_4bit_weights", "int4_symmetric_weights")
    assert last.fmt == ("int8" if keeps_int8 else "int4")
    if row == "int4_weights":
        ids = list(range(3, 3 + 40))
        ppl = quant_bench.perplexity(engine, ids, 1, scored=16)
        assert math.isfinite(ppl) and ppl > 1
