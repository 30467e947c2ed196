"""A request's way in: its prompt validated and tokenized, its sequences made (one per sample,
each with its detokenizer and, when seeded, its generator), and its grammar's compile
started (vLLM's InputProcessor)."""

from __future__ import annotations

import time

import torch

from inference.detokenizer import IncrementalDetokenizer
from inference.prompts import Prompt, check_token_ids, tokenize_prompt
from inference.sampling_params import SamplingParams
from inference.sequence import Sequence
from inference.structured import CompileJob, StructuredOutputManager


class InputProcessor:
    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        max_model_len: int,
        device: torch.device,
        structured: StructuredOutputManager,
    ) -> None:
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.device, self.structured = device, structured

    def tokenize(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """Validates a prompt against the model's limits and returns its token ids."""
        return tokenize_prompt(self.tokenizer, self.vocab_size, self.max_model_len, prompt, params)

    def process(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        log_context: dict | None = None,
        prompt_token_ids: list[int] | None = None,
        tenant: str | None = None,
    ) -> tuple[list[Sequence], CompileJob | None]:
        """The request's sequences, and its grammar's compile job (None without one); raises
        InvalidParameterError for a bad prompt or parameter, including a structured_outputs
        constraint that does not compile within the manager's sync_compile_s."""
        arrival = time.monotonic()
        if prompt_token_ids is not None:  # validated by the caller, but a bad id would crash
            check_token_ids(params, self.vocab_size)
            ids = prompt_token_ids
        else:
            ids = self.tokenize(prompt, params)
        job = None
        if params.structured_outputs is not None:
            # ~1-2 ms for a schema of a few fields (bench/results/structured_backends.json),
            # microseconds from the cache; a grammar that takes longer than the manager's
            # sync_compile_s goes on compiling off the step path and its request waits for it
            job = self.structured.start_compile(params.structured_outputs)
        seqs = [
            self._sequence(request_id, i, ids, params, log_context, tenant) for i in range(params.n)
        ]
        if job is not None:  # its wait for the grammar counts
            for seq in seqs:
                seq.times.arrival = arrival
        return seqs, job

    def _sequence(self, request_id, i, ids, params, log_context, tenant) -> Sequence:
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed + i)
        seq_id = f"{request_id}#{i}" if params.n > 1 else request_id
        seq = Sequence(seq_id, request_id, i, ids, params, gen, log_context, tenant)
        seq.detok = IncrementalDetokenizer(
            self.tokenizer, ids, params.stop, params.skip_special_tokens
        )
        return seq
