"""The scheduler's own Python per token, without gRPC: what bench/control_plane.py's 'scheduler
alone' figure costs before any message is sent.

    .venv/bin/python bench/scheduler_core.py [--steps 600] [--rows 16 64 256 1024]

In one process: a scheduler core with one executor's state, R requests of a Stream connection
(the base model, 3-token prompts, no length limit in reach), and per step exactly what the service
does between the executor's answers: plan the step (`schedule`), build its step-stream message
(`step_request`), take its samples as the executor's answer brings them (columns) in
`on_step_done`, and let the Stream's writer turn the outbox into its message. Prints the process's
CPU microseconds per token at each R, over steady decode after a warm-up.
"""

import argparse
import asyncio
import itertools
import time

from common.detokenizer import OutputProcessor
from common.sampling import SamplingParams
from scheduler.block_manager import BlockManager
from scheduler.core import ExecutorState, Limits, Scheduler
from scheduler.executor_link import step_request
from scheduler.fairness import FairnessWeights
from scheduler.metrics import SchedulerMetrics
from scheduler.request import Request
from scheduler.slots import SlotTable
from scheduler.streams import StreamConnection

WARMUP_STEPS = 20


async def us_per_token(rows: int, steps: int) -> float:
    ex = ExecutorState("bench", BlockManager(rows * 64, 16), SlotTable(1))
    core = Scheduler([ex], FairnessWeights(), Limits(max_num_seqs=rows, max_queued_per_tenant=0),
                     start_load=lambda *_: None, wake=lambda: None)
    core.add_executor(ex)

    async def write(message) -> None:
        message.SerializeToString()  # (as gRPC does before sending it)

    connection = StreamConnection(core, SchedulerMetrics(core), write, write_s=10.0)
    reading = asyncio.get_running_loop().create_future()  # (the caller never stops sending)
    writer = asyncio.create_task(connection.send(reading))
    for stream_id in range(1, rows + 1):
        async def check(stream_id=stream_id) -> Request:
            return Request(stream_id, f"tenant{stream_id % 8}", None, 0, [3, 4, 5],
                           SamplingParams(), OutputProcessor(None, max_new_tokens=10**9),
                           connection.emitter(stream_id))
        connection.submit(stream_id, check)
    await asyncio.sleep(0)  # (the submits are checked and queued)
    tokens, cpu = 0, 0.0
    for step in itertools.count():
        if step == WARMUP_STEPS:
            tokens, cpu = 0, time.process_time()
        elif step == WARMUP_STEPS + steps:
            break
        plan = core.schedule(ex)
        step_request(plan).SerializeToString()  # (built and serialized, as the link sends it)
        answer = ([row.seq.seq_id for row in plan.rows if row.samples],
                  [7] * plan.num_samples, [-0.5] * plan.num_samples)
        core.on_step_done(ex, plan, zip(*answer), 0.02)
        tokens += plan.num_samples
        await asyncio.sleep(0)  # (the Stream's writer sends the step's tokens)
    cpu = time.process_time() - cpu
    writer.cancel()
    return 1e6 * cpu / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256, 1024])
    args = parser.parse_args()
    print("| rows per step | scheduler us/token (in process, no gRPC) |\n|---:|---:|")
    for rows in args.rows:
        print(f"| {rows} | {asyncio.run(us_per_token(rows, args.steps)):.1f} |", flush=True)


if __name__ == "__main__":
    main()
