"""What the gateway's HTTP APIs share: the caller's tenant from its Bearer key, a bounded JSON
body, and handlers that end as soon as the client goes away: from the moment its body is read
(json_body) until the answer is ready, a watcher cancels the handler when the client disconnects
(its Generate calls cancelled with it, also while no token has come); server-sent events then
listen for it themselves."""

import asyncio
import json
import re
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from common import wire
from common.credentials import bearer
from common.errors import InvalidArgument
from common.request_ids import REQUEST_ID_KEY, checked_request_id
from gateway.frontend import CLIENT_WRITE_S, Frontend


def request_id_of(request: Request) -> str:
    """The client's x-request-id (checked), or a new id: the request's in every service's logs
    and in its response."""
    return checked_request_id(request.headers.get(REQUEST_ID_KEY, ""), REQUEST_ID_KEY)


def tenant_of(request: Request, frontend: Frontend) -> str:
    return frontend.tenant(bearer(request.headers.items()),
                           request.headers.get(wire.ON_BEHALF_OF, ""))


async def json_body(request: Request, max_bytes: int) -> dict:
    """The request's JSON object, read up to `max_bytes` (INVALID_ARGUMENT past it)."""
    size, chunks = 0, []
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise InvalidArgument(f"the request body is over {max_bytes} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except ValueError:
        raise InvalidArgument("the request body is not valid JSON") from None
    except RecursionError:
        raise InvalidArgument("the request body nests too deeply") from None
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):  # (rare: only then is every string looked at)
        _check_text(body)
    _watch_for_disconnect(request)
    return body


# A JSON escape of a UTF-16 surrogate: a pair is one character, one alone decodes to a str that
# no tokenizer, protobuf or UTF-8 writer takes (a 500 deep inside, were it let through).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _check_text(value) -> None:
    """INVALID_ARGUMENT when a string of the body (a key or a value) is not Unicode text."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidArgument("the request body holds a lone UTF-16 surrogate escape "
                                      "(\\ud800-\\udfff without its pair): not text") from None


def _watch_for_disconnect(request: Request) -> None:
    """Cancel the running handler (a task of its own: guarded) when the client disconnects. Once
    the body is read, the client has nothing more to send: the next ASGI message is its
    disconnect (or the end of the response)."""
    handler = asyncio.current_task()

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        request.state.client_left = True
        handler.cancel()
    request.state.watcher = asyncio.ensure_future(watch())


class SSEResponse(StreamingResponse):
    """Server-sent events; the stream is cancelled (and its Generate calls with it) as soon as
    the client disconnects, also while no token is on its way, or takes no event within
    `write_s` (it stopped reading: its connection is closed)."""

    def __init__(self, events, write_s: float = CLIENT_WRITE_S):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._write_s = write_s

    async def __call__(self, scope, receive, send) -> None:
        async def send_within(message) -> None:
            async with asyncio.timeout(self._write_s):
                await send(message)
        stream = asyncio.ensure_future(self.stream_response(send_within))
        listen = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait((stream, listen), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, listen):
                task.cancel()
            await asyncio.gather(stream, listen, return_exceptions=True)
            await self.body_iterator.aclose()


def guarded(frontend: Frontend, handler: Callable[[Request], Awaitable[Response]],
            error_response: Callable[[BaseException], JSONResponse]):
    """`handler`, run as a task of its own (what a disconnect cancels), with every error answered
    by `error_response` (the API's error shape) and every outcome counted."""
    async def handle(request: Request) -> Response:
        work = asyncio.ensure_future(handler(request))
        try:
            response = await work
        except asyncio.CancelledError as cancelled:
            if not getattr(request.state, "client_left", False):
                raise
            frontend.metrics.finished("http", cancelled)
            return Response(status_code=CLIENT_CLOSED)  # (nobody reads it)
        except Exception as exc:  # noqa: BLE001 - every error is an error body of the API's
            frontend.metrics.finished("http", exc)
            return error_response(exc)
        finally:
            if (watcher := getattr(request.state, "watcher", None)) is not None:
                watcher.cancel()
        frontend.metrics.finished("http")
        return response
    return handle


CLIENT_CLOSED = 499  # (nginx's status for a client that left before the answer)
