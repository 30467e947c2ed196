"""The API keys a server accepts: `--api-key` (one unnamed key) and `--api-keys-file` (named
keys with limits, read again on SIGHUP).

The file (JSON):

    {"keys": [{"name": "team-a", "key": "sk-..." | "sha256": "<64 hex>",
               "requests_per_minute": N, "tokens_per_minute": N, "max_concurrent": N}]}

Only SHA-256 digests are kept in memory. A bearer token is hashed and compared with every
key's digest in constant time (hmac.compare_digest, no early exit), so neither which key
matched nor how much of one did shows in the response time. A request is known by its key's
name: the `key` label of the request metrics, a span attribute, a log field and the
scheduler's tenant. Names come only from the file or are one of the fixed labels below, so
the label stays bounded whatever clients send. Errors about the file never quote a key.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec

from service.rate_limits import KeyLimiter, Limits
from telemetry.metrics import NO_KEY

OPEN = NO_KEY  # the server takes no key: every request
UNAUTHENTICATED = "unauthenticated"  # refused for a missing or wrong key
DEFAULT = "default"  # --api-key
RESERVED = frozenset({OPEN, UNAUTHENTICATED, DEFAULT})

_PerMinute = Annotated[int, msgspec.Meta(ge=1)]


class _Entry(msgspec.Struct, forbid_unknown_fields=True):
    name: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
    key: Annotated[str, msgspec.Meta(pattern=r"^[\x21-\x7e]+$")] | None = None  # a header token
    sha256: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-fA-F]{64}$")] | None = None
    requests_per_minute: _PerMinute | None = None
    tokens_per_minute: _PerMinute | None = None
    max_concurrent: _PerMinute | None = None


class _File(msgspec.Struct, forbid_unknown_fields=True):
    keys: list[_Entry]


class KeysFileError(ValueError):
    """--api-keys-file cannot be used as it is (the message names the entry, never a key)."""


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


@dataclass(frozen=True, slots=True)
class _Key:
    name: str
    digest: bytes


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request: its key's name (or a fixed label) and that key's limiter."""

    name: str
    limiter: KeyLimiter | None = None

    def acquire(self, prompt_tokens: int) -> None:
        """Admission under the key's limits (RateLimited when over one)."""
        if self.limiter is not None:
            self.limiter.acquire(prompt_tokens)

    def charge(self, tokens: int) -> None:
        if self.limiter is not None:
            self.limiter.charge(tokens)

    def release(self) -> None:
        if self.limiter is not None:
            self.limiter.release()


def _read(path: Path) -> list[tuple[_Key, Limits]]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise KeysFileError(f"cannot read {path}: {exc.strerror}") from None
    try:
        entries = msgspec.json.decode(raw, type=_File).keys
    except msgspec.DecodeError as exc:  # validation errors name the field, not its value
        raise KeysFileError(f"{path}: {exc}") from None
    keys: list[tuple[_Key, Limits]] = []
    seen_names: dict[str, int] = {}
    seen_digests: dict[bytes, int] = {}
    for i, e in enumerate(entries):
        where = f"{path}: keys[{i}] ({e.name!r})"
        if (e.key is None) == (e.sha256 is None):
            raise KeysFileError(f"{where}: give exactly one of 'key' and 'sha256'")
        if e.name in RESERVED:
            raise KeysFileError(f"{where}: the name is reserved ({', '.join(sorted(RESERVED))})")
        if e.name in seen_names:
            raise KeysFileError(f"{where}: the name is also keys[{seen_names[e.name]}]'s")
        value = digest(e.key) if e.key is not None else bytes.fromhex(e.sha256)
        if value in seen_digests:
            raise KeysFileError(f"{where}: the same key as keys[{seen_digests[value]}]")
        seen_names[e.name], seen_digests[value] = i, i
        limits = Limits(e.requests_per_minute, e.tokens_per_minute, e.max_concurrent)
        keys.append((_Key(e.name, value), limits))
    return keys


class KeyRing:
    """The keys in force. `path`: --api-keys-file (KeysFileError when it does not load);
    `single_key`: --api-key. Neither: the server is open and every caller is `OPEN`."""

    def __init__(
        self,
        single_key: str | None = None,
        path: str | Path | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = None if path is None else Path(path)
        self._clock = clock
        self._single = () if not single_key else (_Key(DEFAULT, digest(single_key)),)
        self._keys: tuple[_Key, ...] = self._single
        self._limits: dict[str, Limits] = {}
        self._limiters: dict[str, KeyLimiter] = {}
        if self.path is not None:
            self.reload()

    @property
    def required(self) -> bool:
        """Whether requests must present a key (a keys file with no keys refuses them all)."""
        return bool(self._single) or self.path is not None

    @property
    def names(self) -> list[str]:
        return [k.name for k in self._keys]

    @property
    def anonymous(self) -> Caller:
        """Who a request is until it has shown a valid key."""
        return Caller(UNAUTHENTICATED if self.required else OPEN)

    def reload(self) -> None:
        """Reads the keys file again; KeysFileError leaves the keys in force untouched. A
        key still in the file keeps its limiter (in-flight count, buckets), with new limits;
        a removed key's in-flight requests finish under the limiter they hold."""
        entries = _read(self.path)
        limiters = {}
        for key, limits in entries:
            limiter = self._limiters.get(key.name)
            if limits.configured():
                if limiter is None:
                    limiter = KeyLimiter(key.name, limits, self._clock)
                else:
                    limiter.update(limits)
                limiters[key.name] = limiter
        self._keys = self._single + tuple(key for key, _ in entries)
        self._limits = {key.name: limits for key, limits in entries}
        self._limiters = limiters

    def labels(self) -> dict[str, tuple[str, ...]]:
        """Every `key` label value this ring can give -> the limits configured for it."""
        fixed = {name: () for name in (OPEN, UNAUTHENTICATED, DEFAULT)}
        return fixed | {name: limits.configured() for name, limits in self._limits.items()}

    def authenticate(self, authorization: str | None) -> Caller | None:
        """The caller of a request with this Authorization header (`Bearer <key>`, any case
        of the scheme), None when the key is missing or wrong."""
        if not self.required:
            return Caller(OPEN)
        scheme, _, token = (authorization or "").partition(" ")
        given = digest(token.strip())
        found = None
        for key in self._keys:  # all of them, whatever matched: constant time per key
            if hmac.compare_digest(given, key.digest):
                found = key
        if found is None or scheme.lower() != "bearer":
            return None
        return Caller(found.name, self._limiters.get(found.name))
