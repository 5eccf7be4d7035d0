"""The gateway: the front door of a fleet of pools. Stateless; run any number of replicas.

    python -m gateway.service --pool MODEL_ID=HOST:PORT --store HOST:PORT \
        [--api-keys-file F --service-key-file F] [--address 0.0.0.0:50050] [--http-address ...]

It owns callers' API keys (-> tenant) and per-tenant rate limits; it resolves each request's
adapter to its base model (cached, stale-while-error, like the scheduler), sends the request to
the pool serving that base (gateway/pools.py), under its service key with the tenant named
(metadata loraplex-tenant), and relays the stream. The pools keep fairness, residency and
admission. gRPC (health, reflection) and HTTP (the OpenAI API, gateway/openai_api.py; the
TGI/LoRAX API, gateway/tgi_api.py; GET /health) run on one event loop.
"""

import asyncio
import contextlib
import logging
import socket

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.routing import Route as HttpRoute

from common.metrics import serve_metrics
from common.ratelimit import RateLimiter
from common.registry_client import RegistryClient
from common.server import Service, announce, configure_logging, run, run_until_signalled
from gateway.catalog import Catalog
from gateway.config import GatewayConfig
from gateway.frontend import Frontend
from gateway.grpc_service import GatewayServicer
from gateway.metrics import GatewayMetrics
from gateway.openai_api import OpenAIApi, routing_error
from gateway.pools import Pools
from gateway.tgi_api import TgiApi
from gateway.tokenize_api import TokenizeApi
from protos import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)


class _HttpServer(uvicorn.Server):
    """uvicorn without its own signal handling: the gateway stops it with the gRPC server."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def _listen(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    sock = socket.create_server((host.strip("[]"), int(port)), reuse_port=False)
    sock.setblocking(False)
    return sock


async def serve(config: GatewayConfig) -> None:
    keys = config.keys.load()
    if keys.is_open:
        log.warning("gateway: no keys configured, open access as tenant 'default'; configure "
                    "--api-keys-file and --service-key-file")
    pools = await Pools(config.pools, config.roster, keys.service_key, config.refresh_s,
                        config.rpc_s).start()
    registry = RegistryClient(config.stores, keys.service_key, resolve_s=config.rpc_s,
                              resolve_ttl_s=config.resolve_ttl_s)
    metrics = GatewayMetrics()
    frontend = Frontend(pools, registry,
                        RateLimiter(config.rate_limits, config.default_rate_limit), keys,
                        config.request_timeout_s, metrics)
    servicer = GatewayServicer(frontend)
    service = Service(
        "gateway", config.address,
        lambda server: scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server),
        [scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name])
    port = await service.start()
    max_body = config.max_body_mb << 20
    app = Starlette(routes=[
        *OpenAIApi(frontend, Catalog(config.stores, keys.service_key, config.rpc_s),
                   max_body).routes(),
        *TgiApi(frontend, max_body).routes(),
        *TokenizeApi(frontend, max_body).routes(),
        HttpRoute("/health", lambda _: Response(status_code=200), methods=["GET"])],
        exception_handlers={HTTPException: routing_error})
    sock = _listen(config.http_address)
    http = _HttpServer(uvicorn.Config(app, lifespan="off", log_level="warning",
                                      http="httptools", access_log=False,
                                      timeout_graceful_shutdown=int(config.grace_s)))
    http_task = asyncio.create_task(http.serve(sockets=[sock]), name="http")
    while not http.started:
        if http_task.done():
            await http_task  # raises what stopped it
            raise RuntimeError("the HTTP server stopped before it started")
        await asyncio.sleep(0.01)
    serve_metrics(config.metrics_port, metrics.registry)
    await service.mark_serving()
    announce("gateway-http", f"{config.http_address.rpartition(':')[0]}:"
                             f"{sock.getsockname()[1]}")
    announce("gateway", f"{config.address.rpartition(':')[0]}:{port}")

    async def stop_http() -> None:  # no new connections; requests under way finish
        http.should_exit = True
        await http_task

    await run_until_signalled(service, on_stop=pools.close, grace=config.grace_s,
                              stop_beside=stop_http)


def main(argv: list[str] | None = None) -> None:
    configure_logging("gateway")
    run(lambda: serve(GatewayConfig.from_args(argv)))


if __name__ == "__main__":
    main()
