"""Before a CLI command calls a service: wait for it to serve (a command typed right after
`loraplex up &`), saying so when that takes a while, and telling at once when the address holds
something else (an HTTP server: the gateway's OpenAI port given as --scheduler).

What is there is read from the standard gRPC health service, asked about the service the command
needs (loraplex.v1.Scheduler, loraplex.v1.AdapterStore): SERVING, or NOT_FOUND when another kind
of loraplex service listens there (the call is then made, and that service's UNIMPLEMENTED answer
names what it is: common/server.py)."""

import asyncio
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.server import insecure_channel

NOTICE_AFTER_S = 2.0  # a wait longer than this is announced on stderr
POLL_S = 0.2
# The service each kind of command calls, and the flag that gives its address.
SCHEDULER = ("loraplex.v1.Scheduler", "a scheduler", "--scheduler")
STORE = ("loraplex.v1.AdapterStore", "an adapter store", "--store")
_UP_PORTS = {"--scheduler": 50051, "--store": 50052}  # where `loraplex up` starts them


class NotAService(Exception):
    """The address answers, but not as a gRPC service: one line saying what to give instead."""


async def wait_for_service(address: str, wanted: tuple[str, str, str], timeout_s: float,
                           notice_after_s: float = NOTICE_AFTER_S) -> bool:
    """Whether a gRPC service answers at `address` within `timeout_s`: the `wanted` one (service
    name, what it is, its flag) reporting SERVING, or another kind (True: the call will say what
    it found). After `notice_after_s` a line on stderr says what is awaited. NotAService when an
    HTTP server answers there."""
    name, what, flag = wanted
    start = time.monotonic()
    deadline, told = start + timeout_s, False
    async with insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            left = deadline - time.monotonic()
            try:
                answer = await stub.Check(health_pb2.HealthCheckRequest(service=name),
                                          timeout=max(0.1, min(1.0, left)))
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    return True  # another kind of service: its answer to the call says which
                if "http1" in (err.details() or ""):
                    raise NotAService(
                        f"{address} answers HTTP/1, not gRPC: it is no {what.split()[-1]} (the "
                        f"gateway's OpenAI API is HTTP); give {what}'s gRPC address with {flag} "
                        f"(`loraplex up` starts one at 127.0.0.1:{_UP_PORTS[flag]})") from None
            if time.monotonic() >= deadline:
                return False
            if not told and time.monotonic() - start >= notice_after_s:
                told = True
                print(f"waiting for {what} to serve at {address} (up to {timeout_s:g} s, "
                      "--wait-s) ...", file=sys.stderr, flush=True)
            await asyncio.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
