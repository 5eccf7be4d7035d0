"""The eviction yardsticks (scheduler/sim/belady.py) against brute force, the simulator driving
the real scheduler core on a small workload, and the simulator kept out of serving code."""

import ast
import functools
import pathlib
import random

import pytest

from common.adapter_pages import plan_pages
from common.adapter_ref import AdapterRef
from common.peft.modules import LORA_MODULES
from scheduler.sim.belady import belady_hits, lru_hits, pinned_belady_hits
from scheduler.sim.config import SimConfig
from scheduler.sim.invariants import check_invariants
from scheduler.sim.simulator import Simulator, format_report


def best_hits(events: list[tuple[str, str, int]], capacity: int) -> int:
    """The most hits any eviction choice reaches on a pinned trace (exhaustive search); pinned
    items cannot be evicted unless every cached one is pinned."""
    pins_before, pins = [], {}
    for kind, item, _ in events:
        pins_before.append(dict(pins))
        pins[item] = pins.get(item, 0) + (1 if kind == "+" else -1)

    @functools.cache
    def hits(i: int, cached: frozenset) -> int:
        if i == len(events):
            return 0
        kind, item, _ = events[i]
        if kind == "-":
            return hits(i + 1, cached)
        if item in cached:
            return 1 + hits(i + 1, cached)
        if len(cached) < capacity:
            return hits(i + 1, cached | {item})
        victims = [c for c in cached if not pins_before[i].get(c)] or list(cached)
        return max(hits(i + 1, cached - {v} | {item}) for v in victims)

    return hits(0, frozenset())


def unpinned(trace: list[str]) -> list[tuple[str, str, int]]:
    return [e for item in trace for e in (("+", item, 0), ("-", item, 0))]


def pinned_trace(rng: random.Random, capacity: int) -> list[tuple[str, str, int]]:
    """Random sequence starts and ends that never pin more distinct items than `capacity` (as on
    an executor: every running sequence's adapter holds a slot)."""
    events, running = [], []
    for seq in range(1, rng.randint(2, 16)):
        item = rng.choice("abcdef")
        distinct = {i for i, _ in running}
        is_full = item not in distinct and len(distinct) >= capacity
        if running and (rng.random() < 0.45 or is_full):
            events.append(("-", *running.pop(rng.randrange(len(running)))))
        else:
            events.append(("+", item, seq))
            running.append((item, seq))
    return events + [("-", item, seq) for item, seq in running]


def test_belady_is_the_optimum_without_pins():
    rng = random.Random(0)
    for _ in range(400):
        trace = [rng.choice("abcdef") for _ in range(rng.randint(1, 14))]
        capacity = rng.randint(1, 4)
        assert belady_hits(trace, capacity) == best_hits(unpinned(trace), capacity), \
            (trace, capacity)
        assert lru_hits(trace, capacity) <= belady_hits(trace, capacity)


def test_pinned_belady_is_the_optimum_under_the_same_pins():
    rng = random.Random(1)
    for _ in range(1500):
        capacity = rng.randint(1, 3)
        events = pinned_trace(rng, capacity)
        got = pinned_belady_hits(events, capacity)
        assert got == best_hits(events, capacity), (events, capacity)
        assert got <= belady_hits([item for kind, item, _ in events if kind == "+"], capacity)


def test_a_pin_forces_a_worse_victim():
    # Two slots; "a" runs throughout and is never asked for again. Without pins, "c" replaces "a"
    # and "b" hits; with a's pin, "c" must replace "b", which then misses.
    events = [("+", "a", 1), ("+", "b", 2), ("-", "b", 2), ("+", "c", 3), ("-", "c", 3),
              ("+", "b", 4), ("-", "b", 4), ("-", "a", 1)]
    assert belady_hits(["a", "b", "c", "b"], 2) == 1
    assert pinned_belady_hits(events, 2) == 0 == best_hits(events, 2)


SMALL = {
    "seed": 3, "num_requests": 4000,
    "arrivals": {"process": "bursty", "rate_per_s": 120, "burst_factor": 3, "burst_period_s": 5},
    "lengths": {"prompt_mean": 64, "prompt_max": 512, "output_mean": 16, "output_max": 64},
    "adapters": {"count": 60, "zipf_s": 1.0, "ranks": [8, 16], "bytes_per_rank": 5_242_880},
    "tenants": {"count": 3, "weights": [1, 1, 2]},
    "executors": {"count": 2, "slots": 6, "kv_blocks": 512, "block_size": 16},
}


def checked(sim: Simulator) -> Simulator:
    """`sim`, its core's invariants checked after every step it plans."""
    core_schedule = sim.core.schedule

    def checked_schedule(ex):
        plan = core_schedule(ex)
        check_invariants(sim.core)
        return plan

    sim.core.schedule = checked_schedule
    return sim


@pytest.fixture(scope="module")
def small_run():
    config = SimConfig.from_dict(SMALL)
    sim = checked(Simulator(config))
    return config, sim, sim.run()


def test_simulator_finishes_every_request_within_the_yardsticks(small_run):
    config, _, result = small_run
    assert result.unfinished == 0
    assert sum(t.requests for t in result.tenants.values()) == config.num_requests
    assert result.adapter_admissions >= config.num_requests
    hits = result.adapter_admissions - result.loads
    # No online policy beats the clairvoyant one under the same pins, which no pins can beat.
    assert 0 < hits <= result.pinned_belady_hits <= result.belady_hits
    assert result.max_counter_gap <= result.fairness_bound
    report = format_report(config, result)
    assert "with the same pins" in report and "t2" in report


def test_simulator_traces_never_pin_more_adapters_than_slots(small_run):
    config, sim, _ = small_run
    for events in sim.trace.values():
        running: dict[str, int] = {}
        for kind, adapter, _ in events:
            running[adapter] = running.get(adapter, 0) + (1 if kind == "+" else -1)
            assert sum(1 for n in running.values() if n > 0) <= config.executors.slots
            assert running[adapter] >= 0
        assert not any(running.values())  # every sequence that started also ended


def test_serving_code_never_imports_the_simulator():
    """scheduler/sim/ is offline tooling: no scheduler module outside it imports it (the CLI's
    `simulate` and `fit-cost` import it lazily)."""
    root = pathlib.Path(__file__).resolve().parents[2] / "scheduler"
    wrong = []
    for path in sorted(root.rglob("*.py")):
        if path.parent.name == "sim":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if isinstance(node, ast.ImportFrom) and node.module == "scheduler":
                names += [f"scheduler.{alias.name}" for alias in node.names]
            wrong += [f"{path.name} imports {n}" for n in names
                      if n == "scheduler.sim" or n.startswith("scheduler.sim.")]
    assert not wrong, wrong


def test_the_merge_policy_merges_a_heavy_adapter_in_the_simulator_and_loses_nothing():
    raw = {**SMALL, "num_requests": 3000,
           "adapters": {**SMALL["adapters"], "heavy_share": 0.8},
           "cost": {"step_per_lora_token_s": 0.000004},
           "limits": {"merge_share": 0.5, "unmerge_share": 0.2, "merge_window_s": 2.0}}
    sim = Simulator(SimConfig.from_dict(raw))
    merged_steps = []
    step_seconds = sim._step_seconds

    def checked(ex, plan):  # invariants, and which steps ran with an adapter merged
        check_invariants(sim.core)
        merged_steps.append(sim.core.merges.is_merged(ex))
        return step_seconds(ex, plan)

    sim._step_seconds = checked
    result = sim.run()
    assert result.unfinished == 0
    assert sum(t.requests for t in result.tenants.values()) == 3000
    assert any(merged_steps) and not all(merged_steps), "merged after a window of traffic"
    assert any(sim.core.merges.dedicated_to(ex) == AdapterRef("a0", 1) for ex in sim.executors)


@pytest.mark.parametrize("seed", [3, 9, 15, 27])
def test_two_slots_under_a_tight_fairness_window_never_stall(seed):
    """Seeds at which a slot kept its reservation for an adapter loaded into the other slot, and
    an executor ran nothing with hundreds of requests queued, for good (no fault injected)."""
    spec = {**SMALL, "seed": seed, "num_requests": 1500,
            "executors": {"count": 2, "slots": 2, "kv_blocks": 96, "block_size": 16},
            "limits": {"fairness_window": 200.0, "max_num_seqs": 8, "max_batched_tokens": 128}}
    assert Simulator(SimConfig.from_dict(spec)).run().unfinished == 0


@pytest.mark.parametrize("memory", ["pages", "padded"])
def test_adapters_in_pages_of_the_kv_blocks_keep_every_invariant(memory):
    """Executors whose adapters take pages of the KV blocks, by their ranks or padded to the
    largest: every request finishes, the invariants hold at every step, and each adapter's pages
    are what its ranks (or the largest rank) take."""
    spec = {**SMALL, "num_requests": 1500,
            "adapters": {**SMALL["adapters"], "ranks": [8, 16, 64], "rank_shares": [6, 3, 1]},
            "executors": {**SMALL["executors"], "kv_blocks": 600, "memory": memory}}
    config = SimConfig.from_dict(spec)
    sim = checked(Simulator(config))
    result = sim.run()
    assert result.unfinished == 0 and result.loads > 0
    geometry = config.executors.geometry()
    counts = {a: n for ex in sim.executors
              for a, n in sim.core.residency.of(ex).planned_pages().items()}
    assert len(counts) > 10
    for adapter, n in counts.items():
        rank = sim._ranks[int(adapter.name[1:])] if memory == "pages" else 64
        assert n == plan_pages(dict.fromkeys(LORA_MODULES, rank), geometry).num_pages
    assert "adapter memory: " + memory in format_report(config, result)
