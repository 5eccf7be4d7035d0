"""What a StepRequest does to a ModelRunner, defined once: the executor's Step stream runs it,
and so does every rank of a tensor-parallel executor on its part (executor/tp/follower.py), the
same request in the same order."""

from __future__ import annotations

import logging

from common.errors import InvalidArgument
from common.sampling import SamplingParams
from executor.runner import ModelRunner, Row, Sampled
from protos import executor_pb2

log = logging.getLogger(__name__)


def step_rows(req: executor_pb2.StepRequest, num_kinds: int = 1) -> list[Row]:
    """A step's rows, from their columns (executor.proto), on a runner whose KV has `num_kinds`
    kinds of layers (ModelRunner.kv_layout); INVALID_ARGUMENT when the columns differ."""
    seq_ids, counts, num_blocks = req.row_seq_ids, req.row_num_tokens, req.row_num_new_blocks
    if not len(seq_ids) == len(counts) == len(num_blocks) // num_kinds \
            or len(num_blocks) % num_kinds:
        raise InvalidArgument(f"a step's row columns differ in length: {len(seq_ids)} seq ids, "
                              f"{len(counts)} token counts, {len(num_blocks)} block counts "
                              f"({num_kinds} per row)")
    blocks = list(req.new_block_ids)
    if sum(num_blocks) != len(blocks):
        raise InvalidArgument(f"the rows add {sum(num_blocks)} KV blocks but new_block_ids has "
                              f"{len(blocks)}")
    rows, at = [], 0
    if num_kinds == 1:
        for seq_id, num_tokens, k in zip(seq_ids, counts, num_blocks):
            rows.append(Row(seq_id, num_tokens, tuple(blocks[at:at + k])))
            at += k
        return rows
    for i, (seq_id, num_tokens) in enumerate(zip(seq_ids, counts)):
        by_kind = tuple(num_blocks[i * num_kinds:(i + 1) * num_kinds])
        k = sum(by_kind)
        rows.append(Row(seq_id, num_tokens, tuple(blocks[at:at + k]), by_kind))
        at += k
    return rows


def run_step(runner: ModelRunner, req: executor_pb2.StepRequest,
             rows: list[Row]) -> list[Sampled]:
    """Free, unmerge, add the new sequences, merge, run `rows` (step_rows(req)): the samples."""
    for seq_id in req.freed_seq_ids:
        runner.free_sequence(seq_id)
    if req.unmerge:
        runner.unmerge()
    for new in req.new_sequences:
        runner.add_sequence(new.seq_id, list(new.token_ids), SamplingParams.from_pb(new.sampling),
                            new.slot, new.num_generated, new.num_cached, new.lora_from,
                            list(new.first_blocks))
        log.debug("sequence %d of request %s: %d tokens (%d cached), slot %d", new.seq_id,
                  new.request_id, len(new.token_ids), new.num_cached, new.slot)
    if req.HasField("merge_slot"):
        runner.merge(req.merge_slot)
        log.info("merged the adapter of slot %d into the weights", req.merge_slot)
    return runner.step(rows) if rows else []
