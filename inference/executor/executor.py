"""ModelExecutor: everything between a loaded config and a ready step function. It builds the
checkpoint family's model (models/registry.py), loads and converts its weights, quantizes
(quantize.py), installs a backend (our CPU kernels chosen by the CPU's flags, else torch's;
CUDA runs torch, compiled on request), allocates the paged KV cache and builds the model
runner. LLMEngine keeps requests, the schedule -> execute -> update loop and outputs.
"""

from __future__ import annotations

import os
from pathlib import Path

import structlog
import torch
from torch import nn

from inference.config import EngineConfig
from inference.errors import InvalidParameterError
from inference.executor import cpu_backend, key_calibration
from inference.executor.kv_cache import allocate_kv_cache, kv_bytes_per_token, num_cache_blocks
from inference.executor.loader import load_weights
from inference.executor.model_runner import ModelRunner
from inference.executor.quantize import quantize_model
from inference.executor.sampler import Sampler
from inference.kernels import cpu
from inference.models.args import Family, ModelArgs
from inference.models.moe import gather_limit
from inference.models.paged_cache import INT4, storage_dtype
from inference.quantization.qweight import QWeight
from inference.spec_decode.config import speculative_config
from inference.startup import StartupClock
from inference.structured import StructuredOutputManager

log = structlog.get_logger("inference.engine")


class ModelExecutor:
    def __init__(
        self,
        path: Path,
        family: Family,
        args: ModelArgs,
        device: torch.device,
        dtype: torch.dtype,
        config: EngineConfig,
        quantization: str,
        published: str,
        startup: StartupClock | None = None,
        tokenizer=None,
    ) -> None:
        """quantization: the weights' format to serve (none, int8, int4, fp8, or the
        checkpoint's own); published: the checkpoint's own (none, fp8, gptq, awq,
        compressed-tensors, mxfp4: loader.checkpoint_quantization). `startup`: the clock its
        phases are marked on (the engine marked load_weights). `tokenizer`: the model's, for
        the int4 cache's key calibration (key_calibration.py; None: none)."""
        self.args, self.device, self.dtype, self.config = args, device, dtype, config
        self.startup = clock = startup or StartupClock()
        self.quantization = quantization
        max_positions = min(
            args.max_position_embeddings, config.max_model_len or args.max_position_embeddings
        )
        self.model, published_fp8 = self._load(path, family, max_positions, published)
        # our CPU kernels run bf16 models on the CPU, where this CPU's flags allow a build
        cpu_bf16 = device.type == "cpu" and dtype == torch.bfloat16
        if cpu_bf16:
            clock.mark("compile")  # our CPU kernels: built, or loaded from their cache
        self.kernels = cpu_bf16 and cpu.enable_once() is not None
        if self.kernels:
            # a speculating engine verifies k + 1 rows a sequence: they round as its plain decode
            # steps only with batch invariance, which costs batched decode its shared register
            # tiles; MOESERVE_BATCH_INVARIANT=1 asks it without speculation (vLLM's
            # VLLM_BATCH_INVARIANT), e.g. to compare outputs with a speculating engine's
            cpu.batch_invariant(
                config.speculative_config is not None
                or os.environ.get("MOESERVE_BATCH_INVARIANT", "0") == "1"
            )
        if quantization != "none":
            clock.mark("quantize")
            # an FP8 checkpoint served as fp8 keeps what it shipped in 16 bits (its lm_head);
            # so does a bf16 one quantized to fp8 here: e4m3's 3 mantissa bits on the lm_head
            # cost SmolLM2 4.5% of perplexity, int8's 0.3% (bench/NOTES.md)
            # served as published: only what the checkpoint quantized (its lm_head where so)
            as_published = quantization == published
            quantize_model(
                self.model,
                quantization,
                published_fp8,
                lm_head=quantization in ("int8", "int4") or as_published,
                only_published=as_published,
            )
            self._note_quantized_path()
        # the int4 cache's keys: a shift and a rounding (key_calibration.py), measured below
        int4_keys = (
            tokenizer is not None
            and storage_dtype(config.kv_cache_dtype, dtype) == INT4
            and bool(key_calibration.attention_layers(self.model))  # MLA alone: nothing to do
        )
        shift = int4_keys and key_calibration.switch("MOESERVE_KV_KEY_SHIFT")
        # the rounding where our kernels write the rows: torch's loop over a row's values
        # (paged_cache._weighted_levels) would cost every layer's write a few milliseconds
        rounding = int4_keys and key_calibration.switch("MOESERVE_KV_KEY_ROUNDING") and self.kernels
        if shift or rounding:  # before the backend: the fused step takes their addresses
            key_calibration.prepare(self.model, device, shift, rounding)
        if cpu_bf16:
            clock.mark("pack")  # weights into the kernels' layouts
        self.fused_step = self._install_backend() if cpu_bf16 else None
        self.weight_bytes = weight_bytes(self.model)
        clock.mark("kv_cache_alloc")  # (and the engine's block tables over it)
        self._size_kv_cache(max_positions)
        log.info(
            "model ready",
            quantization=quantization,
            kv_cache_dtype=config.kv_cache_dtype,
            weight_bytes=self.weight_bytes,
        )
        self.kv_caches = allocate_kv_cache(
            args, self.num_blocks, config.block_size, self.kv_storage, device
        )
        # the MTP layer's cache (same blocks, its own tensors) is the drafter's, not the model's
        self.mtp_cache = self.kv_caches.pop() if args.mtp else None
        if shift or rounding:  # on a cache of its own: the same whatever this one's size
            ids = key_calibration.calibration_ids(tokenizer)[:max_positions]
            bs = config.block_size
            scratch = allocate_kv_cache(args, -(-len(ids) // bs), bs, self.dtype, device)
            used = key_calibration.calibrate(self.model, scratch[: args.num_layers], ids)
            log.info("int4 cache keys calibrated", shift=shift, rounding=rounding, tokens=used)

    def _load(self, path: Path, family: Family, max_positions: int, published: str):
        """The family's model with the checkpoint's weights, and its fp8 weights as published
        (parameter name -> QWeight) where fp8 is served."""
        log.info(
            "loading weights",
            model=str(path),
            architecture=self.args.architecture,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            checkpoint_quantization=published,
        )
        with torch.device(self.device):
            model = family.model(self.args, max_positions, gather_limit(self.device.type))
        model.to(self.dtype)
        for module in model.modules():  # what the reference keeps in float32 (rope tables...)
            if getattr(module, "keep_in_fp32", False):
                module.float()
        keep = self.quantization == published != "none" or self.quantization == "fp8"
        published_fp8 = load_weights(model, path, self.args, family, keep)
        return model.eval(), published_fp8

    def _install_backend(self) -> cpu_backend.FusedDecodeStep | None:
        """Our CPU kernels in a bf16 model on the CPU, where this CPU runs them (the start-up
        `CPU kernels` line names the path of each layer kind, ATen's included)."""
        fused = cpu_backend.install(self.model) if self.kernels else None
        log.info("CPU kernels", isa=cpu.ISA or "none", amx=cpu.AMX, **cpu.paths())
        return fused

    def _note_quantized_path(self) -> None:
        """Says at start-up which path the 8-bit weights take where it is not our kernels'
        (never a silent slow path)."""
        if self.quantization == "int4":
            log.info(
                "int4 weights: linear layers, experts and the one-call decode step on the int4 "
                "kernels where the CPU has them (`CPU kernels` line: int4) and the shapes fit "
                "(inputs in octets; rotated), else torch's (experts one at a time)",
            )
        if self.kernels:
            return
        if self.device.type == "cuda":
            scheme = "W4A8" if self.quantization == "int4" else "W8A8"
            path = (
                "torch._scaled_mm with per-token fp8 activations"
                if self.quantization == "fp8"
                else f"float64 matmuls of exact integer sums ({scheme})"
            )
            log.warning(
                "quantized weights on CUDA: unmeasured path (no GPU run has proven it); "
                "experts dequantize one at a time",
                quantization=self.quantization,
                path=path,
            )
        else:
            log.warning(
                "quantized weights without the CPU kernels (float32 model, no AVX2, or kernels "
                "off): torch's path, slower than bf16 on our kernels",
                quantization=self.quantization,
                dtype=str(self.dtype).removeprefix("torch."),
            )

    def _size_kv_cache(self, max_positions: int) -> None:
        """Sizes the paged cache (config: tokens, bytes, or GPU memory): its blocks, tokens,
        bytes and storage dtype, and the longest sequence the model and the cache allow."""
        config, args = self.config, self.args
        self.kv_storage = storage = storage_dtype(config.kv_cache_dtype, self.dtype)
        num_blocks = num_cache_blocks(
            args,
            storage,
            self.device,
            config.block_size,
            config.kv_cache_tokens,
            config.gpu_memory_utilization,
            config.kv_cache_bytes,
        )
        self.num_blocks = num_blocks
        self.kv_cache_tokens = cache_tokens = num_blocks * config.block_size
        self.max_model_len = max_model_len = min(max_positions, cache_tokens)
        if config.max_model_len and config.max_model_len > max_model_len:
            raise InvalidParameterError(
                "max_model_len",
                f"is {config.max_model_len} but the model and KV cache allow at most "
                f"{max_model_len} tokens (a RoPE scaling in --hf-overrides stretches the "
                "model's context, as vLLM's)",
            )
        per_token = kv_bytes_per_token(args, storage)
        self.kv_cache_bytes = cache_tokens * per_token
        log.info(
            "allocating kv cache",
            blocks=num_blocks,
            tokens=cache_tokens,
            bytes=self.kv_cache_bytes,
            max_model_len=max_model_len,
            bytes_per_token=per_token,
            kv_cache_dtype=config.kv_cache_dtype,
        )

    def build_runner(
        self, eos_token_ids: set[int], structured: StructuredOutputManager | None
    ) -> ModelRunner:
        """The model runner over this model and cache: decode-only steps take the backend's
        fused step, or the compiled model (config.compile, where no kernels run)."""
        greedy = cpu_backend.greedy if self.kernels else None
        sampler = Sampler(self.args.vocab_size, eos_token_ids, greedy)
        if self.compiles:
            self.startup.mark("compile")  # torch.compile's wrapper (graphs: at warm-up)
        compiled = self._compiled()
        spec = speculative_config(self.config.speculative_config)
        return ModelRunner(
            self.model,
            self.kv_caches,
            self.config.block_size,
            sampler,
            self.device,
            decode_forward=compiled if self.fused_step is None else self.fused_step,
            paged_kernel=self.kernels,
            structured=structured,
            mtp_cache=self.mtp_cache,
            disable_by_batch_size=spec.disable_by_batch_size if spec else 0,
        )

    @property
    def compiles(self) -> bool:
        """Whether decode steps run a torch.compile'd model (warmed up before any request)."""
        return self.config.compile and self.quantization == "none" and not self.kernels

    def _compiled(self) -> nn.Module | None:
        if self.config.compile and not self.compiles:
            if self.quantization != "none":
                log.info("not compiling: 8-bit weights run eagerly", quantization=self.quantization)
            else:
                # The kernels already fuse what torch.compile would, and a compiled graph of
                # their operators measured slower (one sequence 7 against 132 tok/s eager).
                log.info("not compiling: decode steps run on the CPU kernels", isa=cpu.ISA)
        if not self.compiles:
            return None
        # Inductor would decompose the single-row GEMVs into a generated reduction that runs
        # 1.4-2x slower than the ATen/MKL kernel on our CPUs (768x512 bf16: 53 vs 32 us);
        # without the decomposition they stay ATen calls.
        from torch._inductor.decomposition import decompositions

        decompositions.pop(torch.ops.aten.mv.default, None)
        # Decode-only steps run the compiled model: a few hundred small per-layer ops (norms,
        # rope, routing) become a handful of fused kernels, which is most of a decode step's
        # time at this size. dynamic=True: one graph for one sequence (0/1 specialisation)
        # and one for every larger batch and context length.
        return torch.compile(self.model, dynamic=True)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights held: parameters, 8-bit weights and packed extras."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        for value in module.__dict__.values():
            if isinstance(value, QWeight):
                total += value.nbytes
            elif isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total
