"""EvalScope (ModelScope's evaluation framework), unmodified, over the local pack's cloze items
as its general_mcq custom dataset (bench/eval_pack.write_evalscope_pack): its `evalscope eval`
command, against a served model's chat API (`served_args`) or its own transformers backend on
a checkpoint folder (`checkpoint_args`), greedy, 8 tokens an answer, nothing from a hub.
Used by `make eval` (bench/eval_bench.py) and tests/service/test_evalscope.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

OFFLINE = {name: "1" for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")}
MAX_TOKENS = 8


def served_args(model: str, base_url: str) -> list[str]:
    """The OpenAI-API backend (the chat API under base_url, e.g. http://HOST:PORT/v1)."""
    return [
        "--model",
        model,
        "--eval-type",
        "openai_api",
        "--api-url",
        base_url,
        "--api-key",
        "EMPTY",
    ]


def checkpoint_args(path: str | os.PathLike, precision: str = "float32") -> list[str]:
    """Its transformers backend on a local checkpoint folder, on the CPU."""
    model_args = {"precision": f"torch.{precision}", "device_map": "cpu"}
    return ["--model", str(path), "--eval-type", "llm_ckpt", "--model-args", json.dumps(model_args)]


def run_evalscope(work_dir: Path, data: Path, model_args: list[str]) -> dict:
    """`evalscope eval` over general_mcq's `stdlib` subset in `data`: {"accuracy": the
    report's score, "answers": {item index: the model's text}}. RuntimeError with its output's
    tail if it fails or an item has no answer."""
    dataset = {"general_mcq": {"local_path": str(data), "subset_list": ["stdlib"]}}
    generation = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "do_sample": False}
    command = [
        str(Path(sys.executable).with_name("evalscope")), "eval", *model_args,
        "--datasets", "general_mcq", "--dataset-args", json.dumps(dataset),
        "--generation-config", json.dumps(generation),
        "--work-dir", str(work_dir), "--no-timestamp",
    ]  # fmt: skip
    done = subprocess.run(
        command, check=False, env=os.environ | OFFLINE, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"evalscope failed: {done.stdout[-3000:]}{done.stderr[-3000:]}")
    [report] = (work_dir / "reports").glob("*/general_mcq.json")
    [predictions] = (work_dir / "predictions").glob("*/general_mcq_stdlib.jsonl")
    answers = {}
    for line in predictions.read_text().splitlines():
        record = json.loads(line)
        output = record["model_output"]
        if output["error"] is not None:
            raise RuntimeError(f"evalscope: an item failed: {output['error']}")
        answers[record["index"]] = output["choices"][0]["message"]["content"]
    [metric] = json.loads(report.read_text())["metrics"]
    return {"accuracy": metric["score"], "answers": answers}
