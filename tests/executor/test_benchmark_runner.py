"""Benchmark mode (executor/benchmark_runner.py): the executor's bookkeeping without a forward
pass, made-up deterministic tokens, steps of a chosen length; through the real services too."""

import time

import pytest

from common.sampling import SamplingParams
from common.server import insecure_channel
from executor.benchmark_runner import BenchmarkRunner, benchmark_token
from executor.config import ExecutorConfig
from executor.model.config import ModelConfig
from executor.runner import Row
from loraplex import client
from loraplex.launch import Fleet
from protos import scheduler_pb2_grpc


def test_steps_give_made_up_tokens_after_the_same_checks_and_last_the_step_time():
    runner = BenchmarkRunner.random("tiny", num_kv_blocks=8, block_size=4, num_slots=1,
                                    max_rank=8, step_s=0.02)
    vocab = runner.config.vocab_size
    runner.add_sequence(5, [3, 4, 5, 6, 7], SamplingParams(), -1)
    start = time.perf_counter()
    assert runner.step([Row(5, 3, (0,))]) == [], "a prefill chunk samples nothing"
    (first,) = runner.step([Row(5, 2, (1,))])
    assert time.perf_counter() - start >= 0.04
    (second,) = runner.step([Row(5, 1, (2,))])
    assert (first.token_id, second.token_id) == (benchmark_token(5, 5, vocab),
                                                 benchmark_token(6, 5, vocab))
    assert runner.tokens(5)[5:] == [first.token_id, second.token_id]
    with pytest.raises(ValueError, match="unknown sequence"):
        runner.step([Row(9, 1)])
    with pytest.raises(ValueError, match="holds no adapter"):
        runner.add_sequence(6, [3], SamplingParams(), 0)
        runner.step([Row(6, 1, (3,))])


def test_benchmark_mode_needs_random_weights():
    with pytest.raises(ValueError, match="benchmark-step-s"):
        ExecutorConfig(model="/models/llama", stores=("s:1",), benchmark_step_s=0.01)


async def test_a_benchmark_pool_streams_the_made_up_tokens(tmp_path):
    with Fleet(model="random:tiny", store_url=tmp_path.joinpath("store").as_uri(),
               log_dir=tmp_path / "logs", executor_args=["--benchmark-step-s", "0.005"]) as fleet:
        async with insecure_channel(fleet.scheduler) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            got = await client.generate(stub, client.generate_request("", [7, 8, 9], 6,
                                                                      ignore_eos=True))
    vocab = ModelConfig.named("tiny").vocab_size
    assert got.token_ids == [benchmark_token(3 + i, 1, vocab) for i in range(6)]
