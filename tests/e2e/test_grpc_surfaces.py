"""Standard surfaces on every service: server reflection (what `grpcurl list` uses), health
checking that reports SERVING once warm and NOT_SERVING while stopping, Prometheus metrics."""

import asyncio
import gc
import signal
import socket
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from common import server
from common.server import insecure_channel
from loraplex import client
from loraplex.launch import Fleet, start_service
from protos import scheduler_pb2_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


METRICS = {"scheduler": free_port(), "executor": free_port(), "store": free_port()}


@pytest.fixture(scope="module")
def fleet(tiny, tmp_path_factory, log_dir):
    with Fleet(model=tiny["model_dir"], store_url=tmp_path_factory.mktemp("store").as_uri(),
               log_dir=log_dir / "surfaces",
               executor_args=["--threads", "1", "--metrics-port", str(METRICS["executor"])],
               scheduler_args=["--metrics-port", str(METRICS["scheduler"])],
               store_args=["--metrics-port", str(METRICS["store"])]) as fleet:
        yield fleet


def scrape(port: int) -> dict[str, float]:
    """Sum of every sample of each metric name (labels folded)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


async def test_metrics_count_tokens_steps_loads_and_hits(fleet, tiny):
    await client.push_adapter(fleet.stores[0], tiny["adapters"]["r4_attn"]["path"], "r4_attn")
    async with insecure_channel(fleet.scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        for i in range(3):
            request = client.generate_request("r4_attn", f"metrics {i}", 5, ignore_eos=True)
            await client.generate(stub, request)
    s = scrape(METRICS["scheduler"])
    assert s["loraplex_tokens_total"] >= 15 and s["loraplex_steps_total"] > 0
    assert s["loraplex_adapter_loads_total"] >= 1 and s["loraplex_adapter_hits_total"] >= 2
    assert s["loraplex_time_to_first_token_seconds_count"] == 3
    assert "loraplex_tenant_virtual_counter" in s
    e = scrape(METRICS["executor"])
    assert e["loraplex_executor_adapter_loads_total"] >= 1
    assert e["loraplex_executor_tokens_total"] > 0
    st = scrape(METRICS["store"])
    host_tier_lookups = (st["loraplex_store_host_tier_hits_total"]
                         + st["loraplex_store_host_tier_misses_total"])
    assert host_tier_lookups >= 1
    assert st["loraplex_store_blob_read_bytes_total"] > 0


async def list_services(address: str) -> set[str]:
    async with insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        requests = iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        async for response in stub.ServerReflectionInfo(requests):
            return {s.name for s in response.list_services_response.service}
    return set()


async def health(address: str, service: str = "") -> int:
    async with insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return (await stub.Check(health_pb2.HealthCheckRequest(service=service))).status


@pytest.mark.parametrize("name, service", [("scheduler", "loraplex.v1.Scheduler"),
                                           ("executor", "loraplex.v1.Executor"),
                                           ("adapter_store", "loraplex.v1.AdapterStore")])
async def test_reflection_lists_the_service_and_health_says_serving(fleet, name, service):
    (proc,) = fleet.by_name(name)
    port = proc.address.rsplit(":", 1)[1]
    services = await list_services(f"dns:///localhost:{port}")  # gRPC's own resolver, round_robin
    assert {service, "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= services
    assert await health(proc.address) == health_pb2.HealthCheckResponse.SERVING
    assert await health(proc.address, service) == health_pb2.HealthCheckResponse.SERVING


async def test_health_flips_to_not_serving_while_stopping(tmp_path, log_dir):
    store = start_service("lone-store", "adapter_store.service", ["--url", tmp_path.as_uri()],
                          log_dir)
    assert await health(store.address) == health_pb2.HealthCheckResponse.SERVING
    store.process.send_signal(signal.SIGTERM)
    statuses = []
    for _ in range(300):
        try:
            statuses.append(await health(store.address))
        except grpc.aio.AioRpcError:  # stopped: the probe fails, as it should
            break
        await asyncio.sleep(0.01)
    assert store.process.wait(30) == 0
    assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses


def test_a_service_moves_what_it_built_at_startup_out_of_the_collectors_sight(capsys):
    """announce() freezes the startup heap (torch, weights, modules): a full collection over it
    stalled a store's event loop ~110 ms; frozen objects are never scanned again."""
    gc.unfreeze()
    try:
        server.announce("x", "127.0.0.1:1")
        assert gc.get_freeze_count() > 0
        assert capsys.readouterr().out == "x listening on 127.0.0.1:1\n"
    finally:
        gc.unfreeze()
