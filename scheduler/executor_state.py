"""Plain data the scheduler keeps per executor (placement, lifecycle, counters), the limits it
schedules under, and what one step carries (StepPlan of ScheduledRows, Samples back)."""

import functools
import operator
from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from typing import NamedTuple

from common.adapter_ref import AdapterRef
from common.errors import LoraplexError
from scheduler.block_manager import BlockManager, blocks_for
from scheduler.cohort import Cohort
from scheduler.prefix_cache import SCOPES
from scheduler.queues import ExecutorQueue
from scheduler.request import Request, TokenSink
from scheduler.routing import Popularity, Rates
from scheduler.slots import Slot, SlotTable


@dataclass(frozen=True)
class Limits:
    max_num_seqs: int = 64  # running sequences per executor
    max_batched_tokens: int = 2048  # tokens per step per executor (long prompts are chunked)
    max_adapters_per_batch: int = 0  # distinct adapters running at once per executor; 0 = no limit
    # A request running on an executor that fails (a step errors, the stream or process dies) is
    # recomputed elsewhere; the time this many executors failed under it, it fails too: a request
    # whose step always fails must not bring executors down forever.
    max_executor_failures: int = 3
    affinity_max_wait_s: float = 0.0  # prefer requests whose adapter runs, for at most this long
    slot_wait_s: float = 2.0  # routing: expected wait when every slot of an executor is pinned
    home_bias_s: float = 2.0  # routing: how much busier a cold adapter's home may be and still win
    popularity_half_life_s: float = 60.0  # eviction: decay of adapters' request counts
    max_reserved_slots: int = 1  # slots per executor that may drain for a waiting adapter
    # A tenant more than this many token-equivalents ahead of the least-served backlogged tenant is
    # not admitted (even if that tenant waits for a load): bounds the fairness gap; 0 = no bound.
    fairness_window: float = 8192.0
    # A load that failed retryably (UNAVAILABLE: a store or S3 down or frozen) is tried again
    # after load_backoff_s, doubling up to max_load_backoff_s; its requests wait meanwhile,
    # within their deadlines and max_queue_s. Any other failure fails them at once.
    load_backoff_s: float = 0.5
    max_load_backoff_s: float = 10.0
    # A request not admitted within this long is refused (RESOURCE_EXHAUSTED with retry-after;
    # UNAVAILABLE when its adapter keeps failing to load), also while no executor is up.
    max_queue_s: float = 300.0
    # Requests one tenant may have waiting; one more is refused at once (RESOURCE_EXHAUSTED with
    # retry-after). 0 = no cap.
    max_queued_per_tenant: int = 1024
    # Steps sent to an executor before the oldest one's answer is read (engine.py): at 2 the next
    # step is planned and sent while the executor runs this one, so it never waits between
    # steps; 1 = one at a time.
    pipeline_depth: int = 2
    # Prefix caching (prefix_cache.py): "tenant" reuses KV blocks within a tenant (and adapter
    # version and cache salt), "pool" across tenants too, "off" never.
    prefix_cache: str = "tenant"
    # Automatic merging (merging.py): an adapter whose share of the pool's tokens stays at least
    # merge_share for merge_window_s is merged into one executor's weights (with >= 2 executors
    # up, never the last serving everyone); merged, once its share stays below unmerge_share
    # for a window, it is unmerged. 0 = only the admin Merge RPC merges.
    merge_share: float = 0.0
    unmerge_share: float = 0.5
    merge_window_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 <= self.merge_share <= 1 or not 0 <= self.unmerge_share <= 1:
            raise ValueError("merge_share and unmerge_share must be in [0, 1]")
        if self.merge_share and self.unmerge_share >= self.merge_share:
            raise ValueError(f"unmerge_share ({self.unmerge_share}) must be below merge_share "
                             f"({self.merge_share}): the gap is the hysteresis")
        if not self.merge_window_s > 0:
            raise ValueError(f"merge_window_s must be > 0, got {self.merge_window_s}")
        if self.prefix_cache not in SCOPES:
            raise ValueError(f"prefix_cache must be one of {', '.join(SCOPES)}, got "
                             f"{self.prefix_cache!r}")
        if self.pipeline_depth < 1:
            raise ValueError(f"pipeline_depth must be >= 1, got {self.pipeline_depth}")
        if self.popularity_half_life_s <= 0:
            raise ValueError("popularity_half_life_s must be > 0, got "
                             f"{self.popularity_half_life_s}")
        for name in ("max_num_seqs", "max_batched_tokens", "max_executor_failures"):
            if getattr(self, name) < 1:
                raise ValueError(f"scheduler limit {name} must be >= 1, got {getattr(self, name)}")
        for name in ("load_backoff_s", "max_queue_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"scheduler limit {name} must be > 0, got {getattr(self, name)}")
        if self.max_load_backoff_s < self.load_backoff_s:
            raise ValueError("max_load_backoff_s must be >= load_backoff_s")
        for name in ("max_adapters_per_batch", "affinity_max_wait_s", "slot_wait_s",
                     "max_reserved_slots", "fairness_window", "home_bias_s",
                     "max_queued_per_tenant"):
            if getattr(self, name) < 0:
                raise ValueError(f"scheduler limit {name} must be >= 0, got {getattr(self, name)}")


@dataclass
class LoadFailure:
    """An adapter whose loads keep failing on an executor, retryably: when to try again."""

    count: int
    retry_at: float  # scheduler clock
    error: LoraplexError
    is_due: bool = False  # the executors were woken once its backoff passed


@dataclass(eq=False, slots=True)
class Sequence:
    """A request's current run on one executor (a preempted request gets a new one).

    num_computed, num_known and last_step are its own_* counters, moved by the steps planned since
    it joined its executor's cohort while it is a member (cohort.py)."""

    seq_id: int
    request: Request
    slot: Slot | None
    token_ids: list[int]  # its prompt and every token sampled, as far as answers came back
    own_computed: int = 0  # (num_computed)
    own_known: int = field(init=False)  # (num_known)
    own_last_step: int = 0  # (last_step)
    cohort: "Cohort | None" = None  # its executor's, while a member
    joined_at: int = 0  # the cohort's step count when it joined
    leaves_at: int = 0  # the plan number before which it leaves
    is_sent: bool = False  # its NewSequence went out
    num_cached: int = 0  # leading tokens whose KV it found in the prefix cache
    num_published: int = 0  # of its blocks, those in the prefix cache (prefix_cache.py)
    # Tokens its KV blocks hold (0: not known yet): a row that fits needs no look at the table.
    capacity: int = 0
    # A row of its next known token makes its decode_row while it knows fewer tokens than this:
    # its blocks hold the token and its request's length is not reached (0: not known yet).
    decode_below: int = 0
    # publish() is asked again once its computed and known tokens both reach this (0: at once).
    publish_at: int = 0
    slot_index: int = field(init=False)  # its slot's index, -1 on the base model: rows sort by it
    # Its request is done once it has this many tokens (prompt and max_new_tokens outputs).
    max_tokens: int = field(init=False)
    # A sample that finds fewer tokens than this only adds a token, unless it is a stop token:
    # nothing to publish, no first token, no length bound, a token sink to take it (0: never).
    quiet_below: int = 0
    # Its row in a step that computes its one next token, in its blocks, and samples: the same
    # object every such step (rows are never changed).
    decode_row: "ScheduledRow" = field(init=False)
    # Its request's, at hand for on_step_done's columns: tenant, output tokens, token sink.
    tenant: str = field(init=False)
    output_ids: list[int] = field(init=False)
    sink: TokenSink | None = field(init=False)
    sink_id: int = field(init=False)

    def __post_init__(self) -> None:
        self.slot_index = -1 if self.slot is None else self.slot.index
        req = self.request
        self.max_tokens = len(req.prompt_ids) + req.output.max_new_tokens
        self.own_known = len(self.token_ids)
        self.decode_row = ScheduledRow(self, 1, (), True)
        self.tenant, self.output_ids = req.tenant, req.output.token_ids
        self.sink, self.sink_id = req.sink, req.sink_id

    @property
    def num_computed(self) -> int:
        """Tokens whose KV the executor computes in the steps sent so far."""
        if self.cohort is None:
            return self.own_computed
        return self.own_computed + self.cohort.steps - self.joined_at

    @property
    def num_known(self) -> int:
        """Its tokens once the steps in flight are answered: token_ids and the samples they bring
        (steps are pipelined: engine.py). The executor knows a sample as soon as it made it, so
        a step may compute it before its answer is here."""
        if self.cohort is None:
            return self.own_known
        return self.own_known + self.cohort.steps - self.joined_at

    @property
    def last_step(self) -> int:
        """The last step (its number: Cohort.steps) with a row of it."""
        return self.own_last_step if self.cohort is None else self.cohort.steps

    def hold(self, capacity: int) -> None:
        """Its blocks now hold `capacity` tokens."""
        self.capacity = capacity
        self.decode_below = min(capacity + 1, self.max_tokens)

    def requiet(self) -> None:
        """Set quiet_below after a sample went the long way or publish() moved publish_at."""
        req = self.request
        if self.sink is not None and req.output.is_ids_only and req.first_token_at is not None:
            self.quiet_below = min(self.publish_at, self.max_tokens) - 1


@dataclass(eq=False)
class ExecutorState:
    """What the scheduler knows of one executor: the single source of truth for placement, and
    where it is in its life. The lifecycle flags change only through the core's methods
    (add_executor, on_executor_lost, drain, resume, leave, stop); the engine asks them."""

    address: str
    blocks: BlockManager
    slots: SlotTable
    queue: ExecutorQueue = field(default_factory=ExecutorQueue)
    running: dict[int, Sequence] = field(default_factory=dict)  # seq_id -> seq, admission order
    cohort: Cohort = field(default_factory=Cohort)  # those of them planned as one (cohort.py)
    loose: dict[int, Sequence] = field(default_factory=dict)  # the others (seq_id -> seq)
    # The stop token ids of its running requests (id -> how many have it): a sample that is none
    # of them is no stop token (core.on_step_done).
    stop_ids: dict[int, int] = field(default_factory=dict)
    pending_frees: list[int] = field(default_factory=list)
    # Sequences that left the running set while steps with their rows were in flight: they keep
    # their slot pinned until those are answered (loads are not ordered with steps: an adapter
    # loaded into the slot meanwhile would be read by them).
    unpin_later: list[Sequence] = field(default_factory=list)
    rates: Rates = field(default_factory=Rates)
    popularity: Popularity = field(default_factory=Popularity)  # of adapters routed here
    work_tokens: float = 0.0  # tokens still to compute for its queued and running requests
    load_failures: dict[AdapterRef, LoadFailure] = field(default_factory=dict)
    is_up: bool = False  # connected and stepping: from add_executor until on_executor_lost
    is_draining: bool = False  # admits nothing new; its running sequences finish
    is_leaving: bool = False  # gone from discovery: forget it once drained
    is_stopping: bool = False  # its health said NOT_SERVING: release it once drained
    # Dedicated to one adapter (merging.py): admits only its requests; once it runs nothing else
    # a step merges it into the weights (merged_slot, pinned while merged). unmerge_due: the
    # next step unmerges; its slot (unmerging) stays pinned until that step is answered.
    dedicated_to: AdapterRef | None = None
    dedicated_bytes: int = 0  # its adapter's size (to bring it in)
    merged_slot: Slot | None = None
    unmerge_due: bool = False
    unmerging: Slot | None = None
    num_steps: int = 0
    # The last plan answered (steps are answered in order; cohort.steps counts the plans made):
    # a sequence whose last_step is past it has a step in flight.
    steps_answered: int = 0
    num_loads: int = 0
    num_hits: int = 0
    num_evictions: int = 0

    @property
    def is_admitting(self) -> bool:
        return self.is_up and not self.is_draining

    @property
    def is_drained(self) -> bool:
        return self.is_draining and not self.running

    @property
    def is_retired(self) -> bool:
        """Drained and leaving or stopping: its step stream may close."""
        return self.is_drained and (self.is_leaving or self.is_stopping)

    def serves(self, adapter: AdapterRef | None) -> bool:
        """Requests for `adapter` may be queued here (a dedicated executor takes only its own)."""
        return self.dedicated_to is None or adapter == self.dedicated_to

    def can_hold(self, req: Request) -> bool:
        """All of req's KV (prompt and every token it may generate) fits this executor's blocks."""
        blocks = self.blocks
        return blocks_for(len(req.prompt_ids) + req.output.max_new_tokens,
                          blocks.block_size) <= blocks.num_blocks

    def is_in_flight(self, seq: Sequence) -> bool:
        """A step sent with a row of `seq` is not answered yet."""
        return seq.last_step > self.steps_answered

    def start(self, seq: Sequence) -> None:
        """`seq` runs here (planned one by one until it joins the cohort)."""
        self.running[seq.seq_id] = seq
        self.loose[seq.seq_id] = seq
        for token_id in seq.request.output.stop_ids:
            self.stop_ids[token_id] = self.stop_ids.get(token_id, 0) + 1

    def release(self, seq: Sequence) -> None:
        """`seq` runs here no more (its counters its own again)."""
        del self.running[seq.seq_id]
        if seq.cohort is None:
            del self.loose[seq.seq_id]
        else:
            self.cohort.leave(seq)
        for token_id in seq.request.output.stop_ids:
            if self.stop_ids[token_id] == 1:
                del self.stop_ids[token_id]
            else:
                self.stop_ids[token_id] -= 1

    def unjoin(self, seqs: Iterable[Sequence]) -> None:
        """Members that left the cohort: planned one by one again."""
        for seq in seqs:
            self.loose[seq.seq_id] = seq

    @property
    def can_resume(self) -> bool:
        """An operator may let it admit again: it is up and neither leaving nor stopping."""
        return self.is_up and not (self.is_leaving or self.is_stopping)


@dataclass(slots=True)  # (one per row and step: slots make it twice as fast to build as a tuple)
class ScheduledRow:
    """One sequence's share of a step: its next `num_tokens` tokens, and the KV blocks it was
    given for them. Never changed once made (Sequence.decode_row is reused)."""

    seq: Sequence
    num_tokens: int
    new_block_ids: list[int] | tuple[()]  # () for most decode rows (nothing allocated)
    samples: bool = False  # it reaches the sequence's last known token: a sample comes back
    seq_id: int = field(init=False)  # its sequence's (at hand for the step message's columns)
    slot_index: int = field(init=False)  # its sequence's slot, -1 on the base model: sorts rows

    def __post_init__(self) -> None:
        self.seq_id, self.slot_index = self.seq.seq_id, self.seq.slot_index


@dataclass
class StepPlan:
    step: int  # its number among the executor's plans (Cohort.steps)
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


class Samples(NamedTuple):
    """A step's answer as the step stream brings it: its samples as columns."""

    seq_ids: SequenceOf[int]
    token_ids: SequenceOf[int]
    logprobs: SequenceOf[float]

    @classmethod
    def of(cls, samples: Iterable[Sample]) -> "Samples":
        samples = list(samples)
        return cls([s.seq_id for s in samples], [s.token_id for s in samples],
                    [s.logprob for s in samples])


NO_SAMPLES = Samples((), (), ())
