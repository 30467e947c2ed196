"""Completions that score their prompt, as OpenAI's legacy API and vLLM do: `echo` (the prompt
leads each choice's text, and its tokens lead `logprobs`, the first one's logprob null),
`max_tokens: 0` with echo (the prompt scored, nothing generated) and vLLM's `prompt_logprobs`
(each choice's `prompt_logprobs`: per prompt position null or {token id: {logprob, rank,
decoded_token}}).

The engine scores the prompt on its prefill (SamplingParams.prompt_logprobs); here the API's
fields become the engine's, and the scored prompt becomes what each choice starts with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from inference.outputs import TokenLogprobs
from service.errors import BadRequest
from service.responses import PromptLogprob, Usage


@dataclass(frozen=True, slots=True)
class PromptScoring:
    echo: bool
    generate: bool  # False: max_tokens 0 (the one token the engine samples is not returned)
    logprobs: int | None  # the request's `logprobs`: echo returns the prompt's too
    prompt_logprobs: int | None  # vLLM's field as asked

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """The top-k the engine scores each prompt position with (None: it scores none)."""
        asked = [self.prompt_logprobs]
        if self.echo and self.logprobs is not None:
            asked.append(self.logprobs)
        given = [k for k in asked if k is not None]
        return max(given) if given else None

    def usage(self, usage: Usage | None) -> Usage | None:
        """Nothing generated counts no completion token."""
        if usage is None or self.generate:
            return usage
        return Usage(
            prompt_tokens=usage.prompt_tokens, completion_tokens=0, total_tokens=usage.prompt_tokens
        )


def prompt_scoring(
    echo: bool,
    max_tokens: int,
    min_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    stream: bool,
) -> PromptScoring:
    """The request's scoring fields, checked: max_tokens 0 needs echo; vLLM's prompt_logprobs
    are not streamed (vLLM refuses them with stream too)."""
    if max_tokens == 0 and not echo:
        raise BadRequest(
            "max_tokens must be at least 1 (0 only with echo: true, which scores the prompt "
            "without generating)",
            param="max_tokens",
        )
    if max_tokens == 0 and min_tokens:
        raise BadRequest("min_tokens must be at most max_tokens", param="min_tokens")
    if prompt_logprobs is not None and stream:
        raise BadRequest(
            "prompt_logprobs are not available when stream is true", param="prompt_logprobs"
        )
    return PromptScoring(echo, max_tokens > 0, logprobs, prompt_logprobs)


def echo_text(prompt: object, ids: list[int], tokenizer) -> str:
    """The prompt as the caller sent it, or its token ids' text."""
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else tokenizer.decode(ids)


def vllm_prompt_logprobs(
    entries: list[TokenLogprobs | None], decode: Callable[[int], str]
) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's `prompt_logprobs`: each position's token first, then the top ones by rank."""
    out: list[dict[str, PromptLogprob] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        position = {str(e.token_id): _entry(e.logprob, e.rank, decode(e.token_id))}
        for rank, t in enumerate(e.top, start=1):
            position.setdefault(str(t.token_id), _entry(t.logprob, rank, decode(t.token_id)))
        out.append(position)
    return out


def _entry(logprob: float, rank: int | None, text: str) -> PromptLogprob:
    return PromptLogprob(logprob=logprob, rank=rank, decoded_token=text)
