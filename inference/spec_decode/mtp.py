"""Drafting with the checkpoint's multi-token-prediction layer (speculative method "mtp"), as
vLLM's EagleProposer drafts for method "mtp": greedy drafts, the one MTP layer reused for
every draft position (models/mtp.py has the layer).

The model runner calls it twice a step:
- `first_pass`, after the target's forward pass and sampling: the MTP layer runs over every
  row the step computed (prompt chunks, decode rows, verified rows), each with the token
  after its position, and so fills its own KV cache there (the same blocks as the target's:
  its cache tensor is a layer slot of its own). A verified sequence's rows past what it
  accepted run too (vLLM's padded drafter batch); their KV is overwritten before any row
  reads it, as every position is rewritten when the target computes it again. The row of
  each sequence's new last token gives its first draft and the hidden state it came from
  (MtpState on the sequence).
- `complete`, before the next forward pass: a sequence proposed k > 1 drafts (MtpSpeculator:
  the first, then placeholders) gets drafts 2..k from k - 1 more passes of one row each,
  the previous draft's token and the MTP layer's own output standing in for the target's
  hidden state. It runs after scheduling because those rows write the MTP cache at the
  positions of the drafts, whose blocks the scheduler allots.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from inference.models.attention import AttentionMetadata
from inference.sequence import Sequence
from inference.spec_decode.speculator import Speculator, can_speculate

PLACEHOLDER = -1  # a draft the MTP layer fills in once the step is scheduled (complete)


@dataclass(slots=True)
class MtpState:
    """What the MTP layer left for a sequence's next draft: computed at the row of `position`
    (the sequence's last computed position) with the token after it."""

    position: int
    hidden: torch.Tensor  # [D] the MTP layer's output there
    token: int  # its prediction: the first draft, the token after the sequence's last

    def is_current(self, seq: Sequence) -> bool:
        """Still the sequence's state: nothing computed or appended since (no preemption)."""
        return seq.num_computed_tokens == self.position + 1 == seq.num_tokens - 1


def next_tokens(rows: list[tuple[Sequence, int]], gained: dict[int, list[int]]) -> list[int]:
    """The token after each (sequence, position) row, the MTP layer's input there: the
    sequence's own, else what the step gave it (id(seq) -> its sampled token, or its
    accepted drafts and one more). Rows of rejected drafts get 0 (never read)."""
    out = []
    for seq, p in rows:
        j = p + 1 - seq.num_tokens
        new = gained.get(id(seq), ())
        out.append(seq.token_ids[p + 1] if j < 0 else new[j] if j < len(new) else 0)
    return out


class MtpDrafter:
    def __init__(
        self,
        model,
        cache: tuple[torch.Tensor, ...],
        decode_metadata: Callable[[list[tuple[Sequence, int]]], AttentionMetadata],
        disable_by_batch_size: int,
    ) -> None:
        """`model`: the decoder, whose `mtp` layer, embedding and rope tables it uses;
        `decode_metadata`: the model runner's, for rows of one token each."""
        self.model, self.mtp, self.cache = model, model.mtp, cache
        self.decode_metadata = decode_metadata
        self.disable_by_batch_size = disable_by_batch_size

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, hidden, meta) -> torch.Tensor:
        embeds = self.model.embed(ids)
        cos, sin = self.model.rope.tables(positions, embeds.dtype)
        return self.mtp(embeds, positions, hidden, cos, sin, meta, self.cache)

    def _drafts(self, hidden: torch.Tensor) -> list[int]:
        return self.mtp.logits(hidden, self.model.lm_head).argmax(dim=-1).tolist()

    def first_pass(
        self,
        rows: list[tuple[Sequence, int]],
        positions: torch.Tensor,
        meta: AttentionMetadata,
        target_hidden: torch.Tensor,
        gained: dict[int, list[int]],
        last_rows: list[tuple[Sequence, int]],
    ) -> None:
        """`rows`: every row of the step's forward pass, in its order (positions, meta and
        target_hidden of that pass); `last_rows`: (sequence, row) of each sequence's new last
        token's predecessor, whose output drafts for it."""
        ids = torch.tensor(next_tokens(rows, gained), device=positions.device)
        hidden = self._run(ids, positions, target_hidden, meta)
        wanted = [(s, r) for s, r in last_rows if can_speculate(s)]
        if not wanted or len({id(s) for s, _ in rows}) > self.disable_by_batch_size:
            return  # nobody drafts this step: the cache is filled all the same
        index = torch.tensor([r for _, r in wanted], device=hidden.device)
        picked = hidden[index]
        for (seq, row), h, token in zip(wanted, picked, self._drafts(picked)):
            seq.mtp_state = MtpState(rows[row][1], h, token)

    def complete(self, seqs: list[Sequence]) -> None:
        """Fills the placeholder drafts of the scheduled sequences (see the module's doc)."""
        todo = [s for s in seqs if PLACEHOLDER in s.spec_token_ids]
        if not todo:
            return
        hidden = torch.stack([s.mtp_state.hidden for s in todo])
        dev = hidden.device
        for j in range(1, max(len(s.spec_token_ids) for s in todo)):
            active = [i for i, s in enumerate(todo) if len(s.spec_token_ids) > j]
            seqs_j = [todo[i] for i in active]
            # pass j drafts token j + 1 at position q + j (q: the state's; q + 1 is the last
            # token's, whose target row this step computes)
            rows = [(s, s.num_computed_tokens + j - 1) for s in seqs_j]
            ids = torch.tensor([s.spec_token_ids[j - 1] for s in seqs_j], device=dev)
            positions = torch.tensor([p for _, p in rows], device=dev)
            index = torch.tensor(active, device=dev)
            out = self._run(ids, positions, hidden[index], self.decode_metadata(rows))
            for s, token in zip(seqs_j, self._drafts(out)):
                s.spec_token_ids[j] = token
            hidden[index] = out


class MtpSpeculator(Speculator):
    """Proposes the first draft the MTP layer left on the sequence (first_pass), and
    placeholders for the rest, which `complete` fills after scheduling."""

    def _propose(self, seq: Sequence, k: int) -> list[int]:
        state = seq.mtp_state
        if state is None or not state.is_current(seq):
            return []
        return [state.token] + [PLACEHOLDER] * (k - 1)
