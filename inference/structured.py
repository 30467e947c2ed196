"""Grammar-constrained decoding (structured outputs) on llguidance.

Per constrained sequence an `llguidance.LLMatcher`; per step one int32 bitmask
[sampled rows, ceil(vocab/32)] filled for all constrained rows in one call
(`fill_next_token_bitmask_par`, on llguidance's own threads, without the GIL), turned into
a boolean "disallowed" tensor and applied to the logits by the sampler (`Constraints`); the
sampled token advances the matcher. Compiled grammars are cached by their source (a bounded
LRU of pristine matchers, each new sequence gets a deep copy: microseconds).

Why llguidance, not xgrammar (bench/structured_backends.py, bench/NOTES.md): it compiles a
schema in 1.3-2.8 ms against xgrammar's 11-15 ms (the first request's latency) and its wheel
has no dependencies (xgrammar's pulls triton, pydantic and apache-tvm-ffi). xgrammar fills
one row's mask 6-9x faster (17-24 against 130-160 us on average, having precomputed at
compile time), but in the engine the whole mask work is 2-3% of a 32-row step, so that gap
is worth at most ~2% of throughput.

The bitmask is applied with numpy's unpackbits and torch.where rather than
`llguidance.torch.apply_token_bitmask_inplace`: that one is torch.compile'd, and on the CPU
its first call compiles for ~6 s, which would stall the first constrained step.

The fill runs on the step's path before the forward pass by default. Filling it on a helper
thread while the forward pass runs (`overlap=True`) takes the fill (~2.5 ms a step for 32 JSON
rows) off the step's path, but on two cores the forward pass's two threads lose that CPU to it
instead: bench/structured_bench.py measured no throughput difference above the noise, so the
simpler path stays the default.

Compiling: add_request waits up to `sync_compile_s` (20 ms) for a grammar, so a typical schema
(1-2 ms) and its errors are settled there; a larger one finishes on the compiler thread while
the steps go on (CompileJob, pending_grammars.py).

Preemption needs nothing here: the scheduler keeps a preempted sequence's tokens and
recomputes their KV, so its matcher (which has consumed exactly the output tokens) stays valid.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import llguidance
import llguidance.torch
import numpy as np
import structlog
import torch
from llguidance.gbnf_to_lark import any_to_lark

from inference.errors import InvalidParameterError
from inference.sampling_params import StructuredOutputs

log = structlog.get_logger("inference.structured")

# JSON laid out as `{"a": 1, "b": [2, 3]}`: no free whitespace, so a bounded schema is a
# finite language (a random-weight model ends it too) and the layout is the common one.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256  # compiled grammars kept (a pristine matcher each: tens of KB)
MAX_MESSAGE = 600  # characters of a compiler error passed on to the client
# add_request waits this long for a compile (a schema of a few fields takes 1-2 ms, and its
# errors are raised from add_request); a larger grammar (100 nested properties: ~140 ms)
# finishes on the compiler thread while the steps go on, and its request joins the batch then
SYNC_COMPILE_S = 0.02


def grammar_source(so: StructuredOutputs) -> tuple[str, str]:
    """(param naming the field, llguidance grammar text) of a request's constraint; raises
    InvalidParameterError for input that is malformed before any compiling."""
    kind = so.kind
    param = f"structured_outputs.{kind}"
    Matcher = llguidance.LLMatcher
    if kind == "json":
        schema = so.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise InvalidParameterError(param, f"is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise InvalidParameterError(param, "must be a JSON schema (a JSON object)")
        return param, Matcher.grammar_from_json_schema(
            json.dumps(schema, sort_keys=True), defaults=JSON_OPTIONS
        )
    if kind == "json_object":
        return param, Matcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    if kind == "regex":
        return param, Matcher.grammar_from_regex(so.regex)
    if kind == "choice":
        if not so.choice:
            raise InvalidParameterError(param, "must list at least one string")
        if not all(isinstance(c, str) and c for c in so.choice):
            raise InvalidParameterError(param, "must list non-empty strings")
        return param, Matcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in so.choice)
        )
    try:
        lark = any_to_lark(so.grammar)  # Lark passes through, GBNF is converted
    except Exception as exc:  # noqa: BLE001 - the converter raises assorted types
        raise InvalidParameterError(param, f"is neither Lark nor GBNF: {exc}") from None
    return param, Matcher.grammar_from_lark(lark)


class Constraints:
    """One step's constraints for the sampled rows: a bitmask (or its pending fill) and the
    logit_bias entries, applied to the logits in one batched pass each."""

    def __init__(self, manager: StructuredOutputManager) -> None:
        self.manager = manager
        self.bitmask: torch.Tensor | None = None  # [num_rows, words], -1 on free rows
        self.pending: Future | None = None
        self.bias: tuple[list[int], list[int], list[float]] | None = None  # rows, ids, values

    def apply(self, logits: torch.Tensor, inplace: bool) -> torch.Tensor:
        """logits + bias, with what the grammar forbids at -inf. `inplace=False` leaves the
        given tensor as it is (the sampler keeps the raw logits for logprobs)."""
        started = time.perf_counter()
        totals = self.manager.totals
        if self.bias is not None:
            rows, ids, values = self.bias
            index = (
                torch.tensor(rows, device=logits.device),
                torch.tensor(ids, device=logits.device),
            )
            vals = torch.tensor(values, dtype=logits.dtype, device=logits.device)
            if inplace:
                logits.index_put_(index, vals, accumulate=True)
            else:
                logits, inplace = logits.index_put(index, vals, accumulate=True), True
        if self.pending is not None:
            waited = time.perf_counter()
            self.pending.result()
            self.pending = None
            totals["wait"] += time.perf_counter() - waited
        if self.bitmask is not None:
            # torch.where over a fresh tensor: 4x faster than masked_fill_ on the CPU when
            # nearly every token is forbidden (0.7 against 3.2 ms for 32 x 32000)
            disallowed = _disallowed(self.bitmask, logits.shape[1], logits.device)
            logits = torch.where(disallowed, float("-inf"), logits)
        spent = time.perf_counter() - started
        totals["apply"] += spent
        self.manager.step_s += spent
        return logits


def _disallowed(bitmask: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] bool, True where the bitmask's bit is 0. On the CPU numpy unpacks the
    bits (0.12 ms for 32 x 32000, 40x faster than shifting int32 in torch); elsewhere the
    packed mask (32x smaller) crosses and is unpacked on the device."""
    if device.type == "cpu":
        bits = np.unpackbits((~bitmask.numpy()).view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(bits[:, :vocab]).view(torch.bool)
    packed = bitmask.to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    return bits.view(packed.shape[0], -1)[:, :vocab] == 0


@dataclass(slots=True, eq=False)
class CompileJob:
    """One request's grammar being compiled: done once `matcher` is set."""

    param: str  # the field errors name
    grammar: str  # llguidance grammar text (the cache key)
    started: float  # perf_counter
    future: Future | None = None
    matcher: object | None = None  # the pristine compiled matcher (sequences deep-copy it)
    seconds: float | None = None
    cache_hit: bool | None = None


class StructuredOutputManager:
    """Compiles grammars (cached) for LLMEngine.add_request and builds each step's
    Constraints for the ModelRunner; `step_s` accumulates the step's bitmask cost."""

    def __init__(
        self,
        hf_tokenizer,
        vocab_size: int,
        eos_token_ids: set[int],
        *,
        overlap: bool = False,
        cache_size: int = CACHE_SIZE,
        sync_compile_s: float = SYNC_COMPILE_S,
    ) -> None:
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.overlap = overlap
        self.step_s = 0.0
        # seconds since start-up, for profiles (bench/structured_bench.py): fill (on the step's
        # path: the fill itself, or handing it to the helper thread), fill_work (the fills
        # themselves, wherever they ran), wait (for an overlapped fill), apply (bias, unpack,
        # mask; includes wait), advance (matchers consuming the sampled tokens)
        self.totals = dict.fromkeys(("fill", "fill_work", "wait", "apply", "advance"), 0.0)
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._inflight: dict[str, Future] = {}
        self._compiler: ThreadPoolExecutor | None = None
        self.sync_compile_s = sync_compile_s
        self._executor = None
        self._filler: ThreadPoolExecutor | None = None
        # llguidance's tokenizer view takes ~0.4 s for a 32k vocabulary: built on a thread of
        # its own from start-up, so the first constrained request does not wait for all of it.
        self._tokenizer: object | None = None
        self._tokenizer_error: BaseException | None = None
        self._ready = threading.Event()
        n_vocab = max(vocab_size, len(hf_tokenizer))
        threading.Thread(
            target=self._build_tokenizer,
            args=(hf_tokenizer, n_vocab, sorted(eos_token_ids)),
            name="llguidance-tokenizer",
            daemon=True,
        ).start()
        self.words = (n_vocab + 31) // 32

    def _build_tokenizer(self, hf_tokenizer, n_vocab: int, eos: list[int]) -> None:
        try:
            import llguidance.hf  # imports transformers: only once an engine starts

            self._tokenizer = llguidance.hf.from_tokenizer(
                hf_tokenizer, n_vocab=n_vocab, eos_token=eos or None
            )
        except BaseException as exc:  # noqa: BLE001 - reported on the first constrained request
            self._tokenizer_error = exc
        finally:
            self._ready.set()

    def _llg_tokenizer(self):
        self._ready.wait()
        if self._tokenizer is None:
            raise InvalidParameterError(
                "structured_outputs",
                f"is not supported with this model's tokenizer ({self._tokenizer_error!r})",
            )
        return self._tokenizer

    # ---- compiling (LLMEngine.add_request) ---------------------------------------------------
    def start_compile(self, so: StructuredOutputs) -> CompileJob:
        """Starts compiling a request's constraint on the compiler thread and waits for it up to
        `sync_compile_s`; a cache hit is done at once. InvalidParameterError (param
        "structured_outputs.<kind>") for a constraint that fails by then; a job still running
        finishes off the step path (`finish`)."""
        started = time.perf_counter()
        param = f"structured_outputs.{so.kind}"
        try:
            param, grammar = grammar_source(so)
        except InvalidParameterError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever it is, the request is at fault and
            # must not reach the engine loop, which would die of it
            raise InvalidParameterError(param, f"cannot be compiled: {exc}") from None
        job = CompileJob(param, grammar, started)
        compiled = self._cache.get(grammar)
        if compiled is not None:
            self._cache.move_to_end(grammar)
            job.matcher, job.seconds, job.cache_hit = compiled, time.perf_counter() - started, True
            return job
        job.future = self._inflight.get(grammar)
        if job.future is None:  # the same grammar twice at once compiles once
            if self._compiler is None:
                self._compiler = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
            job.future = self._inflight[grammar] = self._compiler.submit(self._build, grammar)
        self.finish(job, self.sync_compile_s)
        return job

    def _build(self, grammar: str) -> tuple[object, float]:
        """On the compiler thread (llguidance drops the GIL while it compiles)."""
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        return matcher, time.perf_counter()

    def finish(self, job: CompileJob, timeout: float | None = 0.0) -> bool:
        """Whether the job is done (waiting for it up to `timeout` seconds, None: as long as it
        takes); raises InvalidParameterError when its grammar did not compile."""
        if job.matcher is not None:
            return True
        try:
            matcher, ended = job.future.result(timeout)
        except FutureTimeout:
            return False
        except InvalidParameterError:
            self._inflight.pop(job.grammar, None)
            raise
        except Exception as exc:  # noqa: BLE001 - as in start_compile
            self._inflight.pop(job.grammar, None)
            raise InvalidParameterError(job.param, f"cannot be compiled: {exc}") from None
        self._inflight.pop(job.grammar, None)
        if matcher.is_error():
            message = matcher.get_error().strip()
            if len(message) > MAX_MESSAGE:
                message = message[:MAX_MESSAGE] + "..."
            raise InvalidParameterError(job.param, f"does not compile: {message}")
        self._cache[job.grammar] = matcher
        self._cache.move_to_end(job.grammar)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        job.matcher, job.seconds, job.cache_hit = matcher, max(ended - job.started, 0.0), False
        return True

    def compile(self, so: StructuredOutputs) -> tuple[object, float, bool]:
        """(pristine compiled matcher, seconds it took, cache hit), waiting as long as it takes."""
        job = self.start_compile(so)
        self.finish(job, None)
        return job.matcher, job.seconds, job.cache_hit

    # ---- each step (ModelRunner.run) ---------------------------------------------------------
    def constraints(self, seqs: list) -> Constraints | None:
        """The constraints of a step's sampled rows (None when no row has any): the bitmask fill
        starts now, on a helper thread when `overlap` (the forward pass runs meanwhile)."""
        matchers = [(s.matcher, i) for i, s in enumerate(seqs) if s.matcher is not None]
        biased = [i for i, s in enumerate(seqs) if s.params.logit_bias]
        if not matchers and not biased:
            return None
        c = Constraints(self)
        if biased:
            rows, ids, values = [], [], []
            for i in biased:
                bias = seqs[i].params.logit_bias
                rows.extend([i] * len(bias))
                ids.extend(bias.keys())
                values.extend(bias.values())
            c.bias = rows, ids, values
        if matchers:
            started = time.perf_counter()
            c.bitmask = torch.full((len(seqs), self.words), -1, dtype=torch.int32)
            if self.overlap:
                if self._filler is None:
                    self._filler = ThreadPoolExecutor(1, thread_name_prefix="bitmask-fill")
                c.pending = self._filler.submit(self._fill, matchers, c.bitmask)
            else:
                self._fill(matchers, c.bitmask)
            spent = time.perf_counter() - started
            self.totals["fill"] += spent
            self.step_s += spent
        return c

    def _fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        started = time.perf_counter()
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        llguidance.torch.fill_next_token_bitmask_par(self._executor, matchers, bitmask)
        self.totals["fill_work"] += time.perf_counter() - started

    def advance(self, matcher, token: int) -> str | None:
        """Feeds the sampled token to the matcher: None to go on, "stop" when the grammar is
        complete (nothing but EOS may follow), "error" if the matcher refused the token."""
        started = time.perf_counter()
        ok = matcher.consume_token(token)
        done = matcher.is_stopped()
        spent = time.perf_counter() - started
        self.totals["advance"] += spent
        self.step_s += spent
        if not ok:
            log.error("grammar refused a sampled token", token=token, error=matcher.get_error())
            return "error"
        return "stop" if done else None

    def take_step_time(self) -> float:
        spent, self.step_s = self.step_s, 0.0
        return spent
