"""Adapter lookups in the store's registry, from the scheduler."""

import re

import grpc

from loraplex.errors import InvalidArgument, LoraplexError, Unavailable, from_rpc_error
from loraplex.server import insecure_channel
from protos import adapter_store_pb2, adapter_store_pb2_grpc, common_pb2

_ADAPTER_REF = re.compile(r"^(?P<name>[A-Za-z0-9._-]{1,128})(@(?P<version>[0-9]{1,9}|latest))?$")


def parse_adapter_ref(ref: str) -> tuple[str, int]:
    """"name", "name@3" or "name@latest" -> (name, version); version 0 means latest."""
    m = _ADAPTER_REF.match(ref)
    if m is None:
        raise InvalidArgument(f"adapter {ref!r} is not of the form name, name@<version> or "
                              "name@latest (name: 1-128 of A-Z a-z 0-9 . _ -)")
    version = m["version"]
    return m["name"], 0 if version in (None, "latest") else int(version)


class RegistryClient:
    def __init__(self, stores: tuple[str, ...]):
        self._stores = [(a, adapter_store_pb2_grpc.AdapterStoreStub(insecure_channel(a))) for a in stores]

    async def resolve(self, ref: str, tenant: str) -> common_pb2.AdapterInfo:
        """The exact adapter version `ref` names for `tenant` (NOT_FOUND if it may not see it)."""
        name, version = parse_adapter_ref(ref)
        request = adapter_store_pb2.GetAdapterRequest(name=name, version=version, tenant=tenant)
        last: LoraplexError = Unavailable("no adapter store configured")
        for _, stub in self._stores:
            try:
                return await stub.GetAdapter(request, timeout=10)
            except grpc.aio.AioRpcError as err:
                last = from_rpc_error(err, "adapter registry")
                if not isinstance(last, Unavailable):
                    raise last from None
        raise last
