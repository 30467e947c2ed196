"""LLMEngine: step() = schedule -> run -> update, plus request bookkeeping and outputs.

Single-threaded by design; AsyncLLMEngine drives it in a process of its own (engine_core.py).
"""

from __future__ import annotations

import time
from concurrent import futures
from pathlib import Path

import structlog
import torch

from inference.block_manager import BlockManager
from inference.config import EngineConfig, ModelArgs, resolve_device, resolve_dtype
from inference.detokenizer import IncrementalDetokenizer
from inference.errors import InvalidParameterError
from inference.executor.loader import (
    checkpoint_quantization,
    load_hf_config,
    load_tokenizer,
    load_weights,
)
from inference.executor.model_runner import ModelRunner
from inference.executor.sampler import Sampler
from inference.heap import collector_skips_existing, keep_freed_memory
from inference.kernels import cpu as cpu_kernels
from inference.models.decoder import MoETransformer
from inference.models.moe import gather_limit
from inference.models.paged_cache import (
    allocate_kv_cache,
    kv_bytes_per_token,
    num_cache_blocks,
    storage_dtype,
)
from inference.outputs import CompletionOutput, FinishedSequence, RequestOutput, StepStats
from inference.prompts import Prompt, check_token_ids, tokenize_prompt
from inference.sampling_params import SamplingParams
from inference.scheduler import Scheduler
from inference.sequence import Sequence, SequenceStatus
from inference.structured import CompileJob, StructuredOutputManager

log = structlog.get_logger("inference.engine")


class LLMEngine:
    def __init__(
        self,
        model_dir: str | Path,
        device: str = "auto",
        dtype: str = "auto",
        config: EngineConfig | None = None,
    ) -> None:
        path = Path(model_dir)
        self.config = config = config or EngineConfig()
        self.device = resolve_device(device)
        keep_freed_memory()  # every step frees and takes the same big blocks (heap.py)
        hf_config = load_hf_config(path)
        self.args = args = ModelArgs.from_hf_config(hf_config)
        self.dtype = resolve_dtype(dtype, self.device, getattr(hf_config, "dtype", None))
        self.tokenizer = load_tokenizer(path)
        self.model_path = path
        published = checkpoint_quantization(hf_config)
        self.quantization = config.quantization or published
        self.kv_cache_dtype = config.kv_cache_dtype
        log.info(
            "loading weights",
            model=str(path),
            architecture=args.architecture,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            checkpoint_quantization=published,
        )
        max_positions = min(
            args.max_position_embeddings, config.max_model_len or args.max_position_embeddings
        )
        with torch.device(self.device):
            model = MoETransformer(args, max_positions, gather_limit(self.device.type))
        model.to(self.dtype)
        model.rope.to(torch.float32)
        fp8_weights = load_weights(model, path, args, keep_fp8=self.quantization == "fp8")
        self.model = model.eval()
        compile = config.compile
        kernels = (
            self.device.type == "cpu"
            and self.dtype == torch.bfloat16
            and cpu_kernels.enable_once() is not None
        )
        if self.quantization != "none":
            # an FP8 checkpoint served as fp8 keeps what it shipped in 16 bits (its lm_head);
            # so does a bf16 one quantized to fp8 here: e4m3's 3 mantissa bits on the lm_head
            # cost SmolLM2 4.5% of perplexity, int8's 0.3% (bench/NOTES.md)
            model.quantize(
                self.quantization,
                fp8_weights,
                lm_head=self.quantization == "int8",
                only_published=published == "fp8" and self.quantization == "fp8",
            )
            self._note_quantized_path(kernels)
            if compile:
                log.info("not compiling: 8-bit weights run eagerly", quantization=self.quantization)
            compile = False
        if self.device.type == "cpu" and self.dtype == torch.bfloat16:
            if kernels:
                model.pack_for_cpu_kernels()
                # The kernels already fuse what torch.compile would, and a compiled graph of
                # their operators measured slower (one sequence 7 against 132 tok/s eager).
                if compile:
                    log.info(
                        "not compiling: decode steps run on the CPU kernels", isa=cpu_kernels.ISA
                    )
                compile = False
            log.info(
                "CPU kernels",
                isa=cpu_kernels.ISA or "none",
                amx=cpu_kernels.AMX,
                **cpu_kernels.paths(),
            )
        self.weight_bytes = model.weight_bytes()
        kv_storage = storage_dtype(config.kv_cache_dtype, self.dtype)
        num_blocks = num_cache_blocks(
            args,
            kv_storage,
            self.device,
            config.block_size,
            config.kv_cache_tokens,
            config.gpu_memory_utilization,
            config.kv_cache_bytes,
        )
        cache_tokens = num_blocks * config.block_size
        self.max_model_len = min(max_positions, cache_tokens)
        if config.max_model_len and config.max_model_len > self.max_model_len:
            raise InvalidParameterError(
                "max_model_len",
                f"is {config.max_model_len} but the model and KV cache allow at most "
                f"{self.max_model_len} tokens",
            )
        self.kv_cache_tokens = cache_tokens
        self.kv_cache_bytes = cache_tokens * kv_bytes_per_token(args, kv_storage)
        log.info(
            "allocating kv cache",
            blocks=num_blocks,
            tokens=cache_tokens,
            bytes=self.kv_cache_bytes,
            max_model_len=self.max_model_len,
            bytes_per_token=kv_bytes_per_token(args, kv_storage),
            kv_cache_dtype=config.kv_cache_dtype,
        )
        log.info(
            "model ready",
            quantization=self.quantization,
            kv_cache_dtype=config.kv_cache_dtype,
            weight_bytes=self.weight_bytes,
        )
        self.kv_caches = allocate_kv_cache(
            args, num_blocks, config.block_size, kv_storage, self.device
        )
        self.eos_token_ids = self._eos_ids(path, hf_config)
        self.structured = StructuredOutputManager(
            self.tokenizer, args.vocab_size, self.eos_token_ids
        )
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            on_preempt=self._on_preempt,
        )
        self.runner = ModelRunner(
            self.model,
            self.kv_caches,
            config.block_size,
            Sampler(args.vocab_size, self.eos_token_ids),
            self.device,
            compile,
            self.structured,
        )
        self.requests: dict[str, list[Sequence]] = {}
        # requests whose grammar compiles off the step path, and those it failed for
        self._compiling: dict[str, tuple[CompileJob, list[Sequence]]] = {}
        self._rejected: list[tuple[str, InvalidParameterError]] = []
        self.on_compile_done = None  # called (from the compiler thread) as such a compile ends
        self._aborted: list[FinishedSequence] = []  # reported with the next step's stats
        if compile:
            self._warm_up()

    def _warm_up(self) -> None:
        """Compiles the decode graphs before any request: one sequence, then a batch (the
        dynamic graph). Prompt lengths keep the batch and context sizes distinct, so no shape
        is specialised by coincidence."""
        started = time.monotonic()
        log.info("compiling decode steps")
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        for batch in (1, 3):
            self.generate([[1] * 11] * batch, params)
        log.info("decode steps compiled", seconds=round(time.monotonic() - started, 1))

    def _note_quantized_path(self, kernels: bool) -> None:
        """Says at start-up which path the 8-bit weights take where it is not our kernels'
        (never a silent slow path)."""
        if kernels:
            return
        if self.device.type == "cuda":
            path = (
                "torch._scaled_mm with per-token fp8 activations"
                if self.quantization == "fp8"
                else "float32 matmuls of each activation group (W8A8)"
            )
            log.warning(
                "8-bit weights on CUDA: unmeasured path (no GPU run has proven it); "
                "experts dequantize one at a time",
                quantization=self.quantization,
                path=path,
            )
        else:
            log.warning(
                "8-bit weights without the CPU kernels (float32 model, no AVX2, or kernels "
                "off): torch's path, slower than bf16 on our kernels",
                quantization=self.quantization,
                dtype=str(self.dtype).removeprefix("torch."),
            )

    @classmethod
    def from_pretrained(
        cls, path: str | Path, device: str = "auto", dtype: str = "auto", **limits
    ) -> LLMEngine:
        return cls(path, device, dtype, EngineConfig.from_kwargs(**limits))

    def _eos_ids(self, path: Path, hf_config) -> set[int]:
        ids: set[int] = set()
        sources = [getattr(hf_config, "eos_token_id", None), self.tokenizer.eos_token_id]
        try:
            from transformers import GenerationConfig

            sources.append(GenerationConfig.from_pretrained(path).eos_token_id)
        except OSError:
            pass
        for value in sources:
            ids.update(value if isinstance(value, list) else [value] if value is not None else [])
        return ids

    # ---- requests ---------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """Validates a prompt against the model's limits and returns its token ids."""
        return tokenize_prompt(
            self.tokenizer, self.args.vocab_size, self.max_model_len, prompt, params
        )

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        log_context: dict | None = None,
        prompt_token_ids: list[int] | None = None,
        tenant: str | None = None,
    ) -> None:
        """Queues a request; raises InvalidParameterError (nothing queued) for a bad prompt or
        parameter, including a structured_outputs constraint that does not compile. `tenant`
        (e.g. an API key's name): while requests queue, each tenant's get admitted in turn."""
        if request_id in self.requests:
            raise InvalidParameterError("request_id", f"{request_id!r} is already in use")
        arrival = time.monotonic()
        if prompt_token_ids is not None:  # validated by the caller, but a bad id would crash
            check_token_ids(params, self.args.vocab_size)
            ids = prompt_token_ids
        else:
            ids = self.tokenize_prompt(prompt, params)
        job = None
        if params.structured_outputs is not None:
            # ~1-2 ms for a schema of a few fields (bench/results/structured_backends.json),
            # microseconds from the cache; a grammar that takes longer than the manager's
            # sync_compile_s goes on compiling off the step path and its request waits for it
            job = self.structured.start_compile(params.structured_outputs)
        seqs = []
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(params.seed + i)
            seq = Sequence(
                f"{request_id}#{i}" if params.n > 1 else request_id,
                request_id,
                i,
                ids,
                params,
                gen,
                log_context,
                tenant,
            )
            seq.detok = IncrementalDetokenizer(
                self.tokenizer, ids, params.stop, params.skip_special_tokens
            )
            if job is not None:
                seq.times.arrival = arrival
            seqs.append(seq)
        self.requests[request_id] = seqs
        if job is None or job.matcher is not None:
            self._admit(seqs, job)
        else:
            self._compiling[request_id] = (job, seqs)
            done = self.on_compile_done
            if done is not None:
                job.future.add_done_callback(lambda _: done())

    def _admit(self, seqs: list[Sequence], job: CompileJob | None) -> None:
        for seq in seqs:
            if job is not None:  # one matcher per sequence (n > 1: each its own)
                seq.matcher = job.matcher.deep_copy()
                seq.times.grammar_compile_s = job.seconds
                seq.times.grammar_cache_hit = job.cache_hit
            self.scheduler.add(seq)

    def _poll_compiles(self) -> None:
        """Requests whose grammar finished compiling join the scheduler; those whose grammar
        failed leave the engine, their errors kept for take_rejected()."""
        for request_id, (job, seqs) in list(self._compiling.items()):
            try:
                if not self.structured.finish(job):
                    continue
            except InvalidParameterError as exc:
                del self._compiling[request_id]
                self.requests.pop(request_id, None)
                self._rejected.append((request_id, exc))
                log.info("request rejected", param=exc.param, **seqs[0].log_context)
                continue
            del self._compiling[request_id]
            self._admit(seqs, job)

    def take_rejected(self) -> list[tuple[str, InvalidParameterError]]:
        """Requests whose grammar failed after add_request had returned (it compiled past
        sync_compile_s): (request_id, error) each, once. They produce no output."""
        self._poll_compiles()
        rejected, self._rejected = self._rejected, []
        return rejected

    @property
    def is_only_compiling(self) -> bool:
        """Nothing to step but requests waiting for their grammar (wait for on_compile_done)."""
        return bool(self._compiling) and not self.scheduler.has_work and not self._aborted

    def wait_for_compiles(self, timeout: float | None = None) -> None:
        """Blocks until one of the pending grammars is compiled (or `timeout` seconds)."""
        pending = [job.future for job, _ in self._compiling.values()]
        if pending:
            futures.wait(pending, timeout, return_when=futures.FIRST_COMPLETED)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finishes every sequence of the request with reason "abort" and frees its blocks now."""
        seqs = self.requests.pop(request_id, None)
        if seqs is None:
            return None
        compiling = self._compiling.pop(request_id, None) is not None
        for seq in seqs:
            if not seq.is_finished:
                if compiling:  # never reached the scheduler
                    seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
                    seq.times.finished = time.monotonic()
                else:
                    self.scheduler.finish(seq, "abort")
                seq.matcher = None
                self._aborted.append(_finished(seq))
        log.info("request aborted", **seqs[0].log_context)
        return self._output(request_id, seqs)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def has_pending_stats(self) -> bool:
        """Aborted sequences not yet reported: a step (even an empty one) reports them."""
        return bool(self._aborted)

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> tuple[list[RequestOutput], StepStats]:
        started, started_ns = time.monotonic(), time.time_ns()
        if self._compiling:
            self._poll_compiles()
        sched = self.scheduler.schedule()
        result = self.runner.run(sched) if sched.scheduled else None
        now = time.monotonic()
        touched: dict[str, None] = {}
        finished, self._aborted = self._aborted, []
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
            touched[seq.request_id] = None
        for seq, first, values in result.prompt_logprobs if result is not None else ():
            # a recomputed prompt (after a preemption) adds only what is new
            seq.prompt_logprobs.extend(values[len(seq.prompt_logprobs) - first :])
        if result is not None and result.sample is not None:
            for seq, token, lp in zip(
                result.sampled, result.sample.token_ids, result.sample.logprobs
            ):
                self._append_token(seq, token, lp, now)
        for seq, _ in sched.scheduled:
            if seq.is_finished:
                finished.append(_finished(seq))
        outputs = []
        for rid in touched:
            seqs = self.requests.get(rid)
            if seqs is None:
                continue
            out = self._output(rid, seqs)
            if out.finished:
                del self.requests[rid]
            outputs.append(out)
        expert_tokens = None
        if result is not None and result.expert_counts.numel():
            expert_tokens = result.expert_counts.tolist()
        stats = StepStats(
            started=started,
            started_unix_ns=started_ns,
            duration_s=time.monotonic() - started,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting)
            + sum(len(seqs) for _, seqs in self._compiling.values()),
            batch_size=len(sched.scheduled),
            num_prefill_tokens=sum(n for _, n in sched.scheduled if n > 1),
            num_decode_tokens=sum(1 for _, n in sched.scheduled if n == 1),
            num_generated_tokens=len(result.sampled) if result else 0,
            kv_usage=self.block_manager.usage,
            kv_blocks_used=self.block_manager.num_used,
            num_requests=len(self.requests),
            num_preemptions=sched.num_preempted,
            request_ids=list(touched),
            expert_tokens=expert_tokens,
            finished=finished,
            bitmask_s=self.structured.take_step_time(),
        )
        return outputs, stats

    def _append_token(self, seq: Sequence, token: int, lp, now: float) -> None:
        seq.token_ids.append(token)
        if lp is not None:
            seq.logprobs.append(lp)
        if seq.times.first_token is None:
            seq.times.first_token = now
        seq.times.last_token = now
        p = seq.params
        # the grammar: "stop" once complete (only EOS may follow), "error" if it refused
        grammar = None if seq.matcher is None else self.structured.advance(seq.matcher, token)
        ends = token in self.eos_token_ids and not p.ignore_eos
        # an ending EOS adds no text, also where special tokens are kept (skip_special_tokens)
        matched = None if ends else seq.detok.add(token)
        reason = None
        if matched is not None:
            reason, seq.stop_reason = "stop", matched
        elif token in p.stop_token_ids:
            reason, seq.stop_reason = "stop", token
        elif ends:
            reason = "stop"
        elif grammar is not None:
            reason = grammar
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)
            seq.matcher = None

    def _on_preempt(self, seq: Sequence) -> None:
        log.info(
            "sequence preempted",
            seq_id=seq.seq_id,
            num_tokens=seq.num_tokens,
            kv_usage=round(self.block_manager.usage, 3),
            **seq.log_context,
        )

    def _output(self, request_id: str, seqs: list[Sequence]) -> RequestOutput:
        completions = []
        for seq in seqs:
            done = seq.is_finished
            text_end = seq.detok.streamable_len(done)
            text = seq.detok.text
            tokens = seq.output_token_ids
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=text[:text_end],
                    token_ids=tokens,
                    delta_text=text[seq.sent_text : text_end],
                    delta_token_ids=tokens[seq.sent_tokens :],
                    delta_logprobs=seq.logprobs[seq.sent_logprobs :],
                    logprobs=seq.logprobs if seq.params.logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    times=seq.times,
                )
            )
            seq.sent_text, seq.sent_tokens, seq.sent_logprobs = (
                text_end,
                len(tokens),
                len(seq.logprobs),
            )
        first = seqs[0]
        prompt_logprobs = None
        if first.params.prompt_logprobs is not None and (
            len(first.prompt_logprobs) == first.num_prompt_tokens
        ):
            prompt_logprobs = first.prompt_logprobs
        return RequestOutput(
            request_id,
            first.token_ids[: first.num_prompt_tokens],
            completions,
            finished=all(s.is_finished for s in seqs),
            num_cached_tokens=first.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
        )

    # ---- offline batch ----------------------------------------------------------------------
    def generate(
        self, prompts: Prompt | list[Prompt], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        params = params or SamplingParams()
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        ids = [f"offline-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            self.add_request(rid, prompt, params)
        final: dict[str, RequestOutput] = {}
        with collector_skips_existing():
            self._run_until_finished(ids, final)
        return [final[rid] for rid in ids]

    def _run_until_finished(self, ids: list[str], final: dict[str, RequestOutput]) -> None:
        while len(final) < len(ids):
            rejected = self.take_rejected()
            mine = [error for request_id, error in rejected if request_id in ids]
            self._rejected.extend(r for r in rejected if r[0] not in ids)  # someone else's
            if mine:
                for rid in ids:
                    self.abort(rid)
                raise mine[0]
            if self.is_only_compiling:
                self.wait_for_compiles()
                continue
            outputs, _ = self.step()
            for out in outputs:
                if out.finished:
                    final[out.request_id] = out


def _finished(seq: Sequence) -> FinishedSequence:
    return FinishedSequence(
        seq.request_id,
        seq.seq_id,
        seq.num_prompt_tokens,
        seq.num_output_tokens,
        seq.num_cached_tokens,
        seq.finish_reason,
        seq.times,
    )
