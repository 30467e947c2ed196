"""Every MoE dispatch path computes the same layer (the contract that lets the engine keep
several: inference/moe.py).

One router output and one set of expert weights go through each path, forced: the torch
paths by name (gather, single token, padded, grouped: moe.DISPATCH_PATHS), the path the
engine's layer picks by itself on the test device ("auto"), the path it picks on a GPU
("auto-cuda": forced by name where the test device is the CPU), and the CPU kernels (one C
call per layer, for one token, decode batches and prefill chunks alike) on every build this
CPU runs or emulates (kernel_paths.PATHS; a build it cannot run is skipped with the reason).
Token counts: one, a few (the GPU's gather path), more than the experts (and than the GPU's
gather limit), a prefill chunk; top-k 1, 2 and 4; no shared expert (Mixtral, OLMoE,
Qwen3-MoE), Qwen2-MoE's sigmoid-gated one and DeepSeek-V2's plain one; float32 and bfloat16.

Each output is held against the same layer in float64 on the same rounded inputs:
- float32: within 1e-5 of the output's largest magnitude (summation order is all that
  differs; measured below 1e-6);
- bfloat16: within 2**-5 of it (and 2**-6 of each value): each path rounds to bf16 after
  the gate/up product, after SiLU * up, after each expert's down projection (terms that can
  be larger than the sum they cancel into), and with a shared expert after the shared MLP
  and the sum, a few units of 2**-9 each (measured up to 2**-6.4, on every path alike).
The router runs in float32 (router_fp32), so every module computes the same expert ids and
weights; the test checks that it does, and that each path counts the tokens per expert.

MOESERVE_TEST_DEVICE=cuda (bench/gpu_check.sh) runs the torch paths on the GPU, against the
float64 reference computed on the CPU; the CPU kernels are skipped there.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from inference.executor import cpu_backend
from inference.models.moe import (
    DISPATCH_PATHS,
    DenseMLP,
    MoE,
    SharedExpertMoE,
    dispatch_path,
    gather_limit,
)
from tests.inference.kernel_paths import PATHS as KERNEL_PATHS
from tests.inference.kernel_paths import Path as KernelPath
from tests.inference.kernel_paths import forced
from tests.inference.parity_checks import DEVICE

EXPERTS, HIDDEN, WIDTH, SHARED_WIDTH = 8, 64, 48, 96
TOKENS = [1, 3, 12, 200]
TOP_K = [1, 2, 4]
SHARED = ["none", "gated", "plain"]
TOLERANCE = {torch.float32: (0.0, 1e-5), torch.bfloat16: (2**-6, 2**-5)}  # rtol, atol/scale
TORCH_PATHS = [*DISPATCH_PATHS, "auto", "auto-cuda"]


def cases():
    for path in TORCH_PATHS + KERNEL_PATHS:
        kernels = isinstance(path, KernelPath)
        for dtype in (torch.bfloat16,) if kernels else (torch.float32, torch.bfloat16):
            for tokens in TOKENS:
                if path == "single_token" and tokens != 1:
                    continue  # the one-token path takes one token (it raises otherwise)
                for top_k in TOP_K:
                    for shared in SHARED:
                        name = f"{path}-{str(dtype)[6:]}-t{tokens}-k{top_k}-{shared}"
                        yield pytest.param(path, dtype, tokens, top_k, shared, id=name)


def forced_path(path: str, tokens: int, top_k: int) -> str | None:
    """The name MoE(dispatch_path=...) gets for a torch path; None: the layer chooses."""
    if path == "auto":
        return None
    if path == "auto-cuda":
        return dispatch_path(tokens, tokens * top_k, EXPERTS, "cuda", gather_limit("cuda"))
    return path


def build(shared: str, top_k: int, path: str | None, gather_max_tokens: int) -> nn.Module:
    moe = MoE(
        HIDDEN,
        WIDTH,
        EXPERTS,
        top_k,
        norm_topk_prob=True,
        gather_max_tokens=gather_max_tokens,
        router_fp32=True,
        dispatch_path=path,
    )
    if shared == "none":
        return moe
    return SharedExpertMoE(moe, DenseMLP(HIDDEN, SHARED_WIDTH), gated=shared == "gated")


@functools.cache
def master_weights(shared: str) -> dict[str, torch.Tensor]:
    """float32 weights scaled by fan-in, so every activation is of order one."""
    g = torch.Generator().manual_seed(0)
    shapes = build(shared, 1, None, 0).state_dict()
    return {
        name: torch.randn(t.shape, generator=g) * t.shape[-1] ** -0.5 for name, t in shapes.items()
    }


def tokens_in(count: int) -> torch.Tensor:
    return torch.randn(count, HIDDEN, generator=torch.Generator().manual_seed(count))


def routed(module: nn.Module) -> MoE:
    return module.moe if isinstance(module, SharedExpertMoE) else module


def reference(x, weights, ids, params: dict[str, torch.Tensor], shared: str) -> torch.Tensor:
    """The layer in float64: sum over the chosen experts of weight * W2 (silu(g) * u), plus the
    shared MLP (times sigmoid(x . gate) for Qwen2-MoE's)."""
    prefix = "" if shared == "none" else "moe."
    w13, w2 = params[f"{prefix}experts.w13"], params[f"{prefix}experts.w2"]
    gate, up = torch.einsum("td,tahd->tah", x, w13[ids]).chunk(2, dim=-1)
    out = torch.einsum("tai,tadi,ta->td", F.silu(gate) * up, w2[ids], weights)
    if shared != "none":
        gate, up = (x @ params["shared.w13.weight"].T).chunk(2, dim=-1)
        mlp = (F.silu(gate) * up) @ params["shared.w2.weight"].T
        out += mlp * torch.sigmoid(x @ params["shared_gate.weight"].T) if shared == "gated" else mlp
    return out


@pytest.mark.parametrize("path, dtype, tokens, top_k, shared", cases())
def test_every_dispatch_path_computes_the_same_layer(path, dtype, tokens, top_k, shared):
    kernels = isinstance(path, KernelPath)
    if kernels and DEVICE != "cpu":
        pytest.skip(f"the CPU kernels are CPU paths; the test device is {DEVICE}")
    gather_max_tokens = gather_limit(DEVICE) if path == "auto" else 0
    torch_path = None if kernels else forced_path(path, tokens, top_k)
    module = build(shared, top_k, torch_path, gather_max_tokens)
    module.load_state_dict(master_weights(shared))
    module.to(device=DEVICE, dtype=dtype)
    x = tokens_in(tokens).to(device=DEVICE, dtype=dtype)
    with torch.inference_mode():
        weights, ids = routed(module).route(x)  # float32: the same in every module
        if kernels:
            with forced(path):
                cpu_backend.install(module)  # the kernels' modules, as an engine's
                out, counts = module(x)
        else:
            out, counts = module(x)
    # every path was given the router output of a plain CPU module (on another device the
    # float32 router may round its weights differently in the last bit)
    expected_weights, expected_ids = route_of(shared, top_k, dtype, tokens)
    assert torch.equal(ids.cpu(), expected_ids)
    torch.testing.assert_close(weights.cpu(), expected_weights, rtol=1e-6, atol=1e-7)
    assert counts.tolist() == torch.bincount(expected_ids.flatten(), minlength=EXPERTS).tolist()
    rounded = {k: v.to(dtype).double() for k, v in master_weights(shared).items()}
    exact = reference(
        tokens_in(tokens).to(dtype).double(),
        expected_weights.double(),
        expected_ids,
        rounded,
        shared,
    )
    assert out.dtype == dtype and out.shape == (tokens, HIDDEN)
    rtol, atol = TOLERANCE[dtype]
    scale = float(exact.abs().max())
    torch.testing.assert_close(out.cpu().double(), exact, rtol=rtol, atol=atol * scale)


@functools.cache
def route_of(shared: str, top_k: int, dtype: torch.dtype, tokens: int):
    """The router output for these inputs: a plain (unforced, CPU) module's float32 router."""
    module = build(shared, top_k, None, 0)
    module.load_state_dict(master_weights(shared))
    module.to(dtype)
    with torch.inference_mode():
        return routed(module).route(tokens_in(tokens).to(dtype))


def test_the_paths_the_layer_picks_by_itself_are_among_those_checked():
    """What dispatch() runs unforced, on each device, is one of the forced paths above: the
    GPU gathers up to its limit and groups above it; the CPU runs one token alone, pads
    decode batches and groups prefill chunks."""
    picked = {
        (device, tokens, top_k): dispatch_path(
            tokens, tokens * top_k, EXPERTS, device, gather_limit(device)
        )
        for device in ("cpu", "cuda")
        for tokens in TOKENS
        for top_k in TOP_K
    }
    assert set(picked.values()) <= set(DISPATCH_PATHS)
    assert {p for (d, t, _), p in picked.items() if d == "cuda" and t <= 8} == {"gather"}
    assert {p for (d, t, _), p in picked.items() if d == "cuda" and t > 8} == {"grouped"}
    assert picked["cpu", 1, 2] == "single_token"
    assert picked["cpu", 12, 2] == "padded" and picked["cpu", 200, 4] == "grouped"


def test_an_unknown_or_misapplied_path_is_refused():
    with pytest.raises(ValueError, match="unknown MoE dispatch path"):
        MoE(HIDDEN, WIDTH, EXPERTS, 2, True, dispatch_path="fused")
    module = build("none", 2, "single_token", 0)
    module.load_state_dict(master_weights("none"))
    with pytest.raises(ValueError, match="takes one token"), torch.inference_mode():
        module(tokens_in(3))
