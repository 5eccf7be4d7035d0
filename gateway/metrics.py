"""The gateway's Prometheus metrics (served on --metrics-port)."""

import asyncio

from prometheus_client import CollectorRegistry, Counter, Histogram

from common.errors import LoraplexError


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self._requests = Counter("loraplex_gateway_requests",
                                 "Requests by face (grpc, http) and outcome (gRPC status name).",
                                 ["face", "code"], registry=r)
        self.first_token = Histogram(
            "loraplex_gateway_time_to_first_token_seconds",
            "From a Generate sent to a pool to its first message, failovers included.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.tokens = Counter("loraplex_gateway_tokens", "Tokens generated for clients.",
                              registry=r)
        self.failovers = Counter("loraplex_gateway_failovers",
                                 "Generates sent to another cell: the first could not be "
                                 "reached.", registry=r)

    def finished(self, face: str, error: BaseException | None = None) -> None:
        if error is None:
            code = "OK"
        elif isinstance(error, LoraplexError):
            code = error.code.name
        elif isinstance(error, asyncio.CancelledError):  # the client left
            code = "CANCELLED"
        else:
            code = "INVALID_ARGUMENT" if isinstance(error, ValueError) else "INTERNAL"
        self._requests.labels(face, code).inc()
