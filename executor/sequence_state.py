"""What the runner's API speaks in (Row: a sequence's part of a step; Sampled: a token it drew)
and what the runner keeps of each registered sequence (SequenceState)."""

from __future__ import annotations

from dataclasses import dataclass

from common.sampling import SamplingParams
from executor.logprobs import PromptLogprobs, TopLogprobs
from executor.sampling import DrawStream


@dataclass(frozen=True)
class Row:
    seq_id: int
    num_tokens: int
    new_block_ids: tuple[int, ...] = ()
    # With window blocks (common/kv_layout.py): how many of new_block_ids each kind takes, in
    # kind order (each token block's columns together); () on a layout of one kind.
    num_new_by_kind: tuple[int, ...] = ()


@dataclass(frozen=True)
class Sampled:
    seq_id: int
    token_id: int
    logprob: float
    top: TopLogprobs | None = None  # its alternatives, when its sampling asks for them
    prompt: PromptLogprobs | None = None  # with a sequence's first sample, when asked for


@dataclass
class SequenceState:
    token_ids: list[int]  # prompt + tokens sampled so far
    num_computed: int
    # mirror of the scheduler's tables: one per column of each kind (one but with window
    # blocks); -1 where the scheduler sent no block (outside every window of the first row)
    tables: list[list[int]]
    sampling: SamplingParams
    slot: int
    draws: DrawStream
    # It computes with longrope's long factors: registered with more tokens than the model's
    # switch (ModelConfig.rope_switch_len), as transformers' generate() would have them.
    is_long: bool = False
    # Its prompt's logprobs as its prefill makes them, until its first sample takes them (None:
    # not asked for, or taken).
    prompt_logprobs: PromptLogprobs | None = None
    # Its adapter's LoRA applies from this position on (activated LoRA, common/alora.py: earlier
    # positions are computed as the base model's); 0: every position
    lora_from: int = 0
