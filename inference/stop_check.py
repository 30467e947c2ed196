"""Why a sequence stops after its newest token, if it does (vLLM's check_stop): a stop string,
a stop token, EOS, its grammar, or its length."""

from __future__ import annotations

from inference.sequence import Sequence


def stop_reason(
    seq: Sequence, token: int, ends: bool, matched: str | None, grammar: str | None, max_len: int
) -> str | None:
    """The finish reason ("stop", "length", or the grammar's), setting seq.stop_reason where
    a stop string or token matched. ends: the token is an EOS that ends the sequence;
    matched: the stop string the text now ends with; grammar: the matcher's verdict ("stop"
    once complete, "error" if it refused the token)."""
    p = seq.params
    if matched is not None:
        seq.stop_reason = matched
        return "stop"
    if token in p.stop_token_ids:
        seq.stop_reason = token
        return "stop"
    if ends:
        return "stop"
    if grammar is not None:
        return grammar
    if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= max_len:
        return "length"
    return None
