"""Decode graphs (executor/decode_graphs.py) on CPU: the Triton kernels under the interpreter, and
stand-ins for CUDA's capture. A faithful stand-in replays the recorded forward over the static
buffers, as a graph replays its kernels: the start-up check keeps the graphs, and decode steps
replayed through them equal the eager runner's bit for bit, padding rows and adapters included.
A stand-in that differs, or fails, turns the graphs off at start, logged, and the executor's Info
and the scheduler's Stats say which (graphs on: their buckets; off: why)."""

import logging

import pytest
import torch

from common.sampling import SamplingParams
from executor.decode_graphs import DecodeGraphs
from executor.runner import Row
from loraplex.admin_cli import format_stats
from protos import executor_pb2
from scheduler.executor_state import ExecutorShape
from scheduler.stats_pb import stats_pb
from tests.runner_driver import make_runner, prompts, run
from tests.scheduler.sched_world import World

BUCKETS = (1, 4)


def replaying(run_forward):
    """What a CUDA graph does, without one: run the recorded forward again, over whatever the
    static buffers hold now."""
    return run_forward


def differing(run_forward):
    return lambda: run_forward() + 1e-3


def failing(run_forward):
    raise RuntimeError("operation not permitted when stream is capturing")


def graph_runner(tiny, **kw):
    """The Triton paths throughout (what CUDA runs), a slot free for the probe adapter."""
    return make_runner(tiny, lora_backend="triton", attention_backend="triton",
                       scratch_block=True, num_slots=len(tiny["valid"]) + 1, **kw)


@pytest.fixture(scope="module")
def runners(tiny):
    graphed, eager = graph_runner(tiny), graph_runner(tiny)
    graphed.graphs, why = DecodeGraphs.check(graphed, BUCKETS, capture=replaying)
    assert why == ""
    return graphed, eager


def test_a_faithful_capture_keeps_the_graphs_and_leaves_nothing_behind(runners, caplog):
    graphed, _ = runners
    assert graphed.graphs is not None and graphed.graphs.buckets == BUCKETS
    probe_slot = graphed.pool.num_slots - 1
    assert not graphed.pool.is_loaded(probe_slot)  # the probe adapter is gone
    assert graphed.num_sequences == 0
    assert graphed.scratch_block not in graphed.free_blocks()


@pytest.mark.parametrize("slots", [[0, -1, 1, 0], [0, -1, 1]], ids=["full", "padded"])
def test_decode_steps_replayed_equal_the_eager_runner(runners, slots):
    """Sequences on two adapters and the base model: prefill eagerly, then decode steps through
    the 4-row graph. A full bucket: every sampled token and every row's logits equal the eager
    runner's bit for bit. Three rows (a padding row): the same tokens, logits within rounding
    (the graph's matmuls have 4 rows, the eager ones 3: shapes a BLAS may round differently;
    the start-up check compares a graph with the eager forward of its own padded batch)."""
    graphed, eager = runners
    replays, graph_steps = [], graphed.graph_steps
    original = graphed.graphs.run
    graphed.graphs.run = lambda size, *a: (replays.append(size), original(size, *a))[1]
    try:
        requests = {i: (p, slot) for i, (p, slot) in enumerate(zip(prompts(len(slots), seed=7),
                                                                    slots))}
        want = run(eager, requests, num_tokens=4, chunk=32)
        got = run(graphed, requests, num_tokens=4, chunk=32)
    finally:
        graphed.graphs.run = original
    assert replays and set(replays) == {4}  # (the decode steps; the prefill ran eagerly)
    assert graphed.graph_steps - graph_steps == len(replays)  # (the executor's metric)
    for seq_id in requests:
        assert got[seq_id][0] == want[seq_id][0]
        if len(slots) == 4:
            assert torch.equal(got[seq_id][1], want[seq_id][1])
        else:
            torch.testing.assert_close(got[seq_id][1], want[seq_id][1], rtol=0, atol=1e-4)


def test_steps_a_graph_cannot_take_run_eagerly(runners):
    graphed, _ = runners
    graphs = graphed.graphs
    graphed.add_sequence(900, [5, 6, 7], SamplingParams(), -1)
    graphed.add_sequence(901, [5, 6], SamplingParams(), -1)
    try:
        prefill = [Row(900, 3, (10,)), Row(901, 2, (11,))]
        assert graphs.takes(prefill, graphed._seqs) == 0
        graphed.step(prefill)
        decode = [Row(900, 1), Row(901, 1)]
        assert graphs.takes(decode, graphed._seqs) == 4
        many = [Row(900, 1)] * (BUCKETS[-1] + 1)  # past the largest bucket
        assert graphs.takes(many, graphed._seqs) == 0
    finally:
        graphed.free_sequence(900)
        graphed.free_sequence(901)


@pytest.mark.parametrize("capture, says", [(differing, "differs from the eager forward"),
                                           (failing, "capturing the 4-row bucket failed")])
def test_a_capture_that_differs_or_fails_turns_the_graphs_off(tiny, capture, says, caplog):
    runner = graph_runner(tiny)
    with caplog.at_level(logging.INFO, logger="executor.decode_graphs"):
        graphs, why = DecodeGraphs.check(runner, BUCKETS, capture=capture)
    assert graphs is None and says in why  # (what Info's decode_graphs_off says)
    assert says in caplog.text and "decode graphs off" in caplog.text
    assert not runner.pool.is_loaded(runner.pool.num_slots - 1)  # the probe adapter is gone


def test_a_model_the_graphs_cannot_hold_is_refused_before_any_capture(tiny, caplog):
    runner = make_runner(tiny, lora_backend="torch", scratch_block=True)
    with caplog.at_level(logging.INFO, logger="executor.decode_graphs"):
        assert DecodeGraphs.check(runner, BUCKETS, capture=failing) == (None,
                                                                         "the torch LoRA backend")
    assert "decode graphs off: the torch LoRA backend" in caplog.text


def stats_line(buckets, off) -> str:
    """What `loraplex admin stats` says of an executor whose Info gives these (as the executor's
    Info fills them from its runner's graphs and graphs_off), through the scheduler's Stats."""
    info = executor_pb2.InfoResponse(num_kv_blocks=64, block_size=4, num_adapter_slots=2,
                                     decode_graph_buckets=buckets, decode_graphs_off=off)
    w = World(num_executors=0)
    w.core.add_executor("ex-graphs", ExecutorShape.from_info(info))
    response = stats_pb(w.operators.stats())
    ex = response.executors[0]
    assert (tuple(ex.decode_graph_buckets), ex.decode_graphs_off) == (tuple(buckets), off)
    return format_stats(response)


def test_stats_say_which_steps_replay_graphs_and_why_none_do(runners, tiny):
    graphed, _ = runners
    text = stats_line(graphed.graphs.buckets, graphed.graphs_off)
    assert "decode steps of up to 4 sequences replay CUDA graphs (batch sizes 1, 4)" in text
    _, why = DecodeGraphs.check(graph_runner(tiny), BUCKETS, capture=differing)
    text = stats_line((), why)
    assert ("CUDA graphs off, every step eager: the 4-row bucket's graph differs from the eager "
            "forward on the probe batch") in text
    assert "CUDA graphs" not in stats_line((), "")  # (CPU: nothing to say)
