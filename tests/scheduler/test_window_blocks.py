"""Window blocks in the scheduler (issue 45, scheduler/steps/block_manager.py): a window kind's
table holds blocks only for what its next row reads, given back as prefill chunks and decode
move on and reused by others; the prefix cache gives a new sequence a global kind's whole chain
and a window kind's blocks behind the prefix's end only, and matches no further than those are
cached. The stand-in executor (test_pipelined_steps) checks that every row reads its own KV."""

import collections

import pytest

from common.kv_layout import KVLayout
from loraplex.admin_cli import format_stats
from scheduler.limits import Limits
from scheduler.metrics import SchedulerMetrics
from scheduler.sim.invariants import check_invariants
from scheduler.stats_pb import stats_pb
from scheduler.steps.block_manager import BlockManager, Hits, KindBlocks
from scheduler.steps.sequence import Samples
from tests.scheduler.sched_world import World
from tests.scheduler.test_pipelined_steps import StandInExecutor

BS, WINDOW = 4, 6
# a global layer beside three of a 6-key window: blocks of 1 layer, 3 per window token block
LAYOUT = KVLayout.of([WINDOW, None, WINDOW, WINDOW])


def run(w: World, executor: StandInExecutor, watch=None, max_steps: int = 500) -> None:
    """Step the world's executor through the stand-in until its work is done; `watch()` after
    each plan."""
    ex = w.executors[0]
    for _ in range(max_steps):
        w.now += 0.01
        plan = w.core.schedule(ex)
        if not plan and not plan.freed and not w.core.has_work(ex):
            return
        if watch is not None:
            watch()
        w.core.on_step_done(ex, plan, Samples.of(executor.run(plan)))
        check_invariants(w.core, w.requests)
    raise AssertionError("work did not drain")


@pytest.mark.parametrize("chunk", [3, 8, 64])
def test_a_window_kind_holds_only_the_blocks_its_rows_read(chunk):
    w = World(num_blocks=200, block_size=BS, limits=Limits(max_batched_tokens=chunk),
              kv_layout=LAYOUT)
    executor = StandInExecutor(BS, layout=LAYOUT)
    req = w.request(prompt_len=40, max_new=30)
    blocks = w.executors[0].blocks
    most = collections.Counter()

    def watch():
        for seq_id in blocks.tables:
            window = blocks._tables[1][seq_id]  # (the window kind's entries)
            most["window"] = max(most["window"], sum(e >= 0 for e in window))
            most["global"] = max(most["global"], len(blocks.tables[seq_id]))
            # (what Stats reports: the window kind's entries behind it, 3 blocks each)
            assert blocks.num_behind_windows() == 3 * sum(e < 0 for e in window)
            most["behind"] = max(most["behind"], blocks.num_behind_windows())
        if most["behind"] and not most["shown"]:  # (Stats, its message, the CLI, /metrics)
            behind = blocks.num_behind_windows()
            response = stats_pb(w.operators.stats())
            assert response.executors[0].kv_blocks_behind_windows == behind
            assert f"{behind} KV blocks not held behind sliding windows" in format_stats(response)
            scraped = {m.name: m for m in SchedulerMetrics(w.core).registry.collect()}
            assert scraped["loraplex_kv_blocks_behind_windows"].samples[0].value == behind
            most["shown"] = 1

    run(w, executor, watch)
    assert w.finished(req) and len(req.output.token_ids) == 30
    whole = -(-69 // BS)  # (its last sample is not computed: 69 positions)
    assert most["global"] == whole
    # the window's blocks behind a row's first query, and the row's own: at most 2 + chunk's
    assert most["window"] <= -(-(WINDOW - 1) // BS) + 1 + -(-min(chunk, 40) // BS)
    assert most["window"] < whole  # (a window kind keeping the whole context fails here)
    assert most["behind"] >= 3 * (whole - most["window"]) and most["shown"]
    assert blocks.num_behind_windows() == 0  # (nothing runs)
    blocks.check()


def most_running(layout: KVLayout | None, num_blocks: int) -> tuple[int, int]:
    """Six requests of 30 + 40 tokens: the most running at once, and the preemptions."""
    w = World(num_blocks=num_blocks, block_size=BS, limits=Limits(max_batched_tokens=16),
              kv_layout=layout)
    reqs = [w.request(tenant=f"t{i}", prompt_len=30, max_new=40) for i in range(6)]
    running, preempted = collections.Counter(), []
    preempt = w.core._preempt
    w.core._preempt = lambda ex, seq: preempted.append(seq) or preempt(ex, seq)
    run(w, StandInExecutor(BS, layout=layout), lambda: running.update([len(w.running())]))
    assert all(w.finished(r) and len(r.output.token_ids) == 40 for r in reqs)
    return max(running), len(preempted)


def test_blocks_a_window_gave_back_serve_other_sequences():
    """The same memory, 180 one-layer blocks: with window blocks all six requests run at once
    to their end (18 global and at most 9 window blocks each), none preempted; with every layer
    keeping the whole context (45 blocks of 4 layers, 18 each at their end) they are."""
    assert most_running(LAYOUT, 180) == (6, 0)
    assert most_running(None, 45)[1] > 0


def test_a_prefix_takes_the_global_chain_and_the_window_behind_its_end():
    bm = BlockManager(num_blocks=60, block_size=BS, layout=LAYOUT)
    hashes = [bytes([i]) * 16 for i in range(8)]
    table = bm.start(1, [], 32)  # a sequence of 32 tokens computed: 8 token blocks
    assert isinstance(table, KindBlocks) and [len(t) for t in table] == [8, 8 * 3]
    for i, h in enumerate(hashes):
        bm.publish(1, i, h)
    bm.free(1)
    hits = bm.match(hashes[:6])
    # 6 blocks (24 tokens): a row from 24 reads keys 19.. : window blocks 4 and 5
    assert isinstance(hits, Hits) and len(hits) == 6
    assert hits.tables[1][:4] == [-1] * 4 and -1 not in hits.tables[1][4:]
    new = bm.start(2, hits, 27)
    assert bm.first_blocks(2) == (0, 4)
    assert [len(t) for t in new] == [7, 3 * 3]  # (the window's 2 hit blocks and one fresh)
    bm.check()
    bm.free(2)
    bm.check()


def test_a_prefix_matches_no_further_than_its_window_blocks_are_cached():
    bm = BlockManager(num_blocks=60, block_size=BS, layout=LAYOUT)
    hashes = [bytes([i]) * 16 for i in range(8)]
    bm.start(1, [], 32)
    for i, h in enumerate(hashes):
        bm.publish(1, i, h)
    # its window entries of blocks 4, 6 and 7 unhashed: as if evicted
    window = bm._tables[1][1]
    for index in (4, 6, 7):
        key = hashes[index] + bytes((1,))
        del bm._hash_of[bm._block_of.pop(key)]
    bm.free(1)
    bm.check()
    hits = bm.match(hashes)
    # a prefix of 8 blocks needs the window's 6 and 7, of 7 blocks 5 and 6, of 6 blocks 4
    # and 5, of 5 blocks 3 and 4: of 4 blocks, 2 and 3 (keys 11.. from position 16)
    assert len(hits) == 4 and hits.tables[1] == [-1, -1, window[2], window[3]]
    assert bm.match(hashes[:2]).tables[1] == [window[0], window[1]]


def test_pages_come_from_whole_cached_entries_and_settle_per_block():
    bm = BlockManager(num_blocks=12, block_size=BS, layout=LAYOUT)
    bm.start(1, [], 8)  # 2 global + 2 x 3 window blocks
    bm.publish(1, 0, b"h" * 16)
    bm.free(1, last_step=3)
    assert bm.num_free == 12 and bm.num_settled() == 12 - 8
    bm.settle(3)
    assert bm.num_settled() == 12
    pages = bm.take_pages(10)
    assert pages is not None and len(set(pages)) == 10 and bm.num_free == 2
    bm.check()


def test_a_request_that_would_never_fit_is_not_placed():
    """can_hold counts a window kind's blocks at most (its window and a row), not the whole."""
    w = World(num_blocks=20, block_size=BS, limits=Limits(max_batched_tokens=4),
              kv_layout=KVLayout.of([WINDOW] * 2))
    ex = w.executors[0]
    assert ex.can_hold(400, chunk=4)  # 3 blocks at most, whatever the length
    assert not World(num_blocks=20, block_size=BS).executors[0].can_hold(400)
    req = w.request(prompt_len=100, max_new=60)
    run(w, StandInExecutor(BS, layout=KVLayout.of([WINDOW] * 2)))
    assert w.finished(req)


def test_the_step_message_counts_each_kinds_blocks():
    from scheduler.executor_link import step_request

    w = World(num_blocks=60, block_size=BS, limits=Limits(max_batched_tokens=64),
              kv_layout=LAYOUT)
    w.request(prompt_len=10, max_new=3)
    plan = w.core.schedule(w.executors[0])
    msg = step_request(plan, num_kinds=2)
    assert list(msg.row_num_new_blocks) == [3, 9]  # 3 token blocks: 3 global, 3 x 3 window
    assert len(msg.new_block_ids) == 12 and list(msg.new_sequences[0].first_blocks) == [0, 0]


@pytest.mark.parametrize("layout", [LAYOUT, None], ids=["window", "whole"])
@pytest.mark.parametrize("prompt_len,first_end", [(40, 41), (40, 9), (3, 4)])
def test_a_whole_run_is_what_a_start_takes_and_then_to_grow(layout, prompt_len, first_end):
    """can_start(max_tokens=) (admission under adapter pressure) counts what `start` takes and
    what `to_grow` then says the sequence will still take, no more: a window kind up to its
    window, not the whole run."""
    blocks = BlockManager(400, BS, layout)
    max_tokens = 90
    cost = max(r for r in range(401) if blocks.can_start([], prompt_len + 1, first_end,
                                                        max_tokens, reserved=r))
    cost = blocks.num_free - cost
    free = blocks.num_free
    blocks.start(1, [], prompt_len + 1, first_end)
    assert cost == free - blocks.num_free + blocks.to_grow(1, max_tokens)
    every_kind_whole = -(-max_tokens // BS) * sum(kind.columns for kind in blocks.layout.kinds)
    assert cost == every_kind_whole if layout is None else cost < every_kind_whole
