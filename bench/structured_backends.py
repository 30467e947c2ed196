"""Grammar backends compared (issue 18): llguidance (the engine's) against xgrammar, on the
SmolLM2 tokenizer (49152 tokens) and the small demo model's (32000), for one modest JSON
schema. Not part of `make bench`: xgrammar is no dependency of the project. Run it with
xgrammar installed aside, e.g.

    .venv/bin/pip install --no-deps --target /tmp/xgr xgrammar apache-tvm-ffi
    PYTHONPATH=/tmp/xgr .venv/bin/python -m bench.structured_backends

(without xgrammar it measures llguidance alone). Measured per backend and tokenizer:
tokenizer set-up; (a) compiling the schema, first and cached (llguidance has no cache of
its own: the engine keeps compiled matchers and deep-copies them, so "cached" is that copy;
xgrammar's GrammarCompiler caches); (b) the per-token mask fill along random walks through
the grammar (each step a uniformly drawn allowed token, the same seeds for both); (c) one
batched fill of 32 matchers at different points of their walks. Both backends are set to
the same JSON layout (", " and ": " separators, no free whitespace), as the engine compiles
schemas. Results: bench/results/structured_backends.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch

from bench.machine import cpu_name
from inference.checkpoints.demo_model import ensure_demo_model
from inference.checkpoints.model_zoo import resolve_model

RESULTS = Path(__file__).parent / "results"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
BATCH = 32


def _allowed(row: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little", count=vocab)
    return np.flatnonzero(bits)


class Llguidance:
    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab: int, eos: list[int]) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.lt = llguidance, llguidance.torch
        started = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab, eos_token=eos)
        self.setup_s = time.perf_counter() - started
        self.executor = llguidance.LLExecutor()
        self.vocab = vocab

    def compile(self, schema: dict, _first: bool):
        options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def cached(self, compiled):
        return compiled.deep_copy()

    def new_matcher(self, compiled):
        return compiled.deep_copy()

    def bitmask(self, rows: int) -> torch.Tensor:
        return self.lt.allocate_token_bitmask(rows, self.vocab)

    def fill(self, matcher, bitmask) -> None:
        self.lt.fill_next_token_bitmask(matcher, bitmask, 0)

    def fill_batch(self, matchers, bitmask) -> None:
        self.lt.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask
        )

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_stopped()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, hf_tokenizer, vocab: int, eos: list[int]) -> None:
        import xgrammar

        self.xgr = xgrammar
        started = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab, stop_token_ids=eos
        )
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        self.setup_s = time.perf_counter() - started
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=2)
        self.vocab = vocab

    def compile(self, schema: dict, _first: bool):
        return self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(", ", ": ")
        )

    def cached(self, _compiled):
        return self.compile(SCHEMA, False)

    def new_matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, rows: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(rows, self.vocab)

    def fill(self, matcher, bitmask) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def fill_batch(self, matchers, bitmask) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_terminated()


def _walk(backend, compiled, eos: set[int], seed: int, max_steps: int = 400):
    """A random walk through the grammar: per step the fill time and the token taken."""
    rng = random.Random(seed)
    matcher = backend.new_matcher(compiled)
    bitmask = backend.bitmask(1)
    times, tokens = [], []
    while not backend.done(matcher) and len(tokens) < max_steps:
        started = time.perf_counter()
        backend.fill(matcher, bitmask)
        times.append(time.perf_counter() - started)
        allowed = [t for t in _allowed(bitmask[0].numpy(), backend.vocab) if t not in eos]
        if not allowed:  # only EOS is left: the document is complete
            break
        token = int(rng.choice(allowed))
        assert backend.accept(matcher, token), "the matcher refused a token its mask allowed"
        tokens.append(token)
    return times, tokens


def measure(backend, eos: set[int], rounds: int) -> dict:
    started = time.perf_counter()
    compiled = backend.compile(SCHEMA, True)
    first = time.perf_counter() - started
    cached = []
    for _ in range(rounds):
        started = time.perf_counter()
        backend.cached(compiled)
        cached.append(time.perf_counter() - started)
    fills, lengths, walks = [], [], []
    for seed in range(rounds):
        times, tokens = _walk(backend, compiled, eos, seed)
        fills.extend(times)
        lengths.append(len(tokens))
        walks.append(tokens)
    # 32 matchers, each part of the way along a walk, filled as one batch
    matchers = []
    for i in range(BATCH):
        matcher = backend.new_matcher(compiled)
        tokens = walks[i % len(walks)]
        for token in tokens[: (i * 7) % max(len(tokens), 1)]:
            backend.accept(matcher, token)
        matchers.append(matcher)
    bitmask = backend.bitmask(BATCH)
    batch = []
    for _ in range(rounds):
        started = time.perf_counter()
        backend.fill_batch(matchers, bitmask)
        batch.append(time.perf_counter() - started)
    sequential = []
    for _ in range(rounds):
        started = time.perf_counter()
        for i, m in enumerate(matchers):
            backend.fill(m, bitmask[i : i + 1])
        sequential.append(time.perf_counter() - started)
    us = 1e6
    return {
        "tokenizer_setup_s": round(backend.setup_s, 4),
        "compile_first_ms": round(first * 1e3, 3),
        "compile_cached_ms": round(statistics.median(cached) * 1e3, 4),
        "fill_per_token_us": {
            "mean": round(statistics.mean(fills) * us, 1),
            "p50": round(statistics.median(fills) * us, 1),
            "p99": round(float(np.percentile(fills, 99)) * us, 1),
            "max": round(max(fills) * us, 1),
            "tokens": len(fills),
        },
        "walk_tokens_mean": round(statistics.mean(lengths), 1),
        "batch32_fill_ms": round(statistics.median(batch) * 1e3, 3),
        "batch32_fill_one_by_one_ms": round(statistics.median(sequential) * 1e3, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from inference.executor.loader import load_hf_config

    backends = [Llguidance]
    try:
        import xgrammar  # noqa: F401

        backends.append(Xgrammar)
    except ImportError:
        print("xgrammar not importable: llguidance alone")
    torch.set_num_threads(2)
    results: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu_name(),
        "machine": platform.machine(),
        "schema": SCHEMA,
        "tokenizers": {},
    }
    for label, path in (
        ("smollm2", resolve_model("smollm2")),
        ("demo-small", ensure_demo_model("small")),
    ):
        hf = AutoTokenizer.from_pretrained(path)
        vocab = load_hf_config(path).vocab_size
        eos = [hf.eos_token_id]
        entry: dict = {"vocab_size": vocab}
        for cls in backends:
            backend = cls(hf, vocab, eos)
            entry[backend.name] = measure(backend, set(eos), args.rounds)
            print(label, backend.name, json.dumps(entry[backend.name]))
        results["tokenizers"][label] = entry
    results["versions"] = {"llguidance": version("llguidance")}
    if Xgrammar in backends:
        results["versions"]["xgrammar"] = version("xgrammar")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "structured_backends.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
