"""The registry client (the scheduler's and the gateway's adapter lookups) against a real store:
the lookups of one turn of the event loop go in one GetAdapters call, each answered on its own (a
missing name fails alone, with NOT_FOUND), a replica that is down is passed over; and GetAdapters
itself, query by query."""

import asyncio

import grpc

from common.errors import NotFound
from common.registry_client import RegistryClient
from protos import adapter_store_pb2 as pb
from tests.store.helpers import expect_error, in_session_loop, make_adapter

DOWN = "127.0.0.1:1"  # nothing listens there: UNAVAILABLE at once


class CountingStub:
    """A store stub that records the queries of each GetAdapters call made through it."""

    def __init__(self, stub):
        self.stub, self.calls = stub, []

    def GetAdapters(self, request, **kwargs):
        self.calls.append([q.name for q in request.queries])
        return self.stub.GetAdapters(request, **kwargs)


@in_session_loop
async def test_a_turns_lookups_go_in_one_call_past_a_replica_that_is_down(file_store):
    config_json, data = make_adapter()
    for name in ("bot-0", "bot-1", "bot-2"):
        await file_store.push(name, config_json, data)
    registry = RegistryClient((DOWN, file_store.running.address), resolve_s=5.0)
    registry._stores = [(address, CountingStub(stub)) for address, stub in registry._stores]
    down, up = (stub for _, stub in registry._stores)
    answers = await asyncio.gather(
        *(registry.resolve(name, "") for name in ("bot-0", "bot-1", "missing", "bot-2",
                                                  "bot-1")), return_exceptions=True)
    assert [a.name for a in answers if not isinstance(a, Exception)] == [
        "bot-0", "bot-1", "bot-2", "bot-1"]
    assert isinstance(answers[2], NotFound) and "missing" in str(answers[2])
    # one question per reference (bot-1 asked once), one call to each replica in turn
    assert down.calls == up.calls == [["bot-0", "bot-1", "missing", "bot-2"]]
    await asyncio.gather(registry.resolve("bot-0", ""), registry.resolve("bot-2", ""))
    assert len(up.calls) == 1  # answers kept resolve_ttl_s: nothing asked


class FrozenStub:
    """A store that answered once, then is frozen: each GetAdapters call ends UNAVAILABLE at its
    deadline, the clock moved on by that much."""

    def __init__(self, stub, clock: list[float]):
        self.stub, self.clock, self.calls = stub, clock, 0
        self.frozen = False

    async def GetAdapters(self, request, timeout):
        self.calls += 1
        if not self.frozen:
            return await self.stub.GetAdapters(request, timeout=timeout)
        self.clock[0] += timeout
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                   grpc.aio.Metadata(), details="frozen")


@in_session_loop
async def test_a_frozen_store_costs_one_lookup_deadline_per_resolve_ttl_not_per_request(
        file_store):
    """Stale-while-error: once a lookup fails, the last answer serves resolve_ttl_s from the
    failure, even when the failure took the lookup's whole deadline (longer than the TTL)."""
    config_json, data = make_adapter()
    await file_store.push("bot", config_json, data)
    clock = [0.0]
    registry = RegistryClient((file_store.running.address,), resolve_s=2.0, resolve_ttl_s=1.0,
                              clock=lambda: clock[0])
    frozen = FrozenStub(registry._stores[0][1], clock)
    registry._stores = [(file_store.running.address, frozen)]
    assert (await registry.resolve("bot", "")).version == 1
    frozen.frozen, clock[0] = True, 5.0  # the answer is past its TTL: asked again, and failing
    assert (await registry.resolve("bot", "")).version == 1 and clock[0] == 7.0
    for _ in range(3):  # within resolve_ttl_s of the failure: the stale answer, nothing asked
        clock[0] += 0.3
        assert (await registry.resolve("bot", "")).version == 1
    assert frozen.calls == 2


@in_session_loop
async def test_get_adapters_answers_each_query_as_get_adapter_would(file_store):
    config_json, data = make_adapter()
    await file_store.push("mine", config_json, data, owner="acme")
    await file_store.push("mine", config_json, data, owner="acme")
    queries = [pb.GetAdapterRequest(name="mine"), pb.GetAdapterRequest(name="mine", version=1),
               pb.GetAdapterRequest(name="mine", tenant="other"),
               pb.GetAdapterRequest(name="Bad Name"), pb.GetAdapterRequest(name="nobody")]
    response = await file_store.stub.GetAdapters(pb.GetAdaptersRequest(queries=queries))
    assert [a.info.version for a in response.answers] == [2, 1, 0, 0, 0]
    codes = [grpc.StatusCode.OK, grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND,
             grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND]
    assert [a.error_code for a in response.answers] == [c.value[0] for c in codes]
    for query, answer in zip(queries, response.answers):
        if answer.error_code:
            code = next(c for c in grpc.StatusCode if c.value[0] == answer.error_code)
            details = await expect_error(code, file_store.stub.GetAdapter(query))
            assert details == answer.error_message
    too_many = pb.GetAdaptersRequest(queries=[pb.GetAdapterRequest(name="mine")] * 1025)
    details = await expect_error(grpc.StatusCode.INVALID_ARGUMENT,
                                 file_store.stub.GetAdapters(too_many))
    assert "at most 1024" in details
