"""Adapter lookups in the store's registry, from the scheduler.

A reference is resolved once, when the request arrives: the request then carries the exact
"name@version" for its whole life, so moving an alias never changes a running sequence, and the
next request resolves the alias afresh (the store re-reads aliases on every lookup)."""

import logging
import re

import grpc

from common.errors import InvalidArgument, LoraplexError, Unavailable, from_rpc_error
from common.server import insecure_channel
from protos import adapter_store_pb2, adapter_store_pb2_grpc, common_pb2

log = logging.getLogger(__name__)
_ADAPTER_REF = re.compile(r"(?P<name>[A-Za-z0-9._-]{1,128})"
                          r"(@((?P<version>[1-9][0-9]{0,8})|(?P<alias>[A-Za-z][A-Za-z0-9._-]{0,63})))?")


def parse_adapter_ref(ref: str) -> tuple[str, int, str]:
    """"name", "name@3", "name@latest" or "name@prod" -> (name, version, alias); version 0 and
    no alias mean the latest."""
    m = _ADAPTER_REF.fullmatch(ref)  # not match(): its "$" also matches before a final newline
    if m is None:
        raise InvalidArgument(f"adapter {ref[:200]!r} is not of the form name, name@<version>, "
                              "name@latest or name@<alias> (name: 1-128 of A-Z a-z 0-9 . _ -; "
                              "version: a number from 1; alias: starts with a letter)")
    alias = m["alias"] or ""
    if alias == "latest":
        alias = ""
    return m["name"], int(m["version"] or 0), alias


class RegistryClient:
    def __init__(self, stores: tuple[str, ...]):
        self._stores = [(a, adapter_store_pb2_grpc.AdapterStoreStub(insecure_channel(a))) for a in stores]

    async def warm(self, name: str, version: int) -> None:
        """Have the first store that answers bring the version into its RAM tier (best effort:
        the executor's load reads it either way). Executors fetch from the first store that
        answers too, so with the same store list both meet at the same replica."""
        request = adapter_store_pb2.HostPrewarmRequest(name=name, version=version)
        for address, stub in self._stores:
            try:
                await stub.Prewarm(request, timeout=60)
                return
            except grpc.aio.AioRpcError as err:
                log.warning("warming %s@%d in store %s: %s", name, version, address, err.details())
                if err.code() != grpc.StatusCode.UNAVAILABLE:
                    return

    async def resolve(self, ref: str, tenant: str) -> common_pb2.AdapterInfo:
        """The exact adapter version `ref` names for `tenant` (NOT_FOUND if it may not see it)."""
        name, version, alias = parse_adapter_ref(ref)
        request = adapter_store_pb2.GetAdapterRequest(name=name, version=version, tenant=tenant,
                                                      alias=alias)
        last: LoraplexError = Unavailable("no adapter store configured")
        for _, stub in self._stores:
            try:
                return await stub.GetAdapter(request, timeout=10)
            except grpc.aio.AioRpcError as err:
                last = from_rpc_error(err, "adapter registry")
                if not isinstance(last, Unavailable):
                    raise last from None
        raise last
