"""Rank 0 telling the other ranks of a tensor-parallel executor what to do
(executor/tp/followers.py, executor/tp/follower.py, protos/rank_group.proto), over real sockets: a
follower given the steps, loads and clears rank 0 did holds what rank 0 holds and the pair samples
TP=1's tokens; only a rank's part of an adapter travels to it; a follower that is gone, silent or
fails a copy, a collective a rank never meets (it froze), and a rank 0 whose heartbeats stop (it
froze), break the group within the timeout."""

import datetime
import socket
import threading
import time
from multiprocessing.connection import Connection

import pytest
import torch
import torch.distributed as dist

from executor.lora.peft_adapter import parse_peft_adapter
from executor.model.config import ModelConfig
from executor.runner import ModelRunner
from executor.step_request import run_step, step_rows
from executor.tp.collectives import GroupBroken, TensorParallel
from executor.tp.follower import follow
from executor.tp.followers import Followers, load_command, shard_weights
from executor.tp.shards import Shard
from protos import common_pb2, executor_pb2, rank_group_pb2
from tests.rank_threads import TIMEOUT
from tests.runner_driver import BLOCK, MAX_RANK, make_runner, prompts, read_adapter


def channel_pair() -> tuple[Connection, Connection]:
    a, b = socket.socketpair()
    return Connection(a.detach()), Connection(b.detach())


def broken(err: Exception):
    raise GroupBroken(str(err))


@pytest.fixture
def pair(tiny):
    """Rank 0's runner and its Followers, rank 1 following in a thread."""
    store = dist.HashStore()
    made: dict[int, ModelRunner] = {}

    def make(rank: int) -> None:
        group = dist.ProcessGroupGloo(dist.PrefixStore("pair", store), rank, 2, TIMEOUT)
        made[rank] = ModelRunner.from_pretrained(
            tiny["model_dir"], num_kv_blocks=512, block_size=BLOCK, num_slots=3,
            max_rank=MAX_RANK, tp=TensorParallel(rank, 2, group))

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    mine, theirs = channel_pair()
    follower = threading.Thread(target=follow, args=(made[1], theirs, 10.0, broken), daemon=True)
    follower.start()
    followers = Followers([mine], [Shard(made[0].config, 1, 2)], 10.0, broken)
    followers.start_heartbeats()
    yield made[0], made[1], followers
    followers.close()
    mine.close()
    follower.join(10)


def step_request(seqs: dict[int, tuple[list[int], int]], new: bool,
                 blocks: dict[int, list[int]]) -> executor_pb2.StepRequest:
    """Every sequence's next row: its whole prompt when `new`, else one decode token."""
    req = executor_pb2.StepRequest()
    for sid, (prompt, slot) in sorted(seqs.items(), key=lambda item: item[1][1]):
        if new:
            req.new_sequences.add(seq_id=sid, token_ids=prompt, slot=slot,
                                  sampling=common_pb2.SamplingParams())
        length = len(prompt)
        need = -(-length // BLOCK) if new else int((length - 1) % BLOCK == 0)
        added = [max((b for bs in blocks.values() for b in bs), default=-1) + 1 + i
                 for i in range(need)]
        blocks[sid] += added
        req.row_seq_ids.append(sid)
        req.row_num_tokens.append(length if new else 1)
        req.row_num_new_blocks.append(len(added))
        req.new_block_ids.extend(added)
    return req


def test_a_follower_holds_what_rank_0_holds_and_the_pair_samples_tp1s_tokens(tiny, pair):
    rank0, rank1, followers = pair
    one = make_runner(tiny, num_slots=3)
    names = ["r16_all", "r8_patterns", "r8_mlp"]
    pages, free = {}, 100  # (blocks below 100: KV)
    for slot, name in enumerate(names):
        weights = parse_peft_adapter(*read_adapter(tiny, name), rank0.config)
        needed = rank0.pool.pages_for(rank0.shard.lora(weights)).num_pages
        pages[slot], free = tuple(range(free, free + needed)), free + needed
        rank0.load_adapter(slot, weights, pages[slot])
        followers.load(slot, weights, pages[slot])
        one.load_adapter(slot, parse_peft_adapter(*read_adapter(tiny, name), one.config))
    for s in range(3):
        assert rank1.pool.contents(s).pages == pages[s] and rank1.pool.is_loaded(s), (
            rank1.pool.contents(s), pages[s])

    seqs = {sid: (p, sid % 4 - 1) for sid, p in enumerate(prompts(6, seed=8))}
    blocks = {sid: [] for sid in seqs}
    got, want = {sid: [] for sid in seqs}, {sid: [] for sid in seqs}
    for i in range(4):
        req = step_request({s: (p + got[s], slot) for s, (p, slot) in seqs.items()}, i == 0,
                           blocks)
        followers.step(req)
        for s in run_step(rank0, req, step_rows(req)):
            got[s.seq_id].append(s.token_id)
        for s in run_step(one, req, step_rows(req)):
            want[s.seq_id].append(s.token_id)
    assert got == want and rank1.tokens(2) == rank0.tokens(2)

    followers.end_stream()
    followers.clear(1)  # (answered: the end of the stream before it is done too)
    assert rank1.num_sequences == 0 and not rank1.pool.is_loaded(1)
    assert rank1.pool.is_loaded(0)


def test_only_a_ranks_part_travels_to_it(tiny):
    config = ModelConfig.from_pretrained(tiny["model_dir"])
    weights = parse_peft_adapter(*read_adapter(tiny, "r16_all"), config)
    shard = Shard(config, 1, 2)
    command = load_command(0, (5, 6), shard.lora(weights))
    part = shard_weights(command.load)
    halved = {m: (m in ("o_proj", "down_proj"), m not in ("o_proj", "down_proj"))  # A's, B's
              for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj")}
    sent = sum(w.a.numel() + w.b.numel() for w in part.modules.values())
    assert sent == sum(w.a.numel() // (1 + halved[m][0]) + w.b.numel() // (1 + halved[m][1])
                       for (_, m), w in weights.modules.items())
    down = part.modules[(0, "down_proj")]
    assert down.a.shape == (16, config.intermediate_size // 2)  # A's columns
    assert down.b.shape == (config.hidden_size, 16)  # B whole
    assert part.modules[(0, "q_proj")].b.shape == (config.q_size // 2, 16)
    assert part.modules[(0, "q_proj")].scale == weights.modules[(0, "q_proj")].scale


def test_a_follower_gone_silent_or_failing_breaks_the_group():
    mine, theirs = channel_pair()
    followers = Followers([mine], [None], 0.3, broken)
    start = time.monotonic()
    with pytest.raises(GroupBroken, match="did not answer within"):
        followers.clear(0)  # nobody reads the other end
    assert time.monotonic() - start < 2

    theirs.send_bytes(rank_group_pb2.RankAck(error="page 9 is no KV block").SerializeToString())
    with pytest.raises(GroupBroken, match="failed what rank 0 did: page 9"):
        followers.clear(0)

    theirs.close()
    with pytest.raises(GroupBroken, match="rank 1 is gone"):
        for _ in range(3):  # (the first write may still land in the socket's buffer)
            followers.clear(0)


def test_a_collective_a_rank_never_meets_breaks_the_group_within_its_timeout():
    """A frozen rank: the other's all-reduce waits no longer than the group's timeout."""
    store = dist.HashStore()
    groups = {}

    def join(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("frozen", store), rank, 2,
                                             datetime.timedelta(seconds=1))

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tp = TensorParallel(0, 2, groups[0], on_broken=broken)
    start = time.monotonic()
    with pytest.raises(GroupBroken):
        tp.all_reduce(torch.ones(4))  # rank 1 never joins it
    assert time.monotonic() - start < 5


def test_a_follower_takes_a_rank_0_whose_heartbeats_stop_for_frozen(tiny):
    """Rank 0 frozen between steps: its followers sit in their reads, with no collective to
    time out; its heartbeats keep them waiting, and their silence ends them within the timeout
    (the group then restarts). Before rank 0 first speaks (its weights still loading) there is no
    bound."""
    runner = ModelRunner.from_pretrained(tiny["model_dir"], num_kv_blocks=64, block_size=BLOCK,
                                         num_slots=2, max_rank=MAX_RANK)
    mine, theirs = channel_pair()
    ended: list[BaseException] = []

    def run() -> None:
        try:
            follow(runner, theirs, 1.0, broken)
        except GroupBroken as err:
            ended.append(err)

    follower = threading.Thread(target=run, daemon=True)
    follower.start()
    time.sleep(1.5)  # (nothing heard yet: no bound)
    assert follower.is_alive()
    followers = Followers([mine], [None], 1.0, broken)
    followers.start_heartbeats()
    time.sleep(2.5)  # (heard, and kept alive)
    assert follower.is_alive()
    followers.close()  # (rank 0 froze)
    start = time.monotonic()
    follower.join(10)
    assert not follower.is_alive() and "not even its heartbeat" in str(ended[0])
    assert time.monotonic() - start < 4
