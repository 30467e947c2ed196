"""Grammar-constrained decoding (structured outputs) and logit_bias in the engine, on the tiny
random-weight demo model: the constraint alone must make every output valid, so schemas are
bounded (maxLength, enums, maxItems) and every sample is checked."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from multiprocessing.connection import Connection

import jsonschema
import msgspec
import pytest
import torch

from inference import (
    AsyncLLMEngine,
    InvalidParameterError,
    LLMEngine,
    SamplingParams,
    StructuredOutputs,
)
from inference.engine_core import (
    AddRequest,
    EngineCore,
    FromCore,
    Rejected,
    Shutdown,
    StepResult,
    ToCore,
)
from inference.outputs import wire_decoder, wire_encoder

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "maybe so"]
PROMPTS = ["Tell me about a person", [5, 9, 31, 200, 7, 7, 12]]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine.from_pretrained(
        tiny_model_dir, device="cpu", dtype="float32", kv_cache_tokens=2048, max_model_len=512
    )


def _samples(outputs):
    return [c for out in outputs for c in out.outputs]


def _run(engine, requests):
    """requests: {request_id: (prompt, params)} added at once -> {request_id: RequestOutput}."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    final = {}
    while engine.has_unfinished:
        outputs, _ = engine.step()
        final.update({o.request_id: o for o in outputs if o.finished})
    return final


def test_json_schema_every_sample_parses_and_validates(engine):
    params = SamplingParams(
        max_tokens=120, temperature=1.0, n=3, structured_outputs=StructuredOutputs(json=SCHEMA)
    )
    samples = _samples(engine.generate(PROMPTS, params))
    assert len(samples) == 6
    for c in samples:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
        assert c.times.grammar_compile_s is not None and c.times.grammar_compile_s >= 0
    # the schema as JSON text is the same grammar: from the cache
    text = SamplingParams(
        max_tokens=120, structured_outputs=StructuredOutputs(json=json.dumps(SCHEMA))
    )
    [out] = engine.generate(PROMPTS[:1], text)
    assert out.outputs[0].times.grammar_cache_hit is True
    jsonschema.validate(json.loads(out.text), SCHEMA)


def test_regex_and_choice_hold_on_every_sample(engine):
    for so, check in (
        (StructuredOutputs(regex=REGEX), lambda t: re.fullmatch(REGEX, t)),
        (StructuredOutputs(choice=CHOICES), lambda t: t in CHOICES),
    ):
        params = SamplingParams(max_tokens=30, temperature=1.0, n=6, structured_outputs=so)
        samples = _samples(engine.generate(PROMPTS, params))
        assert len(samples) == 12
        for c in samples:
            assert check(c.text) and c.finish_reason == "stop", (so.kind, c.text)


def test_json_object_parses_to_a_dict(engine):
    # any JSON object is unbounded: a bias towards "}" (allowed only where it closes an
    # object, as the mask decides) lets the random model finish
    close = engine.tokenizer.convert_tokens_to_ids("}")
    params = SamplingParams(
        max_tokens=80,
        temperature=1.0,
        n=4,
        seed=11,
        logit_bias={close: 8.0},
        structured_outputs=StructuredOutputs(json_object=True),
    )
    for c in _samples(engine.generate(PROMPTS, params)):
        assert c.finish_reason == "stop"
        assert isinstance(json.loads(c.text), dict), c.text


@pytest.mark.parametrize(
    "grammar",
    [
        'start: "v" DIGIT "." DIGIT\nDIGIT: /[0-9]/',  # Lark
        'root ::= "v" digit "." digit\ndigit ::= [0-9]',  # GBNF, converted
    ],
)
def test_lark_and_gbnf_grammars(engine, grammar):
    params = SamplingParams(
        max_tokens=20, temperature=1.0, n=4, structured_outputs=StructuredOutputs(grammar=grammar)
    )
    for c in _samples(engine.generate(PROMPTS, params)):
        assert re.fullmatch(r"v[0-9]\.[0-9]", c.text) and c.finish_reason == "stop"


def test_greedy_fast_path_respects_the_mask(engine):
    plain = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert not re.fullmatch(REGEX, plain.text)  # unconstrained, the model writes otherwise
    params = SamplingParams(
        max_tokens=30, temperature=0.0, structured_outputs=StructuredOutputs(regex=REGEX)
    )
    first, again = (engine.generate(PROMPTS[:1], params)[0] for _ in range(2))
    assert re.fullmatch(REGEX, first.text) and first.token_ids == again.token_ids


def test_composes_with_penalties_truncation_and_min_p(engine):
    params = SamplingParams(
        max_tokens=120,
        temperature=0.8,
        top_p=0.9,
        top_k=40,
        min_p=0.02,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        n=3,
        structured_outputs=StructuredOutputs(json=SCHEMA),
    )
    for c in _samples(engine.generate(PROMPTS, params)):
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_seeded_constrained_request_same_alone_and_in_a_batch(engine):
    seeded = SamplingParams(
        max_tokens=100,
        temperature=1.0,
        seed=1234,
        n=2,
        structured_outputs=StructuredOutputs(json=SCHEMA),
    )
    alone = _run(engine, {"s": (PROMPTS[0], seeded)})["s"]
    neighbours = {
        "a": (PROMPTS[1], SamplingParams(max_tokens=20, temperature=1.0)),
        "b": (
            PROMPTS[0],
            SamplingParams(max_tokens=30, structured_outputs=StructuredOutputs(regex=REGEX)),
        ),
        "s": (PROMPTS[0], seeded),
        "c": (PROMPTS[1], SamplingParams(max_tokens=40, temperature=0.0, n=2)),
        "d": (
            PROMPTS[1],
            SamplingParams(
                max_tokens=60, temperature=0.7, structured_outputs=StructuredOutputs(json=SCHEMA)
            ),
        ),
    }
    batched = _run(engine, neighbours)["s"]
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in batched.outputs]
    assert alone.outputs[0].token_ids != alone.outputs[1].token_ids  # seed + index per sample


def test_logprobs_are_those_of_the_raw_model(engine):
    """The constraint changes which token is chosen, not the distribution reported."""
    params = SamplingParams(
        max_tokens=5,
        temperature=0.0,
        logprobs=3,
        structured_outputs=StructuredOutputs(choice=CHOICES),
    )
    [constrained] = engine.generate(PROMPTS[:1], params)
    [free] = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=1, temperature=0.0, logprobs=3))
    first, reference = constrained.outputs[0].logprobs[0], free.outputs[0].logprobs[0]
    assert first.top == reference.top  # same position, same raw distribution

    def allowed(token):
        return any(c.startswith(engine.tokenizer.decode([token])) for c in CHOICES)

    assert allowed(first.token_id) and not allowed(reference.token_id)
    raw = {t.token_id: t.logprob for t in reference.top}
    assert first.logprob < max(raw.values())  # the chosen token's raw logprob, not renormalised


def test_stop_strings_and_ignore_eos(engine):
    one = StructuredOutputs(choice=["hello world again"])
    [out] = engine.generate(
        PROMPTS[:1], SamplingParams(max_tokens=20, stop=[" "], structured_outputs=one)
    )
    assert out.text == "hello" and out.finish_reason == "stop" and out.outputs[0].stop_reason == " "
    # a finished grammar ends the sequence even where EOS is ignored
    [out] = engine.generate(
        PROMPTS[:1], SamplingParams(max_tokens=20, ignore_eos=True, structured_outputs=one)
    )
    assert out.text == "hello world again" and out.finish_reason == "stop"


def test_preemption_by_recompute_keeps_the_matcher_right(tiny_model_dir, engine):
    """A KV cache of 8 blocks of 16 tokens for requests needing far more: sequences are
    preempted and recomputed; their matchers (which consumed exactly the kept tokens) go on,
    and seeded samples come out as they do without preemption."""
    small = LLMEngine.from_pretrained(
        tiny_model_dir, device="cpu", dtype="float32", kv_cache_tokens=128, max_num_seqs=8
    )
    requests = {
        f"r{i}": (
            PROMPTS[i % 2],
            SamplingParams(
                max_tokens=90,
                temperature=1.0,
                seed=i,
                structured_outputs=StructuredOutputs(json=SCHEMA),
            ),
        )
        for i in range(6)
    }
    for rid, (prompt, params) in requests.items():
        small.add_request(rid, prompt, params)
    final, preemptions = {}, 0
    while small.has_unfinished:
        outputs, stats = small.step()
        preemptions += stats.num_preemptions
        final.update({o.request_id: o for o in outputs if o.finished})
    assert preemptions > 0
    reference = _run(engine, requests)
    for rid in requests:
        jsonschema.validate(json.loads(final[rid].text), SCHEMA)
        assert final[rid].token_ids == reference[rid].token_ids, rid
    assert small.block_manager.num_used == 0


def test_prefix_cached_prompt_constrained(engine):
    prompt = list(range(40, 90))  # three full blocks shared by both requests
    params = SamplingParams(
        max_tokens=100, seed=7, structured_outputs=StructuredOutputs(json=SCHEMA)
    )
    first = _run(engine, {"p1": (prompt, params)})["p1"]
    second = _run(engine, {"p2": (prompt, params)})["p2"]
    assert second.num_cached_tokens >= 32
    assert second.token_ids == first.token_ids
    jsonschema.validate(json.loads(second.text), SCHEMA)


def test_abort_frees_matchers_and_blocks(engine):
    long = StructuredOutputs(regex="[a-z]{300}")  # cannot end within these steps
    params = SamplingParams(max_tokens=200, n=2, structured_outputs=long)
    engine.add_request("x", PROMPTS[0], params)
    for _ in range(4):
        engine.step()
    seqs = list(engine.requests["x"])
    assert all(s.matcher is not None for s in seqs)
    out = engine.abort("x")
    assert out.finished and out.finish_reason == "abort"
    assert all(s.matcher is None for s in seqs)
    while engine.has_unfinished or engine.has_pending_stats:
        engine.step()
    assert engine.block_manager.num_used == 0


@pytest.mark.parametrize(
    "so, param, words",
    [
        (StructuredOutputs(json={"type": "nonsense"}), "structured_outputs.json", "nonsense"),
        (
            StructuredOutputs(json={"type": "string", "minLength": 5, "maxLength": 2}),
            "structured_outputs.json",
            "minLength",
        ),
        (StructuredOutputs(json="{not json"), "structured_outputs.json", "not valid JSON"),
        (StructuredOutputs(json="[1, 2]"), "structured_outputs.json", "JSON object"),
        # keys no JSON schema can have (msgpack allows them): refused, the engine lives on
        (StructuredOutputs(json={1: "a", "type": "object"}), "structured_outputs.json", "compiled"),
        (StructuredOutputs(regex="a(b"), "structured_outputs.regex", "unclosed group"),
        (StructuredOutputs(choice=[]), "structured_outputs.choice", "at least one"),
        (StructuredOutputs(choice=["a", ""]), "structured_outputs.choice", "non-empty"),
        (
            StructuredOutputs(grammar="start: undefined_rule"),
            "structured_outputs.grammar",
            "undefined_rule",
        ),
        (StructuredOutputs(grammar="root ::= ("), "structured_outputs.grammar", ""),
    ],
)
def test_bad_constraints_raise_naming_the_field(engine, so, param, words):
    with pytest.raises(InvalidParameterError) as info:
        engine.add_request("bad", PROMPTS[0], SamplingParams(structured_outputs=so))
    assert info.value.param == param
    assert words in info.value.message
    assert "bad" not in engine.requests and not engine.has_unfinished


def test_exactly_one_constraint():
    for kwargs in ({}, {"regex": "a", "choice": ["b"]}, {"json_object": True, "grammar": "x"}):
        with pytest.raises(InvalidParameterError) as info:
            StructuredOutputs(**kwargs)
        assert info.value.param == "structured_outputs"
    assert StructuredOutputs(choice=["a"]).kind == "choice"
    assert StructuredOutputs(json_object=True).kind == "json_object"


def test_a_bad_request_does_not_disturb_the_batch(engine):
    good = {
        f"g{i}": (
            PROMPTS[i % 2],
            SamplingParams(
                max_tokens=100, seed=50 + i, structured_outputs=StructuredOutputs(json=SCHEMA)
            ),
        )
        for i in range(3)
    }
    reference = _run(engine, good)
    for rid, (prompt, params) in good.items():
        engine.add_request(rid, prompt, params)
    engine.step()
    engine.step()
    with pytest.raises(InvalidParameterError):
        engine.add_request(
            "bad", PROMPTS[0], SamplingParams(structured_outputs=StructuredOutputs(regex="("))
        )
    final = {}
    while engine.has_unfinished:
        outputs, _ = engine.step()
        final.update({o.request_id: o for o in outputs if o.finished})
    assert set(final) == set(good)
    for rid in good:
        assert final[rid].token_ids == reference[rid].token_ids


def test_logit_bias_forces_and_bans_tokens(engine):
    [free] = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=6, temperature=0.0))
    favourite = free.token_ids[0]
    [banned] = engine.generate(
        PROMPTS[:1], SamplingParams(max_tokens=6, temperature=0.0, logit_bias={favourite: -100})
    )
    assert favourite not in banned.token_ids
    forced_id = 77
    rid_params = {
        "forced": (
            PROMPTS[0],
            SamplingParams(max_tokens=6, temperature=1.0, logit_bias={forced_id: 100}),
        ),
        "other": (
            PROMPTS[1],
            SamplingParams(max_tokens=6, temperature=1.0, logit_bias={forced_id + 1: 100}),
        ),
        "plain": (PROMPTS[1], SamplingParams(max_tokens=6, temperature=0.0)),
    }
    out = _run(engine, rid_params)
    assert out["forced"].token_ids == [forced_id] * 6
    assert out["other"].token_ids == [forced_id + 1] * 6  # each row its own bias, one batch
    assert forced_id not in out["plain"].token_ids


def test_logit_bias_ids_are_checked_against_the_vocabulary(engine):
    vocab = engine.args.vocab_size
    params = SamplingParams(logit_bias={vocab: 1.0})
    for kwargs in ({"prompt": PROMPTS[0]}, {"prompt": None, "prompt_token_ids": [1, 2, 3]}):
        with pytest.raises(InvalidParameterError) as info:
            engine.add_request("lb", params=params, **kwargs)
        assert info.value.param == "logit_bias"
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams(logit_bias={1: 100.5})
    assert info.value.param == "logit_bias"


def test_telemetry_data_on_times_and_step_stats(engine):
    regex = SamplingParams(max_tokens=20, structured_outputs=StructuredOutputs(regex=REGEX))
    engine.add_request("t", PROMPTS[0], regex)
    engine.add_request("u", PROMPTS[1], SamplingParams(max_tokens=30, ignore_eos=True))
    bitmask_s, times = {}, {}
    while engine.has_unfinished:
        outputs, stats = engine.step()
        constrained = "t" in engine.requests or any(o.request_id == "t" for o in outputs)
        bitmask_s.setdefault(constrained, []).append(stats.bitmask_s)
        for out in outputs:
            times[out.request_id] = out.outputs[0].times
    assert all(s > 0 for s in bitmask_s[True])  # "t" sampled in each of these steps
    assert all(s == 0 for s in bitmask_s[False])  # "u" alone: nothing to mask
    assert times["t"].grammar_compile_s > 0 and times["t"].grammar_cache_hit in (True, False)
    assert times["u"].grammar_compile_s is None and times["u"].grammar_cache_hit is None


def test_compiled_grammars_cache_is_a_bounded_lru(engine):
    manager = engine.structured
    size, manager.cache_size = manager.cache_size, 3
    try:
        first, _, hit = manager.compile(StructuredOutputs(choice=["c0"]))
        assert not hit and not first.is_error()
        for i in range(1, 4):
            manager.compile(StructuredOutputs(choice=[f"c{i}"]))
        assert len(manager._cache) == 3
        latest = manager._cache[next(reversed(manager._cache))]
        again, _, hit = manager.compile(StructuredOutputs(choice=["c3"]))
        assert hit and again is latest
        _, _, hit = manager.compile(StructuredOutputs(choice=["c0"]))  # evicted
        assert not hit
    finally:
        manager.cache_size = size


def test_sampling_params_cross_to_the_engine_core_intact():
    params = SamplingParams(
        n=2,
        seed=3,
        logit_bias={5: -100.0, 11: 2.5},
        structured_outputs=StructuredOutputs(
            json={"type": "object", "properties": {"a": {"enum": [1, "x"]}}}
        ),
    )
    for so in (
        params.structured_outputs,
        StructuredOutputs(choice=["a", "b"]),
        StructuredOutputs(json_object=True),
    ):
        message = AddRequest("r", [1, 2], msgspec.structs.replace(params, structured_outputs=so))
        decoded = wire_decoder(ToCore).decode(wire_encoder().encode(message))
        assert decoded == message
        assert decoded.params.structured_outputs.kind == so.kind
        assert decoded.params.logit_bias == {5: -100.0, 11: 2.5}
    # the REST/JSON side spells token ids as strings
    decoded = msgspec.json.decode(b'{"logit_bias": {"7": 1}}', type=SamplingParams)
    assert decoded.logit_bias == {7: 1.0}


async def test_async_stream_rejects_a_bad_grammar_before_any_output(tiny_model_dir):
    engine = AsyncLLMEngine.from_pretrained(
        tiny_model_dir, device="cpu", dtype="float32", kv_cache_tokens=1024
    )
    engine.start()
    try:
        good = SamplingParams(max_tokens=30, structured_outputs=StructuredOutputs(regex=REGEX))
        bad = SamplingParams(structured_outputs=StructuredOutputs(json={"type": "nonsense"}))
        outputs = []
        with pytest.raises(InvalidParameterError) as info:
            async for out in engine.stream(PROMPTS[0], bad):
                outputs.append(out)
        assert info.value.param == "structured_outputs.json" and not outputs
        out = await engine.generate(PROMPTS[0], good)
        assert re.fullmatch(REGEX, out.text) and out.finish_reason == "stop"
        assert out.outputs[0].times.grammar_compile_s is not None
        assert engine.is_alive
    finally:
        await engine.shutdown()


def test_bitmask_unpacking_matches_the_bits():
    from inference.structured import _disallowed

    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 5), dtype=torch.int32)
    got = _disallowed(bitmask, 150, torch.device("cpu"))
    bits = torch.tensor(
        [[(int(w) >> b) & 1 for w in row for b in range(32)] for row in bitmask.tolist()]
    )
    assert torch.equal(got, bits[:, :150] == 0)


def test_overlapped_fill_gives_the_same_outputs(engine):
    """The bitmask filled on a helper thread while the forward pass runs (manager.overlap)
    is the same bitmask: seeded constrained requests come out identical."""
    requests = {
        f"o{i}": (
            PROMPTS[i % 2],
            SamplingParams(
                max_tokens=100, seed=90 + i, n=2, structured_outputs=StructuredOutputs(json=SCHEMA)
            ),
        )
        for i in range(3)
    }
    on_path = _run(engine, requests)
    engine.structured.overlap = True
    try:
        overlapped = _run(engine, requests)
    finally:
        engine.structured.overlap = False
    for rid in requests:
        assert [c.token_ids for c in overlapped[rid].outputs] == [
            c.token_ids for c in on_path[rid].outputs
        ]
        for c in overlapped[rid].outputs:
            jsonschema.validate(json.loads(c.text), SCHEMA)


def _big_schema(n: int = 60) -> dict:
    """A schema that takes tens of milliseconds to compile (past sync_compile_s)."""
    item = {
        "type": "object",
        "properties": {f"f{j}": {"type": ["string", "integer"], "maxLength": 4} for j in range(8)},
        "required": ["f0"],
        "additionalProperties": False,
    }
    one = {"anyOf": [item, {"type": "array", "items": item, "maxItems": 2}]}
    return {
        "type": "object",
        "properties": {f"p{i}": one for i in range(n)},
        "additionalProperties": False,
    }


def test_a_slow_compile_runs_off_the_step_path(engine):
    """A grammar that takes longer than sync_compile_s: add_request returns, the running
    requests keep stepping, the request joins the batch once compiled; a grammar that fails
    there is rejected once (take_rejected) and produces no output."""
    engine.add_request("running", PROMPTS[1], SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    started = time.perf_counter()
    engine.add_request(
        "big",
        PROMPTS[0],
        SamplingParams(max_tokens=12, structured_outputs=StructuredOutputs(json=_big_schema())),
    )
    assert time.perf_counter() - started < 0.5 and "big" in engine.pending_grammars.jobs
    progressed = 0
    while "big" in engine.pending_grammars.jobs:
        before = len(engine.requests["running"][0].token_ids)
        engine.step()
        progressed += len(engine.requests["running"][0].token_ids) - before
    assert progressed > 0  # the batch went on while the grammar compiled
    big = engine.requests["big"][0]
    assert big.matcher is not None and big.times.grammar_cache_hit is False
    assert big.times.grammar_compile_s > 0
    engine.abort("running")
    final = _run(engine, {})
    big = final["big"]
    if big.finish_reason == "stop":
        jsonschema.validate(json.loads(big.text), _big_schema())
    else:
        assert big.finish_reason == "length" and big.text.startswith("{")

    size = engine.structured.sync_compile_s
    engine.structured.sync_compile_s = 0.0  # every compile goes off the path
    try:
        bad = SamplingParams(structured_outputs=StructuredOutputs(json={"type": "nonsense"}))
        engine.add_request("late-bad", PROMPTS[0], bad)  # no error yet
        engine.pending_grammars.wait()
        [(rid, error)] = engine.take_rejected()
        assert rid == "late-bad" and error.param == "structured_outputs.json"
        assert "late-bad" not in engine.requests and engine.take_rejected() == []
        with pytest.raises(InvalidParameterError) as info:  # generate() raises it
            engine.generate(
                PROMPTS[:1], SamplingParams(structured_outputs=StructuredOutputs(regex="b("))
            )
        assert info.value.param == "structured_outputs.regex"
        assert not engine.has_unfinished
        params = SamplingParams(
            max_tokens=30, n=2, structured_outputs=StructuredOutputs(regex="[a-c]{4}x")
        )
        [out] = engine.generate(PROMPTS[:1], params)
        assert all(re.fullmatch("[a-c]{4}x", c.text) for c in out.outputs)
        # aborted while compiling: finished, reported once, nothing left behind
        engine.add_request(
            "gone",
            PROMPTS[0],
            SamplingParams(structured_outputs=StructuredOutputs(regex="[d-f]{9}")),
        )
        assert engine.abort("gone").finish_reason == "abort"
        _, stats = engine.step()
        assert [f.finish_reason for f in stats.finished] == ["abort"]
        engine.pending_grammars.wait()
        assert engine.take_rejected() == [] and not engine.has_unfinished
    finally:
        engine.structured.sync_compile_s = size


def test_engine_core_sends_late_grammar_errors_and_waits_for_compiles(engine):
    """The core loop (in this process, on a socket pair): a grammar failing after add_request
    returned comes back as Rejected, one that compiles late is served, and the loop sleeps
    (no empty steps) while only compiles are pending."""
    ours, theirs = socket.socketpair()
    core = EngineCore(engine, Connection(theirs.detach()), wire_encoder())
    conn = Connection(ours.detach())
    size, engine.structured.sync_compile_s = engine.structured.sync_compile_s, 0.0
    thread = threading.Thread(target=core.run, daemon=True)
    thread.start()
    try:
        encoder, decoder = wire_encoder(), wire_decoder(FromCore)
        bad = SamplingParams(structured_outputs=StructuredOutputs(json={"type": "nonsense"}))
        good = SamplingParams(max_tokens=30, structured_outputs=StructuredOutputs(regex="[x-z]{5}"))
        conn.send_bytes(encoder.encode(AddRequest("bad", [5, 6, 7], bad)))
        conn.send_bytes(encoder.encode(AddRequest("good", [5, 6, 7], good)))
        rejected, finished, steps = [], None, 0
        while finished is None:
            assert conn.poll(30), "the core went quiet"
            message = decoder.decode(conn.recv_bytes())
            if isinstance(message, Rejected):
                rejected.append((message.request_id, message.param))
            else:
                assert isinstance(message, StepResult), message
                steps += 1
                assert message.stats.batch_size > 0  # no empty steps while compiling
                finished = next((o for o in message.outputs if o.finished), None)
        assert rejected == [("bad", "structured_outputs.json")] and steps >= 1
        assert finished.request_id == "good" and re.fullmatch("[x-z]{5}", finished.text)
        conn.send_bytes(encoder.encode(Shutdown()))
        thread.join(10)
        assert not thread.is_alive()
    finally:
        engine.structured.sync_compile_s = size
        engine.pending_grammars.on_done = None
        conn.close()


def test_a_grammar_starts_where_the_reasoning_ends(engine):
    """SamplingParams.reasoning_end (a reasoning parser's end marker, set by the service): the
    output samples freely until its text contains the marker, then the grammar constrains the
    rest, as vLLM's grammars start after the reasoning. Greedy, so the free part is the
    unconstrained output's."""
    prompt = "Tell me about a person"
    free = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    marker = engine.tokenizer.decode(free.token_ids[:4])  # the text of the first 4 tokens
    assert free.text.startswith(marker)
    grammar = StructuredOutputs(regex="[0-9]{3}")
    params = SamplingParams(
        temperature=0, max_tokens=20, structured_outputs=grammar, reasoning_end=marker
    )
    out = engine.generate(prompt, params)[0].outputs[0]
    assert out.token_ids[:4] == free.token_ids[:4]
    assert out.text.startswith(marker) and re.fullmatch("[0-9]{3}", out.text[len(marker) :])
    assert out.finish_reason == "stop"
    # a marker the output never writes: the grammar never starts
    params = SamplingParams(
        temperature=0, max_tokens=10, structured_outputs=grammar, reasoning_end="\x00never"
    )
    assert engine.generate(prompt, params)[0].outputs[0].token_ids == free.token_ids
