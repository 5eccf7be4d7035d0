"""The reference step builder: the planning policy of step_builder.py written plainly, every
sequence planned and every sample taken one by one. It defines the plans; the fast builder
(fast_steps.py) must make the same ones, which tests/scheduler/test_step_builders.py checks over
random arrivals, finishes, cancels, preemptions and two steps in flight."""

from __future__ import annotations

from collections.abc import Mapping

from scheduler.steps.block_manager import BlockManager
from scheduler.steps.prefix_cache import publish
from scheduler.steps.sequence import (
    NO_EXTRAS,
    SampleExtras,
    ScheduledRow,
    Sequence,
    StepPlan,
    row_slot,
)
from scheduler.steps.step_builder import Admit, MakeRoom, OnFinish, OnRunEnd, StepBuilder


class ReferenceSteps(StepBuilder):
    def __init__(self) -> None:
        super().__init__()
        self._steps = 0
        # seq_id -> the plan whose row of it was a plain decode row, when that was its last row
        self._decoded_in: dict[int, int] = {}

    @property
    def steps(self) -> int:
        return self._steps

    def _sequence(self, *args, **kwargs) -> Sequence:
        return Sequence(*args, **kwargs)

    def _left(self, seq: Sequence) -> None:
        self._decoded_in.pop(seq.seq_id, None)

    @staticmethod
    def _is_plain_decode(seq: Sequence) -> bool:
        """Its next row computes one known token, held by its blocks, and is not its last."""
        known = seq.num_known
        return known - seq.num_computed == 1 and known <= seq.capacity and known < seq.max_tokens

    def _is_steady(self, seq: Sequence, step: int) -> bool:
        """Policy step 1: plan `step - 1` gave it a plain decode row, and `step` would too, with
        no block to publish after it."""
        return (self._decoded_in.get(seq.seq_id) == step - 1 and self._is_plain_decode(seq)
                and seq.num_known < seq.publish_at)

    def plan(self, blocks: BlockManager, budget: int, admit: Admit,
             make_room: MakeRoom) -> StepPlan:
        step = self._steps + 1
        steady = [seq for seq in self.running.values() if self._is_steady(seq, step)]
        decode, rows, left = self._plan_others(blocks, budget, steady, make_room)
        admitted = admit(left)  # policy step 3
        for row in admitted:
            row.seq.is_sent = True
        rows += admitted
        self._steps = step
        self._advance(blocks, step, steady + decode, rows)
        rows += [ScheduledRow(seq, 1, (), True) for seq in steady + decode]
        rows.sort(key=row_slot)
        num_tokens = sum(row.num_tokens for row in rows)
        num_samples = sum(row.samples for row in rows)
        return StepPlan(step, self._take_freed(), [row.seq for row in admitted], rows,
                        num_tokens, num_samples)

    def _plan_others(self, blocks: BlockManager, budget: int, steady: list[Sequence],
                     make_room: MakeRoom) -> tuple[list[Sequence], list[ScheduledRow], int]:
        """Policy step 2, the steady rows (step 1) counted first: the others with a plain decode
        row, the others' other rows, and the budget left (`steady` loses its preempted)."""
        running = self.running
        left = budget - len(steady)
        decode: list[Sequence] = []
        rows: list[ScheduledRow] = []
        preempted = False
        for seq in list(running.values()):  # (admission order)
            if left == 0:
                break
            if seq in steady or seq.seq_id not in running:  # (steady, or preempted meanwhile)
                continue
            if self._is_plain_decode(seq):
                decode.append(seq)
                left -= 1
                continue
            known = seq.num_known
            if known >= seq.max_tokens and known > len(seq.token_ids):
                continue  # its last token is on its way: nothing more to compute
            n = min(known - seq.num_computed, left)
            if n <= 0:
                continue
            end = seq.num_computed + n
            new_blocks = ()
            if end > seq.capacity:
                # (its window kinds' blocks behind the row given back first: block_manager.py)
                new_blocks = blocks.try_grow(seq.seq_id, end, seq.num_computed, seq.last_step)
                if new_blocks is None:
                    num_running = len(running)
                    is_room = make_room(seq, end)  # preempts others, or seq itself
                    preempted = preempted or len(running) != num_running
                    if not is_room:
                        continue
                    new_blocks = blocks.grow(seq.seq_id, end)
                seq.hold(blocks.capacity(seq.seq_id))
            rows.append(ScheduledRow(seq, n, new_blocks, end == known))
            left -= n
        if preempted:  # their rows go, and the budget they took comes back
            steady[:] = [seq for seq in steady if seq.seq_id in running]
            decode = [seq for seq in decode if seq.seq_id in running]
            rows = [row for row in rows if row.seq.seq_id in running]
            left = budget - len(steady) - len(decode) - sum(row.num_tokens for row in rows)
        return decode, rows, left

    def _advance(self, blocks: BlockManager, step: int, decode: list[Sequence],
                 rows: list[ScheduledRow]) -> None:
        """Policy step 4: every row's counters move and the blocks it filled are published. (Plain
        decode rows publish first: of two blocks with the same hash in one plan, the first is
        cached, as the fast builder does.)"""
        for seq in decode:
            seq.num_computed = seq.num_known
            seq.num_known += 1
            seq.last_step = step
            self._decoded_in[seq.seq_id] = step
            if seq.num_computed >= seq.publish_at:
                publish(blocks, seq)
        for row in rows:
            seq = row.seq
            seq.num_computed += row.num_tokens
            seq.num_known += row.samples
            seq.last_step = step
            self._decoded_in.pop(seq.seq_id, None)
            if seq.num_computed >= seq.publish_at:
                publish(blocks, seq)

    def take(self, blocks: BlockManager, seqs: list[Sequence], token_ids: list[int],
             logprobs: list[float], now: float, finish: OnFinish, run_end: OnRunEnd,
             extras: Mapping[int, SampleExtras] = NO_EXTRAS) -> None:
        for seq, token_id, logprob in zip(seqs, token_ids, logprobs):
            seq.token_ids.append(token_id)
            if len(seq.token_ids) >= seq.publish_at:
                publish(blocks, seq)
            reason = seq.request.on_sample(token_id, logprob, now, extras.get(seq.seq_id))
            if reason is not None:
                finish(seq, reason)
            elif len(seq.token_ids) >= seq.max_tokens:  # (its run ends before its request)
                run_end(seq)
