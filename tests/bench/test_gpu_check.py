"""The GPU check (bench/gpu_check.sh, bench/gpu_bench.py, bench/gpu_wheels.py) where there is
no GPU: its wheel list against pyproject.toml, the wheel-folder check on real wheel files,
the floor a decode token reads, and the whole script end to end in its CPU dry run, which
writes no GPU figure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from bench import gpu_bench, gpu_wheels
from inference import LLMEngine
from inference.checkpoints.demo_model import write_demo_model

ROOT = Path(__file__).resolve().parents[2]


def test_every_runtime_dependency_is_on_the_gpu_image_or_carried():
    assert gpu_wheels.pin_problems() == []
    assert not set(gpu_wheels.PINS) & gpu_wheels.IMAGE  # the carried never shadow the image


def wheel(folder: Path, name: str, version: str, *requires: str, size: int = 0) -> None:
    """A real (minimal) wheel file: its METADATA, and `size` bytes of payload."""
    dist = f"{name.replace('-', '_')}-{version}"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    metadata += "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as z:
        z.writestr(f"{dist}.dist-info/METADATA", metadata)
        z.writestr(f"{name.replace('-', '_')}/payload.bin", os.urandom(size))


def test_the_wheel_folder_check_finds_what_would_stop_the_install(tmp_path):
    pins = {"alpha": "1.0", "beta-pkg": "2.0"}
    [missing] = gpu_wheels.folder_problems(tmp_path / "none", pins)
    assert "run `make gpu-wheels` where there is network" in missing
    wheel(tmp_path, "alpha", "1.0", "beta-pkg>=2", "numpy", "gamma; python_version < '3.10'")
    wheel(tmp_path, "beta_pkg", "2.0", "extra-only; extra == 'docs'")
    assert gpu_wheels.folder_problems(tmp_path, pins) == []  # numpy is on the image
    wheel(tmp_path, "alpha", "1.1")
    wheel(tmp_path, "delta", "0.1", "beta-pkg>=3", "epsilon")
    (tmp_path / "notes.txt").write_text("x")
    found = gpu_wheels.folder_problems(tmp_path, pins)
    assert "alpha: two versions (1.0, 1.1)" in found
    assert "notes.txt: not a wheel" in found
    assert "delta==0.1: not pinned" in found
    assert "delta-0.1-py3-none-any.whl needs beta-pkg>=3: carried beta-pkg==2.0" in found
    assert "delta-0.1-py3-none-any.whl needs epsilon: neither carried nor on the image" in found
    big = tmp_path / "big"
    big.mkdir()
    wheel(big, "alpha", "1.0", size=4096)
    wheel(big, "beta-pkg", "2.0")
    assert gpu_wheels.folder_problems(big, pins) == []
    [too_big] = gpu_wheels.folder_problems(big, pins, max_bytes=1024)
    assert "MiB of wheels, over" in too_big


def test_the_floor_counts_each_weight_a_decode_token_reads_once(tmp_path):
    path = write_demo_model(tmp_path / "m", gpu_bench.TINY_QWEN2_MOE, arch="qwen2_moe")
    engine = LLMEngine.from_pretrained(path, device="cpu", dtype="float32", kv_cache_tokens=64)
    shape, model = gpu_bench.TINY_QWEN2_MOE, engine.executor.model
    floor = gpu_bench.token_bytes(engine, context_len=10)
    experts = sum(
        layer.mlp.moe.experts.w13.numel() + layer.mlp.moe.experts.w2.numel()
        for layer in model.layers
    )
    everything = sum(p.numel() for p in model.parameters())
    embedding = model.embed.weight.numel()
    expected = everything - experts - embedding + experts * shape.top_k / shape.num_experts
    expected += shape.hidden  # one embedding row
    assert floor["weights"] == pytest.approx(4 * expected)  # float32
    per_token = shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * 4
    assert floor["kv_cache"] == 10 * per_token
    assert model.layers[0].mlp.shared.w2.weight.shape == (shape.hidden, shape.shared_ffn)
    assert engine.args.vocab_size == shape.vocab_size > len(engine.tokenizer)


def test_the_dry_run_never_writes_the_kept_gpu_record(monkeypatch, capsys):
    argv = ["gpu_bench", "--cpu-dry-run", "--out", str(gpu_bench.RESULT)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_:
        gpu_bench.main()
    assert exit_.value.code == 2 and "a dry run writes no GPU figure" in capsys.readouterr().err


def test_a_failed_section_is_reported_in_the_summary():
    record = {
        "device": "cpu (dry run)",
        "parity_passed": False,
        "decode_over_floor": None,
        "throughput_ratio": None,
        "copy": {"bytes_per_s": 2.5e9},
        "errors": {"decode": "Traceback ...\nRuntimeError: out of memory\n"},
    }
    table = gpu_bench.summary(record)
    assert "copy rate" in table and "2.5 GB/s" in table
    assert "decode_over_floor" in table and "ERROR in decode" in table
    assert table.rstrip().endswith("RuntimeError: out of memory")


@pytest.mark.slow
def test_the_whole_check_runs_end_to_end_on_the_cpu(tmp_path):
    """bench/gpu_check.sh --cpu-dry-run: the wheel stage (where .whl/ exists), a few parity
    tests, every benchmark section on a tiny model; the record lands in a scratch folder."""
    kept = gpu_bench.RESULT.stat().st_mtime if gpu_bench.RESULT.exists() else None
    env = {k: v for k, v in os.environ.items() if k != "OUT"} | {"TMPDIR": str(tmp_path)}
    env["PYTHON"] = sys.executable
    done = subprocess.run(
        ["bash", "bench/gpu_check.sh", "--cpu-dry-run"],
        cwd=ROOT,
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    [record_path] = tmp_path.glob("gpu-check.*/gpu_check_dry_run.json")
    record = json.loads(record_path.read_text())
    assert record["dry_run"] and record["device"] == "cpu (dry run)"
    assert record["parity_passed"] is True and record["parity"]["tests"] >= 3
    assert record["errors"] == {}
    for section in ("copy", "model", "decode", "throughput", "breakdown", "hf"):
        assert section in record, section
    assert record["decode_over_floor"] > 1 and record["throughput_ratio"] > 0
    assert record["throughput"]["output_tokens"] == 4 * 16 and not record["hf"]["truncated"]
    fractions = record["breakdown"]["fractions"]
    assert fractions["moe"] > 0 and fractions["attention"] > 0
    assert sum(fractions.values()) == pytest.approx(1.0, abs=0.05)
    assert "decode_over_floor" in done.stdout and "parity suite exit status: 0" in done.stdout
    assert kept == (gpu_bench.RESULT.stat().st_mtime if gpu_bench.RESULT.exists() else None)
    assert not list(tmp_path.glob("gpu-check.*/model"))  # the scratch model is gone
