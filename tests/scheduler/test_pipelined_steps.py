"""Pipelined steps (Limits.pipeline_depth): the core plans a step before the answers of the steps
in flight are back, counting the samples they will bring (Sequence.num_known). Against a
stand-in executor that keeps each sequence's tokens and samples a token that depends on its
whole history, every request must get exactly the tokens it gets one step at a time (rows of
steady decode planned by the executor's cohort among them: cohort.py), through
EOS, stop tokens, length limits, chunked prefill and preemption; no row may ask the executor for
a token it does not have, or compute past the request's last position (prompt + max_new_tokens
- 1: at the context's end that would be refused), or read a slot that a load is writing or that
holds another adapter (loads are not ordered with steps: a sequence that ends keeps its slot
pinned until the steps with its rows are answered); the invariants hold after every answer; and
steps do overlap. The stand-in runs each step as late as it can: when its answer is read."""

import collections
import random
import zlib

import pytest

from common.detokenizer import OutputProcessor
from common.kv_layout import single_layout
from common.sampling import SamplingParams
from scheduler.limits import Limits
from scheduler.request import Ask, FinishEvent, Request, TokenEvent
from scheduler.sim.invariants import check_invariants
from scheduler.steps.sequence import Sample, Samples
from tests.scheduler.sched_world import World, ref

EOS, STOP = 0, 1


class StandInExecutor:
    """Runs each plan as an executor does, in the order sent: its own copy of every sequence's
    tokens and block tables, a sample whenever a row reaches the last of them. Its KV cache holds,
    for each position written, what a model's KV there depends on (the tokens up to it, the
    adapter, and on a longrope model whether the sequence came with more tokens than the switch:
    long factors); before each sample the sequence's whole context is read back through its
    table and must be its own (prefix-cached blocks included), of the kind transformers'
    generate() has at that length (long iff past the switch). Under window blocks
    (`layout`, common/kv_layout.py), every kind's tables are kept and written (a token block's
    columns alike), a global kind's whole context read back at a sample, and a window kind's
    window of every row's queries at each row: blocks the scheduler gave back behind a window
    may hold another sequence's KV by then, the ones a row reads may not."""

    def __init__(self, block_size: int, switch: int = 0, layout=None) -> None:
        self.block_size, self.switch = block_size, switch
        self.layout = layout or single_layout(1)
        # seq_id -> [tokens, computed, each kind's table (each token block's blocks), is long]
        self.seqs: dict[int, list] = {}
        self.slots: dict[int, object] = {}  # slot index -> its adapter (None: being written)
        # (block, offset) -> (tokens so far, adapter, long)
        self.kv: dict[tuple[int, int], tuple] = {}
        self.kinds: dict[int, set[bool]] = collections.defaultdict(set)  # request id -> its runs'

    def run(self, plan) -> list[Sample]:
        for seq_id in plan.freed:
            del self.seqs[seq_id]
        kinds = self.layout.kinds
        for seq in plan.new:
            is_long = 0 < self.switch < len(seq.token_ids)
            first = seq.first_blocks or (0,) * len(kinds)
            self.seqs[seq.seq_id] = [list(seq.token_ids), seq.num_cached,
                                     [[None] * f for f in first], is_long]
            self.kinds[seq.request.serial].add(is_long)
        samples = []
        for row in plan.rows:
            req = row.seq.request
            adapter = req.ask.adapter
            if row.seq.slot_index >= 0:
                assert self.slots.get(row.seq.slot_index) == adapter, \
                    "a row read a slot being loaded or holding another adapter"
            tokens, computed, tables, is_long = self.seqs[row.seq.seq_id]
            new = row.new_block_ids
            for kind, table, blocks in zip(kinds, tables, new if len(kinds) > 1 and new
                                           else (new,) if len(kinds) == 1 else [()] * len(kinds)):
                c = kind.columns
                table.extend(tuple(blocks[i:i + c]) for i in range(0, len(blocks), c))
            assert 1 <= row.num_tokens <= len(tokens) - computed, "a row past the known tokens"
            assert is_long or not self.switch or computed + row.num_tokens <= self.switch, \
                "a short run computed past the longrope switch"
            start, end = computed, computed + row.num_tokens
            for p in range(start, end):
                for block in self._at(tables, p):
                    self.kv[block] = (tuple(tokens[:p + 1]), adapter, is_long)
            for kind, table in zip(kinds, tables):
                if kind.window is not None:
                    for p in range(max(0, start - kind.window + 1), end):
                        self._check(row.seq.seq_id, tokens, adapter, is_long, kind, table, p)
            computed = end
            assert computed <= len(req.ask.prompt_ids) + req.output.max_new_tokens - 1, \
                "computed past the request's last position"
            self.seqs[row.seq.seq_id][1] = computed
            if computed == len(tokens):
                assert is_long == (0 < self.switch < len(tokens)), \
                    f"seq {row.seq.seq_id} sampled from {len(tokens)} tokens of the wrong kind"
                for kind, table in zip(kinds, tables):
                    if kind.window is None:
                        for p in range(computed):
                            self._check(row.seq.seq_id, tokens, adapter, is_long, kind, table, p)
                token = next_token(tokens)
                tokens.append(token)
                samples.append(Sample(row.seq.seq_id, token, -0.5))
        return samples

    def _check(self, seq_id, tokens, adapter, is_long, kind, table, p) -> None:
        entry = table[p // self.block_size]
        assert entry is not None, f"seq {seq_id} reads position {p} of a block it gave back"
        for block in entry:
            assert self.kv.get((block, p % self.block_size)) == (
                tuple(tokens[:p + 1]), adapter, is_long), \
                f"seq {seq_id} read another context's KV at position {p} (window {kind.window})"

    def _at(self, tables: list, position: int) -> list[tuple[int, int]]:
        """Where every kind's KV of `position` is written."""
        offset = position % self.block_size
        return [(block, offset) for table in tables for block in table[position // self.block_size]]


def next_token(history: list[int]) -> int:
    """A token that depends on every token before it: EOS and STOP now and then."""
    h = zlib.crc32(bytes(t % 251 for t in history))
    return EOS if h % 23 == 0 else STOP if h % 29 == 0 else 2 + h % 97


class Sink:
    """A TokenSink (request.py), as a Stream connection's outbox: the tokens it was given, per
    request id; how many of them went through Request.on_sample (the rest came as columns)."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = collections.defaultdict(list)
        self.num_sampled = 0

    def add(self, ids, token_ids, logprobs) -> None:
        for request_id, token_id, _ in zip(ids, token_ids, logprobs, strict=True):
            self.tokens[request_id].append(token_id)

    def counting(self, on_sample):
        def on_sample_counted(*args):
            self.num_sampled += 1
            return on_sample(*args)
        return on_sample_counted


def drive(depth: int, seed: int, num_blocks: int, cancel_every: int = 0,
          num_sinks: int = 0, switch: int = 0) -> dict[int, tuple]:
    """Requests over the base model and 5 adapters (2 slots: loads and evictions all along)
    arriving over time, stepped with `depth` steps in flight; request id -> (tokens, finish
    reason). With `num_sinks`, requests hand their tokens to that many sinks, as a Stream
    connection's do (the core's columnar path), instead of emitting TokenEvents. With `switch`,
    a longrope model's (scheduler/steps/longrope.py): some requests run long from the start, some
    outgrow it and run again, long."""
    rng = random.Random(seed)
    w = World(num_blocks=num_blocks, block_size=4, num_slots=2,
              limits=Limits(max_num_seqs=6, max_batched_tokens=24, pipeline_depth=depth,
                            fairness_window=0.0), rope_switch_len=switch)
    ex, executor = w.executors[0], StandInExecutor(block_size=4, switch=switch)
    in_flight: collections.deque = collections.deque()
    overlapped = steps = 0  # steps planned while another was in flight, all steps
    cohort_rows = 0  # rows planned as the cohort's (cohort.py)
    arrivals = [(rng.randint(0, 60), rng.choice("abc"), rng.randint(1, 30), rng.randint(1, 12))
                for _ in range(30)]
    sinks = [Sink() for _ in range(num_sinks)]
    for step in range(5000):
        w.now += 0.01
        for at, tenant, prompt_len, max_new in arrivals:
            if at == step:
                submit(w, tenant, prompt_len, max_new, rng, sinks)
        if cancel_every and step % cancel_every == cancel_every - 1:
            running = [r for r in w.requests if r.status.name in ("QUEUED", "RUNNING")]
            if running:
                w.core.cancel(rng.choice(running))
        while len(in_flight) < depth:
            plan = w.core.schedule(ex)
            if not plan and not plan.freed:
                break
            overlapped += bool(in_flight) and bool(plan)
            steps += bool(plan)
            cohort_rows += len(w.core.steps_of(ex).cohort)
            in_flight.append(plan)
        loads_started(w, executor)
        if in_flight:
            plan = in_flight.popleft()
            w.core.on_step_done(ex, plan, Samples.of(executor.run(plan)))
            check_invariants(w.core, w.requests)
        loads_started(w, executor)
        if step % 2:  # a load may stay under way while a step runs
            w.complete_loads(loaded=lambda slot, adapter: executor.slots.update({slot: adapter}))
        if step > 60 and not in_flight and not w.core.has_work(ex):
            break
    else:
        raise AssertionError("work did not drain")
    assert all(seq.num_known == len(seq.token_ids) for seq in w.running(ex).values())
    if depth > 1:  # most steps are planned while the one before runs
        assert overlapped > steps / 2, (overlapped, steps)
    assert cohort_rows > 0, "no steady decode: the cohort went untested"
    if switch:  # runs past the switch from the start, and runs that outgrew it
        assert {True} in executor.kinds.values() and {False, True} in executor.kinds.values()
    if sinks:  # a good share of tokens took the columnar path (short requests: ~half)
        num_tokens = sum(len(t) for sink in sinks for t in sink.tokens.values())
        assert sum(sink.num_sampled for sink in sinks) < num_tokens * 0.75
    return {r.serial: outcome(w, r) for r in w.requests}


def loads_started(w: World, executor: StandInExecutor) -> None:
    """A load writes its slot from the moment it starts (as the executor's loader does)."""
    for _, load in w.loads:
        executor.slots[load.slot] = None


ADAPTERS = [None, *(ref(f"lora{i}@1") for i in range(5))]
PREFIXES = [[], [5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 20]]  # shared prompt starts


def submit(w: World, tenant: str, prompt_len: int, max_new: int, rng: random.Random,
           sinks: list[Sink]) -> Request:
    rid = next(w._ids)
    w.events[rid] = []
    ask = Ask(tenant, rng.choice(ADAPTERS), 2**20,
              (*rng.choice(PREFIXES), *(rng.randint(2, 200) for _ in range(prompt_len))),
              SamplingParams())
    sink = sinks[rid % len(sinks)] if sinks else None  # (not drawn from rng: the same workload)
    req = Request(rid, ask, OutputProcessor(None, max_new_tokens=max_new,
                                            stop_token_ids=(EOS, STOP)),
                  w.events[rid].append, sink=sink, sink_id=rid)
    if sink is not None:
        req.on_sample = sink.counting(req.on_sample)
    w.core.submit(req)
    w.requests.append(req)
    return req


def outcome(w: World, req: Request) -> tuple:
    events = w.events[req.serial]
    finishes = [e.reason for e in events if isinstance(e, FinishEvent)]
    if req.sink is not None:
        return req.sink.tokens.get(req.serial, []), finishes
    return [e.token_id for e in events if isinstance(e, TokenEvent)], finishes


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_blocks", [40, 14])  # 14: preemption and recompute
def test_pipelined_steps_give_every_request_the_tokens_of_one_step_at_a_time(seed, num_blocks):
    one_at_a_time = drive(1, seed, num_blocks)
    assert drive(2, seed, num_blocks) == one_at_a_time
    assert drive(3, seed, num_blocks) == one_at_a_time
    assert drive(2, seed, num_blocks, num_sinks=1) == one_at_a_time
    assert drive(2, seed, num_blocks, num_sinks=3) == one_at_a_time
    for tokens, finishes in one_at_a_time.values():
        assert len(finishes) == 1  # each finished once
        assert not set(tokens[:-1]) & {EOS, STOP}  # nothing shown past its stop


@pytest.mark.parametrize("seed", range(3))
def test_a_longrope_switch_gives_every_request_its_tokens_from_kv_of_its_kind(seed):
    """Switch 20: every sample reads KV of transformers' generate() kind for its length, never a
    block of the other kind, and no short run computes past the switch, one step at a time or
    pipelined, preempted or not; every request gets the tokens it gets without a switch."""
    for num_blocks in (40, 14):
        plain = drive(1, seed, num_blocks)
        assert drive(1, seed, num_blocks, switch=20) == plain
        assert drive(2, seed, num_blocks, switch=20) == plain


@pytest.mark.parametrize("seed", range(4))
def test_cancels_while_steps_are_in_flight_keep_every_invariant(seed):
    drive(2, seed, num_blocks=14, cancel_every=7)
    drive(2, seed, num_blocks=14, cancel_every=7, num_sinks=2)
