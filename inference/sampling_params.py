"""Per-request sampling parameters (SPEC section 5), validated on construction."""

from __future__ import annotations

import msgspec

from inference.errors import InvalidParameterError


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top-N logprobs per generated token (0: only the chosen one)
    n: int = 1

    def __post_init__(self) -> None:
        _check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "must be >= 1"
        )
        _check(
            isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            "must be between 0 and max_tokens",
        )
        _check(0.0 <= self.temperature <= 100.0, "temperature", "must be in [0, 100]")
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(self.top_k == -1 or self.top_k >= 0, "top_k", "must be -1, 0 (disabled) or positive")
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        _check(0.0 < self.repetition_penalty <= 10.0, "repetition_penalty", "must be in (0, 10]")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]")
        _check(1 <= self.n <= 16, "n", "must be in [1, 16]")
        _check(self.seed is None or 0 <= self.seed < 2**63, "seed", "must be in [0, 2**63)")
        _check(
            all(isinstance(s, str) and s for s in self.stop) and len(self.stop) <= 8,
            "stop",
            "must be at most 8 non-empty strings",
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative token ids",
        )
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidParameterError(param, message)
