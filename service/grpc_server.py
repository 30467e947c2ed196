"""gRPC API (SPEC section 7): moeserve.v1.Inference on grpc.aio, plus health and reflection.

Generation goes through `ServingState.generate` (api="grpc"), the same path as REST. Errors map
once: ServiceError subclasses carry their gRPC code, bad sampling fields become INVALID_ARGUMENT
naming the field (`params.<name>`), anything unexpected is logged and answered INTERNAL with a
generic message. Requests are parsed inside the handlers (the methods are registered with raw
bytes), so an undecodable message is INVALID_ARGUMENT too, never INTERNAL.

A deadline or a client cancel cancels the handler task; the generator from state.generate is
closed in `finally` (contextlib.aclosing), which aborts the request in the engine and frees its
KV blocks before the next engine step.

Health (grpc.health.v1.Health, services "" and "moeserve.v1.Inference") follows `state.ready`:
NOT_SERVING while the engine is not running or the server drains. Check reads the state live;
Watch streams follow a 0.2 s poll. `mark_not_serving(server)` flips it at once and for good
(call it when draining starts); `stop_grpc_server` does so before stopping.
"""

from __future__ import annotations

import asyncio
import uuid
import weakref
from collections.abc import Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass

import grpc
import structlog
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from inference import InvalidParameterError, RequestOutput, SamplingParams
from service.auth import check_bearer
from service.errors import BadRequest, Overloaded, ServiceError
from service.observability import record_error
from service.prompts import chat_prompt_ids, text_prompt_ids
from service.proto.moeserve.v1 import inference_pb2 as pb
from service.sampling import build_sampling_params
from service.state import ServingState
from telemetry.metrics import status_from_grpc

log = structlog.get_logger("service.grpc")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name  # "moeserve.v1.Inference"
MAX_SEND_BYTES = 16 << 20
HEALTH_POLL_S = 0.2
_REPEATED = ("stop", "stop_token_ids")
_SAMPLING_FIELDS = frozenset(f.name for f in pb.SamplingParams.DESCRIPTOR.fields)
_REQUEST_ID_MAX = 128


# ---- the servicer ---------------------------------------------------------------------------
class InferenceServicer:
    def __init__(self, state: ServingState) -> None:
        self.state = state

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> pb.GenerateResponse:
        prompt_ids, params, rid = await self._parse_generate(request)
        if params.n > 1:
            raise BadRequest(
                "params.n must be 1 for Generate; use GenerateStream for n > 1", param="params.n"
            )
        final: RequestOutput | None = None
        outputs = self._generate(prompt_ids, params, rid, request, stream=False)
        async with aclosing(outputs):
            async for final in outputs:
                pass
        sample = final.outputs[0]
        return pb.GenerateResponse(
            text=sample.text,
            token_ids=sample.token_ids,
            finish_reason=sample.finish_reason or "",
            usage=_usage(final),
            request_id=rid,
            logprobs=_logprobs(sample.logprobs or []),
        )

    async def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        prompt_ids, params, rid = await self._parse_generate(request)
        finished: set[int] = set()
        outputs = self._generate(prompt_ids, params, rid, request, stream=True)
        async with aclosing(outputs):
            async for out in outputs:
                chunks = []
                for sample in out.outputs:
                    if sample.index in finished:
                        continue
                    if sample.finish_reason:
                        finished.add(sample.index)
                    elif not sample.delta_token_ids and not sample.delta_text:
                        continue
                    chunks.append(
                        pb.GenerateResponse(
                            text=sample.delta_text,
                            token_ids=sample.delta_token_ids,
                            finish_reason=sample.finish_reason or "",
                            index=sample.index,
                            request_id=rid,
                            logprobs=_logprobs(sample.delta_logprobs),
                        )
                    )
                if out.finished:
                    if not chunks:
                        chunks.append(pb.GenerateResponse(request_id=rid))
                    chunks[-1].usage.CopyFrom(_usage(out))
                for chunk in chunks:
                    await context.write(chunk)

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        if request.text and request.messages:
            raise BadRequest("set exactly one of text and messages", param="text")
        ids = await self._prompt_ids(request.text, request.messages)  # as Generate tokenizes
        tokenizer = self.state.engine.tokenizer
        return pb.TokenizeResponse(
            token_ids=ids,
            tokens=tokenizer.convert_ids_to_tokens(ids),
            count=len(ids),
            max_model_len=self.state.engine.max_model_len,
        )

    async def ModelInfo(
        self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfoResponse:
        engine = self.state.engine
        args = engine.args
        return pb.ModelInfoResponse(
            model_name=self.state.model_name,
            architecture=args.architecture,
            max_model_len=self.state.engine.max_model_len,
            vocab_size=args.vocab_size,
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            num_experts=args.num_experts,
            num_experts_per_token=args.top_k,
            dtype=engine.dtype,
            device=engine.device,
        )

    # ---- helpers ----------------------------------------------------------------------------
    def _generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        rid: str,
        request: pb.GenerateRequest,
        stream: bool,
    ):
        operation = "chat" if request.messages else "text_completion"
        return self.state.generate(
            "grpc", prompt_ids, params, rid, operation=operation, stream=stream
        )

    async def _parse_generate(
        self, request: pb.GenerateRequest
    ) -> tuple[list[int], SamplingParams, str]:
        if request.prompt and request.messages:
            raise BadRequest("set exactly one of prompt and messages", param="prompt")
        if not request.prompt and not request.messages:
            raise BadRequest("prompt or messages is required (both are empty)", param="prompt")
        rid = request.request_id or f"grpc-{uuid.uuid4().hex}"
        if len(rid) > _REQUEST_ID_MAX or not (rid.isascii() and rid.isprintable()):
            raise BadRequest(
                f"request_id must be at most {_REQUEST_ID_MAX} printable ASCII characters",
                param="request_id",
            )
        params = _sampling_params(request.params)
        return await self._prompt_ids(request.prompt, request.messages), params, rid

    async def _prompt_ids(self, text: str, messages: Sequence[pb.ChatMessage]) -> list[int]:
        """Tokenizes as the REST API does (service/prompts.py)."""
        tokenizer = self.state.engine.tokenizer
        if not messages:
            return await text_prompt_ids(tokenizer, text)
        for i, m in enumerate(messages):
            if not m.role:
                raise BadRequest(
                    f"messages[{i}].role must not be empty", param=f"messages[{i}].role"
                )
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        return await chat_prompt_ids(tokenizer, conversation)


def _sampling_params(p: pb.SamplingParams) -> SamplingParams:
    """Unset optional scalars and empty lists become None (the engine's defaults); range errors
    raise InvalidParameterError, reported as INVALID_ARGUMENT naming params.<field>."""
    fields = {
        name: (list(getattr(p, name)) or None)
        if name in _REPEATED
        else (getattr(p, name) if p.HasField(name) else None)
        for name in _SAMPLING_FIELDS
    }
    return build_sampling_params(**fields)


def _usage(out: RequestOutput) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=len(out.prompt_token_ids),
        completion_tokens=sum(len(o.token_ids) for o in out.outputs),
    )


def _logprobs(items) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[pb.TopLogprob(token_id=t.token_id, logprob=t.logprob) for t in lp.top],
        )
        for lp in items
    ]


# ---- error mapping and method registration --------------------------------------------------
def _status(exc: Exception, method: str) -> tuple[grpc.StatusCode, str, tuple]:
    """The one mapping from an exception to (code, details, trailing metadata)."""
    if isinstance(exc, InvalidParameterError):
        exc = BadRequest(str(exc), param=exc.param)
    if isinstance(exc, ServiceError):
        message = exc.message
        if isinstance(exc, BadRequest) and exc.param in _SAMPLING_FIELDS:
            message = f"params.{message}"  # name the field as the proto spells its path
        trailing = (("retry-after", str(exc.retry_after_s)),) if isinstance(exc, Overloaded) else ()
        return exc.grpc_code, message, trailing
    log.exception("unexpected error in gRPC handler", method=method)
    return grpc.StatusCode.INTERNAL, "internal server error", ()


def _wrap(method: str, fn: Callable, request_type) -> Callable:
    """Parses the raw request and turns exceptions into statuses; cancellation propagates."""

    async def handler(raw: bytes, context: grpc.aio.ServicerContext):
        try:
            request = request_type.FromString(raw)
        except DecodeError as exc:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"cannot decode {request_type.DESCRIPTOR.full_name}: {exc}",
            )
        try:
            return await fn(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 -- mapped to a status right below
            code, details, trailing = _status(exc, method)
            record_error(exc, status_from_grpc(code))
            if trailing:  # abort() replaces the trailing metadata set so far (traceparent)
                trailing = (*(context.trailing_metadata() or ()), *trailing)
        if not context.done():
            await context.abort(code, details, trailing)

    return handler


def _inference_handler(servicer: InferenceServicer) -> grpc.GenericRpcHandler:
    """Registers moeserve.v1.Inference with raw-bytes requests (parsed inside `_wrap`)."""
    methods = pb.DESCRIPTOR.services_by_name["Inference"].methods
    handlers = {}
    for m in methods:
        request_type = pb.DESCRIPTOR.message_types_by_name[m.input_type.name]
        response_type = pb.DESCRIPTOR.message_types_by_name[m.output_type.name]
        fn = _wrap(m.name, getattr(servicer, m.name), getattr(pb, request_type.name))
        make = (
            grpc.unary_stream_rpc_method_handler
            if m.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[m.name] = make(
            fn,
            request_deserializer=None,
            response_serializer=getattr(pb, response_type.name).SerializeToString,
        )
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


# ---- auth -----------------------------------------------------------------------------------
class _ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """`authorization: Bearer KEY` on moeserve.v1.Inference; health and reflection stay open."""

    def __init__(self, api_key: str) -> None:
        self._api_key = api_key
        self._prefix = f"/{SERVICE_NAME}/"

    async def intercept_service(
        self, continuation: Callable[..., Awaitable], details: grpc.HandlerCallDetails
    ):
        handler = await continuation(details)
        if (
            handler is None
            or not details.method.startswith(self._prefix)
            or self._authorized(details)
        ):
            return handler

        async def deny(request: bytes, context: grpc.aio.ServicerContext) -> None:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or invalid API key (metadata 'authorization: Bearer KEY')",
            )

        make = (
            grpc.unary_stream_rpc_method_handler
            if handler.response_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        return make(
            deny, request_deserializer=None, response_serializer=handler.response_serializer
        )

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        for key, value in details.invocation_metadata or ():
            if key == "authorization" and isinstance(value, str):
                return check_bearer(value, self._api_key)  # as REST checks it: constant time
        return False


# ---- health ---------------------------------------------------------------------------------
class _Health(HealthServicer):
    """grpc.health.v1.Health following `state.ready` (services "" and moeserve.v1.Inference)."""

    SERVICES = ("", SERVICE_NAME)

    def __init__(self, state: ServingState) -> None:
        super().__init__()
        self._state = state

    async def sync(self) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        status = serving if self._state.ready else health_pb2.HealthCheckResponse.NOT_SERVING
        if status != serving and not self._gracefully_shutting_down and self._state.draining:
            await self.enter_graceful_shutdown()  # draining is for good
        for service in self.SERVICES:
            if self._server_status.get(service) != status:
                await self.set(service, status)

    async def Check(self, request, context):
        await self.sync()
        return await super().Check(request, context)

    async def poll(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_POLL_S)
            try:
                await self.sync()
            except Exception:  # health reporting must outlive a bad sync
                log.exception("gRPC health sync failed")


@dataclass
class _Extras:
    health: _Health
    poller: asyncio.Task


_EXTRAS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# ---- lifecycle ------------------------------------------------------------------------------
async def start_grpc_server(
    state: ServingState,
    host: str,
    port: int,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> tuple[grpc.aio.Server, int]:
    """Starts the gRPC server; returns it and the bound port (port 0: a free port).
    `interceptors` run before the API-key check (server.py passes the telemetry interceptor,
    service.observability.GrpcTelemetryInterceptor)."""
    settings = state.settings
    chain = list(interceptors)
    if settings.api_key:
        chain.append(_ApiKeyInterceptor(settings.api_key))
    server = grpc.aio.server(
        interceptors=chain,
        options=[
            ("grpc.max_receive_message_length", settings.max_body_bytes),
            ("grpc.max_send_message_length", MAX_SEND_BYTES),
            ("grpc.so_reuseport", 0),  # a taken port is an error, not a silently shared one
        ],
    )
    server.add_generic_rpc_handlers((_inference_handler(InferenceServicer(state)),))
    health = _Health(state)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise RuntimeError(f"cannot bind the gRPC server to {address}: {exc}") from None
    if not bound:
        raise RuntimeError(f"cannot bind the gRPC server to {address}")
    await health.sync()
    await server.start()
    _EXTRAS[server] = _Extras(health, asyncio.get_running_loop().create_task(health.poll()))
    log.info("grpc server started", grpc_host=host, grpc_port=bound)
    return server, bound


async def mark_not_serving(server: grpc.aio.Server) -> None:
    """Health turns NOT_SERVING now and stays so (graceful shutdown has begun)."""
    extras = _EXTRAS.get(server)
    if extras is not None:
        await extras.health.enter_graceful_shutdown()


async def stop_grpc_server(server: grpc.aio.Server, grace: float) -> None:
    """Reports NOT_SERVING, then stops: in-flight RPCs get `grace` seconds, new ones are refused."""
    await mark_not_serving(server)
    extras = _EXTRAS.pop(server, None)
    if extras is not None:
        extras.poller.cancel()
    await server.stop(grace)
    log.info("grpc server stopped")
