"""One step's speculative-decoding counts, with vLLM's meanings (vllm/v1/spec_decode/metrics.py):
drafts (sequences whose draft tokens were verified), draft tokens, accepted draft tokens (the
bonus or replacement token is not one), and accepted tokens by draft position."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecStepCounts:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    positions: int = 0  # rows verified: each sequence's last token and its drafts
    generated: int = 0  # tokens the verified sequences gained (LLMEngine._update adds them)

    @classmethod
    def of(cls, verified, speculator) -> SpecStepCounts:
        """`verified`: RunnerOutput.verified, (sequence, drafts, new tokens) each."""
        counts = cls()
        if not verified:
            return counts
        counts.accepted_per_pos = [0] * speculator.config.num_speculative_tokens
        for _, drafts, tokens in verified:
            accepted = len(tokens) - 1
            counts.num_drafts += 1
            counts.num_draft_tokens += len(drafts)
            counts.num_accepted_tokens += accepted
            for pos in range(accepted):
                counts.accepted_per_pos[pos] += 1
            counts.positions += len(drafts) + 1
        return counts
