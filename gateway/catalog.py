"""What a tenant may ask the gateway for (GET /v1/models): the base models of the pools, and the
adapters the tenant may use (its own and public ones) whose base model a pool serves, each with
its versions and aliases. Adapters come from the store's registry (ListAdapters on behalf of the
tenant, under the gateway's service key; the next replica when one is unavailable)."""

import dataclasses
import logging

import grpc

from common.errors import LoraplexError, Unavailable, from_rpc_error
from common.server import insecure_channel
from protos import adapter_store_pb2, adapter_store_pb2_grpc

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AdapterEntry:
    name: str
    base_model: str
    owner: str  # "" for public adapters
    created_unix: float  # of the latest version
    versions: tuple[int, ...]
    aliases: dict[str, int]


class Catalog:
    def __init__(self, stores: tuple[str, ...], service_key: str = "", rpc_s: float = 5.0):
        self._stubs = [(a, adapter_store_pb2_grpc.AdapterStoreStub(
            insecure_channel(a, service_key))) for a in stores]
        self._rpc_s = rpc_s

    async def adapters(self, tenant: str, base_models: set[str]) -> list[AdapterEntry]:
        """The adapters `tenant` may use whose base model is in `base_models`, by name."""
        request = adapter_store_pb2.ListAdaptersRequest(tenant=tenant, all_versions=True)
        entries: dict[str, AdapterEntry] = {}
        for details in await self._list(request):
            info = details.info
            if info.base_model not in base_models:
                continue
            before = entries.get(info.name)
            entries[info.name] = AdapterEntry(
                name=info.name, base_model=info.base_model, owner=info.owner_tenant,
                created_unix=info.created_unix,
                versions=(*(before.versions if before else ()), info.version),
                aliases={**(before.aliases if before else {}),
                         **{alias: info.version for alias in details.aliases}})
        return sorted(entries.values(), key=lambda e: e.name)

    async def _list(self, request) -> list[adapter_store_pb2.AdapterDetails]:
        """Every page of the listing, from the first store that answers them all."""
        last: LoraplexError = Unavailable("no adapter store configured")
        for address, stub in self._stubs:
            try:
                listed, request.page_token = [], ""
                while True:
                    page = await stub.ListAdapters(request, timeout=self._rpc_s)
                    listed += page.adapters
                    if not page.next_page_token:
                        return listed
                    request.page_token = page.next_page_token
            except grpc.aio.AioRpcError as err:
                last = from_rpc_error(err, f"adapter registry {address}")
                if not isinstance(last, Unavailable):
                    raise last from None
        raise last
