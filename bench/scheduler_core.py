"""The scheduler's own Python per token, without gRPC: what bench/control_plane.py's 'scheduler
alone' figure costs before any message is sent.

    .venv/bin/python bench/scheduler_core.py [--steps 600] [--rows 16 64 256 1024] [--idle-ms 20]

In one process: a scheduler core with one executor's state, R requests of a Stream connection
(the base model, 3-token prompts, no length limit in reach), and per step exactly what the service
does between the executor's answers: plan the step (`schedule`), build its step-stream message
(`step_request`), take the samples of the step before (two in flight, as the service pipelines
them) as the executor's answer brings them (columns) in `on_step_done`, and let the Stream's
writer turn the outbox into its message. Prints the process's
CPU microseconds per token at each R, over steady decode after a warm-up: steps back to back, and
with the process idle --idle-ms between steps, as a scheduler is while its executors compute. The
second is the service's case and costs more for the same work where an idle CPU loses its caches
(a virtual machine's vCPU that halts): the gap between this benchmark and the service's figures.
"""

import argparse
import asyncio
import collections
import itertools
import time

from common.detokenizer import OutputProcessor
from common.sampling import SamplingParams
from scheduler.core import Scheduler
from scheduler.executor_link import step_request
from scheduler.executor_state import ExecutorShape
from scheduler.fairness import FairnessWeights
from scheduler.limits import Limits
from scheduler.metrics import SchedulerMetrics
from scheduler.request import Ask, Request
from scheduler.steps.sequence import Samples
from scheduler.streams import StreamConnection

WARMUP_STEPS = 20


async def us_per_token(rows: int, steps: int, idle_s: float = 0.0) -> float:
    core = Scheduler(FairnessWeights(), Limits(max_num_seqs=rows, max_queued_per_tenant=0),
                     start_load=lambda *_: None, wake=lambda: None)
    ex = core.add_executor("bench", ExecutorShape(rows * 64, 16, 1))

    async def write(message) -> None:
        message.SerializeToString()  # (as gRPC does before sending it)

    connection = StreamConnection(core, SchedulerMetrics(core), write, write_s=10.0)
    reading = asyncio.get_running_loop().create_future()  # (the caller never stops sending)
    writer = asyncio.create_task(connection.send(reading))
    max_new = WARMUP_STEPS + steps + 10  # (no length limit in reach, yet KV for all of it)
    for stream_id in range(1, rows + 1):
        async def check(stream_id=stream_id) -> Request:
            return Request(stream_id, Ask(f"tenant{stream_id % 8}", None, 0, (3, 4, 5),
                                          SamplingParams()),
                           OutputProcessor(None, max_new_tokens=max_new),
                           connection.emitter(stream_id), sink=connection.sink, sink_id=stream_id)
        connection.submit(stream_id, check)
    await asyncio.sleep(0)  # (the submits are checked and queued)
    tokens, cpu = 0, 0.0
    in_flight: collections.deque = collections.deque()
    for step in itertools.count():
        if step == WARMUP_STEPS:
            tokens, cpu = 0, time.process_time()
        elif step == WARMUP_STEPS + steps:
            break
        plan = core.schedule(ex)
        step_request(plan).SerializeToString()  # (built and serialized, as the link sends it)
        in_flight.append(plan)
        if len(in_flight) < 2:
            continue  # (the service plans the next step before this one's answer is read)
        plan = in_flight.popleft()
        answer = ([row.seq.seq_id for row in plan.rows if row.samples],
                  [7] * plan.num_samples, [-0.5] * plan.num_samples)
        core.on_step_done(ex, plan, Samples(*answer), 0.02)
        tokens += plan.num_samples
        await asyncio.sleep(0)  # (the Stream's writer sends the step's tokens)
        if idle_s:
            time.sleep(idle_s)  # (idle, as while an executor computes: no CPU time counted)
    cpu = time.process_time() - cpu
    writer.cancel()
    return 1e6 * cpu / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--idle-ms", type=float, default=20.0)
    args = parser.parse_args()
    print("| rows per step | scheduler us/token (in process, no gRPC), steps back to back "
          f"| the same, {args.idle_ms:g} ms idle between steps |\n|---:|---:|---:|")
    for rows in args.rows:
        hot = asyncio.run(us_per_token(rows, args.steps))
        idle = asyncio.run(us_per_token(rows, max(args.steps // 4, 1), args.idle_ms / 1e3))
        print(f"| {rows} | {hot:.1f} | {idle:.1f} |", flush=True)


if __name__ == "__main__":
    main()
