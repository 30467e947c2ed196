"""Prompt lookup (vLLM's ngram method): the longest suffix of the context (prompt and output so
far), from prompt_lookup_max tokens down to prompt_lookup_min, found earlier in the context;
the tokens that followed its first occurrence are the draft."""

from __future__ import annotations

from array import array


def propose_ngram(context: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k draft tokens (fewer where the match sits near the end; none without a match)."""
    if k < 1 or len(context) < min_n + 1:
        return []
    # bytes.find runs the search in C; a hit must start on a token boundary (4 bytes)
    data = array("i", context).tobytes()
    haystack_end = (len(context) - 1) * 4  # a match must be followed by a token
    for n in range(min(max_n, len(context) - 1), min_n - 1, -1):
        pattern = data[-4 * n :]
        at = data.find(pattern, 0, haystack_end)
        while at >= 0 and at % 4:
            at = data.find(pattern, at + 1, haystack_end)
        if at >= 0:
            follow = at // 4 + n
            return context[follow : follow + k]
    return []
