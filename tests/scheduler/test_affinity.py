"""Slot pressure (driven by sched_world.py): the anti-starvation rule's bound, and affinity
batching's.

starvation_wait_s: a tenant's oldest request that has waited that long for an adapter in no slot
has it brought in, a slot drained for it when none is free, even while its tenant has other work
that can run. Without it, such a request waits for as long as its tenant keeps resident work
queued and other adapters take each slot that frees.
affinity_max_wait_s: within a tenant, a request whose adapter already runs goes first, but never
past a request that has waited that long.
"""

from dataclasses import replace

from scheduler.limits import Limits
from scheduler.request import Request, Status
from tests.scheduler.sched_world import World

TICK_S = 0.1  # each iteration is one step and one clock tick of this long (the engine's tick)
HOT_LEN, COLD_LEN = 12, 4  # tokens a hot and a cold request generate (a step each)
LIMITS = Limits(max_num_seqs=4, max_batched_tokens=64)  # (the default starvation_wait_s)


def waits_under_pressure(limits: Limits, num_steps: int) -> tuple[list[float], Request]:
    """Two slots. Tenant a keeps requests for its hot adapter h queued (two or more at all times,
    so it always has one that can run) and asks for cold adapters now and then; tenant b always
    has one request waiting for an adapter it has never used. h holds one slot; a's cold
    adapters and b's new ones compete for the other. The waits of a's cold requests, in order
    (one still waiting counts until the end), and the last of them."""
    w = World(num_slots=2, num_blocks=400, limits=limits)
    colds: list[Request] = []
    b_next = 0
    for i in range(num_steps):
        while w.queue().queued("a") - sum(r.status is Status.QUEUED for r in colds) < 2:
            w.request("a", "h@1", prompt_len=4, max_new=HOT_LEN)
        if i % 40 == 5 and i < num_steps - 100:  # (the last has 10 s to be served)
            colds.append(w.request("a", f"cold{i}@1", prompt_len=4, max_new=COLD_LEN))
        if not w.queue().queued("b"):
            w.request("b", f"new{b_next}@1", prompt_len=4, max_new=COLD_LEN)
            b_next += 1
        w.complete_loads()
        w.now += TICK_S - 0.01  # (step adds the rest)
        w.step()
        w.core.expire()
    waits = [(r.admitted_at if r.admitted_at is not None else w.now) - r.arrival for r in colds]
    return waits, colds[-1]


def test_no_request_waits_past_the_starvation_bound_plus_one_slot_turnaround():
    bound = LIMITS.starvation_wait_s
    assert bound == 5.0, "the default (bench/affinity.py measured it)"
    waits, last = waits_under_pressure(LIMITS, 800)
    assert len(waits) == 18 and last.status is not Status.QUEUED
    # Past the bound a slot drains for it: its sequences end within HOT_LEN steps (the longest
    # any runs), then a step to load and one to start (when a place among max_num_seqs frees).
    turnaround = (HOT_LEN + 2) * TICK_S
    assert max(waits) <= bound + turnaround, waits


def test_without_the_rule_a_cold_adapter_starves_behind_its_tenants_resident_work():
    waits, _ = waits_under_pressure(replace(LIMITS, starvation_wait_s=0.0), 800)
    assert max(waits) > 4 * LIMITS.starvation_wait_s, waits


def test_a_slot_drains_for_a_request_once_it_has_waited_the_bound_not_before():
    """Both slots run long sequences (every place taken); a cold request for tenant a waits. It
    drains a slot once it has waited starvation_wait_s, not before."""
    w = World(num_slots=2, num_blocks=400,
              limits=Limits(max_num_seqs=2, max_batched_tokens=64, starvation_wait_s=2.0))
    w.request("a", "h@1", prompt_len=4, max_new=100)
    w.request("b", "x@1", prompt_len=4, max_new=100)
    w.complete_loads()
    w.step()
    cold = w.request("a", "cold@1", prompt_len=4, max_new=2)
    while w.now - cold.arrival < 1.9:
        w.complete_loads()
        w.now += TICK_S - 0.01
        w.step()
    assert not any(s.reserved_for for s in w.slots())
    for _ in range(2):
        w.now += TICK_S - 0.01
        w.step()
    assert [s.reserved_for for s in w.slots()].count(cold.ask.adapter) == 1, \
        "past 2 s a slot drains"


def test_affinity_prefers_a_running_adapter_but_not_past_its_wait():
    """Tenant a has y (resident, idle) and x (running) queued: a younger x goes ahead of an
    older y only while y has waited less than affinity_max_wait_s."""
    limits = Limits(max_num_seqs=2, max_batched_tokens=64, affinity_max_wait_s=1.0)
    w = World(num_slots=2, num_blocks=400, limits=limits)
    w.request("a", "x@1", prompt_len=2, max_new=200)
    y_warm = w.request("a", "y@1", prompt_len=2, max_new=1)
    w.complete_loads()
    for _ in range(3):
        w.step()
    assert w.finished(y_warm), "y is resident and idle now; x runs"
    y = w.request("a", "y@1", prompt_len=2, max_new=1)
    w.now += 0.01
    x = w.request("a", "x@1", prompt_len=2, max_new=200)
    w.step()
    assert x.status is Status.RUNNING and y.status is Status.QUEUED, "the running adapter first"
    w.request("a", "x@1", prompt_len=2, max_new=200)  # another x, younger than y
    w.core.cancel(x)  # a place frees
    w.now = y.arrival + 1.0
    w.step()
    assert y.status is not Status.QUEUED, "y has waited affinity_max_wait_s: it goes first"
