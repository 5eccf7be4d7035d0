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
                           notice_after_s: float = NOTICE_AFTER_S) -> str | None:
    """None once a gRPC service answers at `address` within `timeout_s`: the `wanted` one
    (service name, what it is, its flag) reporting SERVING, or another kind (the call will say
    what it found); else what was there, in a line: nothing, a process that takes connections
    but does not answer (frozen: SIGSTOP, a stalled host), or the service not serving. After
    `notice_after_s` a line on stderr says what is awaited. NotAService when an HTTP server
    answers there."""
    name, what, flag = wanted
    start = time.monotonic()
    deadline, told, last = start + timeout_s, False, None
    async with insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            left = deadline - time.monotonic()
            try:
                answer = await stub.Check(health_pb2.HealthCheckRequest(service=name),
                                          timeout=max(0.1, min(1.0, left)))
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return None
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    return None  # another kind of service: its answer to the call says which
                if "http1" in (err.details() or ""):
                    raise NotAService(
                        f"{address} answers HTTP/1, not gRPC: it is no {what.split()[-1]} (the "
                        f"gateway's OpenAI API is HTTP); give {what}'s gRPC address with {flag} "
                        f"(`loraplex up` starts one at 127.0.0.1:{_UP_PORTS[flag]})") from None
                if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and await _connects(address):
                    last = "silent"
                else:
                    last = None
            if time.monotonic() >= deadline:
                return _not_serving(address, what, timeout_s, last)
            if not told and time.monotonic() - start >= notice_after_s:
                told = True
                print(f"waiting for {what} to serve at {address} (up to {timeout_s:g} s, "
                      "--wait-s) ...", file=sys.stderr, flush=True)
            await asyncio.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))


def _not_serving(address: str, what: str, timeout_s: float, last: str | None) -> str:
    """The line a command ends with when `what` did not serve at `address` in time."""
    within = f"within {timeout_s:g}s (--wait-s)"
    if last == "silent":
        return (f"DEADLINE_EXCEEDED: a process at {address} takes connections but did not answer "
                f"{within}: frozen (stopped, or its host stalled) or overloaded; check it, or "
                "restart it")
    if last is not None:
        return (f"UNAVAILABLE: {what} at {address} answers {last} {within}: it is starting or "
                "stopping (its log says which)")
    return (f"UNAVAILABLE: nothing serving at {address} {within}: is `loraplex up` running? "
            "(its services log under its state directory)")


async def _connects(address: str) -> bool:
    """Whether a TCP connection to `address` opens within a second: a listener is there,
    answering or not."""
    host, _, port = address.rpartition(":")
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(host.strip("[]") or "127.0.0.1", int(port)), 1.0)
    except (OSError, ValueError, TimeoutError):
        return False
    writer.close()
    return True
