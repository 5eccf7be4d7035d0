"""Standard gRPC surfaces on every service: server reflection (what `grpcurl list` uses) and
health checking that reports SERVING once warm and NOT_SERVING while stopping."""

import asyncio
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from loraplex.launch import Fleet, start_service
from loraplex.server import insecure_channel


@pytest.fixture(scope="module")
def fleet(tiny, tmp_path_factory, log_dir):
    with Fleet(model=tiny["model_dir"], store_url=tmp_path_factory.mktemp("store").as_uri(),
               log_dir=log_dir / "surfaces", executor_args=["--threads", "1"]) as fleet:
        yield fleet


async def list_services(address: str) -> set[str]:
    async with insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        async for response in stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
                list_services="")])):
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
    services = await list_services(proc.address)
    assert {service, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
    assert await health(proc.address) == health_pb2.HealthCheckResponse.SERVING
    assert await health(proc.address, service) == health_pb2.HealthCheckResponse.SERVING


async def test_health_flips_to_not_serving_while_stopping(tmp_path, log_dir):
    store = start_service("lone-store", "adapter_store.service", ["--url", tmp_path.as_uri()], log_dir)
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
