"""A request's run on one executor (Sequence), and what one step carries: the rows of a plan
(ScheduledRow, StepPlan) and the samples of its answer (Samples). Plain data: the step builders
(step_builder.py) are the only writers of a running sequence's fields."""

import functools
import operator
from collections.abc import Iterable, Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

from scheduler.request import Request, SampleExtras


@dataclass(eq=False, slots=True)
class Sequence:
    """A request's current run on one executor (a preempted request gets a new one).

    Its counters are exact as of the last plan that gave it a row, except while the fast
    builder's cohort plans it (fast_steps.py), which moves them lazily: ask its executor's
    builder (`ex.steps.counters(seq)`) for their current values."""

    seq_id: int
    request: Request
    slot_index: int  # its adapter's slot (residency's), -1 on the base model: rows sort by it
    token_ids: list[int]  # its prompt and every token sampled, as far as answers came back
    num_computed: int = 0  # tokens whose KV the executor computes in the steps sent so far
    # Its tokens once the steps in flight are answered: token_ids and the samples they bring
    # (steps are pipelined: engine.py). The executor knows a sample as soon as it made it, so a
    # step may compute it before its answer is here.
    num_known: int = field(init=False)
    last_step: int = 0  # the last plan (its number) with a row of it
    is_sent: bool = False  # its NewSequence went out
    num_cached: int = 0  # leading tokens whose KV it found in the prefix cache
    num_published: int = 0  # of its blocks, those in the prefix cache (prefix_cache.py)
    capacity: int = 0  # tokens its KV blocks hold
    # publish() is asked again once its computed and known tokens both reach this (0: at once).
    publish_at: int = 0
    # Its run ends once it has this many tokens: its request is done (prompt and max_new_tokens
    # outputs), or, for a longrope model's short run, it outgrew the switch and is recomputed
    # (longrope.py: run_end).
    max_tokens: int = field(init=False)
    # Under window blocks, each kind's first token block its first row brings (a window kind's
    # earlier ones lie behind its window: block_manager.py); () without.
    first_blocks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        req = self.request
        self.max_tokens = len(req.ask.prompt_ids) + req.output.max_new_tokens
        self.num_known = len(self.token_ids)

    def hold(self, capacity: int) -> None:
        """Its blocks now hold `capacity` tokens."""
        self.capacity = capacity


@dataclass(slots=True)  # (one per row and step: slots make it twice as fast to build as a tuple)
class ScheduledRow:
    """One sequence's share of a step: its next `num_tokens` tokens, and the KV blocks it was
    given for them. Never changed once made (the fast builder reuses decode rows)."""

    seq: Sequence
    num_tokens: int
    # () for most decode rows (nothing allocated); under several kinds of KV, each kind's
    # (block_manager.KindBlocks)
    new_block_ids: list[int] | tuple[()]
    samples: bool = False  # it reaches the sequence's last known token: a sample comes back
    seq_id: int = field(init=False)  # its sequence's (at hand for the step message's columns)
    slot_index: int = field(init=False)  # its sequence's slot, -1 on the base model: sorts rows

    def __post_init__(self) -> None:
        self.seq_id, self.slot_index = self.seq.seq_id, self.seq.slot_index


@dataclass
class StepPlan:
    step: int  # its number among the executor's plans
    freed: list[int]  # sequences the executor may forget
    new: list[Sequence]  # sequences the executor has not seen yet
    rows: list[ScheduledRow]  # sorted by slot: each adapter's rows are contiguous
    num_tokens: int  # the rows' tokens
    num_samples: int  # rows whose answer brings a sampled token (they end their known tokens)
    merge_slot: int | None = None  # fold this slot's adapter into the weights before the rows
    unmerge: bool = False  # restore the base weights first

    def __bool__(self) -> bool:
        return bool(self.rows)

    @property
    def needs_sending(self) -> bool:
        """It computes, frees, merges or unmerges something."""
        return bool(self.rows or self.freed or self.unmerge) or self.merge_slot is not None

    @functools.cached_property
    def num_adapters(self) -> int:
        """Distinct adapters (slots) among the rows."""
        return len(set(map(row_slot, self.rows)) - {-1})


row_slot = operator.attrgetter("slot_index")  # a row's slot index, -1 on the base model (C)


class Sample(NamedTuple):
    seq_id: int
    token_id: int
    logprob: float


NO_EXTRAS: Mapping[int, SampleExtras] = MappingProxyType({})


class Samples(NamedTuple):
    """A step's answer as the step stream brings it: its samples as columns, and the extras of
    the few that have them (by sequence id)."""

    seq_ids: SequenceOf[int]
    token_ids: SequenceOf[int]
    logprobs: SequenceOf[float]
    extras: Mapping[int, SampleExtras] = NO_EXTRAS

    @classmethod
    def of(cls, samples: Iterable[Sample]) -> "Samples":
        samples = list(samples)
        return cls([s.seq_id for s in samples], [s.token_id for s in samples],
                   [s.logprob for s in samples])


NO_SAMPLES = Samples((), (), ())
