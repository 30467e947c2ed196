"""A multi-turn chat workload (bench/replicas_bench.py): many conversations in flight at once,
all opening with one short system prompt, each turn adding a user message of a few hundred
tokens and then the reply to the conversation's own history. Each turn is one streamed chat
completion, recorded with where it went, its TTFT (first streamed token, as the client sees
it), its tokens, and how it ended (Turn.outcome: a whole stream, a clean error, a connection
closed mid-body, or a body that ended without its finish_reason and [DONE]).

Two ways to send it:
  - paced (open loop, the default of Workload): conversation c starts at c x
    `arrival_interval_s` from the run's start, whatever the server is doing, and each next
    turn goes `think_time_s` after the previous reply ended, as a user reading it would. Below
    the replicas' capacity, a turn's TTFT is then its own prefill (shorter on a cache hit)
    rather than the queue of every other conversation's prefill;
  - closed loop (`arrival_interval_s=None`): every conversation starts at once and sends its
    next turn as soon as its reply ends, the most load the conversations can make.
Bounded and self-stopping either way: each conversation has its turns and ends, and a run
stops at `max_wall_s` (turns not sent by then are recorded as such, turns in flight are
cancelled and recorded as cancelled).

The text is drawn from a fixed word list by a seeded generator: a `salt` gives another set of
conversations of the same shape (benchmark arms that share replicas share no prefix).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from bench.harness import SseError, aiter_sse

WORDS = (
    "the", "of", "and", "to", "in", "is", "it", "that", "for", "on", "was", "with", "as", "be",
    "at", "by", "this", "had", "not", "are", "but", "from", "or", "have", "an", "they", "which",
    "one", "you", "were", "her", "all", "she", "there", "would", "their", "we", "him", "been",
    "has", "when", "who", "will", "more", "no", "if", "out", "so", "said", "what", "up", "its",
    "about", "into", "than", "them", "can", "only", "other", "new", "some", "could", "time",
    "these", "two", "may", "then", "do", "first", "any", "my", "now", "such", "like", "our",
    "over", "man", "me", "even", "most", "made", "after", "also", "did", "many", "before", "must",
    "through", "back", "years", "where", "much", "your", "way", "well", "down", "should",
    "because", "each", "just", "those", "people", "how", "too", "little", "state", "good", "very",
    "make", "world", "still", "own", "see", "men", "work", "long", "get", "here", "between",
    "both", "life", "being", "under", "never", "day", "same", "another", "know", "while", "last",
    "might", "us", "great", "old", "year", "off", "come", "since", "against", "go", "came",
    "right", "used", "take", "three", "replica", "cache", "router", "block", "token", "prefix",
    "engine", "expert", "batch", "queue", "stream", "model", "layer", "kernel", "memory",
    "request", "reply", "history", "turn",
)  # fmt: skip


@dataclass(frozen=True)
class Workload:
    conversations: int = 32
    turns: int = 4
    user_words: int = 130  # about 200 tokens with the demo model's tokenizer
    system_words: int = 24
    max_tokens: int = 32  # each reply (ignore_eos: every reply has this many)
    seed: int = 0
    # paced arrivals: conversation c starts at c x this (None: all at once, closed loop)
    arrival_interval_s: float | None = 0.4
    think_time_s: float = 1.0  # from a reply's end to the next turn (paced runs only)
    max_wall_s: float = 600.0  # the run stops here, whatever is left

    @property
    def requests(self) -> int:
        return self.conversations * self.turns

    @property
    def paced(self) -> bool:
        return self.arrival_interval_s is not None

    def start_of(self, conversation: int) -> float:
        """Seconds from the run's start to the conversation's first turn."""
        return conversation * self.arrival_interval_s if self.paced else 0.0

    def think(self) -> float:
        return self.think_time_s if self.paced else 0.0


@dataclass
class Turn:
    """One turn's request, as the client saw it. Times in seconds from the run's start."""

    conversation: int
    turn: int
    request_id: str  # sent as x-request-id: each replica's inspector lists the ids it served
    target: str  # the URL it was sent to (the router, or a replica)
    sent: float
    ttft: float | None = None
    e2e: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    status: int | None = None  # HTTP status; None: no response at all
    # ok: to a finish_reason and data: [DONE]. Clean errors: http_error (an error status),
    # stream_error (an SSE error event). aborted: the connection closed mid-body and the client
    # raised (`exception`; vllm-router does this when a replica dies mid-stream). truncated:
    # the body ended without raising but without its finish_reason or [DONE] (only the framing
    # shows it). malformed: a line that is not SSE JSON. transport_error: no response at all.
    # cancelled: still running at max_wall_s. not_sent: max_wall_s came first.
    outcome: str = "ok"
    error: str | None = None
    exception: str | None = None  # the client's exception type, e.g. httpx.RemoteProtocolError
    got_tokens: bool = False  # some tokens arrived (a failure then came mid-stream)
    finish_reason: str | None = None  # the last one a chunk carried
    done: bool = False  # data: [DONE] arrived

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def system_prompt(workload: Workload, salt: str) -> str:
    return "You are a terse assistant. " + _words(
        random.Random(f"{workload.seed}:{salt}:system"), workload.system_words
    )


def user_messages(workload: Workload, salt: str, conversation: int) -> list[str]:
    rng = random.Random(f"{workload.seed}:{salt}:{conversation}")
    return [_words(rng, workload.user_words) for _ in range(workload.turns)]


async def chat_turn(
    client: httpx.AsyncClient, url: str, body: dict, turn: Turn, t0: float
) -> tuple[Turn, str]:
    """Streams one chat completion from `url`; fills `turn` in and returns it with the reply."""
    text: list[str] = []
    ended = False  # the body's last line was read (an SseError then means no [DONE])

    async def lines(response: httpx.Response):
        nonlocal ended
        async for line in response.aiter_lines():
            yield line
        ended = True

    try:
        async with client.stream(
            "POST",
            url + "/v1/chat/completions",
            json=body,
            headers={"x-request-id": turn.request_id},
        ) as response:
            turn.status = response.status_code
            if response.status_code != 200:
                turn.outcome = "http_error"
                turn.error = (await response.aread()).decode(errors="replace")[:300]
                return turn, ""
            async for at, event in aiter_sse(lines(response)):
                if "error" in event:  # an error event in place of the rest of the stream
                    turn.outcome, turn.error = "stream_error", str(event["error"])[:300]
                    return turn, ""
                for choice in event.get("choices") or ():
                    turn.finish_reason = choice.get("finish_reason") or turn.finish_reason
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        text.append(content)
                        if turn.ttft is None:
                            turn.ttft = at - t0 - turn.sent
                            turn.got_tokens = True
                if event.get("usage"):
                    turn.prompt_tokens = event["usage"]["prompt_tokens"]
                    turn.completion_tokens = event["usage"]["completion_tokens"]
            turn.done = True
    except SseError as exc:
        turn.outcome = "truncated" if ended else "malformed"
        turn.error = str(exc)[:300]
        return turn, ""
    except httpx.HTTPError as exc:
        # a response head, then the connection closed mid-body: aborted; none: no response
        turn.outcome = "aborted" if turn.status is not None else "transport_error"
        turn.exception = f"{type(exc).__module__}.{type(exc).__name__}"
        turn.error = str(exc)[:300] or repr(exc)[:300]
        return turn, ""
    if turn.finish_reason is None:  # [DONE] without the chunk that ends a choice
        turn.outcome, turn.error = "truncated", "data: [DONE] without a finish_reason"
        return turn, ""
    turn.e2e = time.perf_counter() - t0 - turn.sent
    return turn, "".join(text)


async def run_conversations(
    workload: Workload,
    model: str,
    target: Callable[[int, int], str],
    *,
    salt: str = "",
    on_turn: Callable[[Turn], None] | None = None,
    timeout: float = 600.0,
) -> tuple[list[Turn], float]:
    """Runs every conversation to its end (paced or all at once, as `workload` says); turn k of
    conversation c goes to `target(c, k)` (a URL). `on_turn(turn)` hears each finished turn as
    it finishes. Returns the turns (in finishing order; those never sent, at `max_wall_s`,
    last) and the run's wall time. A failed turn leaves its user message in the history
    without a reply, and the conversation goes on."""
    system = system_prompt(workload, salt)
    turns: list[Turn] = []
    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=workload.conversations + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def conversation(c: int) -> None:
            history = [{"role": "system", "content": system}]
            await asyncio.sleep(max(0.0, workload.start_of(c) - (time.perf_counter() - t0)))
            for k, message in enumerate(user_messages(workload, salt, c)):
                if k:
                    await asyncio.sleep(workload.think())
                history.append({"role": "user", "content": message})
                body = {
                    "model": model,
                    "messages": history,
                    "max_tokens": workload.max_tokens,
                    "ignore_eos": True,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                url = target(c, k)
                turn = Turn(c, k, _request_id(salt, c, k), url, time.perf_counter() - t0)
                try:
                    turn, reply = await chat_turn(client, url, body, turn, t0)
                except asyncio.CancelledError:  # the run's max_wall_s: recorded, then stop
                    turn.outcome = "cancelled"
                    turn.error = f"cancelled at max_wall_s ({workload.max_wall_s} s)"
                    turns.append(turn)
                    raise
                if turn.ok:
                    history.append({"role": "assistant", "content": reply})
                turns.append(turn)
                if on_turn is not None:
                    on_turn(turn)

        tasks = [asyncio.ensure_future(conversation(c)) for c in range(workload.conversations)]
        _, pending = await asyncio.wait(tasks, timeout=workload.max_wall_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    wall = time.perf_counter() - t0
    sent = {(t.conversation, t.turn) for t in turns}
    for c in range(workload.conversations):
        for k in range(workload.turns):
            if (c, k) not in sent:
                turns.append(
                    Turn(c, k, _request_id(salt, c, k), "", wall, outcome="not_sent",
                         error=f"not sent by max_wall_s ({workload.max_wall_s} s)")
                )  # fmt: skip
    return turns, wall


def _request_id(salt: str, conversation: int, turn: int) -> str:
    return f"{salt or 'run'}-c{conversation}-t{turn}"
