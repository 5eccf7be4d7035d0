"""One executor's steady decode cohort (the fast step builder's, fast_steps.py): its running
sequences that get a plain decode row in every step (one known token, held by its blocks,
nothing to publish), planned with no Python per sequence.

A sequence joins once a step has planned it as a decode row and the steps after it would too:
its known tokens stay below its decode bound (FastSequence.decode_below) and its next publish
point for at least one more step. From then on every plan carries its decode_row, and its
counters (Sequence.num_computed, num_known, last_step) move with the cohort's step count instead
of one by one (FastSteps.counters gives their values meanwhile). It leaves, its counters its own
again, before the first plan in which it would be anything else (a block to grow into or to
publish, its length reached), or as soon as anything else touches it: it ends, is cancelled or
preempted (StepBuilder.release). A sequence out of the cohort is planned one by one
(FastSteps.plan). Every member joined from a row of a plan, within its token budget, so the
cohort never outgrows a step's budget.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.steps.fast_steps import FastSequence as Sequence
    from scheduler.steps.sequence import ScheduledRow


class Cohort:
    def __init__(self) -> None:
        self.steps = 0  # plans made on its executor: a member's counters move with this
        self.members: dict[int, Sequence] = {}  # seq_id -> seq
        self._leaving: dict[int, list[Sequence]] = {}  # plan number -> members to leave before it

    def __len__(self) -> int:
        return len(self.members)

    def rows(self) -> list[ScheduledRow]:
        """The members' rows in a plan: their decode rows (made by map, in C)."""
        return list(map(_decode_row, self.members.values()))

    def join(self, seq: Sequence) -> bool:
        """`seq` was just planned as a decode row (in plan number `steps`, its counters its own):
        it joins if the next plan would give it one too, for as many plans as it would. Whether
        it joined."""
        plans = min(seq.decode_below, seq.publish_at) - seq.num_known
        if plans < 1:
            return False
        seq.cohort, seq.joined_at = self, self.steps
        seq.leaves_at = self.steps + plans + 1
        self.members[seq.seq_id] = seq
        self._leaving.setdefault(seq.leaves_at, []).append(seq)
        return True

    def leave(self, seq: Sequence) -> None:
        """Make a member's counters its own again, as of the last plan."""
        moved = self.steps - seq.joined_at
        seq.num_computed += moved
        seq.num_known += moved
        seq.last_step = self.steps
        seq.cohort = None
        del self.members[seq.seq_id]

    def due(self, step: int) -> list[Sequence]:
        """Before plan number `step`: the members whose plain decode rows end here, out."""
        due = [seq for seq in self._leaving.pop(step, ())
               if seq.cohort is self and seq.leaves_at == step]
        for seq in due:
            self.leave(seq)
        return due


_decode_row = operator.attrgetter("decode_row")
