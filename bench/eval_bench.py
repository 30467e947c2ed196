"""Accuracy per format through the API (issue 39): EleutherAI's lm-evaluation-harness,
unmodified, over the local task pack (bench/eval_pack.py) against `moeserve serve` once per
(model, format) through its `local-completions` model, beside the harness's own `hf` model
(transformers, float32) on the same checkpoint. Accuracy only: nothing here is timed.

Both runs score the same windows (local-completions keeps one token of its max_length for
generation and one for context: the hf run gets max_length - 2).

    python -m bench.eval_bench [--models smollm2,demo] [--formats bf16,int8,kv-int8,kv-fp8]

Results: bench/results/eval.json {"date", "cpu", "harness", "rows": [{"model", "format",
"task", "metric", "ours", "transformers"}]}.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from bench.eval_pack import TASKS, write_pack
from bench.harness import ServerProcess
from bench.machine import cpu_name

RESULTS = Path(__file__).parent / "results"
FORMATS = {
    "bf16": ["--dtype", "bfloat16"],
    "int8": ["--dtype", "bfloat16", "--quantization", "int8"],
    "kv-int8": ["--dtype", "bfloat16", "--kv-cache-dtype", "int8"],
    "kv-fp8": ["--dtype", "bfloat16", "--kv-cache-dtype", "fp8_e4m3"],
}
METRICS = {
    "stdlib_cloze": ["acc,none"],
    "stdlib_perplexity": ["word_perplexity,none", "bits_per_byte,none"],
    "stdlib_generate": ["exact_match,first_identifier"],
}
MAX_LENGTH = 512


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


def served(path: Path, fmt: str, pack: Path) -> dict:
    args = ["--max-model-len", MAX_LENGTH * 2, "--kv-cache-tokens", 16384, *FORMATS[fmt]]
    with ServerProcess(path, *args, start_timeout=600) as srv:
        return evaluate(
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


def reference(path: Path, pack: Path) -> dict:
    return evaluate(
        "hf",
        {
            "pretrained": str(path),
            "dtype": "float32",
            "device": "cpu",
            "max_length": MAX_LENGTH - 2,
        },
        pack,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,demo")
    parser.add_argument("--formats", default=",".join(FORMATS))
    args = parser.parse_args()
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(name, "1")  # the pack is local: nothing reaches a hub
    import lm_eval

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        pack = write_pack(Path(tmp))
        for model, path in model_dirs(args.models.split(",")).items():
            want = reference(path, pack)
            for fmt in args.formats.split(","):
                got = served(path, fmt, pack)
                for task in TASKS:
                    for metric in METRICS[task]:
                        row = {
                            "model": model,
                            "format": fmt,
                            "task": task,
                            "metric": metric,
                            "ours": got[task][metric],
                            "transformers": want[task][metric],
                        }
                        print(json.dumps(row), flush=True)
                        rows.append(row)
    record = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu_name(),
        "harness": f"lm-eval {lm_eval.__version__}",
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "eval.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
