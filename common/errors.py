"""Errors that cross a service boundary, each bound to one gRPC status code.

Core code raises these (or plain ValueError for bad input); servicers wrap every RPC with
`grpc_errors`, the single exception-to-status mapping of a server. Anything else escaping an RPC is
a bug and becomes INTERNAL with its type named, never a crash of the server.
"""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc

from common import wire

log = logging.getLogger(__name__)


class LoraplexError(Exception):
    """Base class: `code` is the gRPC status the caller receives; the message says what to do.
    `trailers` travel as trailing metadata (e.g. retry-after)."""

    code = grpc.StatusCode.INTERNAL
    trailers: tuple[tuple[str, str], ...] = ()


class InvalidArgument(LoraplexError, ValueError):
    """Bad input; also a ValueError, so plain code that checks input can catch it as one."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(LoraplexError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(LoraplexError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(LoraplexError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class PermissionDenied(LoraplexError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(LoraplexError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unauthenticated(LoraplexError):
    code = grpc.StatusCode.UNAUTHENTICATED


class Unavailable(LoraplexError):
    code = grpc.StatusCode.UNAVAILABLE


class Aborted(LoraplexError):
    """The operation did not happen and nothing changed; the caller decides what to do next."""

    code = grpc.StatusCode.ABORTED


class DeadlineExceeded(LoraplexError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class DataLoss(LoraplexError):
    code = grpc.StatusCode.DATA_LOSS


# A status received from another service keeps its code when it is passed on.
_FORWARDED = {cls.code: cls for cls in LoraplexError.__subclasses__()}
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def from_rpc_error(err: grpc.aio.AioRpcError, what: str) -> LoraplexError:
    """Turn a downstream service's error into ours, keeping its code and prefixing `what`."""
    cls = _FORWARDED.get(err.code(), Unavailable)
    if err.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        cls = Unavailable  # a downstream call ran out of time: retryable for our caller
    return cls(f"{what}: {err.details()}")


def relayed(err: grpc.aio.AioRpcError) -> LoraplexError:
    """A downstream error passed on as it came (a gateway relaying its pool's answer): the same
    code, message and retry-after; a status of no class here (CANCELLED, UNKNOWN, INTERNAL...) is
    UNAVAILABLE for the caller."""
    return _relay(err.code(), err.details(), dict(err.trailing_metadata() or ()).get(
        wire.RETRY_AFTER))


def relayed_status(code: int, message: str, wait: str = "") -> LoraplexError:
    """A status sent as data (a scheduler's StreamUpdate: the code's number, the message and the
    retry-after), passed on as `relayed` passes on an RPC's."""
    return _relay(_CODES.get(code, grpc.StatusCode.UNKNOWN), message, wait or None)


def _relay(code: grpc.StatusCode, message: str, wait: str | None) -> LoraplexError:
    error = _FORWARDED.get(code, Unavailable)(message or code.name)
    if wait is not None:
        error.trailers = ((wire.RETRY_AFTER, wait),)
    return error


def retry_after(error: LoraplexError, seconds: float) -> LoraplexError:
    """`error`, carrying a retry-after trailer (seconds) for the caller."""
    error.trailers = ((wire.RETRY_AFTER, f"{seconds:.3f}"),)
    return error


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a caller gets for `exc`."""
    if isinstance(exc, LoraplexError):
        return exc.code, str(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    log.exception("internal error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}: {exc}); this is a bug"


@contextlib.asynccontextmanager
async def grpc_errors(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """Abort the RPC with the mapped status when the body raises. The status leaves behind the
    messages the client has not read: waiting for that is bounded (ABORT_S), the handler ends
    either way and the status follows when the client reads."""
    try:
        yield
    except (grpc.aio.AbortError, KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:  # noqa: BLE001 - the one place every error becomes a status
        code, message = status_for(exc)
        try:
            async with asyncio.timeout(ABORT_S):
                await context.abort(code, message, getattr(exc, "trailers", ()))
        except TimeoutError:
            # The status is queued behind the unread messages; the handler ends as cancelled,
            # which grpc.aio takes quietly (another AbortError would not be its own).
            raise asyncio.CancelledError from None


ABORT_S = 5.0


class WriteBound:
    """Every write of one server stream taken within `seconds`: UNAVAILABLE when the client takes
    a message in none (it stopped reading, its flow-control window is full). One timer for the
    stream, not one per message (asyncio.timeout around each write made and cancelled a timer per
    token: 25-45 us a token in a loaded server, bench/control_plane.py). The timer fires when the
    write in progress, if any, would reach its bound; one that did cancels the handler's task,
    and that write raises UNAVAILABLE. Time between writes does not count. Made in the handler's
    task, as a context manager:

        with WriteBound(30.0) as bound:
            await bound.write(context, message)
    """

    __slots__ = ("_seconds", "_loop", "_task", "_since", "_expired", "_handle")

    def __init__(self, seconds: float):
        self._seconds = seconds
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._since: float | None = None  # when the write in progress began (loop time)
        self._expired = False
        self._handle = self._loop.call_at(self._loop.time() + seconds, self._check)

    def _check(self) -> None:
        since, now = self._since, self._loop.time()
        if since is not None and now - since >= self._seconds:
            self._expired = True
            self._task.cancel()
        else:
            self._handle = self._loop.call_at((now if since is None else since) + self._seconds,
                                              self._check)

    async def write(self, context: grpc.aio.ServicerContext, message) -> None:
        self._since = self._loop.time()
        try:
            await context.write(message)
        except asyncio.CancelledError:
            if not self._expired:
                raise
            self._task.uncancel()
            raise Unavailable(f"the client took no message within {self._seconds:g}s: the call "
                              "ends") from None
        finally:
            self._since = None

    def __enter__(self) -> "WriteBound":
        return self

    def __exit__(self, *exc_info) -> None:
        self._handle.cancel()
