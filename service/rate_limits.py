"""Per-API-key limits: requests per minute, tokens per minute, concurrent requests.

Each rate is a token bucket holding up to a minute's worth (the burst) and refilling at the
rate. Tokens are charged as they are produced: the prompt when the request is admitted, each
generated token when it arrives, so a running request may take its key's bucket below zero,
and that key's next requests wait until it has refilled. The rate-limit libraries (limits,
aiolimiter) refuse a charge that does not fit instead of recording it, which is right for a
request about to start and wrong for tokens a running one has already generated; a bucket
is a few lines, so it is written here.

One event loop serves both APIs and nothing here awaits, so no lock is needed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from service.errors import RateLimited

LIMITS = ("requests_per_minute", "tokens_per_minute", "max_concurrent")  # the metric's label


@dataclass(frozen=True, slots=True)
class Limits:
    """A key's limits; None: unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None

    def configured(self) -> tuple[str, ...]:
        return tuple(name for name in LIMITS if getattr(self, name) is not None)


class TokenBucket:
    """`per_minute` units a minute, at most a minute's worth banked; starts full."""

    def __init__(self, per_minute: int, clock: Callable[[], float]) -> None:
        self.capacity, self.rate = float(per_minute), per_minute / 60.0
        self.clock = clock
        self.level, self._at = self.capacity, clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self._at) * self.rate)
        self._at = now

    def wait_s(self, amount: float) -> float:
        """Seconds until `amount` (at most the capacity) is available; 0.0 when it is now."""
        self._refill()
        return max(0.0, (min(amount, self.capacity) - self.level) / self.rate)

    def take(self, amount: float) -> None:
        """Takes `amount`, into debt if need be."""
        self._refill()
        self.level -= amount

    def resize(self, per_minute: int) -> None:
        """A new rate (a reloaded keys file); what is banked stays, up to the new capacity."""
        self._refill()
        self.capacity, self.rate = float(per_minute), per_minute / 60.0
        self.level = min(self.level, self.capacity)


class KeyLimiter:
    """One key's limits and what it has used; kept across reloads of the keys file, so
    in-flight requests and the buckets' levels carry over (see `update`)."""

    def __init__(self, key: str, limits: Limits, clock: Callable[[], float] = time.monotonic):
        self.key, self.clock = key, clock
        self.limits = Limits()
        self.active = 0  # requests admitted and not yet finished
        self.request_bucket: TokenBucket | None = None
        self.token_bucket: TokenBucket | None = None
        self.update(limits)

    def update(self, limits: Limits) -> None:
        self.limits = limits
        self.request_bucket = self._bucket(self.request_bucket, limits.requests_per_minute)
        self.token_bucket = self._bucket(self.token_bucket, limits.tokens_per_minute)

    def _bucket(self, bucket: TokenBucket | None, per_minute: int | None) -> TokenBucket | None:
        if per_minute is None:
            return None
        if bucket is None:
            return TokenBucket(per_minute, self.clock)
        bucket.resize(per_minute)
        return bucket

    def acquire(self, prompt_tokens: int) -> None:
        """Admits a request of `prompt_tokens` (charged now) or raises RateLimited naming the
        limit with the longest wait, and consumes nothing. A prompt larger than the whole
        tokens-per-minute allowance waits for a full bucket, then goes into debt."""
        waits: dict[str, float] = {}
        limits = self.limits
        if limits.max_concurrent is not None and self.active >= limits.max_concurrent:
            waits["max_concurrent"] = 1.0  # unknown: when one of its requests finishes
        if self.request_bucket is not None:
            waits["requests_per_minute"] = self.request_bucket.wait_s(1)
        if self.token_bucket is not None:
            waits["tokens_per_minute"] = self.token_bucket.wait_s(max(prompt_tokens, 1))
        refused = {name: s for name, s in waits.items() if name == "max_concurrent" or s > 0}
        if refused:
            limit = max(refused, key=refused.get)
            raise RateLimited(
                f"API key '{self.key}' is over its {limit} limit ({getattr(limits, limit)})",
                limit=limit,
                retry_after_s=max(1, math.ceil(refused[limit])),
            )
        self.active += 1
        if self.request_bucket is not None:
            self.request_bucket.take(1)
        self.charge(prompt_tokens)

    def charge(self, tokens: int) -> None:
        """Tokens a running request produced (tokens per minute)."""
        if self.token_bucket is not None and tokens:
            self.token_bucket.take(tokens)

    def release(self) -> None:
        """An admitted request has finished."""
        self.active -= 1
