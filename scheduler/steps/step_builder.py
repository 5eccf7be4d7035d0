"""Planning one executor's steps: its running sequences, the rows of each plan and the samples of
each answer. One interface, two builders that make the same plans:

    ReferenceSteps (reference_steps.py)  plain: every sequence planned and every sample taken one
                                         by one. The definition, and the oracle the tests check
                                         the fast one against.
    FastSteps (fast_steps.py)            the same plans with no Python per sequence for steady
                                         decode (the cohort) and samples taken as columns.

The policy both follow, for plan number `step` with a budget of `budget` tokens:
  1. Every sequence in steady decode gets its one-token row: its last plan gave it a plain decode
     row (one known token to compute, held by its blocks, not its last), and so would this one,
     with no block to publish after it. These rows come first from the budget.
  2. The other running sequences, oldest admission first, while the budget lasts: each computes
     what it knows and has not computed (a long prompt in chunks of what is left of the budget),
     growing its KV blocks first. When blocks run out, sequences are preempted (the scheduler's
     `make_room`: the most-served tenant's latest first) until the row fits or its own sequence
     went; a preempted sequence loses its row, and the budget it took comes back only after
     this pass.
  3. Admissions, in fair order, with the budget left (the scheduler's `admit`).
  4. Every row's counters move (its tokens computed, its sample known) and the blocks it filled
     are published to the prefix cache; the rows are sorted by adapter slot.
A sample of the answer is appended to its sequence, publishes the blocks it completes, reaches
its request (which may finish on it: the scheduler's `finish`). A sequence runs up to its
max_tokens: its request's end, or a longrope model's switch (longrope.py), where a sample that
does not finish its request ends its run (the scheduler's `run_end`: it recomputes it).

The builder is the only writer of its sequences' fields and of its running set; the scheduler
(core.py) keeps one per executor and calls `start`, `release`, `plan`, `answered` and `take`.
What the other managers need of the running set they ask of it: `blocks_to_grow` (residency: the
KV the running sequences will still take), `runs_only` (merging), `running` (admission).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping

from common.adapter_ref import AdapterRef
from common.detokenizer import Finish
from scheduler.request import Request
from scheduler.steps.block_manager import BlockManager, KindBlocks
from scheduler.steps.sequence import NO_EXTRAS, SampleExtras, ScheduledRow, Sequence, StepPlan


def blocks_to_grow(running: Iterable[Sequence], blocks: BlockManager) -> int:
    """Blocks the `running` sequences (their tables in `blocks`) will still take, each up to its
    max_tokens (a window kind's up to what it holds at most: BlockManager.to_grow)."""
    if not blocks.layout.is_single:
        return sum(blocks.to_grow(seq.seq_id, seq.max_tokens) for seq in running)
    block_size = blocks.block_size
    return sum(-(-seq.max_tokens // block_size) - seq.capacity // block_size for seq in running)


# The scheduler's side of a plan: admit with the budget left -> rows of new sequences; preempt
# until a sequence's blocks can hold `num_tokens` (False if it went itself); finish a sequence;
# recompute a sequence whose run ended before its request did (longrope.py).
Admit = Callable[[int], list[ScheduledRow]]
MakeRoom = Callable[[Sequence, int], bool]
OnFinish = Callable[[Sequence, Finish], None]
OnRunEnd = Callable[[Sequence], None]


class StepBuilder(ABC):
    def __init__(self) -> None:
        self.running: dict[int, Sequence] = {}  # seq_id -> seq, in admission order
        self.pending_frees: list[int] = []  # sent sequences released since the last plan
        self.steps_answered = 0  # the last plan answered (plans are answered in order)

    @property
    @abstractmethod
    def steps(self) -> int:
        """Plans made so far (the last one's number)."""

    def __len__(self) -> int:
        return len(self.running)

    # ---- the running set --------------------------------------------------------------------
    def start(self, seq_id: int, req: Request, slot_index: int, tokens: list[int],
              table: list[int] | KindBlocks, num_hits: int, blocks: BlockManager, budget: int,
              max_tokens: int) -> ScheduledRow:
        """Run `req` as `seq_id` in its adapter's slot `slot_index` (-1: the base model) with the
        block table `table`, its first `num_hits` blocks found in the prefix cache, up to
        `max_tokens` tokens (longrope.py: run_end): its first row, of at most `budget` tokens."""
        cached = num_hits * blocks.block_size
        seq = self._sequence(seq_id, req, slot_index, list(tokens), num_computed=cached,
                             num_cached=cached, num_published=num_hits)
        seq.max_tokens = max_tokens
        seq.hold(blocks.capacity(seq_id))
        if not blocks.layout.is_single:
            seq.first_blocks = blocks.first_blocks(seq_id)
        self.running[seq_id] = seq
        self._joined(seq)
        n = min(len(tokens) - cached, budget)
        return ScheduledRow(seq, n, table, samples=cached + n == len(tokens))

    def release(self, seq: Sequence) -> int:
        """`seq` runs here no more (its counters current from now on). The last plan with a row
        of it (0: none was sent): until that is answered, a step in flight reads its blocks and
        its adapter's slot."""
        del self.running[seq.seq_id]
        self._left(seq)
        if not seq.is_sent:
            return 0
        self.pending_frees.append(seq.seq_id)
        return seq.last_step

    def answered(self, step: int) -> None:
        self.steps_answered = max(self.steps_answered, step)

    def runs_only(self, adapter: AdapterRef | None) -> bool:
        """Every running sequence is of `adapter`."""
        return all(seq.request.ask.adapter == adapter for seq in self.running.values())

    def blocks_to_grow(self, blocks: BlockManager) -> int:
        """Blocks the running sequences will still take, each up to its max_tokens."""
        return blocks_to_grow(self.running.values(), blocks)

    def counters(self, seq: Sequence) -> tuple[int, int, int]:
        """A running sequence's (num_computed, num_known, last_step) now."""
        return seq.num_computed, seq.num_known, seq.last_step

    def check(self, where: str, max_batched_tokens: int) -> None:
        """Assert the builder's own bookkeeping (tests, the simulator)."""

    def forget_frees(self) -> None:
        """The executor was lost: it has forgotten every sequence itself."""
        self.pending_frees.clear()

    def _take_freed(self) -> list[int]:
        freed, self.pending_frees = self.pending_frees, []
        return freed

    # ---- what each builder does its own way -------------------------------------------------
    @abstractmethod
    def _sequence(self, *args, **kwargs) -> Sequence:
        """A new sequence of the builder's kind."""

    def _joined(self, seq: Sequence) -> None:
        """`seq` was just added to the running set."""

    def _left(self, seq: Sequence) -> None:
        """`seq` was just taken out of the running set."""

    @abstractmethod
    def plan(self, blocks: BlockManager, budget: int, admit: Admit,
             make_room: MakeRoom) -> StepPlan:
        """The next plan (its merge fields left to the scheduler)."""

    @abstractmethod
    def take(self, blocks: BlockManager, seqs: list[Sequence], token_ids: list[int],
             logprobs: list[float], now: float, finish: OnFinish, run_end: OnRunEnd,
             extras: Mapping[int, SampleExtras] = NO_EXTRAS) -> None:
        """A step's samples, seqs[i]'s being token_ids[i] (all of them running); `extras`: the
        alternatives and prompt logprobs of those that have them, by sequence id."""

