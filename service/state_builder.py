"""The ServingState built from the settings: the model's folder and served name, the engine
loaded and started, its observability and the inspector's recorder attached to it."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry

from inference import AsyncLLMEngine
from inference.startup import PhaseMark
from service.api_keys import KeyRing
from service.inspector.recorder import InspectorRecorder
from service.observability import Observability
from service.settings import Settings
from service.state import ServingState
from telemetry import instance
from telemetry.api_requests import ApiRequests
from telemetry.cost import CostCollector
from telemetry.genai_metrics import GenAIServerMetrics, configure_meter_provider, opted_in
from telemetry.logging import capture_request_lines, configure_logging
from telemetry.metrics import ServiceMetrics
from telemetry.tracing import configure_tracing


def model_path_and_name(settings: Settings) -> tuple[Path, str]:
    """`demo`, a ready model name (`smollm2`) or a checkpoint folder -> (folder, served name)."""
    from inference.checkpoints.model_zoo import READY_MODELS, resolve_model

    path = resolve_model(settings.model, demo_preset=settings.demo_preset)
    if settings.model == "demo" or settings.model in READY_MODELS:
        return path, settings.served_model_name or settings.model
    return path, settings.served_model_name or path.resolve().name


def build_inspector(settings: Settings) -> InspectorRecorder | None:
    """The request inspector's recorder (service/inspector/), or None with --no-inspector."""
    if settings.no_inspector:
        return None
    return InspectorRecorder(
        settings.inspector_requests,
        log_prompts=settings.log_prompts,
        trace_url_template=settings.trace_url_template,
    )


def build_observability(engine: AsyncLLMEngine, settings: Settings, model: str) -> Observability:
    """Tracing (the process's provider, from OTEL_* variables; configured on first use) and a
    Prometheus registry shaped like the model: one `layer` per MoE layer (dense layers
    route nothing), one `expert` per routed expert."""
    if not settings.telemetry:
        return Observability.disabled()
    # Current HTTP semantic-convention names on the REST server span (read once, at the first
    # app built), unless the operator chose otherwise.
    os.environ.setdefault("OTEL_SEMCONV_STABILITY_OPT_IN", "http")
    args = engine.args
    metrics = ServiceMetrics(
        CollectorRegistry(),
        model,
        args.num_moe_layers,
        args.num_experts,
        engine.max_waiting,
        info={
            "dtype": engine.dtype,
            "device": engine.device,
            "quantization": engine.quantization,
            "kv_cache_dtype": engine.kv_cache_dtype,
        },
        weight_bytes=engine.weight_bytes,
        kv_cache_bytes=engine.kv_cache_bytes,
        kv_cache_blocks=(engine.block_size, engine.num_blocks),
    )
    tokenizer = engine.tokenizer
    obs = Observability(
        model,
        metrics=metrics,
        tracer_provider=configure_tracing(),
        log_prompts=settings.log_prompts,
        decode=tokenizer.decode,
    )
    obs.api_requests = ApiRequests(metrics.registry, model)
    if opted_in():  # OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental
        obs.genai_metrics = GenAIServerMetrics(configure_meter_provider(), model)
    return obs


async def load_serving_state(
    settings: Settings,
    inspector: InspectorRecorder | None,
    keys: KeyRing,
    on_startup_phase: Callable[[PhaseMark], None] | None = None,
) -> ServingState:
    """Loads and starts the engine (off the event loop) and builds the state around it; the
    inspector and keys come built, so that their settings fail a start before the model
    loads. `on_startup_phase` hears the engine's start-up phases as it reaches them (on the
    loading thread)."""
    s = settings
    path, name = await asyncio.to_thread(model_path_and_name, s)
    # the engine core process logs like this one (same stdout, same format); for the
    # inspector it also ships the lines it logs on requests' behalf with its steps; its
    # lines name this replica as ours do
    logging_init = capture_request_lines if inspector is not None else configure_logging
    engine = await asyncio.to_thread(
        AsyncLLMEngine.from_pretrained,
        path,
        s.device,
        s.dtype,
        functools.partial(logging_init, s.log_format, instance_id=instance.current()),
        on_startup_phase,
        **s.engine_limits(),
    )
    engine.start()
    obs = build_observability(engine, s, name)
    engine.add_stats_listener(obs.on_step)
    if s.cost_per_hour is not None and obs.metrics is not None:
        obs.cost = CostCollector(name, s.cost_per_hour)
        obs.metrics.registry.register(obs.cost)
        engine.add_stats_listener(obs.cost.on_step)
    if inspector is not None:
        inspector.attach(engine)
    return ServingState(engine, s, name, observability=obs, inspector=inspector, keys=keys)
