"""Fixtures of the end-to-end tests. Each module starts the fleet it needs as its own `fleet`."""

import pytest

from common.server import insecure_channel
from protos import scheduler_pb2_grpc


@pytest.fixture
async def stub(fleet):
    """A scheduler stub on the requesting module's `fleet`."""
    async with insecure_channel(fleet.scheduler) as channel:
        yield scheduler_pb2_grpc.SchedulerStub(channel)
