"""llama.cpp's side of issue 40's accuracy targets: SmolLM2-135M as a bf16 GGUF and as
llama.cpp's own Q8_0, Q4_0 and Q4_K_M quantizations of it, measured on exactly what
bench/quant_bench.py measures our formats on (a benchmark, not a test):

- perplexity over quant_bench's text and windows (lm-eval's rolling windows of 1,024 scored
  tokens over the first 32,768 tokens of pydoc_data/topics.py, the same token ids), from the
  logits llama.cpp returns for every scored position (its C API through llama-cpp-python's
  low-level bindings, each window one `llama_batch` read back through llama.cpp's f16 KV cache);
- greedy agreement with llama.cpp's own bf16 GGUF over quant_bench's passages
  (`quant_bench.passages`: 8 prompts of 64 tokens, 48 greedy tokens each), as the mean count
  of tokens before the first difference.

The bf16 GGUF comes from the checkpoint folder our engine serves (the `smollm2` ready model)
through the vendored `convert_hf_to_gguf.py` (run_peers.ensure_gguf); the quantized ones from
it through llama.cpp's own quantizer (quantize_gguf.py: `llama_model_quantize`, what its
`llama-quantize` tool runs, default parameters). Rows go to bench/results/quant_bench.json under "llamacpp_accuracy",
beside our rows ("accuracy"), with the CPU's name.

    .venv/bin/python -m bench.peers.llama_accuracy [--formats bf16 q8_0 q4_0 q4_k_m]

Needs the llamacpp peer (bench/peers/setup_peers.sh llamacpp). The worker half of this file
runs in that peer's venv and imports nothing of ours.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
FORMATS = ("bf16", "q8_0", "q4_0", "q4_k_m")  # llama.cpp's file types, as GGUF names spell them


# --------------------------------------------------------------------------------------------
# worker: runs in the llamacpp peer venv (llama_cpp, numpy, gguf)
# --------------------------------------------------------------------------------------------


class _Scorer:
    """One llama.cpp context over a GGUF: logits of chosen positions of a fresh sequence."""

    def __init__(self, gguf: str, n_ctx: int, threads: int) -> None:
        import llama_cpp as L

        self.L = L
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(gguf.encode(), L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        cparams = L.llama_context_default_params()
        cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = n_ctx
        cparams.n_seq_max = 1
        cparams.n_threads = cparams.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.batch = L.llama_batch_init(n_ctx, 0, 1)

    def clear(self) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def decode(self, tokens: list[int], start: int, want: range):
        """Feed tokens at positions start.. (one batch); the logits rows of the positions in
        `want` (offsets into tokens), float32 [len(want), n_vocab]."""
        import numpy as np

        L, b = self.L, self.batch
        for i, tok in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, start + i, 1, i in want
            b.seq_id[i][0] = 0
        b.n_tokens = len(tokens)
        rc = L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        return np.ctypeslib.as_array(L.llama_get_logits(self.ctx), shape=(len(want), self.n_vocab))

    def window_nll(self, context: list[int], tokens: list[int]) -> float:
        """Summed negative log-likelihood of `tokens` after `context` (one window)."""
        import numpy as np

        self.clear()
        seq = context + tokens
        logits = self.decode(seq, 0, range(len(context) - 1, len(seq) - 1)).astype(np.float64)
        top = logits.max(axis=1, keepdims=True)
        logz = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
        return float((logz - logits[np.arange(len(tokens)), tokens]).sum())

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        self.clear()
        out = [int(self.decode(prompt, 0, range(len(prompt) - 1, len(prompt)))[0].argmax())]
        while len(out) < n:
            pos = len(prompt) + len(out) - 1
            out.append(int(self.decode([out[-1]], pos, range(1))[0].argmax()))
        return out


def tensor_types(gguf: str) -> dict[str, int]:
    """How many of the GGUF's tensors are stored in each of llama.cpp's types."""
    from gguf import GGUFReader

    counts: dict[str, int] = {}
    for t in GGUFReader(gguf).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return dict(sorted(counts.items()))


def worker_main(spec_path: str, out_path: str) -> None:
    import llama_cpp

    spec = json.loads(Path(spec_path).read_text())
    threads = spec["threads"]
    rows = {}
    for fmt, path in spec["ggufs"].items():
        started = time.monotonic()
        n_ctx = max(len(c) + len(t) for c, t in spec["windows"])
        n_ctx = max(n_ctx, max(len(p) for p in spec["passages"]) + spec["passage_tokens"])
        scorer = _Scorer(path, (n_ctx + 255) // 256 * 256, threads)
        nll = sum(scorer.window_nll(c, t) for c, t in spec["windows"])
        scored = sum(len(t) for _, t in spec["windows"])
        outputs = [scorer.greedy(p, spec["passage_tokens"]) for p in spec["passages"]]
        rows[fmt] = {
            "perplexity": math.exp(nll / scored),
            "file_bytes": Path(path).stat().st_size,
            "tensor_types": tensor_types(path),
            "continuations": outputs,
            "seconds": round(time.monotonic() - started, 1),
        }
        print(f"{fmt}: ppl {rows[fmt]['perplexity']:.4f} ({rows[fmt]['seconds']} s)", flush=True)
        del scorer
    Path(out_path).write_text(
        json.dumps({"rows": rows, "version": f"llama-cpp-python {llama_cpp.__version__}"})
    )


# --------------------------------------------------------------------------------------------
# orchestrator: runs in moeserve's venv
# --------------------------------------------------------------------------------------------


def llamacpp_rows(formats: list[str], threads: int) -> dict:
    """The llama.cpp accuracy rows of `formats` (bf16 always, the reference), with their
    perplexity change and passage agreement against the bf16 GGUF."""
    from transformers import AutoTokenizer

    from bench.peers.run_peers import (
        engine_env,
        ensure_gguf,
        ensure_quantized_gguf,
        peer_python,
    )
    from bench.quant_bench import (
        PASSAGE_TOKENS,
        TOKENS,
        corpus_ids,
        passages,
        prefix_token,
        rolling_windows,
    )
    from inference.checkpoints.model_zoo import resolve_model

    model_dir = resolve_model("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = corpus_ids(tokenizer)
    log_dir = Path(tempfile.mkdtemp(prefix="moeserve-llama-accuracy-"))
    gguf = ensure_gguf(model_dir, log_dir)
    chosen = ["bf16", *(f for f in formats if f != "bf16")]
    ggufs = {f: gguf if f == "bf16" else ensure_quantized_gguf(gguf, f, log_dir) for f in chosen}
    spec = {
        "ggufs": {f: str(path) for f, path in ggufs.items()},
        "threads": threads,
        "windows": rolling_windows(ids[:TOKENS], prefix_token(tokenizer)),
        "passages": passages(ids),
        "passage_tokens": PASSAGE_TOKENS,
    }
    spec_file, out_file = log_dir / "spec.json", log_dir / "out.json"
    spec_file.write_text(json.dumps(spec))
    print(f"llama.cpp accuracy: {', '.join(chosen)} (logs: {log_dir})", flush=True)
    rc = subprocess.run(
        [str(peer_python("llamacpp")), str(HERE / "llama_accuracy.py"), "worker"]
        + [str(spec_file), str(out_file)],
        env=engine_env("llamacpp"),
        check=False,
    ).returncode
    if rc != 0:
        sys.exit(f"llama.cpp accuracy worker failed (exit {rc})")
    return rows_against_bf16(json.loads(out_file.read_text()))


def rows_against_bf16(result: dict) -> dict:
    """The worker's rows with each one's perplexity change and passage agreement against the
    bf16 GGUF's (its continuations dropped)."""
    from bench.quant_bench import PASSAGE_TOKENS, passage_agreement

    rows = result["rows"]
    base = rows["bf16"]
    for row in rows.values():
        row["ppl_increase"] = row["perplexity"] / base["perplexity"] - 1
        row["version"] = result["version"]
    reference = base["continuations"]
    for row in rows.values():
        row |= passage_agreement(row.pop("continuations"), reference)
    for fmt, row in rows.items():
        print(
            f"llama.cpp {fmt:7s} ppl {row['perplexity']:.4f}  {100 * row['ppl_increase']:+.3f}%  "
            f"passages {row['passage_tokens_before_first_difference']:.1f}/{PASSAGE_TOKENS} "
            f"({row['passage_identical']} identical)  {row['file_bytes']:,} bytes  "
            f"{row['tensor_types']}",
            flush=True,
        )
    return rows


def main() -> None:
    if sys.argv[1:2] == ["worker"]:
        worker_main(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE.parents[1]))
    from bench.machine import cpu_name
    from bench.peers.run_peers import require_peers
    from bench.quant_bench import RESULTS

    require_peers(["llamacpp"])
    rows = llamacpp_rows(args.formats, args.threads)
    out = RESULTS / "quant_bench.json"
    record = json.loads(out.read_text()) if out.exists() else {}
    record["llamacpp_accuracy"] = record.get("llamacpp_accuracy", {}) | rows
    record["llamacpp_accuracy_date"] = time.strftime("%Y-%m-%d %H:%M")
    record["llamacpp_accuracy_cpu"] = cpu_name()
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
