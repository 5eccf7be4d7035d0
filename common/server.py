"""Shared gRPC server plumbing: one place that builds, starts and gracefully stops a service."""

import asyncio
import dataclasses
import gc
import inspect
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common import wire
from common.errors import InvalidArgument

log = logging.getLogger(__name__)
T = TypeVar("T")

# Large enough for a prompt of a full context and adapter chunks; executors stream bigger payloads.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# How long a stopping service answers health checks with NOT_SERVING before it refuses RPCs.
NOT_SERVING_NOTICE_S = 0.5
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# Clients spread calls over every address a name resolves to (dns:///stores.ns.svc:50052 with a
# headless Service): gRPC's own resolver re-resolves, its round_robin policy balances. Each
# channel keeps its own connections (grpc.use_local_subchannel_pool): with the process-wide pool,
# a new channel to a service back on an address took over the backoff of an older channel's
# failed connection there and failed at once, "connections to all backends failing", until that
# backoff ran out (up to 2 minutes; a test's new channel met a port an earlier test's dead
# scheduler had used).
# A channel whose service went away tries to connect again at most every 2 s
# (grpc.max_reconnect_backoff_ms; gRPC's default grows to 2 minutes): between tries its calls fail
# at once, so after a 60 s store outage executors' fetches failed for another 15-30 s with the
# store back, and a request for a cold adapter ran out its 30 s load wait.
CLIENT_OPTIONS = CHANNEL_OPTIONS + [("grpc.lb_policy_name", "round_robin"),
                                    ("grpc.use_local_subchannel_pool", 1),
                                    ("grpc.max_reconnect_backoff_ms", 2_000)]
# A server pings the peers of its open calls every 30 s and drops a connection whose peer does not
# answer within 10 s: a frozen or vanished client (a scheduler holding an executor's only step
# stream, an executor in the middle of a Fetch) releases what its calls held.
# Clients that ping (KEEPALIVE_OPTIONS) are let ping every 5 s, and never sent away for it.
# The wait for a ping's answer is grpc.http2.ping_timeout_ms (default 60 s) in the gRPC we pin:
# keepalive_timeout_ms alone is not applied, so a frozen peer was found after 60 s, not 10 or 5
# (measured with grpc 1.85: a SIGSTOPped server broke a pinging client's stream after 60.2 s,
# 5.4 s with the ping timeout set; tests/common/test_keepalive.py).
# grpc.so_reuseport 0: gRPC's default lets a second server bind a port one already listens on
# (SO_REUSEPORT), and the kernel then spreads connections over both: a second `loraplex up` on
# the same ports started, half of its calls reached the other's services, and it failed later and
# obscurely. Off, a port taken is an error at start.
SERVER_OPTIONS = CHANNEL_OPTIONS + [("grpc.so_reuseport", 0),
                                    ("grpc.keepalive_time_ms", 30_000),
                                    ("grpc.keepalive_timeout_ms", 10_000),
                                    ("grpc.http2.ping_timeout_ms", 10_000),
                                    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
                                    ("grpc.http2.max_ping_strikes", 0)]
# A client whose calls may wait long for a first answer (a gateway's Generate on a scheduler)
# pings during them: a frozen server is a broken call (UNAVAILABLE) within 15 s.
KEEPALIVE_OPTIONS = [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
                     ("grpc.http2.ping_timeout_ms", 5_000),
                     ("grpc.keepalive_permit_without_calls", 0)]


def insecure_channel(address: str, key: str = "", keepalive: bool = False) -> grpc.aio.Channel:
    """A client channel with the same message limits as our servers; every call on it presents
    `key` (metadata "authorization: Bearer <key>") unless the call sets its own, except two-way
    streams, which pass `credentials.metadata(key)` themselves: grpc runs an intercepted two-way
    stream through a queue and a task per message (on the scheduler's step stream, ~25% more CPU
    per round trip). With `keepalive`, it pings the server during calls (KEEPALIVE_OPTIONS)."""
    interceptors = None
    if key:
        entry = (wire.AUTHORIZATION, f"{wire.BEARER}{key}")
        # One object per call shape: the channel files each interceptor under its first kind.
        interceptors = [_PresentKeyUnary(entry), _PresentKeyUnaryStream(entry),
                        _PresentKeyStreamUnary(entry)]
    options = CLIENT_OPTIONS + (KEEPALIVE_OPTIONS if keepalive else [])
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


class _PresentKey:
    """Adds the authorization metadata to a call, unless the call brings its own."""

    def __init__(self, entry: tuple[str, str]):
        self._entry = entry

    def _with_key(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        if wire.AUTHORIZATION not in metadata:
            metadata.add(*self._entry)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                          details.credentials, details.wait_for_ready)


class _PresentKeyUnary(_PresentKey, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._with_key(details), request)


class _PresentKeyUnaryStream(_PresentKey, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._with_key(details), request)


class _PresentKeyStreamUnary(_PresentKey, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._with_key(details), request_iterator)


class Service:
    """A grpc.aio server with the health and reflection services, bound to `address`
    ("host:port", port 0 = any), so `grpcurl` and Kubernetes' gRPC probes work against it.

    `add_servicers(server)` registers the service's servicers; `service_names` are their full
    names (e.g. "loraplex.v1.Scheduler"), listed by reflection. `start()` returns the bound port;
    health reports SERVING only once `mark_serving()` is called (after warm-up), and NOT_SERVING
    again as soon as `stop()` begins.
    """

    def __init__(self, name: str, address: str, add_servicers: Callable[[grpc.aio.Server], None],
                 service_names: Sequence[str] = ()):
        self.name = name
        self._server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[
            _UndecodableRequests(), _FirstMessageFirst()])
        add_servicers(self._server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self._service_names = tuple(service_names)
        reflection.enable_server_reflection(
            (*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), self._server)
        self._server.add_generic_rpc_handlers([_UnknownMethod(name, self._service_names)])
        try:
            self.port = self._server.add_insecure_port(address)
        except RuntimeError:  # (grpc's words: "Failed to bind to address ...")
            self.port = 0
        if self.port == 0:
            raise OSError(f"{name}: cannot listen on {address}: the port is in use or the address "
                          "is not this machine's (give another --address)")

    async def start(self) -> int:
        await self._server.start()
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        return self.port

    async def mark_serving(self) -> None:
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)

    async def mark_not_serving(self) -> None:
        """Draining: probes and load balancers stop sending new work."""
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace: float = 5.0) -> None:
        await self.mark_not_serving()
        await self._server.stop(grace)

    async def _set_health(self, status) -> None:
        """Overall health ("") and every named service's follow the same state."""
        for name in ("", *self._service_names):
            await self._health.set(name, status)

    async def wait(self) -> None:
        await self._server.wait_for_termination()


# How long a call's first message is waited for before its handler runs (_FirstMessageFirst), or
# before an unknown method is refused (_UnknownMethod); past it the handler runs all the same.
FIRST_MESSAGE_WAIT_S = 10.0
# The same for a call that streams both ways: its client may well read before it writes (a
# second Step stream, refused as "already driven", must be told within its first stream's idle
# bound), and a first message in flight when a handler refuses arrives well within this.
BOTH_WAYS_FIRST_MESSAGE_WAIT_S = 1.0
_KINDS = {"adapter_store": "an adapter store", "executor": "an executor",
          "scheduler": "a scheduler", "gateway": "a gateway"}


async def _first_message(requests, wait_s: float) -> tuple[AsyncIterator, asyncio.Future]:
    """Wait for a call's first message (or `wait_s`, or the client's end): the call's messages
    from the first on, and the read of the first (to cancel once the handler is over: one that
    refused without reading)."""
    iterator = requests.__aiter__()
    first = asyncio.ensure_future(anext(iterator, _NO_MESSAGE))
    await asyncio.wait({first}, timeout=wait_s)

    async def replayed():
        message = await first
        if message is not _NO_MESSAGE:
            yield message
            async for message in iterator:
                yield message

    return replayed(), first


async def _first_message_read(requests, then: Callable[[object], Awaitable[T]],
                              wait_s: float = FIRST_MESSAGE_WAIT_S) -> T:
    """`then(replayed)` once the call's first message arrived (_first_message): `replayed`
    yields that message, then the rest."""
    replayed, first = await _first_message(requests, wait_s)
    try:
        return await then(replayed)
    finally:
        first.cancel()


_NO_MESSAGE = object()


class _FirstMessageFirst(grpc.aio.ServerInterceptor):
    """A call that streams its requests (AdapterStore.Push; Scheduler.Stream and Executor.Step,
    which stream both ways: BOTH_WAYS_FIRST_MESSAGE_WAIT_S at most) runs its handler once its
    first message has arrived. A handler that
    refuses a call at once (no key, a wrong one) otherwise ends it while the client is still
    sending that message, and grpc's Python client then reports INTERNAL "Internal error from
    Core" in place of the refusal (3 pushes without a key in 16; Streams without a key on one
    channel too); read first, the refusal arrives as itself."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not handler.request_streaming:
            return handler
        if not handler.response_streaming:
            behavior = handler.stream_unary

            async def after_first(requests, context):
                return await _first_message_read(requests, lambda r: behavior(r, context))

            return grpc.stream_unary_rpc_method_handler(
                after_first, handler.request_deserializer, handler.response_serializer)
        both = handler.stream_stream
        if inspect.isasyncgenfunction(both):  # (it yields its responses: Step)
            async def after_first_both(requests, context):
                replayed, first = await _first_message(requests, BOTH_WAYS_FIRST_MESSAGE_WAIT_S)
                try:
                    async for response in both(replayed, context):
                        yield response
                finally:
                    first.cancel()
        else:  # (it writes them: Stream)
            async def after_first_both(requests, context):
                return await _first_message_read(requests, lambda r: both(r, context),
                                                 BOTH_WAYS_FIRST_MESSAGE_WAIT_S)

        return grpc.stream_stream_rpc_method_handler(
            after_first_both, handler.request_deserializer, handler.response_serializer)


@dataclasses.dataclass(frozen=True)
class _Undecodable:
    """A request message that did not decode, in place of it (_UndecodableRequests)."""

    error: str


class _UndecodableRequests(grpc.aio.ServerInterceptor):
    """A request that does not decode as its message (a string field that is not UTF-8, a
    truncated message) is INVALID_ARGUMENT naming the method: grpc's own answer was UNKNOWN for
    a unary call and INTERNAL "this is a bug" for a push. A streamed request's bad message is an
    InvalidArgument raised where the handler reads it (its grpc_errors gives the status)."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        decode, method = handler.request_deserializer, details.method

        def deserializer(data: bytes):
            try:
                return decode(data)
            except DecodeError as err:
                return _Undecodable(str(err))

        def refusal(bad: _Undecodable) -> str:
            return (f"{method}: the request is not a valid message ({bad.error}); is every "
                    "string field UTF-8?")

        async def checked(requests):
            async for request in requests:
                if isinstance(request, _Undecodable):
                    raise InvalidArgument(refusal(request))
                yield request

        kind = ("stream" if handler.request_streaming else "unary") + "_" + (
            "stream" if handler.response_streaming else "unary")
        behavior = getattr(handler, kind)
        if handler.request_streaming and inspect.isasyncgenfunction(behavior):
            async def wrapped(requests, context):
                async for response in behavior(checked(requests), context):
                    yield response
        elif handler.request_streaming:
            async def wrapped(requests, context):
                return await behavior(checked(requests), context)
        elif inspect.isasyncgenfunction(behavior):
            async def wrapped(request, context):
                if isinstance(request, _Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal(request))
                async for response in behavior(request, context):
                    yield response
        else:
            async def wrapped(request, context):
                if isinstance(request, _Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal(request))
                return await behavior(request, context)
        return getattr(grpc, f"{kind}_rpc_method_handler")(
            wrapped, deserializer, handler.response_serializer)


class _UnknownMethod(grpc.GenericRpcHandler):
    """Every method this server does not have: UNIMPLEMENTED saying which service answered
    (a client pointed at the wrong port learns what is there), after the call's first message
    (so a streaming client is told so, not INTERNAL: _FirstMessageFirst)."""

    def __init__(self, name: str, service_names: Sequence[str]):
        self._what = (f"{_KINDS.get(name, name)} (loraplex {name}"
                      f"{': ' + ', '.join(service_names) if service_names else ''})")

    def service(self, details):
        method = details.method

        async def refuse(requests, context):
            async def abort(_):
                await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                    f"this address serves {self._what}, which has no method "
                                    f"{method}: check the address you gave")
            await _first_message_read(requests, abort)

        return grpc.stream_stream_rpc_method_handler(refuse)


async def run_until_signalled(service: Service,
                              on_stop: Callable[[], Awaitable[None]] | None = None,
                              grace: float = 5.0,
                              stop_beside: Callable[[], Awaitable[None]] | None = None) -> None:
    """Serve until SIGINT/SIGTERM. Then report NOT_SERVING for NOT_SERVING_NOTICE_S (so probes
    and load balancers stop sending work), stop taking RPCs, let in-flight ones finish within
    `grace` (while `stop_beside` stops another server of the process the same way), and run
    `on_stop`."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("%s: stopping (grace %.1fs)", service.name, grace)
    await service.mark_not_serving()
    await asyncio.sleep(NOT_SERVING_NOTICE_S)
    beside = asyncio.ensure_future(stop_beside()) if stop_beside is not None else None
    await service.stop(grace)
    if beside is not None:
        await beside
    if on_stop is not None:
        await on_stop()


# loraplex's own loggers (not the libraries'), whose level $LORAPLEX_LOG_LEVEL sets: DEBUG adds a
# line per request in each service, with its id (common/request_ids.py), for following one.
# ("__main__": a service's own module, run as `python -m scheduler.service`.)
OWN_LOGGERS = ("__main__", "adapter_store", "common", "executor", "gateway", "kernels",
               "scheduler")


def configure_logging(name: str) -> None:
    """Log lines on stderr, named for the service (stdout carries only `announce`), at INFO, or
    at $LORAPLEX_LOG_LEVEL (DEBUG, INFO, WARNING, ERROR) for loraplex's own loggers."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")
    level = os.environ.get("LORAPLEX_LOG_LEVEL", "").upper()
    if level:
        if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise SystemExit(f"LORAPLEX_LOG_LEVEL must be DEBUG, INFO, WARNING or ERROR, got "
                             f"{level!r}")
        for logger in OWN_LOGGERS:
            logging.getLogger(logger).setLevel(level)


# The collector's youngest-generation threshold once a service serves (CPython's is 700). Serving
# allocates container objects per request and per token (tasks, futures, messages, events) that
# mostly die young by reference counting; at 700 the scheduler's direct Generate path spent 4-7%
# of its CPU in collections, at 20,000 1-2% (bench/control_plane.py --only generate, gc.callbacks).
# A young collection then scans at most about this many objects: under a millisecond here.
GC_YOUNG_THRESHOLD = 20_000


def announce(name: str, address: str) -> None:
    """The one stdout line a service prints once it serves; loraplex.launch waits for it.
    Everything built so far (modules, torch, weights' Python objects) is moved out of the garbage
    collector's sight first: a full collection over it stalls the event loop for ~100 ms (an
    adapter store's first SetAlias took 130 ms instead of 20 when one landed there)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    print(f"{name} listening on {address}", flush=True)


def run(main: Callable[[], Awaitable[T]]) -> T:
    """Run an async entry point on uvloop and return its result."""
    import uvloop

    return uvloop.run(main())
