"""Generation updates (service/generation.py) as OpenAI's response bodies: the whole response,
or the per-choice chunks of a stream with their usage, and the logprobs of each."""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
from litestar import Request

from inference.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from service.controllers.common import serving_state
from service.generation import Update
from service.prompt_scoring import PromptScoring, vllm_prompt_logprobs
from service.reasoning import ChoiceParse, ReasoningPlan
from service.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    FunctionCallBody,
    FunctionDelta,
    ToolCallBody,
    ToolCallDeltaBody,
    TopLogprob,
    Usage,
)
from service.tools import ToolPlan


class Render:
    """What both renderers share: the response's id, time and model. Each renders `whole`
    (the final update as the response), `chunks` (an update as the stream's chunk choices,
    each with the usage it reports) and `chunk` (choices and usage as one SSE chunk)."""

    chunk_type: type[msgspec.Struct]  # the body of a stream's chunk

    def __init__(self, request: Request, response_id: str) -> None:
        self.response_id, self.created = response_id, int(time.time())
        self.model = serving_state(request).model_name
        self.decode: Callable[[int], str] = request.app.state.token_text

    def body(self, body: type[msgspec.Struct], choices: list, usage: Usage | None):
        return body(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
        )

    def chunk(self, choices: list, usage: Usage | None):
        return self.body(self.chunk_type, choices, usage)


class CompletionRender(Render):
    chunk_type = CompletionResponse

    def __init__(
        self,
        request: Request,
        response_id: str,
        n: int,
        logprobs: bool,
        scoring: PromptScoring | None = None,
        prompt_text: str = "",
    ) -> None:
        """`scoring`: echo, max_tokens 0 and prompt_logprobs (service/prompt_scoring.py), with
        `prompt_text` the echoed prompt."""
        super().__init__(request, response_id)
        self.logprobs = logprobs
        self.offsets = [0] * n  # text_offset of each choice's next token
        self.scoring, self.prompt_text = scoring, prompt_text
        self.echoed: set[int] = set()  # streamed choices whose prompt has gone out

    def _logprobs(
        self, index: int, entries: list[TokenLogprobs | None], ids: list[int] | None = None
    ) -> CompletionLogprobs | None:
        """`ids`: the tokens of `entries` (needed where an entry is None: an echoed prompt's
        first token, which has no logprob)."""
        if not self.logprobs:
            return None
        tokens = [self.decode(t) for t in (ids or [e.token_id for e in entries])]
        text_offset = []
        for t in tokens:
            text_offset.append(self.offsets[index])
            self.offsets[index] += len(t)
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[None if e is None else e.logprob for e in entries],
            top_logprobs=[
                None if e is None else {self.decode(t.token_id): t.logprob for t in e.top}
                for e in entries
            ],
            text_offset=text_offset,
        )

    def _choice(
        self,
        c: CompletionOutput,
        text: str,
        logprobs: list[TokenLogprobs],
        out: RequestOutput,
        first: bool,
    ):
        """`first`: the choice's first text (an echo leads it)."""
        scoring, finish, stop = self.scoring, c.finish_reason, c.stop_reason
        if scoring is not None and not scoring.generate:  # the sampled token is not returned
            text, logprobs, finish, stop = "", [], finish and "length", None
        ids, prompt_lp = None, msgspec.UNSET
        if scoring is not None and first and scoring.echo:
            text = self.prompt_text + text
            if self.logprobs:
                ids = out.prompt_token_ids + [e.token_id for e in logprobs]
                logprobs = (out.prompt_logprobs or []) + logprobs
        if scoring is not None and first and scoring.prompt_logprobs is not None:
            prompt_lp = vllm_prompt_logprobs(out.prompt_logprobs or [], self.decode)
        return CompletionChoice(
            index=c.index,
            text=text,
            logprobs=self._logprobs(c.index, logprobs, ids),
            finish_reason=finish,
            stop_reason=stop,
            prompt_logprobs=prompt_lp,
        )

    def chunk(self, choices: list, usage: Usage | None):
        return super().chunk(choices, self.scoring.usage(usage) if self.scoring else usage)

    def whole(self, final: Update) -> CompletionResponse:
        out = final.output
        choices = [self._choice(c, c.text, c.logprobs or [], out, True) for c in out.outputs]
        return self.chunk(choices, final.usage)

    def chunks(self, update: Update) -> list[tuple[CompletionChoice, Usage]]:
        result = []
        for c in update.choices:
            first = c.index not in self.echoed
            self.echoed.add(c.index)
            choice = self._choice(c, c.delta_text, c.delta_logprobs, update.output, first)
            result.append((choice, update.usage))
        return result


class ChatRender(Render):
    chunk_type = ChatCompletionChunk

    def __init__(
        self,
        request: Request,
        response_id: str,
        logprobs: bool,
        tools: ToolPlan | None,
        reasoning: ReasoningPlan | None = None,
        specials: tuple[str, ...] = (),  # service.reasoning.special_texts
    ) -> None:
        super().__init__(request, response_id)
        self.logprobs, self.tools, self.reasoning = logprobs, tools, reasoning
        self.specials = specials
        self.parsed = tools is not None or reasoning is not None  # else the text is the content
        self.opened: set[int] = set()  # choices whose role chunk has gone out
        self.streams: dict[int, ChoiceParse] = {}  # each streamed choice's parse

    def _token(self, kind: type[TopLogprob], token_id: int, logprob: float, **more):
        text = self.decode(token_id)
        return kind(token=text, logprob=logprob, bytes=list(text.encode()), **more)

    def _logprobs(self, entries: list[TokenLogprobs]) -> ChatLogprobs | None:
        if not self.logprobs:
            return None
        return ChatLogprobs(
            content=[
                self._token(
                    ChatTokenLogprob,
                    e.token_id,
                    e.logprob,
                    top_logprobs=[self._token(TopLogprob, t.token_id, t.logprob) for t in e.top],
                )
                for e in entries
            ]
        )

    def whole(self, final: Update) -> ChatCompletionResponse:
        choices = []
        for c in final.output.outputs:
            reasoning, content, calls, finish = None, c.text, [], c.finish_reason
            if self.parsed:
                parse = ChoiceParse(self.reasoning, self.tools, self.specials)
                reasoning, content, calls = parse.whole(c.text)
                finish = parse.finish_reason(c.finish_reason)
            bodies = [
                ToolCallBody(id=t.id, function=FunctionCallBody(name=t.name, arguments=t.arguments))
                for t in calls
            ]
            message = AssistantMessage(
                role="assistant",
                content=content,
                reasoning_content=reasoning,
                tool_calls=bodies or None,
            )
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=message,
                    logprobs=self._logprobs(c.logprobs or []),
                    finish_reason=finish,
                    stop_reason=c.stop_reason,
                )
            )
        return self.body(ChatCompletionResponse, choices, final.usage)

    def _delta(self, c: CompletionOutput) -> tuple[DeltaMessage, str | None]:
        """A choice's new text as reasoning, content and tool-call deltas (a call goes out
        whole), and its finish reason."""
        if not self.parsed:
            return DeltaMessage(content=c.delta_text or None), c.finish_reason
        parse = self.streams.setdefault(
            c.index, ChoiceParse(self.reasoning, self.tools, self.specials)
        )
        reasoning, content, deltas = parse.feed(c.delta_text)
        if c.finish_reason:
            rest = parse.finish()
            reasoning, content = reasoning + rest.reasoning, content + rest.content
            deltas = deltas + rest.tool_calls
        calls = [
            ToolCallDeltaBody(
                index=d.index,
                id=d.id,
                type="function" if d.id else None,
                function=FunctionDelta(name=d.name, arguments=d.arguments),
            )
            for d in deltas
        ]
        finish = parse.finish_reason(c.finish_reason) if c.finish_reason else None
        delta = DeltaMessage(
            content=content or None, reasoning_content=reasoning or None, tool_calls=calls or None
        )
        return delta, finish

    def chunks(self, update: Update) -> list[tuple[ChatChunkChoice, Usage]]:
        """OpenAI opens each choice with a chunk of the role, which reports no completion
        token yet (as vLLM does)."""
        usage, prompt = update.usage, update.usage.prompt_tokens
        opening = Usage(prompt_tokens=prompt, completion_tokens=0, total_tokens=prompt)
        new = {c.index: c for c in update.choices}
        result = []
        for index in (c.index for c in update.output.outputs):
            if index not in self.opened:
                self.opened.add(index)
                role = DeltaMessage(role="assistant", content="")
                result.append((ChatChunkChoice(index=index, delta=role), opening))
            c = new.get(index)
            if c is not None:
                delta, finish = self._delta(c)
                choice = ChatChunkChoice(
                    index=index,
                    delta=delta,
                    logprobs=self._logprobs(c.delta_logprobs),
                    finish_reason=finish,
                )
                if self.parsed and choice == ChatChunkChoice(index=index, delta=DeltaMessage()):
                    continue  # text held back while it may be a marker: nothing to send yet
                result.append((choice, usage))
        return result
