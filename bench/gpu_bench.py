"""The measuring half of `make gpu-check` (bench/gpu_check.sh runs the parity suite first and
hands its JUnit report here), issue 21. Sections, in this order, each recorded as it ends:

1. copy: the device's copy rate, bytes read + written per second of a 2 GiB device-to-device
   copy of random bytes (median of 20, CUDA events).
2. model: a random-weight checkpoint of Qwen1.5-MoE-A2.7B's shape (24 layers, hidden 2048,
   60 routed experts of width 1408 top-4, a shared expert of 5632, vocab 151,936, bf16),
   drawn on the GPU by the demo-model writer, then loaded by the engine.
3. decode: batch-1 decode (a 512-token prompt, then 64 greedy steps; median engine step)
   against its floor, the bytes one token reads (each weight it touches once: attention, the
   router, its 4 experts, the shared expert, norms, lm_head, one embedding row, plus its KV
   context) over the copy rate: `decode_over_floor`.
4. throughput: 64 concurrent requests, 512 prompt -> 256 output tokens (greedy, EOS
   ignored), our output tokens/s (continuous batching, no prefix caching).
5. breakdown: decode steps of that batch under torch.profiler: device time in the MoE blocks
   (router, experts, shared expert) and the attention blocks (projections, rope, cache write,
   attention) per step, the rest of the device time, and the host (the share of the step the
   device sits idle), each over the median unprofiled step.
6. transformers: `generate` on static batches of 64 of the same requests (what its default
   MoE implementation does), capped at --hf-max-time seconds a batch (flagged if it bites).

A failing section is recorded with its traceback and the next ones still run; the exit status
is 1 then. The record goes to --out after every section (default bench/results/gpu_check.json,
which is kept in the repo: only measured GPU figures belong there).

--cpu-dry-run runs every section on the CPU with a tiny model of the same architecture and a
small workload, to prove the script end to end where there is no GPU; it writes no GPU figure
and refuses to write bench/results/gpu_check.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import torch

from bench.engine_bench import hf_static_batches, make_prompts
from inference import LLMEngine, SamplingParams
from inference.checkpoints.demo_model import Preset, write_demo_model
from inference.executor.kv_cache import kv_bytes_per_token
from inference.kernels import cpu as cpu_kernels
from inference.models.moe import MoE, SharedExpertMoE

RESULT = Path(__file__).parent / "results" / "gpu_check.json"

# Qwen1.5-MoE-A2.7B's config.json, random weights (its tokenizer has 151,646 tokens; ours
# 32,000, the ids above it decode to nothing, as the ids above 151,646 do in Qwen's).
QWEN15_MOE_A27B = Preset(
    num_layers=24,
    hidden=2048,
    num_heads=16,
    head_dim=128,
    num_kv_heads=16,
    num_experts=60,
    top_k=4,
    ffn=1408,
    shared_ffn=5632,
    vocab_size=151936,
    tokenizer_vocab=32000,
    max_positions=8192,
    rope_theta=1e6,
    dtype=torch.bfloat16,
)
# The dry run's model: the same architecture (a shared expert wider than the routed ones, a
# model vocabulary above the tokenizer's), small enough for seconds on two CPU cores.
TINY_QWEN2_MOE = dataclasses.replace(
    QWEN15_MOE_A27B,
    num_layers=2,
    hidden=64,
    num_heads=4,
    head_dim=16,
    num_kv_heads=4,
    num_experts=6,
    ffn=32,
    shared_ffn=128,
    vocab_size=1100,
    tokenizer_vocab=1024,
    max_positions=1024,
)


@dataclasses.dataclass(frozen=True)
class Workload:
    shape: Preset
    copy_bytes: int
    requests: int
    prompt_len: int
    output_len: int
    decode_steps: int
    profile_steps: int
    hf_batch: int


# 4 profiled steps: the profiler's trace of each (tens of thousands of ops) takes a while to read
GPU = Workload(QWEN15_MOE_A27B, 2 << 30, 64, 512, 256, 64, 4, 64)
DRY_RUN = Workload(TINY_QWEN2_MOE, 64 << 20, 4, 32, 16, 8, 4, 4)


def seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Wall time of fn() on the device: CUDA events around it, or the host clock."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def copy_rate(device: torch.device, nbytes: int, repeats: int = 20) -> dict:
    """Bytes read + written per second by a device copy of random bytes (never zeros)."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = [seconds(lambda: dst.copy_(src), device) for _ in range(repeats + 3)][3:]
    assert torch.equal(dst[-4096:], src[-4096:])
    return {
        "bytes": nbytes,
        "median_s": statistics.median(times),
        "bytes_per_s": 2 * nbytes / statistics.median(times),
    }


def token_bytes(engine: LLMEngine, context_len: float) -> dict:
    """The bytes one decode token of a lone sequence reads at least: every weight it touches
    once (of each MoE layer's experts only its top_k, of the embedding one row) and its KV
    context."""
    model, args = engine.executor.model, engine.args
    experts = {
        id(p): m.top_k / m.num_experts
        for m in model.modules()
        if isinstance(m, MoE)
        for p in (m.experts.w13, m.experts.w2)
    }
    weights = 0.0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if name == "embed.weight":
            nbytes = p.shape[1] * p.element_size()
        weights += nbytes * experts.get(id(p), 1.0)
    kv = kv_bytes_per_token(args, engine.dtype) * context_len
    return {"weights": weights, "kv_cache": kv, "total": weights + kv}


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0, ignore_eos=True)


def decode_batch1(engine: LLMEngine, prompt: list[int], steps: int) -> dict:
    """A lone sequence: its prefill step, then `steps` decode steps timed one by one (each
    engine step ends reading its sampled token back, so the host clock is the step's)."""
    engine.add_request("decode-1", prompt, greedy(steps + 1))
    engine.step()  # the prefill and the first token
    times = []
    while engine.has_unfinished:
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return {
        "steps": len(times),
        "median_step_s": statistics.median(times),
        "mean_context": len(prompt) + (steps + 1) / 2,
    }


def run_batch(engine: LLMEngine, prompts: list[list[int]], out_len: int, limit_s: float) -> dict:
    """All prompts at once, stepped until they finish or `limit_s` passes (the rest aborted,
    and the run flagged as truncated); output tokens per second."""
    ids = [f"batch-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, greedy(out_len))
    start, generated, steps = time.perf_counter(), 0, 0
    while engine.has_unfinished and time.perf_counter() - start < limit_s:
        _, stats = engine.step()
        generated += stats.num_generated_tokens
        steps += 1
    elapsed = time.perf_counter() - start
    truncated = engine.has_unfinished
    for rid in ids:
        engine.abort(rid)
    assert engine.block_manager.num_used == 0
    return {
        "output_tokens": generated,
        "seconds": elapsed,
        "tok_per_s": generated / elapsed,
        "steps": steps,
        "truncated": truncated,
    }


class Ranges:
    """Profiler ranges around modules ("moe", "attention", "model") through forward hooks, so
    the model's code stays as it is."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.handles, self.open = [], {}
        blocks = [(model, "model")]
        for layer in model.layers:
            blocks.append((layer.attn, "attention"))
            if isinstance(layer.mlp, MoE | SharedExpertMoE):
                blocks.append((layer.mlp, "moe"))
        for module, name in blocks:
            self.handles.append(module.register_forward_pre_hook(self._enter(name)))
            self.handles.append(module.register_forward_hook(self._exit))

    def _enter(self, name: str):
        def hook(module, args):
            self.open[id(module)] = rf = torch.profiler.record_function(name)
            rf.__enter__()

        return hook

    def _exit(self, module, args, output):
        self.open.pop(id(module)).__exit__(None, None, None)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def step_breakdown(engine: LLMEngine, prompts: list[list[int]], steps: int, out_len: int) -> dict:
    """Decode steps of the whole batch (of `out_len` tokens each, enough for the prefill
    steps and these): `steps` unprofiled (the step time), then `steps` under torch.profiler. On CUDA the blocks' shares are their kernels' device time over the step
    time and the host's is the step time the device sits idle; on the CPU (dry run) they are
    host times over the profiled steps."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.device.type == "cuda"
    ids = [f"profile-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, greedy(out_len))
    while engine.has_unfinished:  # until every sequence is past its prefill
        _, stats = engine.step()
        if stats.num_prefill_tokens == 0 and stats.num_decode_tokens == len(prompts):
            break
    else:
        raise RuntimeError("the batch finished before all of it was decoding together")

    def timed_steps() -> list[float]:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            _, stats = engine.step()
            times.append(time.perf_counter() - start)
            assert stats.num_decode_tokens == len(prompts) and not stats.num_prefill_tokens
        return times

    plain = timed_steps()
    ranges = Ranges(engine.executor.model)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        with profile(activities=activities) as prof:
            profiled = timed_steps()
    finally:
        ranges.remove()
        for rid in ids:
            engine.abort(rid)
    events = [e for e in prof.events() if e.device_type == DeviceType.CPU]

    def per_step(name: str) -> float:  # seconds per step inside the named ranges
        if cuda:
            total_us = sum(e.device_time_total for e in events if e.name == name)
        else:
            total_us = sum(e.cpu_time_total for e in events if e.name == name)
        return total_us / 1e6 / steps

    if cuda:
        basis = statistics.median(plain)
        busy = sum(k.duration for e in events for k in e.kernels) / 1e6 / steps
    else:
        basis = statistics.mean(profiled)
        busy = per_step("model")
    moe, attention = per_step("moe"), per_step("attention")
    return {
        "batch": len(prompts),
        "steps": steps,
        "median_step_s": statistics.median(plain),
        "basis": "device time / unprofiled step" if cuda else "host time / profiled step",
        "fractions": {
            "moe": moe / basis,
            "attention": attention / basis,
            "other_device": max(busy - moe - attention, 0.0) / basis,
            "host": max(1.0 - busy / basis, 0.0),
        },
    }


def hf_throughput(model_dir: Path, prompts, w: Workload, device, max_time: float) -> dict:
    """transformers `generate` on static batches of w.hf_batch, capped at max_time a batch."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, device_map=str(device)
    ).eval()
    with torch.inference_mode():
        hf_static_batches(hf, prompts[: w.hf_batch], 2, size=w.hf_batch)  # warm-up
        start = time.perf_counter()
        tokens = hf_static_batches(hf, prompts, w.output_len, size=w.hf_batch, max_time=max_time)
        elapsed = time.perf_counter() - start
    return {
        "batch": w.hf_batch,
        "experts_implementation": getattr(hf.config, "_experts_implementation", None),
        "output_tokens": tokens,
        "seconds": elapsed,
        "tok_per_s": tokens / elapsed,
        "truncated": tokens < len(prompts) * w.output_len,
    }


def parity(junit: Path | None) -> dict:
    """The parity suite's counts from its JUnit report (None: not run)."""
    if junit is None or not junit.is_file():
        return {"ran": False}
    suites = ET.parse(junit).getroot()
    suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return {"ran": True, **counts}


def environment(device: torch.device) -> dict:
    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "cpu": platform.processor() or platform.machine(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        env["gpu_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    return env


def write(record: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, out)


def summary(record: dict) -> str:
    def fmt(value, unit="", scale=1.0, digits=1) -> str:
        return "-" if value is None else f"{value * scale:.{digits}f}{unit}"

    copy, dec, ours, hf = (record.get(k) or {} for k in ("copy", "decode", "throughput", "hf"))
    fractions = (record.get("breakdown") or {}).get("fractions", {})
    w = record.get("workload", {})
    load = f"{w.get('requests')} x {w.get('prompt_len')}->{w.get('output_len')}"
    rows = [
        ("device", record["device"]),
        ("parity passed", str(record["parity_passed"])),
        ("copy rate", fmt(copy.get("bytes_per_s"), " GB/s", 1e-9)),
        ("batch-1 decode", fmt(dec.get("ms_per_token"), " ms/token", 1, 2)),
        ("  bytes/token floor", fmt(dec.get("floor_ms"), " ms", 1, 3)),
        ("  decode_over_floor", fmt(record.get("decode_over_floor"), "x (target <= 1.5)", 1, 2)),
        (f"{load} moeserve", fmt(ours.get("tok_per_s"), " tok/s")),
        ("  transformers generate", fmt(hf.get("tok_per_s"), " tok/s")),
        ("  ratio", fmt(record.get("throughput_ratio"), "x (target >= 8)", 1, 2)),
    ]
    rows += [(f"  step share: {k}", fmt(v, "%", 100)) for k, v in fractions.items()]
    rows += [(f"ERROR in {k}", v.strip().splitlines()[-1]) for k, v in record["errors"].items()]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-dry-run", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--parity-junit", type=Path, help="the parity suite's JUnit report")
    parser.add_argument("--parity-rc", type=int, help="the parity suite's exit status")
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument(
        "--section-limit", type=float, default=120.0, help="seconds each throughput run may take"
    )
    args = parser.parse_args()
    dry = args.cpu_dry_run
    w = DRY_RUN if dry else GPU
    if dry:
        out = args.out or Path(tempfile.gettempdir()) / "gpu_check_dry_run.json"
        if out.resolve() == RESULT.resolve():
            parser.error(f"a dry run writes no GPU figure: not to {RESULT}")
        device = torch.device("cpu")
        cpu_kernels.enable(None)  # the torch code the GPU runs, not the CPU's own kernels
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA device (use --cpu-dry-run to check the script on the CPU)")
        out, device = args.out or RESULT, torch.device("cuda")
    model_dir = args.model_dir or Path(tempfile.gettempdir()) / (
        "moeserve-gpu-check-dry-run" if dry else "moeserve-gpu-check-model"
    )
    junit = parity(args.parity_junit)
    passed = None
    if junit["ran"]:
        passed = args.parity_rc == 0 and junit["tests"] > 0 and not junit["failures"]
        passed = passed and not junit["errors"]
    record = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "dry_run": dry,
        "device": torch.cuda.get_device_name(device) if not dry else "cpu (dry run)",
        "parity_passed": passed,
        "parity": junit,
        "env": environment(device),
        "model": dataclasses.asdict(w.shape) | {"dtype": "bfloat16", "arch": "qwen2_moe"},
        "workload": {k: v for k, v in dataclasses.asdict(w).items() if k != "shape"},
        "decode_over_floor": None,
        "throughput_ratio": None,
        "errors": {},
    }
    state: dict = {}

    def section(name: str, fn: Callable[[], dict | None]) -> None:
        started = time.perf_counter()
        print(f"[gpu_bench] {name} ...", flush=True)
        try:
            result = fn()
            if result is not None:
                record[name] = result | {"section_s": round(time.perf_counter() - started, 1)}
        except Exception:  # noqa: BLE001 - recorded with its traceback; the next sections run
            record["errors"][name] = traceback.format_exc()
            print(record["errors"][name], file=sys.stderr, flush=True)
        write(record, out)

    def build() -> dict:
        write_demo_model(model_dir, w.shape, seed=0, arch="qwen2_moe", device=str(device))
        engine = LLMEngine.from_pretrained(
            model_dir,
            device=str(device),
            dtype="bfloat16",
            max_num_seqs=w.requests,
            kv_cache_tokens=w.requests * (w.prompt_len + w.output_len + 16),
            enable_prefix_caching=False,  # transformers has none; the runs reuse prompts
        )
        state["engine"] = engine
        state["prompts"] = make_prompts(w.requests, w.prompt_len, w.shape.tokenizer_vocab)
        parameters = sum(p.numel() for p in engine.executor.model.parameters())
        return {"dir": str(model_dir), "parameters": parameters}

    def decode() -> dict:
        engine, prompts = state["engine"], state["prompts"]
        engine.generate(prompts[:1], greedy(4))  # warm-up
        result = decode_batch1(engine, prompts[0], w.decode_steps)
        floor_bytes = token_bytes(engine, result["mean_context"])
        floor_s = floor_bytes["total"] / record["copy"]["bytes_per_s"]
        record["decode_over_floor"] = result["median_step_s"] / floor_s
        return result | {
            "ms_per_token": result["median_step_s"] * 1e3,
            "floor_bytes": floor_bytes,
            "floor_ms": floor_s * 1e3,
        }

    def throughput() -> dict:
        engine, prompts = state["engine"], state["prompts"]
        engine.generate(prompts, greedy(2))  # warm-up: every prefill shape once
        return run_batch(engine, prompts, w.output_len, args.section_limit)

    def hf() -> dict:
        state.pop("engine", None)  # its weights and cache leave room for transformers'
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result = hf_throughput(model_dir, state["prompts"], w, device, args.section_limit)
        if "throughput" in record:
            record["throughput_ratio"] = record["throughput"]["tok_per_s"] / result["tok_per_s"]
        return result

    section("copy", lambda: copy_rate(device, w.copy_bytes))
    section("model", build)
    if "engine" in state:
        if "copy" in record:
            section("decode", decode)
        section("throughput", throughput)
        section(
            "breakdown",
            lambda: step_breakdown(
                state["engine"], state["prompts"], w.profile_steps, w.output_len
            ),
        )
        section("hf", hf)
    print("\n" + summary(record), flush=True)
    print(f"\n[gpu_bench] record: {out}", flush=True)
    return 1 if record["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
