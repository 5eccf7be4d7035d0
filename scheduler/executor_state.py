"""What the scheduler knows of one executor: the single source of truth for placement. Each part
has one writer (tests/scheduler/test_ownership.py holds the rule):

    steps                    its running sequences and plans    the step builder (step_builder.py)
    blocks                   its KV block tables, prefix cache  BlockManager's own methods
    queue, work_tokens,      the requests waiting for it, the   Placement (placement.py)
      popularity               work ahead, adapters' demand
    slots, load_failures,    adapter residency and pins         Residency (residency.py)
      fetching_since, page_counts,
      unpin_later, counters' adapter_*
    merge                    its dedication and merge           Merges (merging.py)
    is_up, is_draining,      where it is in its life, its       the Scheduler (core.py)
      is_leaving, is_stopping, measured rates, steps answered
      rates, steps_since_up,
      counters' steps_run

`counters` live for the scheduler's process: an executor that reconnects gets a fresh view
(ExecutorLink.connect) that carries them on, so what Stats and /metrics count never goes back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.adapter_pages import PageGeometry
from common.adapter_ref import AdapterRef
from scheduler.merging import MergeState
from scheduler.queues import ExecutorQueue
from scheduler.request import Request
from scheduler.residency.slots import SlotTable
from scheduler.routing import Popularity, Rates
from scheduler.steps.block_manager import BlockManager, blocks_for
from scheduler.steps.fast_steps import FastSteps
from scheduler.steps.sequence import Sequence
from scheduler.steps.step_builder import StepBuilder

if TYPE_CHECKING:
    from scheduler.residency.residency import LoadFailure


@dataclass
class ExecutorCounters:
    """What happened on one executor since the scheduler started, across its reconnects."""

    adapter_loads: int = 0  # loads completed
    adapter_hits: int = 0  # admissions that found their adapter resident
    adapter_evictions: int = 0  # adapters evicted to make room (not by an operator)
    steps_run: int = 0  # steps that computed something, answered


@dataclass(eq=False)
class ExecutorState:
    address: str
    blocks: BlockManager
    slots: SlotTable
    steps: StepBuilder = field(default_factory=FastSteps)
    queue: ExecutorQueue = field(default_factory=ExecutorQueue)
    work_tokens: float = 0.0  # tokens still to compute for its queued and running requests
    popularity: Popularity = field(default_factory=Popularity)  # of adapters routed here
    load_failures: dict[AdapterRef, LoadFailure] = field(default_factory=dict)
    # Adapters being fetched onto it (staged or loaded, or failing and backing off): since when.
    fetching_since: dict[AdapterRef, float] = field(default_factory=dict)
    # How its memory holds adapters (its Info says; None: fixed slots outside the KV blocks, no
    # pages), and the pages each adapter it met takes.
    geometry: PageGeometry | None = None
    page_bytes: int = 0  # bytes of one page (one KV block)
    page_counts: dict[AdapterRef, int] = field(default_factory=dict)
    # Its model's longrope switch (its Info's longrope_switch_len, longrope.py; 0: none).
    rope_switch_len: int = 0
    # Sequences that left the running set while steps with their rows were in flight: they keep
    # their slot pinned until those are answered (loads are not ordered with steps: an adapter
    # loaded into the slot meanwhile would be read by them).
    unpin_later: list[Sequence] = field(default_factory=list)
    counters: ExecutorCounters = field(default_factory=ExecutorCounters)
    merge: MergeState = field(default_factory=MergeState)
    rates: Rates = field(default_factory=Rates)
    is_up: bool = False  # connected and stepping: from add_executor until on_executor_lost
    is_draining: bool = False  # admits nothing new; its running sequences finish
    is_leaving: bool = False  # gone from discovery: forget it once drained
    is_stopping: bool = False  # its health said NOT_SERVING: release it once drained
    steps_since_up: int = 0  # steps answered since it came up (this connection): its warm-up

    @property
    def running(self) -> dict[int, Sequence]:
        """Its running sequences (seq_id -> seq, in admission order)."""
        return self.steps.running

    @property
    def dedicated_to(self) -> AdapterRef | None:
        """The adapter it is dedicated to (merging.py), if any."""
        return self.merge.dedicated_to

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

    @property
    def can_resume(self) -> bool:
        """An operator may let it admit again: it is up and neither leaving nor stopping."""
        return self.is_up and not (self.is_leaving or self.is_stopping)

    def serves(self, adapter: AdapterRef | None) -> bool:
        """Requests for `adapter` may be queued here (a dedicated executor takes only its own)."""
        return self.merge.dedicated_to is None or adapter == self.merge.dedicated_to

    def can_hold(self, req: Request, adapter_pages: int = 0) -> bool:
        """All of req's KV (prompt and every token it may generate) fits this executor's blocks,
        beside its adapter's `adapter_pages` pages."""
        return (blocks_for(req.max_tokens, self.blocks.block_size) + adapter_pages
                <= self.blocks.num_blocks)
