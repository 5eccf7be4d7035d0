"""A client channel keeps its own connections: a new channel to a service back on an address
connects at once, whatever an older channel of the same process still tries there (with gRPC's
process-wide subchannel pool it took over that channel's backoff and failed at once,
"connections to all backends failing")."""

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.server import insecure_channel


async def serve(address: str) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port(address)
    await server.start()
    return server, port


async def test_a_new_channel_reaches_a_service_back_on_an_address_an_old_one_backs_off_from():
    server, port = await serve("127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    await server.stop(None)
    lingering = insecure_channel(address)  # (never closed while the service is away)
    for _ in range(6):  # its failed connections back off: 1 s, 1.6 s, 2.6 s, ...
        lingering.get_state(try_to_connect=True)
        await asyncio.sleep(1)
    server, _ = await serve(address)
    try:
        async with insecure_channel(address) as channel:
            answer = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await lingering.close()
        await server.stop(None)
