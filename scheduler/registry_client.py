"""Adapter lookups in the store's registry, from the scheduler.

A reference is resolved once, when the request arrives: the request then carries the exact
"name@version" for its whole life, so moving an alias never changes a running sequence, and the
next request resolves the alias afresh (the store re-reads aliases on every lookup)."""

import logging

import grpc

from common.adapter_ref import AdapterQuery, AdapterRef
from common.errors import LoraplexError, Unavailable, from_rpc_error
from common.server import insecure_channel
from protos import adapter_store_pb2, adapter_store_pb2_grpc, common_pb2

log = logging.getLogger(__name__)
class RegistryClient:
    def __init__(self, stores: tuple[str, ...]):
        self._stores = [(a, adapter_store_pb2_grpc.AdapterStoreStub(insecure_channel(a)))
                        for a in stores]

    async def warm(self, adapter: AdapterRef) -> None:
        """Have the first store that answers bring the version into its RAM tier (best effort:
        the executor's load reads it either way). Executors fetch from the first store that
        answers too, so with the same store list both meet at the same replica."""
        request = adapter_store_pb2.HostPrewarmRequest(name=adapter.name, version=adapter.version)
        for address, stub in self._stores:
            try:
                await stub.Prewarm(request, timeout=60)
                return
            except grpc.aio.AioRpcError as err:
                log.warning("warming %s in store %s: %s", adapter, address, err.details())
                if err.code() != grpc.StatusCode.UNAVAILABLE:
                    return

    async def resolve(self, ref: str, tenant: str) -> common_pb2.AdapterInfo:
        """The exact adapter version `ref` names for `tenant` (NOT_FOUND if it may not see it)."""
        query = AdapterQuery.parse(ref)
        request = adapter_store_pb2.GetAdapterRequest(name=query.name, version=query.version,
                                                      tenant=tenant, alias=query.alias)
        last: LoraplexError = Unavailable("no adapter store configured")
        for _, stub in self._stores:
            try:
                return await stub.GetAdapter(request, timeout=10)
            except grpc.aio.AioRpcError as err:
                last = from_rpc_error(err, "adapter registry")
                if not isinstance(last, Unavailable):
                    raise last from None
        raise last
