"""The key ring and the limiters without a server: the keys file (every way it can be wrong,
and errors that never quote a key), bearer matching, reloads that keep what is in flight, and
each limit against a fake clock."""

from __future__ import annotations

import json
import re

import pytest

from service.api_keys import DEFAULT, OPEN, UNAUTHENTICATED, KeyRing, KeysFileError, digest
from service.errors import RateLimited
from service.rate_limits import KeyLimiter, Limits
from tests.access.conftest import write_keys

SECRET = "sk-do-not-print-me-0123"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_bearer_tokens_name_their_key(tmp_path):
    path = write_keys(
        tmp_path / "keys.json",
        {"name": "team-a", "key": SECRET, "max_concurrent": 2},
        {"name": "team-b", "sha256": digest("sk-b").hex().upper()},
    )
    ring = KeyRing("sk-single", path)
    assert ring.required and ring.names == [DEFAULT, "team-a", "team-b"]
    assert ring.authenticate(f"Bearer {SECRET}").name == "team-a"
    assert ring.authenticate(f"bearer  {SECRET} ").name == "team-a"  # scheme in any case
    assert ring.authenticate("Bearer sk-b").name == "team-b"
    assert ring.authenticate("Bearer sk-single").name == DEFAULT
    assert ring.authenticate(f"Bearer {SECRET}").limiter.limits == Limits(max_concurrent=2)
    assert ring.authenticate("Bearer sk-b").limiter is None  # no limits
    for header in (None, "", SECRET, f"Basic {SECRET}", f"Bearer {SECRET}x", "Bearer "):
        assert ring.authenticate(header) is None, header
    assert ring.anonymous.name == UNAUTHENTICATED
    assert ring.labels() == {
        OPEN: (),
        UNAUTHENTICATED: (),
        DEFAULT: (),
        "team-a": ("max_concurrent",),
        "team-b": (),
    }


def test_no_keys_means_an_open_server():
    ring = KeyRing()
    assert not ring.required
    assert ring.authenticate(None).name == OPEN == ring.anonymous.name
    assert ring.authenticate("Bearer anything").name == OPEN


def test_an_empty_keys_file_refuses_everyone(tmp_path):
    ring = KeyRing(None, write_keys(tmp_path / "keys.json"))
    assert ring.required and ring.authenticate("Bearer x") is None


BAD_FILES = {
    "JSON is malformed": "{keys: [",
    "unknown field `kye`": {"keys": [{"name": "a", "kye": SECRET}]},
    "exactly one of 'key' and 'sha256'": {"keys": [{"name": "a"}]},
    "exactly one of": {"keys": [{"name": "a", "key": SECRET, "sha256": "ab" * 32}]},
    "sha256": {"keys": [{"name": "a", "sha256": SECRET}]},
    "$.keys[0].key": {"keys": [{"name": "a", "key": SECRET + " with spaces"}]},
    "$.keys[0].name": {"keys": [{"name": "a b", "key": SECRET}]},
    "reserved": {"keys": [{"name": "default", "key": SECRET}]},
    "also keys[0]'s": {"keys": [{"name": "a", "key": SECRET}, {"name": "a", "key": "sk-2"}]},
    "same key as keys[0]": {
        "keys": [{"name": "a", "key": SECRET}, {"name": "b", "sha256": digest(SECRET).hex()}]
    },
    "$.keys[0].requests_per_minute": {
        "keys": [{"name": "a", "key": SECRET, "requests_per_minute": 0}]
    },
    "$.keys[0].max_concurrent": {"keys": [{"name": "a", "key": SECRET, "max_concurrent": "2"}]},
    "Expected `object`": [SECRET],
}


@pytest.mark.parametrize("message", BAD_FILES)
def test_a_bad_keys_file_is_refused_without_quoting_a_key(tmp_path, message):
    path = tmp_path / "keys.json"
    content = BAD_FILES[message]
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(KeysFileError, match=re.escape(message)) as e:
        KeyRing(None, path)
    assert SECRET not in str(e.value) and digest(SECRET).hex() not in str(e.value)
    with pytest.raises(KeysFileError, match="cannot read"):
        KeyRing(None, tmp_path / "missing.json")


def test_reload_swaps_keys_and_keeps_what_is_in_flight(tmp_path):
    path = tmp_path / "keys.json"
    write_keys(
        path, {"name": "a", "key": "sk-a", "max_concurrent": 1}, {"name": "b", "key": "sk-b"}
    )
    clock = Clock()
    ring = KeyRing(None, path, clock)
    held = ring.authenticate("Bearer sk-a")
    held.acquire(5)  # a request of a's in flight
    write_keys(
        path,
        {"name": "a", "key": "sk-a", "max_concurrent": 2, "requests_per_minute": 60},
        {"name": "c", "key": "sk-c"},
    )
    ring.reload()
    assert ring.authenticate("Bearer sk-b") is None  # revoked
    assert ring.authenticate("Bearer sk-c").name == "c"  # added
    again = ring.authenticate("Bearer sk-a")
    assert again.limiter is held.limiter and again.limiter.active == 1  # same limiter
    again.acquire(5)  # the new max_concurrent of 2 counts the one in flight
    with pytest.raises(RateLimited, match="max_concurrent"):
        again.acquire(5)
    path.write_text("{not json")
    with pytest.raises(KeysFileError):
        ring.reload()
    assert ring.authenticate("Bearer sk-c").name == "c"  # the previous keys stay in force
    write_keys(path)  # a's key revoked while its requests run: they release what they hold
    ring.reload()
    held.release()
    again.release()
    assert held.limiter.active == 0 and ring.authenticate("Bearer sk-a") is None


def test_requests_per_minute_refill_and_retry_after():
    clock = Clock()
    limiter = KeyLimiter("a", Limits(requests_per_minute=2), clock)
    limiter.acquire(1)
    limiter.acquire(1)  # a minute's worth is the burst
    with pytest.raises(RateLimited) as e:
        limiter.acquire(1)
    assert (e.value.limit, e.value.retry_after_s, e.value.status_code) == (
        "requests_per_minute",
        30,
        429,
    )
    clock.now += 29.5
    with pytest.raises(RateLimited) as e:
        limiter.acquire(1)
    assert e.value.retry_after_s == 1  # never 0: rounded up
    clock.now += 0.5
    limiter.acquire(1)
    assert limiter.active == 3


def test_tokens_per_minute_go_into_debt_as_they_are_produced():
    clock = Clock()
    limiter = KeyLimiter("a", Limits(tokens_per_minute=120), clock)
    limiter.acquire(100)  # the prompt is charged on admission: 20 left
    with pytest.raises(RateLimited, match="tokens_per_minute") as e:
        limiter.acquire(30)  # does not fit: 10 more needed at 2 a second
    assert e.value.retry_after_s == 5
    limiter.acquire(20)  # fits exactly
    for _ in range(50):
        limiter.charge(1)  # generated tokens, charged as they come: 50 owed
    with pytest.raises(RateLimited) as e:
        limiter.acquire(1)
    assert e.value.retry_after_s == 26  # (50 + 1) / 2, rounded up
    clock.now += 60  # 70 back
    with pytest.raises(RateLimited) as e:
        limiter.acquire(500)  # bigger than a minute's worth: waits for a full bucket (25 s)
    assert e.value.retry_after_s == 25
    clock.now += 25
    limiter.acquire(500)  # then goes into debt
    assert limiter.token_bucket.level == pytest.approx(120 - 500)


def test_a_refused_request_takes_nothing():
    clock = Clock()
    limiter = KeyLimiter(
        "a", Limits(requests_per_minute=10, tokens_per_minute=60, max_concurrent=1), clock
    )
    limiter.acquire(10)
    levels = (limiter.request_bucket.level, limiter.token_bucket.level)
    with pytest.raises(RateLimited) as e:
        limiter.acquire(100)  # over max_concurrent (1 s), and tokens: a full bucket (10 s)
    assert (e.value.limit, e.value.retry_after_s) == ("tokens_per_minute", 10)
    assert (limiter.request_bucket.level, limiter.token_bucket.level) == levels
    assert limiter.active == 1
    limiter.release()
    limiter.acquire(1)
    with pytest.raises(RateLimited, match="max_concurrent"):
        limiter.acquire(1)
    limiter.update(Limits(requests_per_minute=3))  # a reload: the buckets shrink, not refill
    assert limiter.request_bucket.capacity == 3 and limiter.request_bucket.level == 3
    assert limiter.token_bucket is None
