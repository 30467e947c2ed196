"""The engine core process: start-up errors come back as engine errors, a dead core fails
every stream and marks the engine dead, and the core never outlives the API process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file, save_file

from inference import (
    AsyncLLMEngine,
    EngineDeadError,
    InvalidParameterError,
    ModelLoadError,
    SamplingParams,
)
from inference.engine_core import StepResult


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # exited, not yet reaped
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_start_errors_in_the_core_come_back_as_engine_errors(tiny_model_dir, tmp_path):
    with pytest.raises(InvalidParameterError) as info:  # raised in the core (it sizes the KV cache)
        AsyncLLMEngine.from_pretrained(
            tiny_model_dir, device="cpu", dtype="float32", kv_cache_tokens=64, max_model_len=4096
        )
    assert info.value.param == "max_model_len" and "at most 64 tokens" in str(info.value)

    broken = tmp_path / "broken"
    subprocess.run(["cp", "-r", str(tiny_model_dir), str(broken)], check=True)
    weights = load_file(broken / "model.safetensors")
    weights.pop("model.layers.0.self_attn.q_proj.weight")
    save_file(weights, broken / "model.safetensors")
    with pytest.raises(ModelLoadError, match="lacks weights for: layers.0.attn.wqkv.weight"):
        AsyncLLMEngine.from_pretrained(broken, device="cpu", dtype="float32", kv_cache_tokens=256)


async def test_a_dead_core_fails_every_stream_and_refuses_new_ones(tiny_model_dir):
    engine = AsyncLLMEngine.from_pretrained(
        tiny_model_dir, device="cpu", dtype="float32", kv_cache_tokens=1024
    )
    engine.start()
    try:
        long = SamplingParams(max_tokens=1000, ignore_eos=True, temperature=0)
        agen = engine.stream("a long one", long)
        await agen.__anext__()
        os.kill(engine._process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="engine process exited"):
            async for _ in agen:
                pass
        assert not engine.is_alive
        with pytest.raises(EngineDeadError):
            await engine.generate("after", SamplingParams(max_tokens=2))
    finally:
        await engine.shutdown()


async def test_outputs_carry_the_prompt_the_core_does_not_send_back(tiny_model_dir):
    """The core's step messages leave each output's prompt out (the API process sent it, and a
    32K-token prompt is ~100 KB to encode every step); the stream puts it back."""
    engine = AsyncLLMEngine.from_pretrained(
        tiny_model_dir, device="cpu", dtype="float32", kv_cache_tokens=1024
    )
    sent_back, decoder = [], engine._decoder

    class Recording:
        def decode(self, data: bytes):
            message = decoder.decode(data)
            if isinstance(message, StepResult):
                sent_back.extend(out.prompt_token_ids for out in message.outputs)
            return message

    engine._decoder = Recording()
    engine.start()
    try:
        ids = [5, 6, 7, 8, 9]
        params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
        outputs = [o async for o in engine.stream("", params, prompt_token_ids=ids)]
    finally:
        await engine.shutdown()
    assert len(outputs) >= 2 and all(o.prompt_token_ids == ids for o in outputs)
    assert len(sent_back) >= len(outputs) and not any(sent_back)


def test_the_core_exits_when_the_api_process_dies(tiny_model_dir):
    script = (
        "import sys\n"
        "from inference import AsyncLLMEngine\n"
        f"e = AsyncLLMEngine.from_pretrained({str(tiny_model_dir)!r}, device='cpu', dtype='float32',"
        " kv_cache_tokens=256)\n"
        "print(e._process.pid, file=sys.stderr, flush=True)\n"
        "sys.stdin.read()\n"
    )
    api = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        core = int(api.stderr.readline())
        assert not _gone(core, 0.2)
        api.kill()  # no shutdown message: the core sees its pipe close
        api.wait(10)
        assert _gone(core, 10), "the engine core outlived the API process"
    finally:
        api.kill()
        api.wait(10)


def test_the_core_ignores_signals_sent_to_the_whole_group(tiny_model_dir):
    """SIGINT/SIGTERM to the process group reach the core too; only the API process acts on
    them (the drain decides when the core stops)."""
    engine = AsyncLLMEngine.from_pretrained(
        tiny_model_dir, device="cpu", dtype="float32", kv_cache_tokens=256
    )
    try:
        os.kill(engine._process.pid, signal.SIGTERM)
        os.kill(engine._process.pid, signal.SIGINT)
        assert not _gone(engine._process.pid, 0.5)
    finally:
        engine._process.kill()
        engine._process.wait(10)
