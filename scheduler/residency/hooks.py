"""What an executor's residency (executor_residency.py) is given and hands out: the hooks it calls
out through, its counters, and the loads it starts."""

from collections.abc import Callable, Collection
from dataclasses import dataclass

from common.adapter_ref import AdapterRef
from scheduler.executor_state import ExecutorState
from scheduler.limits import Limits
from scheduler.request import Request


@dataclass
class AdapterCounters:
    """What happened to one executor's adapters since the scheduler started, across its
    reconnects (Residency keeps them by address)."""

    loads: int = 0  # loads completed
    hits: int = 0  # admissions that found their adapter resident
    evictions: int = 0  # adapters evicted to make room (not by an operator)
    # Of those, adapters evicted before they served anyone since their load: loaded too soon,
    # or given up too early (churn: the requests they were loaded for load them again).
    early_evictions: int = 0


@dataclass(frozen=True)
class Load:
    """A load to start (the engine's LoadAdapter): `adapter` into slot `slot`, its weights into
    `pages`; `is_from_staged`: it copies bytes already staged on the executor's host."""

    slot: int
    adapter: AdapterRef
    num_bytes: int  # (sizes the load's deadline)
    pages: tuple[int, ...]
    is_from_staged: bool


@dataclass(frozen=True)
class Hooks:
    """What residency calls out to: the executors' RPCs (the engine's, or the simulator's), the
    store, and the other managers, asked what it decides by (their answers, bound by the
    core)."""

    limits: Limits
    clock: Callable[[], float]
    start_load: Callable[[ExecutorState, Load], None]
    # (executor, slot index, adapter, done=None): empty the slot; with `done`, the slot of a
    # failed load whose pages wait for the executor's word, told whether it came
    start_unload: Callable[..., None]
    start_stage: Callable[[ExecutorState, AdapterRef, int], None]  # (executor, adapter, bytes)
    warm_host: Callable[[AdapterRef], None]  # a store brings it into its RAM tier
    charge_load: Callable[[Request, ExecutorState], None]  # Admission: req caused a fetch
    observe_load: Callable[[ExecutorState, int, float], None]  # the core: bytes in seconds
    # Placement: the adapters queued requests want on the executor, and their popularity there
    # at a time.
    wanted: Callable[[ExecutorState], Collection[AdapterRef | None]]
    popularity: Callable[[ExecutorState, float], Callable[[AdapterRef], float]]
    # The KV blocks a load of an adapter leaves to others: those the executor's running
    # sequences will still grow into (its step builder's), and those the requests queued ahead
    # of the adapter's will take (Placement.kv_ahead).
    kv_ahead: Callable[[ExecutorState, AdapterRef | None], int]
