"""Malformed requests for the hostile-input scenario (`python -m bench.scenarios.hostile`
sends them from a process of its own): a seeded, endless mix of

- wrong_types: well-formed JSON whose fields have the wrong type or range
- malformed_json: truncated, trailing garbage, NaN, top-level arrays or scalars, empty
- invalid_utf8: bodies with bytes that are not UTF-8 (or escaped lone surrogates)
- deep_nesting: arrays or objects nested 1,000 to 200,000 deep
- huge: bodies over the server's body limit, and giant fields under it
- bad_auth: no Authorization, a wrong key, a wrong scheme, junk bytes in the header
- bad_http: wrong method or content type, unknown paths
- raw: broken HTTP/1.1 on a bare socket (bad request line, bad header, short body)

Each case is (category, send); `send(client, base_url, key)` returns the HTTP status (or
"closed" when a raw connection got no response line). `run_hostile` sends them from a
few concurrent workers and counts statuses by category.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import sys
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx

CATEGORIES = (
    "wrong_types",
    "malformed_json",
    "invalid_utf8",
    "deep_nesting",
    "huge",
    "bad_auth",
    "bad_http",
    "raw",
)
# relative frequency; huge bodies are costly to send, raw sockets slower to open
WEIGHTS = (30, 15, 10, 8, 2, 20, 10, 5)
ROUTES = ("/v1/completions", "/v1/chat/completions")

Send = Callable[[httpx.AsyncClient, str, str], Awaitable[str]]

_WRONG = {
    "prompt": [123, None, {"text": "x"}, [1.5, 2], [[1, "a"]], True, [-1], [10**12]],
    # (no null for max_tokens or model: null is valid there, and a chat's null max_tokens is a
    # generation to the end of the context, work rather than a malformed request)
    "max_tokens": ["ten", -5, 0, 1.5, 10**18, "", [], {"n": 1}],
    "temperature": ["hot", -1, 1e308, [0.1], {"t": 1}, True],
    "top_p": [2, -0.5, "all", [1]],
    "n": [0, -1, "two", 1000000],
    "stream": ["yes", 1, [], {"on": True}],
    "stop": [5, [1, 2], {"s": "x"}, ["a"] * 100],
    "logprobs": ["x", -1, 1000],
    "seed": ["s", 1.5, 2**80],
    "model": [7, {}, [], "no-such-model"],
    "messages": [{"role": "user"}, "hi", [1, 2], [{"role": 5, "content": "x"}], [{}], []],
    "stream_options": ["x", {"include_usage": "y"}],
    "response_format": [{"type": "nope"}, "json", {"type": "json_schema"}],
    "tools": [{"type": "function"}, [{"type": "x"}], "t"],
    "logit_bias": [{"a": 1}, {"1": 1000}, [1]],
}


def _valid(route: str, model: str) -> dict[str, Any]:
    if "chat" in route:
        return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return {"model": model, "prompt": "hi", "max_tokens": 4}


def _headers(key: str, content_type: str = "application/json") -> dict[str, str]:
    return {"authorization": f"Bearer {key}", "content-type": content_type}


def _post(route: str, body: bytes, headers: dict[str, str]) -> Send:
    async def send(client: httpx.AsyncClient, base: str, key: str) -> str:
        h = {k: (v.replace("{key}", key) if isinstance(v, str) else v) for k, v in headers.items()}
        r = await client.post(base + route, content=body, headers=h)
        return str(r.status_code)

    return send


def _raw(payload: bytes) -> Send:
    async def send(client: httpx.AsyncClient, base: str, key: str) -> str:
        host, port = base.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(payload.replace(b"{key}", key.encode()))
            await writer.drain()
            try:
                writer.write_eof()
            except OSError:
                pass
            line = await asyncio.wait_for(reader.readline(), 10)
        except (ConnectionError, TimeoutError):
            return "closed"
        finally:
            writer.close()
        parts = line.split()
        return parts[1].decode() if len(parts) >= 2 and parts[1].isdigit() else "closed"

    return send


@functools.cache
def _nested(route: str, model: str, field: str, shape: str, depth: int) -> bytes:
    inner = "[" * depth + "]" * depth if shape == "array" else '{"a":' * depth + "1" + "}" * depth
    text = json.dumps({**_valid(route, model), field: 0})
    return text.replace(f'"{field}": 0', f'"{field}": {inner}').encode()


@functools.cache
def _huge(route: str, model: str, kind: str) -> bytes:
    prompt = {
        "over_limit": "x" * 1_200_000,
        "long_text": "word " * 180_000,
        "many_ids": [1] * 150_000,
    }
    return json.dumps({**_valid(route, model), "prompt": prompt[kind]}).encode()


def cases(model: str, seed: int = 0, skip: tuple[str, ...] = ()) -> Iterator[tuple[str, Send]]:
    """An endless seeded stream of (category, send), without the categories in `skip`."""
    rng = random.Random(seed)
    weights = [0 if c in skip else w for c, w in zip(CATEGORIES, WEIGHTS, strict=True)]
    auth = {"authorization": "Bearer {key}", "content-type": "application/json"}
    while True:
        category = rng.choices(CATEGORIES, weights)[0]
        route = rng.choice(ROUTES)
        base = _valid(route, model)
        if category == "wrong_types":
            field = rng.choice(list(_WRONG))
            body = {**base, field: rng.choice(_WRONG[field])}
            if rng.random() < 0.2:
                body[f"unknown_{rng.randint(0, 99)}"] = rng.choice([1, "x", [], {}])
            yield category, _post(route, json.dumps(body).encode(), auth)
        elif category == "malformed_json":
            text = json.dumps(base)
            choice = rng.randrange(8)
            payload = [
                text[: rng.randint(0, len(text) - 1)].encode(),
                (text + rng.choice(["}", "]", " x", ",", "\x00"])).encode(),
                text.replace('"hi"', "NaN").encode(),
                b"[" + text.encode() + b"]",
                rng.choice([b"null", b"42", b'"str"', b"true"]),
                b"",
                text.replace(":", "=").encode(),
                (f'{{"model": "{model}", "model": 1, "prompt": "hi"}}').encode(),
            ][choice]
            yield category, _post(route, payload, auth)
        elif category == "invalid_utf8":
            junk = rng.choice(
                [b"\xff\xfe", b"\xc0\xaf", b"\xed\xa0\x80", b"\x80" * 10, b"\xf8\x88\x80\x80\x80"]
            )
            text = json.dumps(base).encode()
            payload = text.replace(b'"hi"', b'"h' + junk + b'i"')
            if rng.random() < 0.3:
                payload = text.replace(b'"hi"', b'"\\ud800\\udc00\\ud800"')
            yield category, _post(route, payload, auth)
        elif category == "deep_nesting":
            depth = rng.choice([1_000, 10_000, 100_000, 200_000])
            shape = rng.choice(["array", "object"])
            field = rng.choice(["prompt", "messages", "extra", "stop", "tools"])
            yield category, _post(route, _nested(route, model, field, shape, depth), auth)
        elif category == "huge":
            # over the body limit (1 MiB by default): 413; under it, a prompt far over the
            # context; a giant token-id list
            kind = rng.choices(["over_limit", "long_text", "many_ids"], [2, 1, 1])[0]
            yield category, _post(route, _huge(route, model, kind), auth)
        elif category == "bad_auth":
            variant = rng.randrange(6)
            h: dict[str, str] = {"content-type": "application/json"}
            if variant == 1:
                h["authorization"] = "Bearer sk-wrong"
            elif variant == 2:
                h["authorization"] = "Basic {key}"
            elif variant == 3:
                h["authorization"] = "Bearer"
            elif variant == 4:
                h["authorization"] = "Bearer {key}{key}"
            elif variant == 5:
                h["authorization"] = "bearer  " + "k" * 10_000
            yield category, _post(route, json.dumps(base).encode(), h)
        elif category == "bad_http":
            variant = rng.randrange(4)
            if variant == 0:
                yield (
                    category,
                    _post(route, json.dumps(base).encode(), _headers("{key}", "text/plain")),
                )
            elif variant == 1:
                yield (
                    category,
                    _post(
                        route,
                        b"prompt=hi&max_tokens=4",
                        _headers("{key}", "application/x-www-form-urlencoded"),
                    ),
                )
            elif variant == 2:
                path = rng.choice(["/v1/nope", "/v1/completions/x", "/../../etc/passwd", "/v1/%00"])
                yield category, _post(path, json.dumps(base).encode(), auth)
            else:

                async def get(client: httpx.AsyncClient, base_url: str, key: str, r=route) -> str:
                    resp = await client.request(
                        rng.choice(["GET", "PUT", "DELETE"]), base_url + r, headers=_headers(key)
                    )
                    return str(resp.status_code)

                yield category, get
        else:  # raw
            body = json.dumps(base).encode()
            variant = rng.randrange(5)
            payload = [
                b"GARBAGE /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n",
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nBad Header Line\r\n\r\n",
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                b"Content-Type: application/json\r\nContent-Length: 9999\r\n\r\n" + body,
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                b"Authorization: Bearer {key}\r\n\r\nzz\r\n" + body + b"\r\n0\r\n\r\n",
                b"POST /v1/completions HTTP/9.9\r\nHost: x\r\n\r\n",
            ][variant]
            yield category, _raw(payload)


async def run_hostile(
    base_url: str,
    model: str,
    key: str,
    count: int,
    workers: int = 4,
    rate: float | None = None,
    seed: int = 0,
    skip: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Sends `count` cases from `workers` concurrent clients, at most `rate` a second (None:
    as fast as they go); returns {"sent", "seconds", "by_category": {category: {status: n}},
    "5xx", "errors"} (errors: transport failures by type)."""
    it = cases(model, seed, skip)
    by_cat: dict[str, Counter] = {c: Counter() for c in CATEGORIES}
    errors: Counter = Counter()
    sent = 0
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    async def worker() -> None:
        nonlocal sent
        async with httpx.AsyncClient(timeout=30) as client:
            while sent < count:
                sent += 1
                if rate:
                    await asyncio.sleep(max(0.0, t0 + sent / rate - loop.time()))
                category, send = next(it)
                try:
                    status = await send(client, base_url, key)
                except (httpx.HTTPError, OSError) as exc:
                    status = "closed"
                    errors[type(exc).__name__] += 1
                by_cat[category][status] += 1

    await asyncio.gather(*(worker() for _ in range(workers)))
    fives = sum(n for c in by_cat.values() for s, n in c.items() if s.isdigit() and int(s) >= 500)
    return {
        "sent": sent,
        "seconds": round(loop.time() - t0, 1),
        "by_category": {c: dict(v) for c, v in by_cat.items()},
        "5xx": fives,
        "errors": dict(errors),
    }


def main(argv: list[str] | None = None) -> None:
    """`python -m bench.scenarios.hostile URL MODEL KEY COUNT [--rate R]`: the sender in a
    process of its own (its CPU is not the harness's event loop, which times the good
    traffic); prints the result as one JSON line."""
    p = argparse.ArgumentParser(prog="python -m bench.scenarios.hostile")
    p.add_argument("url")
    p.add_argument("model")
    p.add_argument("key")
    p.add_argument("count", type=int)
    p.add_argument("--rate", type=float)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--skip", default="", help="comma-separated categories left out")
    ns = p.parse_args(argv)
    skip = tuple(c for c in ns.skip.split(",") if c)
    result = asyncio.run(
        run_hostile(ns.url, ns.model, ns.key, ns.count, ns.workers, ns.rate, skip=skip)
    )
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
