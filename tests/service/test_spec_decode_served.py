"""A server started with --speculative-config: its /metrics count drafts (vLLM's meanings) and
a request's span carries what its drafts achieved."""

from __future__ import annotations

import asyncio
import json

import pytest

from inference import SamplingParams
from service.generation import Generation
from service.validation import GenerationInput
from tests.inference.parity_checks import prompts
from tests.service.test_service_observability import _observed

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}


@pytest.mark.slow
def test_served_speculation_counts_drafts_and_traces_acceptance(start_server, tiny_model_dir):
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    # a prompt repeating itself, whose greedy continuation (this model's) repeats its own
    # tokens: drafts get proposed and some accepted (tests/inference/test_spec_decode.py)
    prompt = prompts(vocab, [12])[0] * 3
    with start_server(speculative_config=json.dumps(NGRAM)) as srv:
        exporter, provider, _, _, state = _observed(srv)

        async def run() -> None:
            span = provider.get_tracer("t").start_span("server")
            gen = Generation(state, "rest", "spec-1", span)
            params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
            spec = GenerationInput(prompt, params, "text_completion", stream=False)
            [u async for u in gen.updates(spec)]
            gen.finish()
            span.end()

        asyncio.run_coroutine_threadsafe(run(), srv.loop).result(60)
        request = next(s for s in exporter.get_finished_spans() if s.name == "text_completion m")
        drafted = request.attributes["moeserve.spec_decode.num_draft_tokens"]
        accepted = request.attributes["moeserve.spec_decode.num_accepted_tokens"]
        assert drafted > 0 and 0 <= accepted <= drafted
        assert request.attributes["moeserve.spec_decode.acceptance_rate"] == accepted / drafted
        served = srv.state.observability.metrics.registry
        labels = {"model": srv.state.model_name}
        drafts = served.get_sample_value("moeserve_spec_decode_num_draft_tokens_total", labels)
        assert drafts >= drafted  # the server's own counters saw the same steps
        assert served.get_sample_value("moeserve_spec_decode_num_drafts_total", labels) > 0
