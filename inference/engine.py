"""LLMEngine: requests, step() = schedule -> execute -> update, and outputs. Everything between
the checkpoint and a ready step function (model, weights, quantization, backend, KV cache) is
the executor's (executor/executor.py).

Single-threaded by design; AsyncLLMEngine drives it in a process of its own (engine_core.py).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import structlog

from inference.block_manager import BlockManager
from inference.config import PUBLISHED_FORMATS, EngineConfig, resolve_device, resolve_dtype
from inference.errors import InvalidParameterError, ModelLoadError
from inference.executor.executor import ModelExecutor
from inference.executor.loader import (
    checkpoint_quantization,
    checkpoint_tensor_names,
    eos_token_ids,
    load_hf_config,
    load_tokenizer,
)
from inference.heap import keep_freed_memory
from inference.input_processor import InputProcessor
from inference.models.registry import family_of, model_args
from inference.offline import generate_offline, warm_up
from inference.outputs import RequestOutput, StepStats
from inference.pending_grammars import PendingGrammars
from inference.prompts import Prompt
from inference.sampling_params import SamplingParams
from inference.scheduler import Scheduler
from inference.sequence import Sequence, SequenceStatus, request_output
from inference.spec_decode.config import check_servable
from inference.spec_decode.config import speculative_config as speculative_config_of
from inference.spec_decode.metrics import SpecStepCounts
from inference.spec_decode.mtp import MtpSpeculator
from inference.spec_decode.speculator import NgramSpeculator
from inference.startup import StartupClock
from inference.stop_check import stop_reason
from inference.structured import CompileJob, StructuredOutputManager

log = structlog.get_logger("inference.engine")


class LLMEngine:
    def __init__(
        self,
        model_dir: str | Path,
        device: str = "auto",
        dtype: str = "auto",
        config: EngineConfig | None = None,
        startup: StartupClock | None = None,
        *,
        speculative_config: str | dict | None = None,
    ) -> None:
        """`startup`: the clock the start's phases are marked on (inference/startup.py).
        `speculative_config`: vLLM's (inference/spec_decode/config.py), in place of the
        config's."""
        self.startup = clock = startup or StartupClock()
        clock.mark("load_weights")  # the config, tokenizer and model too
        path = self.model_path = Path(model_dir)
        config = config or EngineConfig()
        if speculative_config is not None:
            config = dataclasses.replace(config, speculative_config=speculative_config)
        self.config = config
        spec = speculative_config_of(config.speculative_config)
        self.device = resolve_device(device)
        keep_freed_memory()  # every step frees and takes the same big blocks (heap.py)
        hf_config = load_hf_config(path, config.hf_overrides)
        # before the weights load
        check_servable(spec, hf_config, str(path), lambda: checkpoint_tensor_names(path))
        self.args = args = model_args(hf_config)
        if spec is not None and spec.method == "mtp":  # its layer built and loaded
            head = f"model.layers.{args.num_layers}.shared_head.head.weight"
            args.mtp, args.mtp_own_head = True, head in checkpoint_tensor_names(path)
        self.dtype = resolve_dtype(dtype, self.device, getattr(hf_config, "dtype", None))
        self.tokenizer = load_tokenizer(path)
        published = checkpoint_quantization(hf_config)
        # a quantized checkpoint is served as published (fp8; gptq, awq, compressed-tensors,
        # mxfp4 in 4 bits); --quantization none serves its weights dequantized
        if config.quantization in PUBLISHED_FORMATS and config.quantization != published:
            raise ModelLoadError(
                f"--quantization {config.quantization} serves a checkpoint as published; "
                f"{path} is {published!r} (quantization_config.quant_method)"
            )
        self.quantization = config.quantization or published
        self.kv_cache_dtype = config.kv_cache_dtype
        self.executor = ex = ModelExecutor(
            path, family_of(hf_config), args, self.device, self.dtype, config, self.quantization,
            published, clock, self.tokenizer,
        )  # fmt: skip
        self.max_model_len, self.weight_bytes = ex.max_model_len, ex.weight_bytes
        self.kv_cache_tokens, self.kv_cache_bytes = ex.kv_cache_tokens, ex.kv_cache_bytes
        self.eos_token_ids = eos_token_ids(path, hf_config, self.tokenizer)
        self.structured = StructuredOutputManager(
            self.tokenizer, args.vocab_size, self.eos_token_ids
        )
        self.block_manager = BlockManager(
            ex.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
        )
        self.runner = ex.build_runner(self.eos_token_ids, self.structured)
        self.requests: dict[str, list[Sequence]] = {}
        self.pending_grammars = PendingGrammars(self.structured)
        self.inputs = InputProcessor(
            self.tokenizer, args.vocab_size, self.max_model_len, self.device, self.structured
        )
        self._aborted: list = []  # FinishedSequence records, reported with the next step's stats
        self.speculator = None
        if spec is not None:
            kind = MtpSpeculator if spec.method == "mtp" else NgramSpeculator
            self.speculator = kind(spec, self.max_model_len)
        if ex.compiles:
            clock.mark("warmup")  # compiles the decode graphs on their first calls
            warm_up(self)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, device: str = "auto", dtype: str = "auto", **limits
    ) -> LLMEngine:
        return cls(path, device, dtype, EngineConfig.from_kwargs(**limits))

    # ---- requests ---------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """Validates a prompt against the model's limits and returns its token ids."""
        return self.inputs.tokenize(prompt, params)

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
        seqs, job = self.inputs.process(
            request_id, prompt, params, log_context, prompt_token_ids, tenant
        )
        self.requests[request_id] = seqs
        if job is None or job.matcher is not None:
            self._admit(seqs, job)
        else:
            self.pending_grammars.add(request_id, job, seqs)

    def _admit(self, seqs: list[Sequence], job: CompileJob | None) -> None:
        for seq in seqs:
            if job is not None:  # one matcher per sequence (n > 1: each its own)
                matcher = job.matcher.deep_copy()
                if seq.params.reasoning_end is None:
                    seq.matcher = matcher
                else:  # free until the reasoning ends (_append_token)
                    seq.reasoning_matcher = matcher
                seq.times.grammar_compile_s = job.seconds
                seq.times.grammar_cache_hit = job.cache_hit
            self.scheduler.add(seq)

    def _poll_grammars(self) -> None:
        """Requests whose grammar compiled join the scheduler; those it failed for leave."""
        for request_id in self.pending_grammars.poll(self._admit):
            self.requests.pop(request_id, None)

    def take_rejected(self) -> list[tuple[str, InvalidParameterError]]:
        """Requests whose grammar failed after add_request had returned (it compiled past
        sync_compile_s): (request_id, error) each, once. They produce no output."""
        self._poll_grammars()
        return self.pending_grammars.take_rejected()

    @property
    def is_only_compiling(self) -> bool:
        """Nothing to step but requests waiting for their grammar (pending_grammars.on_done)."""
        return bool(self.pending_grammars) and not self.scheduler.has_work and not self._aborted

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finishes every sequence of the request with reason "abort" and frees its blocks now."""
        seqs = self.requests.pop(request_id, None)
        if seqs is None:
            return None
        compiling = self.pending_grammars.discard(request_id)
        for seq in seqs:
            if not seq.is_finished:
                if compiling:  # never reached the scheduler
                    seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
                    seq.times.finished = time.monotonic()
                else:
                    self.scheduler.finish(seq, "abort")
                seq.matcher = seq.reasoning_matcher = None
                self._aborted.append(seq.finished_record())
        log.info("request aborted", **seqs[0].log_context)
        return request_output(request_id, seqs)

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
        self._poll_grammars()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        result = self.runner.run(sched) if sched.scheduled else None
        spec = SpecStepCounts.of(result.verified if result else [], self.speculator)
        finished, self._aborted = self._aborted, []
        touched = self._update(sched, result, finished, spec)
        # a verified sequence's positions (its last token and drafts) count as decode
        prefill_tokens = sum(n for _, n in sched.scheduled if n > 1) - spec.positions
        decode_tokens = sum(1 for _, n in sched.scheduled if n == 1) + spec.positions
        outputs = []
        for rid in touched:
            seqs = self.requests.get(rid)
            if seqs is None:
                continue
            out = request_output(rid, seqs)
            if out.finished:
                del self.requests[rid]
            outputs.append(out)
        if self.speculator is not None and sched.scheduled and not prefill_tokens:
            # what a decode step of this many rows costs: the price of drafting (step_cost.py)
            self.speculator.cost.observe(decode_tokens, time.monotonic() - started)
        expert_tokens = None
        if result is not None and result.expert_counts.numel():
            expert_tokens = result.expert_counts.numpy()
        stats = StepStats(
            started=started,
            started_unix_ns=started_ns,
            duration_s=time.monotonic() - started,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + self.pending_grammars.num_sequences,
            batch_size=len(sched.scheduled),
            num_prefill_tokens=prefill_tokens,
            num_decode_tokens=decode_tokens,
            num_generated_tokens=(len(result.sampled) if result else 0) + spec.generated,
            kv_usage=self.block_manager.usage,
            kv_blocks_used=self.block_manager.num_used,
            num_requests=len(self.requests),
            num_preemptions=sched.num_preempted,
            request_ids=list(touched),
            prefix_cache_queries=sched.prefix_cache_queries,
            prefix_cache_hits=sched.prefix_cache_hits,
            expert_tokens=expert_tokens,
            finished=finished,
            bitmask_s=self.structured.take_step_time(),
            spec_num_drafts=spec.num_drafts,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_pos=spec.accepted_per_pos,
        )
        return outputs, stats

    def _update(self, sched, result, finished: list, spec: SpecStepCounts) -> dict[str, None]:
        """The scheduled sequences advance by what ran: computed tokens, cached blocks, prompt
        logprobs and sampled tokens; those that finished join `finished`. Returns the
        requests touched, in order."""
        now = time.monotonic()
        touched: dict[str, None] = {}
        verified = result.verified if result is not None else []
        for seq, n in sched.scheduled:
            touched[seq.request_id] = None
            if not seq.spec_token_ids:  # a verified one advances by what it accepted (below)
                seq.num_computed_tokens += n
                self.block_manager.cache_full_blocks(seq)
        for seq, first, values in result.prompt_logprobs if result is not None else ():
            # a recomputed prompt (after a preemption) adds only what is new
            seq.prompt_logprobs.extend(values[len(seq.prompt_logprobs) - first :])
        if result is not None and result.sample is not None:
            for seq, token, lp in zip(
                result.sampled, result.sample.token_ids, result.sample.logprobs
            ):
                self._append_token(seq, token, lp, now)
        for seq, drafts, tokens in verified:
            spec.generated += self._accept(seq, drafts, tokens, now)
        finished.extend(seq.finished_record() for seq, _ in sched.scheduled if seq.is_finished)
        return touched

    def _accept(self, seq: Sequence, drafts: list[int], tokens: list[int], now: float) -> int:
        """A verified sequence keeps the KV of its last token and its accepted drafts; the
        blocks taken for rejected ones are freed before any block is registered in the prefix
        cache, so none holds a rejected token. Then its new tokens are appended one by one,
        each checked for a stop (the rest are dropped once one stops it). Returns how many
        were appended."""
        seq.spec_token_ids = []
        self.speculator.record(seq, len(drafts), len(tokens) - 1)
        seq.num_computed_tokens += len(tokens)
        self.block_manager.release_uncomputed(seq)
        for appended, token in enumerate(tokens, 1):
            self._append_token(seq, token, None, now)
            if seq.is_finished:
                return appended
        self.block_manager.cache_full_blocks(seq)
        return len(tokens)

    def _append_token(self, seq: Sequence, token: int, lp, now: float) -> None:
        seq.append_token(token, lp, now)
        grammar = None if seq.matcher is None else self.structured.advance(seq.matcher, token)
        ends = token in self.eos_token_ids and not seq.params.ignore_eos
        # an ending EOS adds no text, also where special tokens are kept (skip_special_tokens)
        seen = len(seq.detok.text)
        matched = None if ends else seq.detok.add(token)
        if seq.reasoning_matcher is not None:
            _end_reasoning(seq, seen)
        reason = stop_reason(seq, token, ends, matched, grammar, self.max_model_len)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            seq.matcher = seq.reasoning_matcher = None

    # ---- offline batch ----------------------------------------------------------------------
    def generate(
        self, prompts: Prompt | list[Prompt], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Runs the prompts to completion (steps until they finish): offline.py."""
        return generate_offline(self, prompts, params or SamplingParams())


def _end_reasoning(seq: Sequence, seen: int) -> None:
    """The grammar of a sequence that reasons starts once its text has the reasoning's end
    marker (looked for in the text new since `seen` characters); it constrains the tokens after
    the one that completed the marker."""
    end = seq.params.reasoning_end
    if seq.detok.text.find(end, max(seen - len(end) + 1, 0)) >= 0:
        seq.matcher, seq.reasoning_matcher = seq.reasoning_matcher, None
