"""Speculative decoding's counters (SPEC section 13 names, vLLM's meanings) from StepStats."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from inference.outputs import StepStats
from telemetry.metrics import ServiceMetrics, render_metrics
from telemetry.tracing import record_step_span


def _step(**spec) -> StepStats:
    return StepStats(
        started=0.0,
        started_unix_ns=0,
        duration_s=0.01,
        num_running=1,
        num_waiting=0,
        batch_size=1,
        num_prefill_tokens=0,
        num_decode_tokens=4,
        num_generated_tokens=3,
        kv_usage=0.1,
        kv_blocks_used=1,
        num_requests=1,
        num_preemptions=0,
        request_ids=["a"],
        **spec,
    )


def test_spec_decode_counters_add_up_each_step():
    registry = CollectorRegistry()
    metrics = ServiceMetrics(registry, "m", num_layers=1, num_experts=2, max_waiting=4)
    metrics.observe_step(_step())  # no speculation: nothing counted
    for _ in range(2):
        metrics.observe_step(
            _step(
                spec_num_drafts=2,
                spec_num_draft_tokens=5,
                spec_num_accepted_tokens=3,
                spec_accepted_per_pos=[2, 1, 0],
            )
        )

    def value(name, **labels):
        return registry.get_sample_value(name, {"model": "m", **labels})

    assert value("moeserve_spec_decode_num_drafts_total") == 4
    assert value("moeserve_spec_decode_num_draft_tokens_total") == 10
    assert value("moeserve_spec_decode_num_accepted_tokens_total") == 6
    per_pos = "moeserve_spec_decode_num_accepted_tokens_per_pos_total"
    assert [value(per_pos, position=str(p)) for p in range(3)] == [4, 2, 0]
    body, _ = render_metrics(registry)
    assert (
        b'moeserve_spec_decode_num_accepted_tokens_per_pos_total{model="m",position="1"} 2.0'
        in body
    )


def test_a_step_span_carries_its_drafts_only_when_it_had_some(tracer, span_exporter):
    record_step_span(_step(), lambda rid: None, tracer=tracer)
    record_step_span(
        _step(spec_num_drafts=1, spec_num_draft_tokens=4, spec_num_accepted_tokens=3),
        lambda rid: None,
        tracer=tracer,
    )
    plain, spec = [s.attributes for s in span_exporter.get_finished_spans()]
    assert not any(k.startswith("moeserve.spec_decode") for k in plain)
    assert spec["moeserve.spec_decode.num_drafts"] == 1
    assert spec["moeserve.spec_decode.num_draft_tokens"] == 4
    assert spec["moeserve.spec_decode.num_accepted_tokens"] == 3
