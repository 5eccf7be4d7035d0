"""What a ModelRunner refuses, checked before anything changes: a sequence it cannot register,
a step it cannot run (ValueError, naming the sequence and what is wrong: the executor answers
INVALID_ARGUMENT)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from executor.runner import ModelRunner, Row


def check_new_sequence(runner: ModelRunner, seqs: Mapping[int, Any], seq_id: int,
                       token_ids: Sequence[int], slot: int, num_generated: int, num_cached: int,
                       lora_from: int) -> None:
    """ModelRunner.add_sequence's arguments, against its registered sequences `seqs`, its
    model, pool and merge."""
    if seq_id in seqs:
        raise ValueError(f"sequence {seq_id} already exists")
    if not token_ids:
        raise ValueError(f"sequence {seq_id}: empty prompt")
    bad = [t for t in token_ids if not 0 <= t < runner.config.vocab_size]
    if bad:
        raise ValueError(f"sequence {seq_id}: token id {bad[0]} out of range "
                         f"[0, {runner.config.vocab_size})")
    if len(token_ids) > runner.config.max_position_embeddings:
        raise ValueError(f"sequence {seq_id}: prompt of {len(token_ids)} tokens exceeds "
                         f"max_position_embeddings {runner.config.max_position_embeddings}")
    if not -1 <= slot < runner.pool.num_slots:
        raise ValueError(f"sequence {seq_id}: adapter slot {slot} out of range "
                         f"[-1, {runner.pool.num_slots})")
    if not 0 <= num_generated < len(token_ids):
        raise ValueError(f"sequence {seq_id}: num_generated {num_generated} must be below "
                         f"its {len(token_ids)} tokens (a prompt comes first)")
    if not 0 <= lora_from < len(token_ids) or (lora_from and slot < 0):
        raise ValueError(f"sequence {seq_id}: lora_from {lora_from} must lie within its "
                         f"{len(token_ids)} tokens, with an adapter slot")
    if lora_from and slot == runner.merged_slot:
        raise ValueError(f"sequence {seq_id}: adapter slot {slot} is merged into the "
                         "weights, and an activated LoRA's rows before its activation "
                         "need the base weights")
    if not 0 <= num_cached < len(token_ids):
        raise ValueError(f"sequence {seq_id}: num_cached {num_cached} must be below its "
                         f"{len(token_ids)} tokens (the last one is computed for a sample)")


def check_rows(runner: ModelRunner, seqs: Mapping[int, Any], rows: Sequence[Row]) -> None:
    """A whole step's rows, against its registered sequences `seqs` (seq_id -> its state)."""
    seen: set[int] = set()
    switch = runner.rope_switch_len
    for r in rows:
        if r.seq_id not in seqs:
            raise ValueError(f"unknown sequence id {r.seq_id}")
        if r.seq_id in seen:
            raise ValueError(f"sequence {r.seq_id} appears in more than one row of the step")
        seen.add(r.seq_id)
        seq = seqs[r.seq_id]
        remaining = len(seq.token_ids) - seq.num_computed
        if not 1 <= r.num_tokens <= remaining:
            raise ValueError(f"sequence {r.seq_id}: num_tokens {r.num_tokens} out of range "
                             f"[1, {remaining}] ({remaining} tokens not yet computed)")
        runner.kv.check_block_ids(r.new_block_ids, r.seq_id)
        if seq.slot >= 0 and seq.slot in runner.pool.holders(r.new_block_ids):
            raise ValueError(f"sequence {r.seq_id}: a new block of it holds its own "
                             f"adapter's weights (a page of slot {seq.slot}), not KV")
        end = seq.num_computed + r.num_tokens
        runner.kv_tables.check(r.seq_id, seq.tables, r.new_block_ids, r.num_new_by_kind, end)
        if end > runner.config.max_position_embeddings:
            raise ValueError(f"sequence {r.seq_id}: position {end - 1} is beyond "
                             f"max_position_embeddings {runner.config.max_position_embeddings}")
        if switch and not seq.is_long and end > switch:
            raise ValueError(f"sequence {r.seq_id}: position {end - 1} is past the longrope "
                             f"switch {switch} of a sequence registered within it (short "
                             "factors): free it and register it again with all its tokens")
        if seq.slot >= 0 and not runner.pool.is_loaded(seq.slot):
            raise ValueError(f"sequence {r.seq_id}: adapter slot {seq.slot} holds no adapter")
        if runner.merged_slot is not None and seq.slot != runner.merged_slot:
            raise ValueError(f"sequence {r.seq_id}: the adapter of slot {runner.merged_slot} "
                             "is merged into the weights; only its rows may run here")
