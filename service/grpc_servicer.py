"""moeserve.v1.Inference (SPEC section 7): gRPC messages in, service.generation updates out.

Each method parses its request into the shared validation (service/validation.py) and
renders what the Generation yields; errors, statuses and telemetry are handled around it
(service/grpc_server.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from inference import SamplingParams
from inference.outputs import CompletionOutput, TokenLogprobs
from service import validation
from service.errors import BadRequest
from service.generation import Generation, Update
from service.proto.moeserve.v1 import inference_pb2 as pb
from service.state import ServingState
from service.validation import GenerationInput

_REPEATED = ("stop", "stop_token_ids")
SAMPLING_FIELDS = frozenset(f.name for f in pb.SamplingParams.DESCRIPTOR.fields)


class InferenceServicer:
    def __init__(self, state: ServingState) -> None:
        self.state = state

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, gen: Generation
    ) -> pb.GenerateResponse:
        spec = await self._parse(request, stream=False)
        if spec.params.n > 1:
            raise BadRequest(
                "params.n must be 1 for Generate; use GenerateStream for n > 1", param="params.n"
            )
        final = await gen.final(spec)
        c = final.output.outputs[0]
        response = _response(gen, c, c.text, c.token_ids, c.logprobs or [])
        response.usage.CopyFrom(_usage(final))
        return response

    async def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, gen: Generation
    ) -> None:
        spec = await self._parse(request, stream=True)
        async for update in gen.updates(spec):
            chunks = [
                _response(gen, c, c.delta_text, c.delta_token_ids, c.delta_logprobs)
                for c in update.choices
            ]
            if update.finished:
                if not chunks:
                    chunks.append(pb.GenerateResponse(request_id=gen.request_id))
                chunks[-1].usage.CopyFrom(_usage(update))
            for chunk in chunks:
                await context.write(chunk)

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        validation.one_of(("text", request.text), ("messages", request.messages))
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
            max_model_len=engine.max_model_len,
            vocab_size=args.vocab_size,
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            num_experts=args.num_experts,
            num_experts_per_token=args.top_k,
            dtype=engine.dtype,
            device=engine.device,
        )

    async def _parse(self, request: pb.GenerateRequest, stream: bool) -> GenerationInput:
        validation.one_of(("prompt", request.prompt), ("messages", request.messages))
        params = _sampling_params(request.params)
        ids = await self._prompt_ids(request.prompt, request.messages)
        return GenerationInput(
            ids, params, "chat" if request.messages else "text_completion", stream
        )

    async def _prompt_ids(self, text: str, messages: Sequence[pb.ChatMessage]) -> list[int]:
        tokenizer = self.state.engine.tokenizer
        if not messages:
            return await validation.text_ids(tokenizer, text)
        return await validation.chat_ids(
            tokenizer, [{"role": m.role, "content": m.content} for m in messages]
        )


def _sampling_params(p: pb.SamplingParams) -> SamplingParams:
    """Unset optional scalars and empty lists take the engine's defaults."""
    return validation.sampling_params(
        **{
            name: (list(getattr(p, name)) or None)
            if name in _REPEATED
            else (getattr(p, name) if p.HasField(name) else None)
            for name in SAMPLING_FIELDS
        }
    )


def _response(
    gen: Generation, c: CompletionOutput, text: str, ids: list[int], logprobs: list[TokenLogprobs]
) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        text=text,
        token_ids=ids,
        finish_reason=c.finish_reason or "",
        index=c.index,
        request_id=gen.request_id,
        logprobs=_logprobs(logprobs),
    )


def _usage(update: Update) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=update.usage.prompt_tokens, completion_tokens=update.usage.completion_tokens
    )


def _logprobs(items: list[TokenLogprobs]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[pb.TopLogprob(token_id=t.token_id, logprob=t.logprob) for t in lp.top],
        )
        for lp in items
    ]
