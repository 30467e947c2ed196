"""Locust load test for moeserve (or any OpenAI-compatible server, REST users only).

Users (closed loop: each user keeps one stream in flight, then waits `--think-time`):

  ChatUser         POST /v1/chat/completions, streamed (tags: rest, chat)
  CompletionsUser  POST /v1/completions, streamed       (tags: rest, completions)
  GrpcUser         Inference/GenerateStream             (tags: grpc)

Every request gives three Locust entries:

  <method> <name>      the whole request (end to end), failures included
  TTFT <name>          time to the first content chunk (role-only / empty chunks skipped)
  TPOT <name>          (last content chunk - first content chunk) / (output tokens - 1),
                       the mean gap between output tokens after the first (vLLM's TPOT)

Output tokens come from the final usage chunk (`stream_options.include_usage`; on gRPC the
last message's usage) and fall back to the number of content chunks.

Targets and settings (SPEC section 11):

  --host                      REST base URL (e.g. http://127.0.0.1:8000)
  MOESERVE_GRPC_TARGET        gRPC host:port (default: --host's host, port 50051)
  MOESERVE_SERVED_MODEL_NAME  model name (default: the first id from GET /v1/models)
  MOESERVE_API_KEY            sent as `Authorization: Bearer KEY` (REST header, gRPC metadata)

Options (also environment variables; see `locust -f loadtest/locustfile.py --help`):

  --prompt-tokens DIST   prompt length in tokens (default 128); DIST is N (fixed), A-B
                         (uniform), normal:MEAN,STD or exp:MEAN (clipped to >= 1)
  --output-tokens DIST   max_tokens per request, same forms (default 128)
  --ignore-eos / --no-ignore-eos   generate exactly max_tokens (vLLM extension; default on)
  --chat-weight, --completions-weight, --grpc-weight   user mix (weights; 0 drops a class)
  --think-time S         seconds each user waits between requests (default 0)
  --request-log PATH     one CSV row per request: trace id, x-request-id, TTFT, TPOT, e2e
  --slowest N            slowest requests (by end-to-end time) printed at the end with
                         their trace ids, and written to <--csv prefix>_slowest.csv

Pick user classes with tags (`--tags grpc`, `--exclude-tags chat`: a class none of whose
tasks survive is dropped) or by naming them (`locust ... ChatUser GrpcUser`).

Prompts are random English words; the words-per-token ratio is measured once through the
server's POST /tokenize (vLLM and moeserve have it), else assumed to be 1.3 tokens a word, so
prompt lengths are close to, not exactly, the requested token counts (use bench_serving.py
for exact lengths).

Tracing: every request carries a fresh W3C `traceparent` (sampled), so a slow request in the
report can be looked up in the trace backend by its trace id.
"""

from __future__ import annotations

import csv
import heapq
import json
import logging
import os
import random
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import gevent
import locust.stats
import requests
from grpc_client_stubs import load_inference_stubs
from locust import User, events, tag, task
from locust.runners import WorkerRunner
from prompt_words import FALLBACK_TOKENS_PER_WORD, WORDS

try:  # grpcio must cooperate with gevent before any channel exists
    import grpc
    import grpc.experimental.gevent as grpc_gevent

    grpc_gevent.init_gevent()
except ImportError:  # REST-only runs work without grpcio
    grpc = None

log = logging.getLogger("moeserve.loadtest")

DEFAULT_GRPC_PORT = 50051


# ---------------------------------------------------------------------------------------------
# Settings


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: fixed, uniform range, normal or exponential."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        s = str(text).strip().lower()
        try:
            if m := re.fullmatch(r"(\d+)", s):
                return cls("fixed", int(m[1]))
            if m := re.fullmatch(r"(\d+)\s*-\s*(\d+)", s):
                lo, hi = int(m[1]), int(m[2])
                if lo > hi:
                    raise ValueError
                return cls("uniform", lo, hi)
            if m := re.fullmatch(r"normal:([\d.]+),([\d.]+)", s):
                return cls("normal", float(m[1]), float(m[2]))
            if m := re.fullmatch(r"exp:([\d.]+)", s):
                return cls("exp", float(m[1]))
        except ValueError:
            pass
        raise ValueError(
            f"bad length distribution {text!r}: use N, A-B, normal:MEAN,STD or exp:MEAN"
        )

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = rng.randint(int(self.a), int(self.b))
        elif self.kind == "normal":
            value = rng.gauss(self.a, self.b)
        else:
            value = rng.expovariate(1.0 / self.a) if self.a > 0 else 1
        return max(1, round(value))


@dataclass
class Config:
    host: str = "http://127.0.0.1:8000"
    grpc_target: str = f"127.0.0.1:{DEFAULT_GRPC_PORT}"
    model: str | None = None
    api_key: str | None = None
    prompt_tokens: LengthDist = field(default_factory=lambda: LengthDist("fixed", 128))
    output_tokens: LengthDist = field(default_factory=lambda: LengthDist("fixed", 128))
    ignore_eos: bool = True
    think_time: float = 0.0
    timeout: float = 600.0
    request_log: str | None = None
    slowest: int = 10
    csv_prefix: str | None = None


CONFIG = Config()


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    group = parser.add_argument_group("moeserve")
    group.add_argument(
        "--prompt-tokens",
        default="128",
        env_var="MOESERVE_LT_PROMPT_TOKENS",
        help="prompt length in tokens: N, A-B, normal:MEAN,STD or exp:MEAN",
    )
    group.add_argument(
        "--output-tokens",
        default="128",
        env_var="MOESERVE_LT_OUTPUT_TOKENS",
        help="max_tokens per request: N, A-B, normal:MEAN,STD or exp:MEAN",
    )
    group.add_argument(
        "--ignore-eos",
        dest="ignore_eos",
        action="store_true",
        default=True,
        help="send ignore_eos so every request generates max_tokens (default)",
    )
    group.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="leave ignore_eos out (servers that reject unknown fields)",
    )
    group.add_argument(
        "--chat-weight",
        type=int,
        default=1,
        env_var="MOESERVE_LT_CHAT_WEIGHT",
        help="weight of ChatUser in the user mix (0 drops it)",
    )
    group.add_argument(
        "--completions-weight",
        type=int,
        default=1,
        env_var="MOESERVE_LT_COMPLETIONS_WEIGHT",
        help="weight of CompletionsUser in the user mix (0 drops it)",
    )
    group.add_argument(
        "--grpc-weight",
        type=int,
        default=1,
        env_var="MOESERVE_LT_GRPC_WEIGHT",
        help="weight of GrpcUser in the user mix (0 drops it)",
    )
    group.add_argument(
        "--think-time",
        type=float,
        default=0.0,
        env_var="MOESERVE_LT_THINK_TIME",
        help="max seconds a user waits between requests (uniform 0..S)",
    )
    group.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        env_var="MOESERVE_LT_REQUEST_TIMEOUT",
        help="per-request timeout (s)",
    )
    group.add_argument(
        "--request-log",
        default=None,
        env_var="MOESERVE_LT_REQUEST_LOG",
        help="CSV file with one row per request (trace id, TTFT, TPOT, e2e)",
    )
    group.add_argument(
        "--slowest",
        type=int,
        default=10,
        env_var="MOESERVE_LT_SLOWEST",
        help="how many of the slowest requests to report with their trace ids",
    )


def _grpc_target_default(host: str) -> str:
    parsed = urlparse(host if "://" in host else f"http://{host}")
    hostname = parsed.hostname or "127.0.0.1"
    if ":" in hostname:
        hostname = f"[{hostname}]"
    return f"{hostname}:{DEFAULT_GRPC_PORT}"


@events.init.add_listener
def _configure(environment, **_kwargs) -> None:
    opts = environment.parsed_options
    if opts is not None:
        CONFIG.prompt_tokens = LengthDist.parse(opts.prompt_tokens)
        CONFIG.output_tokens = LengthDist.parse(opts.output_tokens)
        CONFIG.ignore_eos = opts.ignore_eos
        CONFIG.think_time = opts.think_time
        CONFIG.timeout = opts.request_timeout
        CONFIG.request_log = opts.request_log
        CONFIG.slowest = opts.slowest
        CONFIG.csv_prefix = getattr(opts, "csv_prefix", None)
        for cls, weight in (
            (ChatUser, opts.chat_weight),
            (CompletionsUser, opts.completions_weight),
            (GrpcUser, opts.grpc_weight),
        ):
            cls.weight = weight
    CONFIG.host = (environment.host or CONFIG.host).rstrip("/")
    CONFIG.grpc_target = os.environ.get("MOESERVE_GRPC_TARGET") or _grpc_target_default(CONFIG.host)
    CONFIG.model = os.environ.get("MOESERVE_SERVED_MODEL_NAME") or None
    CONFIG.api_key = os.environ.get("MOESERVE_API_KEY") or None
    _select_user_classes(environment)


def _select_user_classes(environment) -> None:
    """Drops classes with weight 0 and, under --tags/--exclude-tags, classes none of whose
    tasks survive the filter (Locust itself would spawn them and fail)."""
    opts = environment.parsed_options
    tags = set(environment.tags or getattr(opts, "tags", None) or []) or None
    exclude = set(environment.exclude_tags or getattr(opts, "exclude_tags", None) or []) or None

    def keeps(cls) -> bool:
        if cls.weight <= 0 and not cls.fixed_count:
            return False
        for t in cls.tasks:
            names = getattr(t, "locust_tag_set", set())
            if (tags is None or names & tags) and not (exclude and names & exclude):
                return True
        return False

    kept = [cls for cls in environment.user_classes if keeps(cls)]
    if not kept:
        raise ValueError("no user class left after --tags/--exclude-tags and the weights")
    environment.user_classes[:] = kept


# ---------------------------------------------------------------------------------------------
# Prompts and model name (measured once per process)

_lock = threading.Lock()
_tokens_per_word: float | None = None


def _auth_headers() -> dict[str, str]:
    return {"authorization": f"Bearer {CONFIG.api_key}"} if CONFIG.api_key else {}


def tokens_per_word() -> float:
    """Tokens per random word, from the server's /tokenize (1.3 when it has none)."""
    global _tokens_per_word
    with _lock:
        if _tokens_per_word is None:
            rng = random.Random(0)
            words = 400
            text = " ".join(rng.choice(WORDS) for _ in range(words))
            ratio = FALLBACK_TOKENS_PER_WORD
            try:
                body = {"prompt": text, "add_special_tokens": False}
                if CONFIG.model:
                    body["model"] = CONFIG.model
                r = requests.post(
                    f"{CONFIG.host}/tokenize", json=body, headers=_auth_headers(), timeout=30
                )
                if r.status_code == 200:
                    data = r.json()
                    count = data.get("count") or len(data.get("tokens") or [])
                    ratio = max(count / words, 0.1) if count else ratio
            except (requests.RequestException, ValueError):
                pass
            _tokens_per_word = ratio
            log.info("tokens per prompt word: %.3f", ratio)
        return _tokens_per_word


def model_name() -> str:
    with _lock:
        if CONFIG.model is None:
            r = requests.get(f"{CONFIG.host}/v1/models", headers=_auth_headers(), timeout=30)
            r.raise_for_status()
            CONFIG.model = r.json()["data"][0]["id"]
            log.info("model: %s", CONFIG.model)
        return CONFIG.model


def make_prompt(rng: random.Random, num_tokens: int) -> str:
    n = max(1, round(num_tokens / tokens_per_word()))
    return " ".join(rng.choice(WORDS) for _ in range(n))


def new_traceparent() -> tuple[str, str]:
    trace_id = secrets.token_hex(16)
    return trace_id, f"00-{trace_id}-{secrets.token_hex(8)}-01"


# ---------------------------------------------------------------------------------------------
# Recording: Locust entries, the request log, the slowest requests


@dataclass
class Result:
    api: str  # "REST" | "gRPC"
    method: str  # Locust request_type of the request entry
    name: str
    trace_id: str
    start: float  # unix time
    e2e: float = 0.0  # seconds
    ttft: float | None = None
    first: float | None = None  # perf_counter of the first / last content chunk
    last: float | None = None
    chunks: int = 0
    output_tokens: int | None = None  # from usage
    prompt_tokens: int | None = None
    request_id: str = ""
    status: str = ""
    error: Exception | None = None

    @property
    def tokens(self) -> int:
        return self.output_tokens if self.output_tokens is not None else self.chunks

    @property
    def tpot(self) -> float | None:
        if self.first is None or self.last is None or self.tokens < 2:
            return None
        return (self.last - self.first) / (self.tokens - 1)


_slowest: list[tuple[float, int, dict]] = []  # min-heap of the N largest e2e
_counter = 0
_log_file = None
_log_writer = None
LOG_FIELDS = [
    "start",
    "api",
    "name",
    "status",
    "trace_id",
    "request_id",
    "ttft_ms",
    "tpot_ms",
    "e2e_ms",
    "prompt_tokens",
    "output_tokens",
    "error",
]


def record(environment, r: Result) -> None:
    global _counter, _log_file, _log_writer
    context = {"trace_id": r.trace_id, "request_id": r.request_id}
    fire = environment.events.request.fire
    fire(
        request_type=r.method,
        name=r.name,
        response_time=r.e2e * 1000,
        response_length=r.tokens,
        exception=r.error,
        context=context,
    )
    if r.error is None:
        if r.ttft is not None:
            fire(
                request_type="TTFT",
                name=f"TTFT {r.name}",
                response_time=r.ttft * 1000,
                response_length=0,
                exception=None,
                context=context,
            )
        if (tpot := r.tpot) is not None:
            fire(
                request_type="TPOT",
                name=f"TPOT {r.name}",
                response_time=tpot * 1000,
                response_length=r.tokens,
                exception=None,
                context=context,
            )
    row = {
        "start": f"{r.start:.3f}",
        "api": r.api,
        "name": r.name,
        "status": r.status,
        "trace_id": r.trace_id,
        "request_id": r.request_id,
        "ttft_ms": _ms(r.ttft),
        "tpot_ms": _ms(r.tpot),
        "e2e_ms": _ms(r.e2e),
        "prompt_tokens": r.prompt_tokens if r.prompt_tokens is not None else "",
        "output_tokens": r.tokens,
        "error": str(r.error or "")[:300],
    }
    with _lock:
        _counter += 1
        item = (r.e2e, _counter, row)
        if len(_slowest) < max(CONFIG.slowest, 0):
            heapq.heappush(_slowest, item)
        elif _slowest and item > _slowest[0]:
            heapq.heapreplace(_slowest, item)
        if CONFIG.request_log:
            if _log_writer is None:
                _log_file = open(CONFIG.request_log, "w", newline="")  # noqa: SIM115
                _log_writer = csv.DictWriter(_log_file, fieldnames=LOG_FIELDS)
                _log_writer.writeheader()
            _log_writer.writerow(row)


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1000:.2f}"


@events.quitting.add_listener
def _report_slowest(environment, **_kwargs) -> None:
    if _log_file is not None:
        _log_file.close()
    if CONFIG.csv_prefix and not isinstance(environment.runner, WorkerRunner):
        # Locust rewrites <prefix>_stats.csv once a second and not at exit: give its writer
        # one more turn now that every user has stopped, so the CSV holds the final numbers.
        gevent.sleep(locust.stats.CSV_STATS_INTERVAL_SEC + 0.2)
    rows = [row for _, _, row in sorted(_slowest, reverse=True)]
    if not rows:
        return
    lines = [f"{'e2e ms':>10} {'TTFT ms':>10} {'TPOT ms':>9}  {'status':<8} {'name':<32} trace_id"]
    lines += [
        f"{row['e2e_ms']:>10} {row['ttft_ms']:>10} {row['tpot_ms']:>9}  {row['status']:<8} "
        f"{row['name']:<32} {row['trace_id']}"
        for row in rows
    ]
    log.info("slowest requests (look them up by trace id):\n%s", "\n".join(lines))
    if CONFIG.csv_prefix:
        with open(f"{CONFIG.csv_prefix}_slowest.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=LOG_FIELDS)
            writer.writeheader()
            writer.writerows(rows)


# ---------------------------------------------------------------------------------------------
# REST users


class StreamError(Exception):
    pass


class _RestUser(User):
    abstract = True
    path = ""
    name = ""

    def wait_time(self) -> float:
        return random.uniform(0, CONFIG.think_time)

    def on_start(self) -> None:
        self.session = requests.Session()
        self.rng = random.Random()
        model_name()  # fail fast (in on_start) when the server is unreachable

    def on_stop(self) -> None:
        self.session.close()

    def body(self, prompt: str, max_tokens: int) -> dict:
        raise NotImplementedError

    @staticmethod
    def content(choice: dict) -> str:
        raise NotImplementedError

    def stream(self) -> None:
        prompt = make_prompt(self.rng, CONFIG.prompt_tokens.sample(self.rng))
        body = self.body(prompt, CONFIG.output_tokens.sample(self.rng))
        body.update(model=model_name(), stream=True, stream_options={"include_usage": True})
        if CONFIG.ignore_eos:
            body["ignore_eos"] = True
        trace_id, traceparent = new_traceparent()
        headers = {"traceparent": traceparent, "accept": "text/event-stream", **_auth_headers()}
        r = Result(api="REST", method="POST", name=self.name, trace_id=trace_id, start=time.time())
        t0 = time.perf_counter()
        try:
            with self.session.post(
                f"{CONFIG.host}{self.path}",
                json=body,
                headers=headers,
                stream=True,
                timeout=CONFIG.timeout,
            ) as resp:
                r.status = str(resp.status_code)
                r.request_id = resp.headers.get("x-request-id", "")
                if resp.status_code != 200:
                    raise StreamError(f"HTTP {resp.status_code}: {resp.text[:200]}")
                done = False
                for line in resp.iter_lines(chunk_size=None):
                    if not line or not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        r.status = "stream_error"
                        raise StreamError(str(chunk["error"].get("message", chunk["error"])))
                    if usage := chunk.get("usage"):
                        r.output_tokens = usage.get("completion_tokens")
                        r.prompt_tokens = usage.get("prompt_tokens")
                    for choice in chunk.get("choices") or ():
                        if self.content(choice):
                            now = time.perf_counter()
                            if r.first is None:
                                r.first, r.ttft = now, now - t0
                            r.last = now
                            r.chunks += 1
                if not done:
                    raise StreamError("stream ended without data: [DONE]")
                if r.first is None:
                    raise StreamError("no content chunk in the stream")
        except (requests.RequestException, ValueError, StreamError) as exc:
            r.error = exc
            r.status = r.status or type(exc).__name__
        r.e2e = time.perf_counter() - t0
        record(self.environment, r)


class ChatUser(_RestUser):
    """Streams /v1/chat/completions with one user message."""

    path = "/v1/chat/completions"
    name = "/v1/chat/completions"

    def body(self, prompt: str, max_tokens: int) -> dict:
        return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}

    @staticmethod
    def content(choice: dict) -> str:
        return (choice.get("delta") or {}).get("content") or ""

    @tag("rest", "chat")
    @task
    def chat(self) -> None:
        self.stream()


class CompletionsUser(_RestUser):
    """Streams /v1/completions with a text prompt."""

    path = "/v1/completions"
    name = "/v1/completions"

    def body(self, prompt: str, max_tokens: int) -> dict:
        return {"prompt": prompt, "max_tokens": max_tokens}

    @staticmethod
    def content(choice: dict) -> str:
        return choice.get("text") or ""

    @tag("rest", "completions")
    @task
    def completion(self) -> None:
        self.stream()


# ---------------------------------------------------------------------------------------------
# gRPC user


class GrpcUser(User):
    """Streams Inference/GenerateStream (moeserve's gRPC API) to MOESERVE_GRPC_TARGET."""

    name = "GenerateStream"

    def wait_time(self) -> float:
        return random.uniform(0, CONFIG.think_time)

    def on_start(self) -> None:
        if grpc is None:
            raise RuntimeError("GrpcUser needs grpcio (pip install grpcio)")
        inference_pb2, inference_pb2_grpc = load_inference_stubs()
        self.pb = inference_pb2
        self.channel = grpc.insecure_channel(CONFIG.grpc_target)
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)
        self.rng = random.Random()

    def on_stop(self) -> None:
        self.channel.close()

    @tag("grpc")
    @task
    def generate_stream(self) -> None:
        pb = self.pb
        prompt = make_prompt(self.rng, CONFIG.prompt_tokens.sample(self.rng))
        params = pb.SamplingParams(max_tokens=CONFIG.output_tokens.sample(self.rng))
        if CONFIG.ignore_eos:
            params.ignore_eos = True
        trace_id, traceparent = new_traceparent()
        metadata = [("traceparent", traceparent)]
        if CONFIG.api_key:
            metadata.append(("authorization", f"Bearer {CONFIG.api_key}"))
        request_id = f"locust-{trace_id[:16]}"
        req = pb.GenerateRequest(prompt=prompt, params=params, request_id=request_id)
        r = Result(
            api="gRPC",
            method="gRPC",
            name=self.name,
            trace_id=trace_id,
            start=time.time(),
            request_id=request_id,
        )
        t0 = time.perf_counter()
        try:
            for msg in self.stub.GenerateStream(req, metadata=metadata, timeout=CONFIG.timeout):
                if msg.token_ids or msg.text:
                    now = time.perf_counter()
                    if r.first is None:
                        r.first, r.ttft = now, now - t0
                    r.last = now
                    r.chunks += len(msg.token_ids) or 1
                if msg.HasField("usage") and msg.usage.completion_tokens:
                    r.output_tokens = msg.usage.completion_tokens
                    r.prompt_tokens = msg.usage.prompt_tokens
            r.status = "OK"
            if r.first is None:
                raise StreamError("no tokens in the stream")
        except grpc.RpcError as exc:
            r.status = exc.code().name if exc.code() else "RpcError"
            r.error = StreamError(f"{r.status}: {exc.details()}")
        except StreamError as exc:
            r.error = exc
        r.e2e = time.perf_counter() - t0
        record(self.environment, r)
