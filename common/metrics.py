"""Prometheus plumbing shared by the services: one registry per process, served on its own port."""

from prometheus_client import CollectorRegistry, start_http_server


def serve_metrics(port: int, registry: CollectorRegistry, host: str = "0.0.0.0") -> None:
    """Expose `registry` at http://host:port/metrics (port 0: metrics off)."""
    if port:
        start_http_server(port, addr=host, registry=registry)


class BoundedLabel:
    """Label values for an unbounded domain (tenants): the first `limit` seen keep their name,
    later ones share "other", so a metric never grows past limit + 1 series."""

    def __init__(self, limit: int = 50):
        self._limit = limit
        self._known: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self._known:
            return value
        if len(self._known) < self._limit:
            self._known.add(value)
            return value
        return "other"
