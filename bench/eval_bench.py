"""Accuracy per format through the API (issue 39): EleutherAI's lm-evaluation-harness,
unmodified, over the local task pack (bench/eval_pack.py) against `moeserve serve` once per
(model, format) through its `local-completions` model, beside the harness's own `hf` model
(transformers, float32) on the same checkpoint. Accuracy only: nothing here is timed.

Every format's reference is that one run of the unquantized checkpoint: transformers serves
no int8/int4 weights or quantized KV here, and the point of the quantized rows is what the
quantization costs through our API (int8 and int4 are quantized at load from the bf16
checkpoint, as `--quantization` does when serving).

The 8-bit and int4 KV rows prefill in chunks of PREFILL_CHUNK tokens: a prompt prefilled
whole attends to the keys and values it has just computed, never to the cache as stored, so
without chunks those rows would only measure the cache on generation. Every chunk after a
prompt's first reads its context back from the quantized cache (tests/bench/test_eval_bench.py
shows it does).

Both runs score the same windows (local-completions keeps one token of its max_length for
generation and one for context: the hf run gets max_length - 2).

    python -m bench.eval_bench [--models smollm2,demo] [--formats int4,kv-int4]

--formats defaults to every one of FORMATS: bf16, int8, int4, kv-int8, kv-fp8, kv-int4.

EvalScope (bench/evalscope_run.py) runs its general_mcq over the same cloze items through
the chat API, beside its own transformers backend: the evalscope_general_mcq rows.

Results: bench/results/eval.json {"date", "cpu", "harness", "rows": [{"model", "format",
"task", "metric", "ours", "transformers", "harness", "date", "commit"}]}; a row's commit is
the checkout's HEAD when its server started, with "+" and the served code's uncommitted
files, if any. A run of some models or formats replaces their rows and keeps the others'
(with their own dates) from the same CPU and harness versions.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from bench.eval_pack import TASKS, write_evalscope_pack, write_pack
from bench.evalscope_run import checkpoint_args, run_evalscope, served_args
from bench.harness import ServerProcess
from bench.machine import cpu_name

RESULTS = Path(__file__).parent / "results"
FORMATS = {
    "bf16": ["--dtype", "bfloat16"],
    "int8": ["--dtype", "bfloat16", "--quantization", "int8"],
    "int4": ["--dtype", "bfloat16", "--quantization", "int4"],
    "kv-int8": ["--dtype", "bfloat16", "--kv-cache-dtype", "int8"],
    "kv-fp8": ["--dtype", "bfloat16", "--kv-cache-dtype", "fp8_e4m3"],
    "kv-int4": ["--dtype", "bfloat16", "--kv-cache-dtype", "int4"],
}
# the step budget (--max-num-batched-tokens) of the quantized KV rows: a cloze prompt is 2 to 4
# chunks, a perplexity window about 64
PREFILL_CHUNK = 8
CHUNKED = ("kv-int8", "kv-fp8", "kv-int4")
METRICS = {
    "stdlib_cloze": ["acc,none"],
    "stdlib_perplexity": ["word_perplexity,none", "bits_per_byte,none"],
    "stdlib_generate": ["exact_match,first_identifier"],
    # EvalScope's general_mcq over the cloze items, a generative multiple choice (its chat
    # prompt asks for the letter) through the chat API, beside its transformers backend
    "evalscope_general_mcq": ["acc"],
}
MAX_LENGTH = 512


def source_commit() -> str:
    """HEAD, and the inference/ and service/ files that differ from it: the kernels change
    under other work, and a row's accuracy belongs to the code that served it."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, check=True
        ).stdout

    head = git("rev-parse", "--short", "HEAD").strip()
    # porcelain lines are "XY path": the status columns, so nothing may be stripped first
    changed = git("status", "--porcelain", "--", "inference", "service").splitlines()
    return " +".join([head, *sorted(line[3:] for line in changed)])


def model_dirs(names: list[str]) -> dict[str, Path]:
    from inference.checkpoints.demo_model import ensure_demo_model
    from inference.checkpoints.model_zoo import resolve_model

    known = {
        "smollm2": lambda: Path(resolve_model("smollm2")),
        "demo": lambda: ensure_demo_model("small", arch="mixtral"),
    }
    return {name: known[name]() for name in names}


def evaluate(model: str, model_args: dict, pack: Path) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=list(TASKS),
        task_manager=TaskManager(include_path=str(pack)),
        batch_size=1,
    )
    return {task: {m: out["results"][task][m] for m in METRICS[task]} for task in TASKS}


def server_args(fmt: str) -> list[str]:
    """`moeserve serve` flags (after --model) of one format's row."""
    args = ["--max-model-len", MAX_LENGTH * 2, "--kv-cache-tokens", 16384, *FORMATS[fmt]]
    if fmt in CHUNKED:
        args += ["--max-num-batched-tokens", PREFILL_CHUNK]
    return [str(a) for a in args]


def evalscope_data(pack: Path) -> Path:
    return pack / "evalscope"


def served(path: Path, fmt: str, pack: Path) -> dict:
    with ServerProcess(path, *server_args(fmt), start_timeout=600) as srv:
        scores = evaluate(
            "local-completions",
            {
                "model": srv.started["model"],
                "base_url": f"http://127.0.0.1:{srv.rest_port}/v1/completions",
                "tokenizer": str(path),
                "tokenizer_backend": "huggingface",
                "max_length": MAX_LENGTH,
                "max_retries": 1,
            },
            pack,
        )
        api = served_args(srv.started["model"], f"http://127.0.0.1:{srv.rest_port}/v1")
        with tempfile.TemporaryDirectory() as work:
            es = run_evalscope(Path(work), evalscope_data(pack), api)
    return scores | {"evalscope_general_mcq": {"acc": es["accuracy"]}}


def reference(path: Path, pack: Path) -> dict:
    scores = evaluate(
        "hf",
        {
            "pretrained": str(path),
            "dtype": "float32",
            "device": "cpu",
            "max_length": MAX_LENGTH - 2,
        },
        pack,
    )
    with tempfile.TemporaryDirectory() as work:
        es = run_evalscope(Path(work), evalscope_data(pack), checkpoint_args(path))
    return scores | {"evalscope_general_mcq": {"acc": es["accuracy"]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,demo")
    parser.add_argument("--formats", default=",".join(FORMATS))
    args = parser.parse_args()
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(name, "1")  # the pack is local: nothing reaches a hub
    from importlib.metadata import version

    harness = {task: f"lm-eval {version('lm_eval')}" for task in TASKS}
    harness["evalscope_general_mcq"] = f"evalscope {version('evalscope')}"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        pack = write_pack(Path(tmp))
        write_evalscope_pack(evalscope_data(pack))
        for model, path in model_dirs(args.models.split(",")).items():
            want = reference(path, pack)
            for fmt in args.formats.split(","):
                commit = source_commit()  # the code this format's server starts from
                got = served(path, fmt, pack)
                for task, metrics in METRICS.items():
                    for metric in metrics:
                        row = {
                            "model": model,
                            "format": fmt,
                            "task": task,
                            "metric": metric,
                            "ours": got[task][metric],
                            "transformers": want[task][metric],
                            "harness": harness[task],
                            "date": time.strftime("%Y-%m-%d %H:%M"),
                            "commit": commit,
                        }
                        print(json.dumps(row), flush=True)
                        rows.append(row)
    record = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu_name(),
        "harness": ", ".join(dict.fromkeys(harness.values())),
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "eval.json"
    record["rows"] = merged(json.loads(path.read_text()) if path.exists() else None, record, rows)
    path.write_text(json.dumps(record, indent=2) + "\n")


def merged(previous: dict | None, record: dict, rows: list[dict]) -> list[dict]:
    """rows, among the previous file's rows of the (model, format) pairs not run this time, in
    the previous order (kept only from the same CPU and a harness version this run has; they
    keep their date and harness)."""
    if not previous or previous["cpu"] != record["cpu"]:
        return rows
    harnesses = set(record["harness"].split(", "))
    fresh: dict[tuple, list[dict]] = {}
    for row in rows:
        fresh.setdefault((row["model"], row["format"]), []).append(row)
    out = []
    for row in previous["rows"]:
        pair = (row["model"], row["format"])
        if pair not in fresh:
            old = {"harness": previous["harness"], "date": previous["date"]} | row
            if old["harness"] in harnesses:
                out.append(old)
        elif fresh[pair]:
            out += fresh[pair]
            fresh[pair] = []  # placed where the pair's old rows were
    return out + [row for pair_rows in fresh.values() for row in pair_rows]


if __name__ == "__main__":
    main()
