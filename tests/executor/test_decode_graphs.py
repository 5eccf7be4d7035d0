"""Decode graphs (executor/decode_graphs.py) on CPU: the Triton kernels under the interpreter, and
stand-ins for CUDA's capture. A faithful stand-in replays the recorded forward over the static
buffers, as a graph replays its kernels: the start-up check keeps the graphs, and decode steps
replayed through them equal the eager runner's bit for bit, padding rows and adapters included.
A stand-in that differs, or fails, turns the graphs off at start, logged."""

import logging

import pytest
import torch

from common.sampling import SamplingParams
from executor.decode_graphs import DecodeGraphs
from executor.runner import Row
from tests.runner_driver import make_runner, prompts, run

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
    graphed.graphs = DecodeGraphs.check(graphed, BUCKETS, capture=replaying)
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
    replays = []
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
        assert DecodeGraphs.check(runner, BUCKETS, capture=capture) is None
    assert says in caplog.text and "decode graphs off" in caplog.text
    assert not runner.pool.is_loaded(runner.pool.num_slots - 1)  # the probe adapter is gone


def test_a_model_the_graphs_cannot_hold_is_refused_before_any_capture(tiny, caplog):
    runner = make_runner(tiny, lora_backend="torch", scratch_block=True)
    with caplog.at_level(logging.INFO, logger="executor.decode_graphs"):
        assert DecodeGraphs.check(runner, BUCKETS, capture=failing) is None
    assert "decode graphs off: the torch LoRA backend" in caplog.text
