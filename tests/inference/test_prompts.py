"""inference.prompts: a text far over the context is refused by its head alone, without
tokenizing the rest; texts the head cannot prove too long are tokenized whole."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from inference import InvalidParameterError
from inference.prompts import HEAD_CHARS_PER_TOKEN, HEAD_MARGIN, encode_within

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


class Recording:
    """The real tokenizer, recording the length of every text it is asked to encode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.lengths = tokenizer, []

    def encode(self, text: str, **kwargs) -> list[int]:
        self.lengths.append(len(text))
        return self.tokenizer.encode(text, **kwargs)


def test_far_over_is_refused_by_the_head_alone(tokenizer):
    recording = Recording(tokenizer)
    text = "word " * 100_000
    with pytest.raises(InvalidParameterError) as caught:
        encode_within(recording, text, MAX_MODEL_LEN)
    assert caught.value.param == "prompt"
    assert recording.lengths == [MAX_MODEL_LEN * HEAD_CHARS_PER_TOKEN]
    # what it says is true: the whole text has more tokens than it claims
    claimed = int(str(caught.value).split("over ")[1].split()[0])
    assert len(tokenizer.encode(text)) > claimed >= MAX_MODEL_LEN


def test_long_text_of_few_tokens_is_tokenized_whole(tokenizer):
    """A head under the bound proves nothing: the text is tokenized whole, as it is."""
    text = " " * (MAX_MODEL_LEN * HEAD_CHARS_PER_TOKEN * 2)
    ids = encode_within(tokenizer, text, MAX_MODEL_LEN)
    assert ids == tokenizer.encode(text)
    assert len(tokenizer.encode(text[: MAX_MODEL_LEN * HEAD_CHARS_PER_TOKEN])) < (
        MAX_MODEL_LEN + HEAD_MARGIN
    ), "this case needs a text whose head is under the bound"


def test_short_text_and_no_limit_are_plain_encode(tokenizer):
    for text, limit in (("hello world", MAX_MODEL_LEN), ("word " * 10_000, None)):
        recording = Recording(tokenizer)
        assert encode_within(recording, text, limit) == tokenizer.encode(text)
        assert recording.lengths == [len(text)]
