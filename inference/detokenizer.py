"""Incremental detokenization and stop-string matching for one sequence.

tokenizers' DecodeStream turns one token id at a time into text (holding back incomplete
UTF-8), seeded with the prompt's tail so word boundaries come out right. Text that could
still be the start of a stop string is held back from streaming until it is decided.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

_PROMPT_CONTEXT = 8  # prompt tokens given to the decoder for leading-space handling


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
    ) -> None:
        self._backend = tokenizer.backend_tokenizer  # tokenizers.Tokenizer of a fast tokenizer
        self._stream = DecodeStream(
            ids=prompt_token_ids[-_PROMPT_CONTEXT:], skip_special_tokens=skip_special_tokens
        )
        self.stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""

    def add(self, token_id: int) -> str | None:
        """Appends a token's text; returns the stop string it completed, if any (the text is
        then cut before the stop string)."""
        piece = self._stream.step(self._backend, token_id)
        if not piece:
            return None
        start = max(len(self.text) - self._hold, 0)
        self.text += piece
        hits = [(at, s) for s in self.stop if (at := self.text.find(s, start)) != -1]
        if not hits:
            return None
        at, matched = min(hits)
        self.text = self.text[:at]
        return matched

    def streamable_len(self, finished: bool) -> int:
        """How much of the text may be sent: all of it once finished, otherwise all but a tail
        that might still grow into a stop string."""
        return len(self.text) if finished or not self.stop else max(len(self.text) - self._hold, 0)
