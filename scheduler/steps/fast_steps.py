"""The fast step builder: the reference builder's plans (reference_steps.py, the policy in
step_builder.py) with no Python per sequence in steady decode.

Two shortcuts, each checked against the reference by tests/scheduler/test_step_builders.py:
  - the cohort (cohort.py): sequences in steady decode are planned as one; their rows are the
    same objects every plan and their counters move with the cohort's step count, lazily;
  - quiet samples (quiet_samples.py): samples that only add a token are taken as columns.
The sequences it runs are FastSequences: a Sequence with what those shortcuts keep at hand.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field

from scheduler.request import TokenSink
from scheduler.steps.block_manager import BlockManager
from scheduler.steps.cohort import Cohort
from scheduler.steps.prefix_cache import publish
from scheduler.steps.quiet_samples import quiet_samples, take_quiet
from scheduler.steps.sequence import (
    NO_EXTRAS,
    SampleExtras,
    ScheduledRow,
    Sequence,
    StepPlan,
    row_slot,
)
from scheduler.steps.step_builder import Admit, MakeRoom, OnFinish, OnRunEnd, StepBuilder


@dataclass(eq=False, slots=True)
class FastSequence(Sequence):
    # A row of its next known token is a plain decode row while it knows fewer tokens than this:
    # its blocks hold the token and its request's length is not reached.
    decode_below: int = 0
    # A sample that finds fewer tokens than this only adds a token, unless it is a stop token:
    # nothing to publish, no first token, no length bound, a token sink to take it (0: never).
    quiet_below: int = 0
    # Its row in a step that computes its one next token, in its blocks, and samples: the same
    # object every such step (rows are never changed).
    decode_row: ScheduledRow = field(init=False)
    cohort: Cohort | None = None  # its executor's, while a member
    joined_at: int = 0  # the cohort's step count when it joined
    leaves_at: int = 0  # the plan number before which it leaves
    # Its request's, at hand for the columns of take_quiet: output tokens, token sink.
    output_ids: list[int] = field(init=False)
    sink: TokenSink | None = field(init=False)
    sink_id: int = field(init=False)

    def __post_init__(self) -> None:
        Sequence.__post_init__(self)
        self.decode_row = ScheduledRow(self, 1, (), True)
        req = self.request
        self.output_ids, self.sink, self.sink_id = req.output.token_ids, req.sink, req.sink_id

    def hold(self, capacity: int) -> None:
        self.capacity = capacity
        self.decode_below = min(capacity + 1, self.max_tokens)

    def requiet(self) -> None:
        """Set quiet_below after a sample went the long way or publish() moved publish_at."""
        req = self.request
        if self.sink is not None and req.output.is_ids_only and req.first_token_at is not None \
                and not req.ask.sampling.top_logprobs:  # (alternatives go the long way)
            self.quiet_below = min(self.publish_at, self.max_tokens) - 1


class FastSteps(StepBuilder):
    def __init__(self) -> None:
        super().__init__()
        self.cohort = Cohort()  # the running sequences planned as one
        self.loose: dict[int, FastSequence] = {}  # the others (seq_id -> seq)
        # The stop token ids of its running requests (id -> how many have it): a sample that is
        # none of them is no stop token.
        self.stop_ids: dict[int, int] = {}

    @property
    def steps(self) -> int:
        return self.cohort.steps

    def _sequence(self, *args, **kwargs) -> FastSequence:
        return FastSequence(*args, **kwargs)

    def _joined(self, seq: FastSequence) -> None:
        self.loose[seq.seq_id] = seq  # (planned one by one until it joins the cohort)
        for token_id in seq.request.output.stop_ids:
            self.stop_ids[token_id] = self.stop_ids.get(token_id, 0) + 1

    def _left(self, seq: FastSequence) -> None:
        if seq.cohort is None:
            del self.loose[seq.seq_id]
        else:
            self.cohort.leave(seq)  # (its counters its own again)
        for token_id in seq.request.output.stop_ids:
            if self.stop_ids[token_id] == 1:
                del self.stop_ids[token_id]
            else:
                self.stop_ids[token_id] -= 1

    def counters(self, seq: FastSequence) -> tuple[int, int, int]:
        if seq.cohort is None:
            return seq.num_computed, seq.num_known, seq.last_step
        moved = self.cohort.steps - seq.joined_at
        return seq.num_computed + moved, seq.num_known + moved, self.cohort.steps

    def plan(self, blocks: BlockManager, budget: int, admit: Admit,
             make_room: MakeRoom) -> StepPlan:
        """Policy steps 1-4 (step_builder.py): the cohort's rows, then the loose sequences', then
        admissions. (Runs for every step: its loops stay plain.)"""
        cohort = self.cohort
        step = cohort.steps + 1
        for seq in cohort.due(step):  # members whose plain decode rows end here: loose again
            self.loose[seq.seq_id] = seq
        decode, rows, budget = self._plan_loose(blocks, budget, make_room)
        admitted = admit(budget)
        new = [row.seq for row in admitted]
        for seq in new:  # sent now: one cancelled while this step runs must be freed after it
            seq.is_sent = True
        rows += admitted
        # Counted as computed once sent: the next plan may follow at once. The members move with
        # the cohort's step count.
        cohort.steps = step
        member_rows = cohort.rows()  # (before the decode rows that stay plain join)
        num_tokens, num_samples = self._advance(blocks, step, decode, rows)
        rows += member_rows
        rows += map(_decode_row, decode)
        rows.sort(key=row_slot)
        return StepPlan(step, self._take_freed(), new, rows, num_tokens, num_samples)

    def _plan_loose(self, blocks: BlockManager, budget: int, make_room: MakeRoom
                    ) -> tuple[list[FastSequence], list[ScheduledRow], int]:
        """Policy step 2, the cohort's rows counted first: the loose sequences with a plain
        decode row, the other loose rows, and the budget left for admissions."""
        running, cohort = self.running, self.cohort
        full_budget = budget
        budget -= len(cohort)  # (never below 0: cohort.py)
        decode: list[FastSequence] = []  # rows of one known token, in its blocks, that samples
        rows: list[ScheduledRow] = []  # the others
        preempted = False
        for _, seq in sorted(self.loose.items()):  # (in admission order: the older first)
            if budget == 0:
                break
            if preempted and seq.seq_id not in running:  # preempted to make room for another
                continue
            known = seq.num_known  # what the executor will have
            n = known - seq.num_computed
            if n == 1 and known < seq.decode_below:
                decode.append(seq)
                budget -= 1
                continue
            if known >= seq.max_tokens and known > len(seq.token_ids):
                continue  # its last token is on its way: nothing more to compute
            if n <= 0:
                continue
            if n > budget:
                n = budget
            end = seq.num_computed + n
            if end <= seq.capacity:
                new_blocks = ()
            else:
                new_blocks = blocks.try_grow(seq.seq_id, end, seq.num_computed,
                                             seq.last_step)
                if new_blocks is None:
                    num_running = len(running)
                    is_room = make_room(seq, end)
                    preempted = preempted or len(running) != num_running
                    if not is_room:
                        continue
                    new_blocks = blocks.grow(seq.seq_id, end)
                seq.hold(blocks.capacity(seq.seq_id))
            rows.append(ScheduledRow(seq, n, new_blocks, end == known))
            budget -= n
        if preempted:  # drop the rows of sequences preempted after their row was made
            rows = [row for row in rows if row.seq.seq_id in running]
            decode = [seq for seq in decode if seq.seq_id in running]
            budget = (full_budget - len(cohort) - len(decode)  # (theirs back, a preempted
                      - sum(row.num_tokens for row in rows))  # member's too)
        return decode, rows, budget

    def _advance(self, blocks: BlockManager, step: int, decode: list[FastSequence],
                 rows: list[ScheduledRow]) -> tuple[int, int]:
        """Policy step 4 for the loose and new rows (the members move with the cohort): their
        counters, the blocks they filled published, decode rows that stay plain joining the
        cohort. The plan's tokens and samples."""
        cohort = self.cohort
        num_tokens = num_samples = len(decode) + len(cohort)
        for seq in decode:
            computed = seq.num_computed = seq.num_known
            seq.num_known = computed + 1
            seq.last_step = step
            if computed >= seq.publish_at:  # (publish's cheap half)
                publish(blocks, seq)
                seq.requiet()
            if cohort.join(seq):
                del self.loose[seq.seq_id]
        for row in rows:
            seq, n = row.seq, row.num_tokens
            computed = seq.num_computed = seq.num_computed + n
            seq.num_known += row.samples
            num_samples += row.samples
            seq.last_step = step
            num_tokens += n
            if computed >= seq.publish_at:
                publish(blocks, seq)
                seq.requiet()
        return num_tokens, num_samples

    def take(self, blocks: BlockManager, seqs: list[FastSequence], token_ids: list[int],
             logprobs: list[float], now: float, finish: OnFinish, run_end: OnRunEnd,
             extras: Mapping[int, SampleExtras] = NO_EXTRAS) -> None:
        # (A sample with extras is never quiet: its request asks for alternatives, or it is a
        # first token.)
        quiet = quiet_samples(seqs, token_ids, self.stop_ids)  # (taken as columns)
        if all(quiet):
            return take_quiet(seqs, token_ids, logprobs)
        if any(quiet):
            take_quiet(list(itertools.compress(seqs, quiet)),
                       list(itertools.compress(token_ids, quiet)),
                       list(itertools.compress(logprobs, quiet)))
        for i in itertools.compress(range(len(quiet)), map(operator.not_, quiet)):
            self._take_sample(blocks, seqs[i], token_ids[i], logprobs[i], now, finish, run_end,
                              extras.get(seqs[i].seq_id))

    @staticmethod
    def _take_sample(blocks: BlockManager, seq: FastSequence, token_id: int, logprob: float,
                     now: float, finish: OnFinish, run_end: OnRunEnd,
                     extras: SampleExtras | None) -> None:
        """A sample the long way: it may publish blocks, be the first token, end the request
        or the run (the one that reaches max_tokens is never quiet)."""
        tokens = seq.token_ids
        tokens.append(token_id)
        if len(tokens) >= seq.publish_at:  # (publish's cheap half)
            publish(blocks, seq)
        reason = seq.request.on_sample(token_id, logprob, now, extras)
        if reason is not None:
            finish(seq, reason)
        elif len(tokens) >= seq.max_tokens:  # (its run ends before its request)
            run_end(seq)
        else:
            seq.requiet()

    def check(self, where: str, max_batched_tokens: int) -> None:
        members = self.cohort.members
        assert len(members) <= max_batched_tokens, f"{where}: cohort past the budget"
        assert set(self.running) == set(self.loose) | set(members) and not set(
            self.loose) & set(members), \
            f"{where}: running sequences not either in the cohort or out of it"
        for seq in members.values():
            computed, known, _ = self.counters(seq)
            assert seq.cohort is self.cohort and known - computed == 1 \
                and known <= min(seq.decode_below, seq.publish_at), \
                f"{where}: seq {seq.seq_id} in the cohort, its next row no plain decode row"
        assert all(seq.cohort is None for seq in self.loose.values()), f"{where}: loose member"
        stops: dict[int, int] = {}
        for seq in self.running.values():
            for token_id in seq.request.output.stop_ids:
                stops[token_id] = stops.get(token_id, 0) + 1
        assert self.stop_ids == stops, f"{where}: stop token ids of its requests miscounted"


_decode_row = operator.attrgetter("decode_row")
