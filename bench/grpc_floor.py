"""What one gRPC round trip costs the scheduler's process on this machine, whatever the scheduler
does: the floor under bench/control_plane.py's 'scheduler us/step'.

    .venv/bin/python bench/grpc_floor.py [--round-trips 300] [--idle-ms 0 20]

A server process answers every message of a bidirectional grpc.aio stream (the executor's Step
RPC, empty messages) at once; this process writes one and reads the answer, round trip after
round trip, under uvloop as the scheduler runs, idle for --idle-ms between them (a scheduler is
idle while its executors compute). Prints this process's CPU microseconds per round trip (utime +
stime). A scheduler's executor step is one such round trip and one Stream message more; where an
idle CPU wakes up slowly (a virtual machine's vCPU that halts), the idle column is far above the
other, and every per-step figure of the control-plane benchmark carries that cost.

The floor under a client's direct path (a message per token) is `stream_floor`: a bare server
whose Generate writes one message per token to each of its streams once per step, with nothing
to compute (StreamFloor); bench/control_plane.py measures it beside the real scheduler, at its
streams and step rate, so that line reads against what this machine's gRPC costs that day.
"""

import argparse
import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import uvloop

from protos import executor_pb2, executor_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

WARMUP = 20


class _Echo(executor_pb2_grpc.ExecutorServicer):
    async def Step(self, request_iterator, context):
        async for _ in request_iterator:
            yield executor_pb2.StepResponse()


class StreamFloor(scheduler_pb2_grpc.SchedulerServicer):
    """The scheduler's Generate with nothing but its messages: a step every `step_s`, and on
    each step every stream wakes and writes its token as one message (max_new_tokens of them,
    then the finish), as the scheduler's handlers do, minus scheduling and detokenizing."""

    def __init__(self, step_s: float):
        self._step_s = step_s
        self._step: asyncio.Future | None = None
        self._ticker: asyncio.Task | None = None

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._step_s)
            step, self._step = self._step, loop.create_future()
            step.set_result(None)

    async def Generate(self, request, context):
        if self._ticker is None:  # (the first call starts the steps)
            self._step = asyncio.get_running_loop().create_future()
            self._ticker = asyncio.create_task(self._tick())
        for i in range(request.max_new_tokens):
            await self._step
            await context.write(scheduler_pb2.GenerateResponse(token_id=i, logprob=-0.5,
                                                               text=" word"))
        await context.write(scheduler_pb2.GenerateResponse(
            finish_reason=scheduler_pb2.FINISH_REASON_LENGTH))


async def _serve(step_s: float | None) -> None:
    server = grpc.aio.server()
    executor_pb2_grpc.add_ExecutorServicer_to_server(_Echo(), server)
    if step_s is not None:
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(StreamFloor(step_s), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


async def us_per_round_trip(port: int, round_trips: int, idle_s: float) -> float:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = executor_pb2_grpc.ExecutorStub(channel).Step()
        for i in range(WARMUP + round_trips):
            if i == WARMUP:
                cpu = time.process_time()
            await call.write(executor_pb2.StepRequest())
            await call.read()
            if idle_s:
                await asyncio.sleep(idle_s)
        cpu = time.process_time() - cpu
        call.cancel()
    return 1e6 * cpu / round_trips


@contextlib.contextmanager
def floor_server(step_s: float | None = None) -> Iterator[tuple[int, int]]:
    """(port, pid) of a bare server in its own process (with StreamFloor when step_s is set)."""
    argv = [sys.executable, __file__, "--serve"] + ([] if step_s is None
                                                    else ["--step-s", str(step_s)])
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        yield int(server.stdout.readline()), server.pid
    finally:
        server.kill()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--round-trips", type=int, default=300)
    parser.add_argument("--idle-ms", type=float, nargs="+", default=[0.0, 20.0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--step-s", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return uvloop.run(_serve(args.step_s))
    with floor_server() as (port, _):
        print("| idle between round trips (ms) | client CPU us per round trip |\n|---:|---:|")
        for idle_ms in args.idle_ms:
            us = uvloop.run(us_per_round_trip(port, args.round_trips, idle_ms / 1e3))
            print(f"| {idle_ms:g} | {us:.0f} |", flush=True)


if __name__ == "__main__":
    main()
