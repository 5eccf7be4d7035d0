"""Keepalive finds a frozen peer within its own bounds (common/server.py), both ways: a pinging
client's call on a frozen server breaks, and a server drops the call of a frozen client. The
peer is a process stopped with SIGSTOP (its kernel still acknowledges TCP: only the pings tell).
The ping interval is cut to 1 s so that the tests are short; the rest of the options are the
services' own. Without grpc.http2.ping_timeout_ms the gRPC we pin waits 60 s for a ping's answer
whatever keepalive_timeout_ms says (both tests then take over 60 s and fail)."""

import asyncio
import os
import pathlib
import signal
import subprocess
import sys
import time

import grpc
import pytest

from common.server import KEEPALIVE_OPTIONS, SERVER_OPTIONS

REPO = pathlib.Path(__file__).resolve().parents[2]
BOUND_S = 30  # well above 1 s + the options' 5 or 10 s, well below the 60 s of the default


def with_ping_every_second(options: list[tuple[str, int]]) -> list[tuple[str, int]]:
    return [(k, 1000 if k == "grpc.keepalive_time_ms" else v) for k, v in options]


def ticks_handler(on_end=None) -> grpc.GenericRpcHandler:
    """/t.T/Ticks: a byte every 0.1 s, forever; on_end(seconds) when the call ends."""
    async def ticks(request, context):
        start = time.monotonic()
        try:
            while True:
                yield b"t"
                await asyncio.sleep(0.1)
        finally:
            if on_end:
                on_end(time.monotonic() - start)
    return grpc.method_handlers_generic_handler(
        "t.T", {"Ticks": grpc.unary_stream_rpc_method_handler(ticks)})


def spawn(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                            text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


SERVER = """
import asyncio, sys, grpc
from tests.common.test_keepalive import ticks_handler
async def main():
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((ticks_handler(),))
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)  # its port, for the test
    await server.start()
    await server.wait_for_termination()
asyncio.run(main())
"""

FROZEN_CLIENT = """
import asyncio, os, signal, sys, grpc
async def main():
    channel = grpc.aio.insecure_channel("127.0.0.1:" + sys.argv[1])
    async for _ in channel.unary_stream("/t.T/Ticks")(b""):
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen with the call open
asyncio.run(main())
"""


async def test_a_pinging_clients_call_on_a_frozen_server_breaks_within_the_bound():
    server = spawn(SERVER)
    try:
        port = int(await asyncio.to_thread(server.stdout.readline))
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                            options=with_ping_every_second(KEEPALIVE_OPTIONS))
        call = channel.unary_stream("/t.T/Ticks")(b"", wait_for_ready=True, timeout=120)
        frozen_at = None
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in call:
                if frozen_at is None:
                    os.kill(server.pid, signal.SIGSTOP)
                    frozen_at = time.monotonic()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert time.monotonic() - frozen_at < BOUND_S
        await channel.close()
    finally:
        server.kill()
        server.wait()


async def test_a_server_drops_the_call_of_a_frozen_client_within_the_bound():
    ended = asyncio.get_running_loop().create_future()
    server = grpc.aio.server(options=with_ping_every_second(SERVER_OPTIONS))
    server.add_generic_rpc_handlers((ticks_handler(
        lambda s: ended.done() or ended.set_result(s)),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = spawn(FROZEN_CLIENT, str(port))
    try:
        assert await asyncio.wait_for(ended, 90) < BOUND_S
    finally:
        client.kill()
        client.wait()
        await server.stop(None)


GENERATE_SERVER = """
import asyncio, grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from protos import scheduler_pb2
async def generate(request, context):
    while True:  # a token every 0.1 s, forever
        yield scheduler_pb2.GenerateResponse(token_id=5, text="t")
        await asyncio.sleep(0.1)
async def main():
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "loraplex.v1.Scheduler", {"Generate": grpc.unary_stream_rpc_method_handler(
            generate, request_deserializer=scheduler_pb2.GenerateRequest.FromString,
            response_serializer=scheduler_pb2.GenerateResponse.SerializeToString)}),))
    serving = health.aio.HealthServicer()  # (the CLI asks it first)
    await serving.set("loraplex.v1.Scheduler", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(serving, server)
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    await server.start()
    await server.wait_for_termination()
asyncio.run(main())
"""


async def test_loraplex_generate_ends_when_its_scheduler_freezes_mid_answer():
    """The CLI's Generate pings (its own options: a ping every 10 s, 5 s for the answer): a
    scheduler frozen while it streams ends the command with an error, not a wait forever."""
    server = spawn(GENERATE_SERVER)
    cli = None
    try:
        port = int(await asyncio.to_thread(server.stdout.readline))
        cli = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "loraplex.cli", "generate", "--scheduler",
            f"127.0.0.1:{port}", "--max-new-tokens", "100000", "hi", cwd=REPO,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(REPO)})
        assert await asyncio.wait_for(cli.stdout.readexactly(3), 60) == b"ttt"
        os.kill(server.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        await asyncio.wait_for(cli.wait(), BOUND_S)
        assert time.monotonic() - frozen_at < BOUND_S and cli.returncode != 0
        stderr = (await cli.stderr.read()).decode()
        assert "UNAVAILABLE" in stderr or "unavailable" in stderr, stderr
    finally:
        if cli is not None and cli.returncode is None:
            cli.kill()
            await cli.wait()
        server.kill()
        server.wait()
