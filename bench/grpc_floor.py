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
"""

import argparse
import asyncio
import subprocess
import sys
import time

import grpc
import uvloop

from protos import executor_pb2, executor_pb2_grpc

WARMUP = 20


class _Echo(executor_pb2_grpc.ExecutorServicer):
    async def Step(self, request_iterator, context):
        async for _ in request_iterator:
            yield executor_pb2.StepResponse()


async def _serve() -> None:
    server = grpc.aio.server()
    executor_pb2_grpc.add_ExecutorServicer_to_server(_Echo(), server)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--round-trips", type=int, default=300)
    parser.add_argument("--idle-ms", type=float, nargs="+", default=[0.0, 20.0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return uvloop.run(_serve())
    server = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE,
                              text=True)
    try:
        port = int(server.stdout.readline())
        print("| idle between round trips (ms) | client CPU us per round trip |\n|---:|---:|")
        for idle_ms in args.idle_ms:
            us = uvloop.run(us_per_round_trip(port, args.round_trips, idle_ms / 1e3))
            print(f"| {idle_ms:g} | {us:.0f} |", flush=True)
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    main()
