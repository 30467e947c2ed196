"""A server started with --speculative-config: its /metrics count drafts (vLLM's meanings) and
a request's span carries what its drafts achieved; with n-gram drafts, and with method "mtp" on
a DeepSeek-V3 checkpoint whose MTP layer drafts."""

from __future__ import annotations

import asyncio
import json

import pytest

from bench.harness import InProcessServer
from inference import SamplingParams
from inference.checkpoints.mtp_layer import write_with_mtp_layer
from service.generation import Generation
from service.validation import GenerationInput
from tests.inference.parity_checks import prompts
from tests.service.conftest import make_settings
from tests.service.test_service_observability import _observed

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}


@pytest.mark.slow
def test_served_speculation_counts_drafts_and_traces_acceptance(tiny_model_dir):
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    # a prompt repeating itself, whose greedy continuation (this model's) repeats its own
    # tokens: drafts get proposed and some accepted (tests/inference/test_spec_decode.py)
    _check_served(tiny_model_dir, NGRAM, prompts(vocab, [12])[0] * 3)


@pytest.mark.slow
def test_served_mtp_counts_drafts_and_traces_acceptance(model_dirs, tmp_path):
    """An MTP layer drafting the target's own next token: its drafts are accepted."""
    path = write_with_mtp_layer(model_dirs("deepseek_v3"), tmp_path / "m", self_predicting=True)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    accepted = _check_served(
        path, {"method": "mtp", "num_speculative_tokens": 2}, prompts(vocab, [12])[0]
    )
    assert accepted > 0


def _check_served(model_dir, spec: dict, prompt: list[int]) -> int:
    """Serves a 24-token greedy request; checks its span's and the server's draft counts and
    returns how many of its drafts were accepted."""
    with InProcessServer(make_settings(model_dir, speculative_config=json.dumps(spec))) as srv:
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
    return accepted
