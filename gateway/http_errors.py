"""Errors over HTTP, in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with the
HTTP status OpenAI clients expect for each kind (their exception classes follow the status), and
`Retry-After` (whole seconds, plus `retry-after-ms`) when the gateway or a pool says when to come
back, 1 s on any other 503 (a pool down, a store unreachable)."""

import math

import grpc

from common import wire
from common.errors import InvalidArgument, status_for

# gRPC status -> (HTTP status, OpenAI error type)
_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),  # (OpenAI's, model_not_found)
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.ABORTED: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "not_implemented"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


class BadField(InvalidArgument):
    """INVALID_ARGUMENT about one field of the body (`param` in OpenAI's error)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


UNAVAILABLE_RETRY_S = 1.0  # Retry-After of a 503 that says no time of its own

_CODES = {401: "invalid_api_key", 404: "model_not_found", 429: "rate_limit_exceeded"}


def error_body(exc: BaseException) -> tuple[int, dict, dict[str, str]]:
    """(HTTP status, body, headers) for an exception raised while serving a request."""
    code, message = status_for(exc)
    status, kind = _HTTP.get(code, (500, "internal_error"))
    headers = {}
    wait = dict(getattr(exc, "trailers", ())).get(wire.RETRY_AFTER)
    if wait is None and status == 503:
        wait = UNAVAILABLE_RETRY_S  # (a pool down: soon, not a client's own longer backoff)
    if wait is not None:
        seconds = float(wait)
        headers = {"Retry-After": str(max(1, math.ceil(seconds))),
                   "retry-after-ms": str(max(1, round(seconds * 1000)))}
    return status, openai_error(message, kind, getattr(exc, "param", None),
                                _CODES.get(status)), headers


def openai_error(message: str, kind: str, param: str | None = None,
                 code: str | None = None) -> dict:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def routing_error_body(method: str, path: str, status: int, detail: str,
                       allowed: str = "") -> dict:
    """The body for a request no handler took, as OpenAI answers it: a path no route serves
    (404), a method its route does not take (405, `allowed` the ones it does), else `detail`."""
    where = f"({method} {path[:200]})"
    if status == 404:
        message = f"Invalid URL {where}: no such endpoint"
    elif status == 405:
        message = f"Method not allowed {where}: use {allowed or 'another method'}"
    else:
        message = f"{detail} {where}"
    return openai_error(message, "invalid_request_error" if status < 500 else "internal_error")
