"""Prefix caching in the scheduler (block_manager.py, prefix_cache.py, core.py): which requests
reuse which blocks, what they compute and are charged, and how cached blocks are evicted."""

from hypothesis import given, settings
from hypothesis import strategies as st

from common.detokenizer import Finish, OutputProcessor
from common.sampling import SamplingParams
from scheduler.fairness import FairnessWeights
from scheduler.limits import Limits
from scheduler.request import Ask, Request, Status, TokenEvent
from scheduler.sim.invariants import check_invariants
from scheduler.steps.block_manager import BlockManager
from scheduler.steps.prefix_cache import cache_key, extend_hashes
from scheduler.steps.sequence import Sample, Samples
from tests.scheduler.sched_world import World, ref

SYSTEM = list(range(100, 112))  # a 12-token shared prompt start: 3 blocks of 4


def submit(w: World, tenant: str = "t", prompt: list[int] = SYSTEM + [1, 2], adapter=None,
           max_new: int = 2, salt: str = "", lora_from: int = 0) -> Request:
    rid = next(w._ids)
    w.events[rid] = []
    ask = Ask(tenant, ref(adapter) if adapter else None, 2**20, tuple(prompt), SamplingParams(),
              cache_salt=salt, lora_from=lora_from)
    req = Request(rid, ask, OutputProcessor(None, max_new_tokens=max_new), w.events[rid].append)
    w.core.submit(req)
    w.requests.append(req)
    return req


def first_row(w: World, req: Request):
    """Plan one step and return req's row in it (then answer the step)."""
    ex = w.executors[0]
    plan = w.core.schedule(ex)
    row = next(r for r in plan.rows if r.seq.request is req)
    w.core.on_step_done(ex, plan, Samples.of(
        Sample(r.seq.seq_id, 7, -0.1) for r in plan.rows if r.samples))
    return row


def test_a_repeated_prefix_is_computed_once_and_its_blocks_are_shared():
    w = World(num_blocks=32)
    a = submit(w)
    w.run()
    b = submit(w, prompt=SYSTEM + [7, 8, 9])
    row = first_row(w, b)
    assert row.seq.num_cached == 12 and row.num_tokens == 3, "3 cached blocks, 3 tokens to go"
    assert row.new_block_ids[:3] == w.executors[0].blocks.tables[row.seq.seq_id][:3]
    assert b.charges.cached_prompt_tokens == 12 and a.charges.cached_prompt_tokens == 0
    w.run()
    assert w.finished(b)


def test_the_last_prompt_token_is_always_computed():
    w = World(num_blocks=32)
    submit(w, prompt=SYSTEM)
    w.run()
    again = submit(w, prompt=SYSTEM)  # every block cached: the last one is computed again
    row = first_row(w, again)
    assert row.seq.num_cached == 8 and row.num_tokens == 4 and row.samples


def test_blocks_are_shared_within_a_tenant_or_pool_never_across_salts_or_adapters():
    """Default scope: within a tenant; pool scope: across tenants; never another salt or adapter."""
    for scope, tenant, salt, adapter, expect in [
            ("tenant", "t", "", None, 12), ("tenant", "u", "", None, 0),
            ("pool", "u", "", None, 12), ("pool", "u", "s1", None, 0),
            ("pool", "t", "", "a@1", 0), ("off", "t", "", None, 0)]:
        w = World(num_blocks=32, limits=Limits(prefix_cache=scope))
        submit(w, tenant="t")
        w.complete_loads()
        w.run()
        req = submit(w, tenant=tenant, salt=salt, adapter=adapter)
        w.complete_loads()
        row = first_row(w, req)
        assert row.seq.num_cached == expect, (scope, tenant, salt, adapter)


def test_an_activated_lora_shares_the_base_models_blocks_before_its_invocation():
    """Issue 43: a base request computes a context; an activated LoRA on that context plus its
    invocation (at position 13: blocks 0-2 lie wholly before it) takes those 3 blocks from the
    cache and computes only from its activation block on, and is charged for what it computes;
    a second aLoRA adapter on it shares them too, and its own blocks from the activation on are
    its adapter's (an ordinary adapter on the same context shares nothing). Its adapter's blocks
    go when the adapter is evicted, the base model's stay."""
    invocation = [900, 901]
    context = SYSTEM + [1]  # 13 tokens; the invocation starts at 13
    w = World(num_blocks=64, num_slots=3)
    submit(w, prompt=context + [5])
    w.run()
    first = submit(w, prompt=context + invocation + [7], adapter="alora-a@1", lora_from=13)
    w.complete_loads()
    row = first_row(w, first)
    assert row.seq.num_cached == 12 and row.num_tokens == 4
    assert first.charges.cached_prompt_tokens == 12
    w.run()
    second = submit(w, prompt=context + invocation + [8], adapter="alora-b@1", lora_from=13)
    w.complete_loads()
    assert first_row(w, second).seq.num_cached == 12
    plain = submit(w, prompt=context + invocation + [9], adapter="plain@1")
    w.complete_loads()
    assert first_row(w, plain).seq.num_cached == 0
    w.run()
    again = submit(w, prompt=context + invocation + [7, 1, 2, 3], adapter="alora-a@1",
                   lora_from=13)
    w.complete_loads()
    assert first_row(w, again).seq.num_cached == 16  # (its own block 3, from the activation)
    w.run()
    blocks = w.executors[0].blocks
    assert blocks.drop_cached_of(ref("alora-a@1")) > 0  # (its block from the activation on)
    base = submit(w, prompt=context + [6])
    assert first_row(w, base).seq.num_cached == 12  # the base model's blocks stayed


def test_fairness_charges_only_the_prompt_tokens_computed():
    counters = {}
    for scope in ("tenant", "off"):
        w = World(num_blocks=32, limits=Limits(prefix_cache=scope))
        submit(w)
        w.run()
        submit(w)
        w.run()
        counters[scope] = w.core.fair.counter("t")
    cached = 12 * w.core.fair.weights.input_weight  # of the second request's 14 prompt tokens
    assert counters["off"] - counters["tenant"] == cached


def test_a_preempted_sequence_resumes_from_its_own_cached_blocks():
    w = World(num_blocks=10, limits=Limits(max_batched_tokens=64, fairness_window=0.0),
              weights=FairnessWeights(tenant_weights={"a": 0.01}))  # a: the one preempted
    long = submit(w, tenant="a", prompt=SYSTEM, max_new=24)  # grows to 9 blocks
    w.step()
    other = submit(w, tenant="b", prompt=list(range(200, 212)), max_new=12)
    ex = w.executors[0]
    for _ in range(40):
        w.step()
        if long.status is Status.QUEUED:
            break
    assert long.status is Status.QUEUED, "preempted to make room"
    while long.status is Status.QUEUED:
        w.step()
    seq = next(s for s in w.running(ex).values() if s.request is long)
    assert seq.num_cached >= 12, "its prompt's blocks (at least) were still cached"
    w.run()
    assert w.finished(long) and w.finished(other)
    assert long.charges.cached_prompt_tokens == 0, "counted at its first admission only"


def test_cached_blocks_are_evicted_least_recently_used_and_only_when_nothing_is_free():
    bm = BlockManager(num_blocks=4, block_size=2)
    key = b"k"
    chains = {}
    for seq_id, tokens in [(1, [1, 2]), (2, [3, 4])]:
        hashes: list[bytes] = []
        extend_hashes(hashes, key, tokens, 2)
        chains[seq_id] = hashes
        bm.start(seq_id, [], 2)
        bm.publish(seq_id, 0, hashes[0])
    bm.free(1)
    bm.free(2)  # blocks of 1 then 2 cached; 2 free blocks left
    bm.check()
    assert bm.num_free == 4 and bm.num_cached == 2
    bm.start(3, [], 4)  # takes the 2 free blocks: nothing cached evicted
    assert bm.match(chains[1]) and bm.match(chains[2])
    bm.start(4, [], 2)  # must evict: the least recently used is seq 1's
    assert not bm.match(chains[1]) and bm.match(chains[2])
    bm.check()
    assert bm.can_grow(4, 4) and not bm.can_grow(4, 6), "only the cached block may be taken"


def test_cancel_drops_a_sequences_references():
    w = World(num_blocks=32)
    submit(w)
    w.run()
    req = submit(w)
    w.step()
    ex = w.executors[0]
    shared = ex.blocks.tables[next(iter(w.running(ex)))][:3]
    w.core.cancel(req)
    assert not w.running(ex) and all(b not in ex.blocks._refs for b in shared)
    assert ex.blocks.num_free == 32 and ex.blocks.num_cached == 3
    ex.blocks.check()


def test_stats_show_cached_blocks_and_cached_prompt_tokens():
    w = World(num_blocks=32)
    submit(w)
    w.run()
    submit(w)
    w.run()
    stats = w.operators.stats()
    assert stats.executors[0].cached_kv_blocks == 3
    totals = next(t.totals for t in stats.tenants if t.tenant == "t")
    assert (totals.prompt_tokens, totals.cached_prompt_tokens) == (28, 12)


def test_hashes_chain_over_every_earlier_block():
    a: list[bytes] = []
    b: list[bytes] = []
    key = cache_key("tenant", "t", None, "")
    extend_hashes(a, key, [1, 2, 3, 4, 5, 6], 2)
    extend_hashes(b, key, [9, 2, 3, 4, 5, 6], 2)
    assert len(a) == 3 and all(x != y for x, y in zip(a, b)), "a different first block"
    c: list[bytes] = []
    extend_hashes(c, key, [1, 2, 3], 2)
    extend_hashes(c, key, [1, 2, 3, 4, 5, 6, 7], 2)
    assert c == a, "extending block by block gives the same chain"
    assert cache_key("tenant", "t", None, "") != cache_key("tenant", "u", None, "")
    assert cache_key("pool", "t", None, "") == cache_key("pool", "u", None, "")


ops = st.lists(st.tuples(st.sampled_from(["start", "grow", "try_grow", "publish", "free"]),
                         st.integers(0, 5), st.integers(0, 3), st.integers(1, 12)),
               max_size=80)


@settings(max_examples=200, deadline=None)
@given(ops=ops)
def test_block_manager_keeps_every_block_free_cached_or_referenced(ops):
    """Random starts (with whatever prefix matches), growth (tried or checked first), publishes
    and frees of sequences of two keys' prompts: reference counts match the tables, no block is
    lost, no block is in two states, and a match never returns a block another key published."""
    bm = BlockManager(num_blocks=10, block_size=2)
    keys = [b"k0", b"k1"]
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 50, 60, 70, 80, 9, 10]]
    owner: dict[int, int] = {}  # seq -> its prompt / key index
    published_by: dict[int, bytes] = {}  # block -> key of whoever published it
    for op, seq, which, n in ops:
        if op == "start" and seq not in bm.tables:
            which %= 2
            hashes: list[bytes] = []
            extend_hashes(hashes, keys[which], prompts[which][:n], 2)
            hits = bm.match(hashes)
            assert all(published_by.get(b) == keys[which] for b in hits)
            if bm.can_start(hits, n):
                bm.start(seq, hits, n)
                owner[seq] = which
        elif op == "grow" and seq in bm.tables and bm.can_grow(seq, n):
            bm.grow(seq, n)
        elif op == "try_grow" and seq in bm.tables:  # grow when it can, else take nothing
            could, before = bm.can_grow(seq, n), list(bm.tables[seq])
            new = bm.try_grow(seq, n)
            assert (new is not None) == could
            assert bm.tables[seq] == before + (new or [])
        elif op == "publish" and seq in bm.tables:
            which = owner[seq]
            hashes = []
            extend_hashes(hashes, keys[which], prompts[which], 2)
            table = bm.tables[seq]
            for i in range(min(len(table), len(hashes))):
                if table[i] not in published_by or published_by[table[i]] == keys[which]:
                    bm.publish(seq, i, hashes[i])
                    if bm.match(hashes[:i + 1])[-1:] == [table[i]]:
                        published_by[table[i]] = keys[which]
        elif op == "free":
            bm.free(seq)
        live = {b for b, h in bm._hash_of.items()}
        published_by = {b: k for b, k in published_by.items() if b in live}
        bm.check()


def test_eviction_takes_a_chains_tail_before_its_head():
    bm = BlockManager(num_blocks=3, block_size=2)
    hashes: list[bytes] = []
    extend_hashes(hashes, b"k", [1, 2, 3, 4, 5, 6], 2)
    bm.start(1, [], 6)
    for i, h in enumerate(hashes):
        bm.publish(1, i, h)
    bm.free(1)
    bm.start(2, [], 2)  # one block, evicted from the cached chain
    assert len(bm.match(hashes)) == 2, "the first two blocks still match"


def test_a_block_its_last_sample_fills_is_cached_when_a_step_behind_computed_it():
    """Steps are pipelined: the step behind computes a sampled token's KV before the sample's
    answer is read. A sequence that then stops on that token leaves its full last block cached
    (named on the answer, as the sequence ends), and a next turn reuses it."""
    w = World(num_blocks=32)
    rid = next(w._ids)
    w.events[rid] = []
    prompt = SYSTEM + [1, 2, 3]  # 15 tokens: the first sample completes block 3
    first = Request(rid, Ask("t", None, 2**20, tuple(prompt), SamplingParams()),
                    OutputProcessor(None, max_new_tokens=10, stop_token_ids=[7]),
                    w.events[rid].append)
    w.core.submit(first)
    ex = w.executors[0]
    prefill, behind = w.core.schedule(ex), w.core.schedule(ex)
    (row,) = behind.rows
    assert row.seq.num_computed == 16, "the step behind computes the sampled token"
    stop = Sample(row.seq.seq_id, 7, -0.1)  # 7: a stop token
    w.core.on_step_done(ex, prefill, Samples.of([stop]))
    w.core.on_step_done(ex, behind, Samples.of([Sample(row.seq.seq_id, 5, -0.1)]))
    assert first.finish_reason is Finish.STOP
    turn = submit(w, prompt=prompt + [7, 5])
    assert first_row(w, turn).seq.num_cached == 16, "all 4 blocks reused"


def test_short_and_long_runs_of_a_longrope_model_never_share_blocks():
    """A longrope model (switch 16, scheduler/steps/longrope.py): a block's KV differs between a
    run that started within the switch (short factors) and one past it (long). A long prompt reuses
    no short run's block; long runs reuse each other's, short runs theirs. A short run that
    outgrows the switch ends at 17 tokens and runs again from all of them, long, under the long
    key, its tokens streamed once."""
    w = World(num_blocks=64, rope_switch_len=16)
    submit(w, prompt=SYSTEM + [1, 2])  # 14 tokens, 16 when done: short all along
    w.run()
    first_long = submit(w, prompt=SYSTEM + [1, 2, 3, 4, 5])  # 17 tokens: long
    assert first_row(w, first_long).seq.num_cached == 0, "no short block for a long run"
    w.run()
    assert first_long.runs_long
    assert first_row(w, submit(w, prompt=SYSTEM + [9] * 6)).seq.num_cached == 12  # long's
    w.run()
    assert first_row(w, submit(w, prompt=SYSTEM + [3])).seq.num_cached == 12  # short's
    w.run()
    across = submit(w, prompt=SYSTEM + [4], max_new=8)  # 13 tokens, 21 when done
    ex, runs = w.executors[0], []
    while not w.finished(across):
        plan = w.core.schedule(ex)
        runs += [(len(seq.token_ids), seq.num_cached, seq.max_tokens) for seq in plan.new]
        w.core.on_step_done(ex, plan, Samples.of(
            Sample(r.seq.seq_id, 7, -0.1) for r in plan.rows if r.samples))
        check_invariants(w.core, w.requests)
    # (short: the short blocks of SYSTEM; long, from its 17 tokens: the long ones)
    assert runs == [(13, 12, 17), (17, 12, 21)] and across.runs_long
    assert [e.token_id for e in w.events[across.serial] if isinstance(e, TokenEvent)] == \
        [7] * 8
