"""The model runner: a step's scheduled sequences -> device tensors -> forward -> sample."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch
from torch import nn

from inference.executor.prompt_scores import score_rows
from inference.executor.sampler import Sampler, SamplerOutput
from inference.models.attention import AttentionMetadata, PrefillChunk
from inference.outputs import TokenLogprobs
from inference.scheduler import SchedulerOutput
from inference.sequence import Sequence
from inference.spec_decode.mtp import MtpDrafter
from inference.spec_decode.rejection_sampler import verify
from inference.structured import StructuredOutputManager


def block_table_rows(rows: list[tuple[Sequence, int]]) -> torch.Tensor:
    """[rows, width] int32 block tables of decode rows (padded with block 0). A sequence's
    table (an int32 array: copied as memory) is copied once, then repeated for its further
    rows (a verified sequence's k + 1): torch.tensor over lists took 0.11 ms of CPU a step at
    32K tokens (2,048 blocks), 0.57 ms with four drafts, and grows with the context."""
    seqs, counts = [], []
    for s, _ in rows:
        if seqs and seqs[-1] is s:
            counts[-1] += 1
        else:
            seqs.append(s)
            counts.append(1)
    width = max(len(s.block_table) for s in seqs)
    flat = array("i")
    for s in seqs:
        flat.extend(s.block_table)
        flat.extend(array("i", bytes(4 * (width - len(s.block_table)))))
    table = torch.frombuffer(flat, dtype=torch.int32).view(len(seqs), width)
    if len(seqs) == len(rows):
        return table.clone()  # its own memory, not the array's
    return table.repeat_interleave(torch.tensor(counts), dim=0)


@dataclass(slots=True)
class RunnerOutput:
    sampled: list[Sequence]  # sequences that produced a token this step, in sampler order
    sample: SamplerOutput | None
    expert_counts: torch.Tensor  # [moe layers, E]
    # SamplingParams.prompt_logprobs: (sequence, prompt position of the first, logprobs)
    prompt_logprobs: list[tuple[Sequence, int, list[TokenLogprobs]]] = field(default_factory=list)
    # speculative decoding: (sequence, its drafts, the tokens it gains: accepted drafts and one)
    verified: list[tuple[Sequence, list[int], list[int]]] = field(default_factory=list)


class ModelRunner:
    """Scheduled sequences -> tensors -> forward -> sample: the only code that builds a step's
    device tensors. `forward`: the model, or for decode-only steps `decode_forward` (a
    backend's fused step or the compiled model). `paged_kernel`: decode rows attend through
    a backend that reads the paged cache in place (kernels/modules.py), so the step carries
    block tables instead of gathered slots. `mtp_cache`: speculative method "mtp", the MTP
    layer's KV cache (spec_decode/mtp.py drafts with it around each forward pass)."""

    def __init__(
        self,
        model: nn.Module,
        kv_caches,
        block_size: int,
        sampler: Sampler,
        device: torch.device,
        decode_forward=None,
        paged_kernel: bool = False,
        structured: StructuredOutputManager | None = None,
        mtp_cache: tuple[torch.Tensor, ...] | None = None,
        disable_by_batch_size: int = 0,
    ) -> None:
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.sampler, self.device = sampler, device
        self.structured = structured
        self.paged_kernel = paged_kernel
        self.decode_model = model if decode_forward is None else decode_forward
        self.drafter = (
            None
            if mtp_cache is None
            else MtpDrafter(model, mtp_cache, self.decode_metadata, disable_by_batch_size)
        )

    def _slots(self, block_tables: list[array], length: int) -> torch.Tensor:
        """[rows, length] cache slots of each row's first `length` positions (rows padded with
        block 0). A fresh tensor, never a slice: the compiled decode graph would otherwise
        specialise on the stride of a wider table."""
        width = max(len(b) for b in block_tables)
        table = torch.tensor([list(b) + [0] * (width - len(b)) for b in block_tables])
        pos = torch.arange(length)
        return table[:, pos // self.block_size] * self.block_size + pos % self.block_size

    def _decode_fields(self, rows: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, dict]:
        """Decode rows (sequence, position), one token each: the cache slots they write and
        the decode fields of AttentionMetadata (block tables for a paged kernel, else
        gathered slots and a mask)."""
        bs = self.block_size
        slots = torch.tensor(
            [s.block_table[p // bs] * bs + p % bs for s, p in rows], dtype=torch.long
        )
        positions = [p for _, p in rows]
        decode_slots = decode_mask = block_tables = context_lens = None
        if rows and self.paged_kernel:
            block_tables = block_table_rows(rows)
            context_lens = torch.tensor(positions, dtype=torch.int32) + 1
        elif rows:
            context = max(positions) + 1
            decode_slots = self._slots([s.block_table for s, _ in rows], context)
            if len(rows) > 1:  # one row has no padding to mask
                lens = torch.tensor(positions) + 1
                decode_mask = (torch.arange(context).unsqueeze(0) < lens.unsqueeze(1)).view(
                    len(rows), 1, 1, context
                )
        dev = self.device
        return slots, {
            "num_decode": len(rows),
            "decode_slots": None if decode_slots is None else decode_slots.to(dev),
            "decode_mask": None if decode_mask is None else decode_mask.to(dev),
            "block_tables": block_tables,
            "context_lens": context_lens,
        }

    def decode_metadata(self, rows: list[tuple[Sequence, int]]) -> AttentionMetadata:
        """The metadata of a step of decode rows only (the MTP drafter's further passes)."""
        slots, fields = self._decode_fields(rows)
        return AttentionMetadata(
            slot_mapping=slots.to(self.device), prefills=[], block_size=self.block_size, **fields
        )

    @torch.inference_mode()
    def run(self, sched: SchedulerOutput) -> RunnerOutput:
        bs = self.block_size
        # A speculating sequence's last token and its k drafts run as k + 1 decode rows (its
        # block table each, its own context length each: causal), so verification is a decode
        # step: the fused one-call step where the model has it, rounding as plain decode does.
        decode = [s for s, n in sched.scheduled if n == 1 or s.spec_token_ids]
        prefill = [(s, n) for s, n in sched.scheduled if n > 1 and not s.spec_token_ids]
        if self.drafter is not None:  # MTP drafts 2..k, now that their blocks are allotted
            self.drafter.complete(decode)
        rows = [  # (sequence, position) of each decode row
            (s, s.num_computed_tokens + j) for s in decode for j in range(1 + len(s.spec_token_ids))
        ]
        input_ids = [
            s.token_ids[p] if p < s.num_tokens else s.spec_token_ids[p - s.num_tokens]
            for s, p in rows
        ]
        positions = [p for _, p in rows]
        row_slots, decode_fields = self._decode_fields(rows)
        slot_parts = [row_slots]
        # a one-token chunk inside a prompt runs as a decode row too, but samples nothing
        sample_rows, verify_rows = [], []  # verify_rows: (sequence, first row, rows)
        first = 0
        for s in decode:
            if s.spec_token_ids:
                verify_rows.append((s, first, 1 + len(s.spec_token_ids)))
            elif s.num_computed_tokens + 1 == s.num_tokens:
                sample_rows.append(first)
            first += 1 + len(s.spec_token_ids)
        sampled = [rows[i][0] for i in sample_rows]
        chunks = []
        for s, n in prefill:
            start, p0 = len(input_ids), s.num_computed_tokens
            input_ids.extend(s.token_ids[p0 : p0 + n])
            positions.extend(range(p0, p0 + n))
            slots = self._slots([s.block_table], p0 + n)[0]
            slot_parts.append(slots[p0:])
            chunks.append(PrefillChunk(start, n, p0, slots.to(self.device) if p0 else None))
            if p0 + n == s.num_tokens:  # reaches the end: sample
                sample_rows.append(start + n - 1)
                sampled.append(s)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slot_parts).to(dev),
            prefills=chunks,
            block_size=bs,
            **decode_fields,
        )
        positions_t = torch.tensor(positions, device=dev)
        # the grammar masks of the sampled rows are filled now (while the forward pass runs,
        # when the manager overlaps them)
        constraints = self.structured.constraints(sampled) if self.structured else None
        forward = self.model if chunks else self.decode_model
        hidden, expert_counts = forward(
            torch.tensor(input_ids, device=dev), positions_t, meta, self.kv_caches
        )
        # rows still inside a prompt (a one-token chunk runs as a decode row)
        prompt_rows = [(s, row, 1) for row, (s, _) in enumerate(rows) if not s.spec_token_ids]
        prompt_rows += [(s, c.start, c.length) for (s, _), c in zip(prefill, chunks)]
        prompt_logprobs = [
            (s, s.num_computed_tokens + 1, self._prompt_logprobs(hidden, start, n, s))
            for s, start, n in prompt_rows
            if s.needs_prompt_logprobs and s.num_computed_tokens + 1 < s.num_prompt_tokens
        ]
        sample = None
        if sampled:
            sample_hidden = (
                hidden
                if len(sample_rows) == hidden.shape[0]
                else hidden[torch.tensor(sample_rows, device=dev)]
            )
            sample = self.sampler(self.model.logits(sample_hidden), sampled, constraints)
        verified = []
        if verify_rows:
            index = torch.cat([torch.arange(start, start + n) for _, start, n in verify_rows])
            drafts = [(s, s.spec_token_ids) for s, _, _ in verify_rows]
            logits = self.model.logits(hidden[index.to(dev)])
            tokens = verify(self.sampler, logits, drafts)
            verified = [(s, d, t) for (s, d), t in zip(drafts, tokens)]
        if self.drafter is not None:  # the MTP layer over this step's rows: the next drafts
            step_rows = rows + [
                (s, c.context_len + i)
                for (s, _), c in zip(prefill, chunks)
                for i in range(c.length)
            ]
            gained = {id(s): [t] for s, t in zip(sampled, sample.token_ids)} if sample else {}
            last_rows = list(zip(sampled, sample_rows))
            for (s, start, _), (_, _, tokens) in zip(verify_rows, verified):
                gained[id(s)] = tokens  # its accepted drafts and one more
                last_rows.append((s, start + len(tokens) - 1))
            self.drafter.first_pass(step_rows, positions_t, meta, hidden, gained, last_rows)
        return RunnerOutput(sampled, sample, expert_counts, prompt_logprobs, verified)

    def _prompt_logprobs(
        self, hidden: torch.Tensor, start: int, n: int, seq: Sequence
    ) -> list[TokenLogprobs]:
        """The logprobs of the prompt tokens that follow a chunk's rows [start, start + n)
        (each row's logits predict the next position): executor/prompt_scores.py."""
        p0 = seq.num_computed_tokens
        targets = seq.token_ids[p0 + 1 : min(p0 + n + 1, seq.num_prompt_tokens)]
        rows = hidden[start : start + len(targets)]
        return score_rows(self.model, rows, targets, seq.params.prompt_logprobs)
