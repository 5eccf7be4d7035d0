"""The AdapterStore gRPC service: a thin servicer over Registry and HostCache, and its entry point.

    python -m adapter_store.service --url file:///data/adapters --port 50053
    python -m adapter_store.service --url s3://bucket/prefix --s3-endpoint-url http://127.0.0.1:8333

Prints "adapter_store listening on HOST:PORT" on stdout once it serves; stops on SIGTERM/SIGINT.
"""

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence

from adapter_store.blob_backends import open_blob_store
from adapter_store.blobs import BlobStore
from adapter_store.config import StoreConfig, parse_args
from adapter_store.host_cache import RESTART, HostCache
from adapter_store.leases import LeaseBook
from adapter_store.messages import (
    base_to_pb,
    list_page,
    meta_from_pb,
    record_to_details,
    record_to_pb,
)
from adapter_store.metrics import store_registry
from adapter_store.push_receive import receive_push
from adapter_store.records import AdapterRecord
from adapter_store.registry import Registry
from common import server
from common.adapter_ref import AdapterRef
from common.allocator import keep_freed_memory
from common.base_fingerprint import check_fingerprint
from common.credentials import KeyRing, Role, acting_tenant
from common.errors import (
    DataLoss,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    grpc_errors,
    status_for,
)
from common.metrics import serve_metrics
from common.wire import PUSH_ACCEPTED
from protos import adapter_store_pb2 as pb
from protos import adapter_store_pb2_grpc, common_pb2

log = logging.getLogger(__name__)

MAX_QUERIES = 1024  # lookups in one GetAdapters


def _ref(pb: common_pb2.AdapterRef, field: str) -> AdapterRef:
    try:
        return AdapterRef.from_pb(pb)
    except InvalidArgument as err:
        raise InvalidArgument(f"{field}: {err}") from None


class AdapterStoreServicer(adapter_store_pb2_grpc.AdapterStoreServicer):
    """Thin: messages in, Registry / HostCache / LeaseBook, messages out."""

    def __init__(self, config: StoreConfig, registry: Registry, cache: HostCache,
                 leases: LeaseBook, keys: KeyRing):
        self._config = config
        self._keys = keys
        self._registry = registry
        self._cache = cache
        self._leases = leases
        self._num_fetches = 0
        self._push_bytes = 0  # announced by the pushes being received; each is held in RAM

    @contextlib.asynccontextmanager
    async def _reading(self, record: AdapterRecord) -> AsyncIterator[None]:
        """Around host-tier reads: a version deleted on another replica since this one last
        looked is NOT_FOUND, not DATA_LOSS."""
        try:
            yield
        except DataLoss:
            await self._registry.check_live(record)
            raise

    async def _registered(self, record: AdapterRecord, aliases: list[str],
                          tenant: str) -> common_pb2.AdapterInfo:
        for alias in aliases:
            await self._registry.set_alias(record.name, alias, record.version, tenant)
        return record_to_pb(record)

    def _reader(self, context, tenant: str) -> str:
        """The tenant a lookup acts as: a tenant key's own, or the one a service or an admin
        names ("" = every adapter)."""
        caller = self._keys.require(context, Role.TENANT, Role.SERVICE, Role.ADMIN)
        return acting_tenant(caller, tenant)

    def _owner(self, context, owner_tenant: str) -> str:
        """Who a pushed version belongs to: a tenant key pushes its own; an admin any owner
        ("" = public)."""
        caller = self._keys.require(context, Role.TENANT, Role.ADMIN)
        return acting_tenant(caller, owner_tenant)

    async def Push(self, request_iterator, context) -> common_pb2.AdapterInfo:
        reserved, owner = 0, ""
        async with grpc_errors(context):  # who it is, before anything it sent is looked at
            self._keys.require(context, Role.TENANT, Role.ADMIN)

        async def accept(header: pb.PushHeader) -> None:
            """Check the caller may push as the owner named and reserve the push's bytes within
            the budget; then tell the client to send them."""
            nonlocal reserved, owner
            owner = self._owner(context, header.owner_tenant)
            await self._registry.check_push(header.name, owner, header.config_json,
                                            header.base_fingerprint)
            budget = 2 * self._config.max_adapter_bytes
            if self._push_bytes + header.num_bytes > budget:
                raise ResourceExhausted(
                    f"pushes of {self._push_bytes} bytes are being received and this one "
                    f"announces {header.num_bytes}: over the store's {budget}-byte budget for "
                    "pushes in flight; retry in a moment or push to another replica")
            reserved = header.num_bytes
            self._push_bytes += reserved
            await context.send_initial_metadata((PUSH_ACCEPTED,))

        async with grpc_errors(context):
            try:
                header, meta, aliases, data = await receive_push(
                    request_iterator, accept, self._config.max_adapter_bytes,
                    self._config.push_idle_s, self._config.push_min_bytes_per_s)
                record = await self._registry.push(header.name, owner, header.config_json,
                                                   header.weights_filename, data, meta,
                                                   header.base_fingerprint)
            finally:
                self._push_bytes -= reserved
            return await self._registered(record, aliases, owner)

    async def Register(self, request, context) -> common_pb2.AdapterInfo:
        async with grpc_errors(context):
            # Admins only: it reads a URI with the store's own credentials, which may read more
            # than any one tenant should (tenants push their bytes instead).
            self._keys.require(context, Role.ADMIN)
            owner = request.owner_tenant
            meta, aliases = meta_from_pb(request.metadata)
            if not request.source_uri:
                raise InvalidArgument("source_uri is empty: give s3://bucket/prefix of a PEFT "
                                      "folder")
            record = await self._registry.register_from_uri(
                request.source_uri, request.name, owner, meta)
            return await self._registered(record, aliases, owner)

    async def GetAdapter(self, request, context) -> common_pb2.AdapterInfo:
        async with grpc_errors(context):
            tenant = self._reader(context, request.tenant)
            return record_to_pb(await self._registry.get(
                request.name, request.version, tenant, request.alias))

    async def GetAdapters(self, request, context) -> pb.GetAdaptersResponse:
        async with grpc_errors(context):
            if len(request.queries) > MAX_QUERIES:
                raise InvalidArgument(f"{len(request.queries)} queries in one GetAdapters; at "
                                      f"most {MAX_QUERIES}")
            caller = self._keys.require(context, Role.TENANT, Role.SERVICE, Role.ADMIN)
            return pb.GetAdaptersResponse(answers=await asyncio.gather(
                *(self._answer(caller, query) for query in request.queries)))

    async def _answer(self, caller, query: pb.GetAdapterRequest) -> pb.AdapterAnswer:
        """One query of GetAdapters, as GetAdapter answers it: its record, or its status."""
        try:
            return pb.AdapterAnswer(info=record_to_pb(await self._registry.get(
                query.name, query.version, acting_tenant(caller, query.tenant), query.alias)))
        except Exception as exc:  # noqa: BLE001 - each query's error is its answer
            code, message = status_for(exc)
            return pb.AdapterAnswer(error_code=code.value[0], error_message=message)

    async def DescribeAdapter(self, request, context) -> pb.AdapterDetails:
        async with grpc_errors(context):
            tenant = self._reader(context, request.tenant)
            record = await self._registry.get(request.name, request.version, tenant,
                                              request.alias)
            return record_to_details(record, self._registry.aliases_of(record))

    async def ListAdapters(self, request, context) -> pb.ListAdaptersResponse:
        async with grpc_errors(context):
            tenant = self._reader(context, request.tenant)
            records = await self._registry.list_visible(tenant, request.name,
                                                        request.all_versions)
            return list_page(records, self._registry.aliases_of, request.page_size,
                             request.page_token)

    async def SetAlias(self, request, context) -> pb.SetAliasResponse:
        async with grpc_errors(context):
            tenant = self._owner(context, request.tenant)
            expected = request.expected_version if request.HasField("expected_version") else None
            previous = await self._registry.set_alias(request.name, request.alias,
                                                      request.version, tenant, expected)
            return pb.SetAliasResponse(previous_version=previous)

    async def DeleteAdapter(self, request, context) -> pb.DeleteAdapterResponse:
        async with grpc_errors(context):
            tenant = self._owner(context, request.tenant)
            self._leases.check_certain(self._config.lease_ttl_s)

            async def holders(record: AdapterRecord) -> list[str]:
                return await self._leases.holders_of(record.ref)

            deleted = await self._registry.delete(request.name, request.version, tenant, holders)
            for version in deleted:
                self._cache.evict(AdapterRef(request.name, version))
            return pb.DeleteAdapterResponse(versions=deleted)

    async def Fetch(self, request, context) -> AsyncIterator[pb.FetchResponse]:
        async with grpc_errors(context):
            self._keys.require(context, Role.SERVICE, Role.ADMIN)
            if not request.adapter.version:
                raise InvalidArgument("Fetch needs an exact version (resolve it with GetAdapter)")
            ref = _ref(request.adapter, "adapter")
            record = await self._registry.get(ref.name, ref.version)
            self._num_fetches += 1
            # Pieces of at most chunk_bytes, as they arrive from S3 if cold: the read starts
            # here, while the first message is on its way.
            pieces = self._cache.stream(record)
            async with self._reading(record), contextlib.aclosing(pieces):
                yield pb.FetchResponse(info=record_to_pb(record))
                async for piece in pieces:
                    yield (pb.FetchResponse(restart=True) if piece is RESTART else
                           pb.FetchResponse(chunk=piece))

    async def Prewarm(self, request, context) -> pb.HostPrewarmResponse:
        async with grpc_errors(context):
            # Services and admins only, as the scheduler's Prewarm is admin-only: the host tier's
            # RAM is shared by every tenant, and a tenant warming at will could evict the others'
            # adapters from it and, from was_cached and the time, learn what others use. The
            # scheduler warms ahead of its loads with its service key (RegistryClient.warm);
            # it may name the tenant it acts for.
            caller = self._keys.require(context, Role.SERVICE, Role.ADMIN)
            tenant = acting_tenant(caller, request.tenant)
            record = await self._registry.get(request.name, request.version, tenant,
                                              request.alias)
            was_cached = record in self._cache
            started = time.perf_counter()
            async with self._reading(record):
                await self._cache.warm(record)
            return pb.HostPrewarmResponse(
                info=record_to_pb(record), was_cached=was_cached,
                seconds=0.0 if was_cached else time.perf_counter() - started)

    async def Stats(self, request, context) -> pb.StoreStatsResponse:
        async with grpc_errors(context):
            self._keys.require(context, Role.SERVICE, Role.ADMIN)
            stats, cache = self._cache.stats, self._cache
            num_adapters, num_versions = self._registry.counts()
            return pb.StoreStatsResponse(
                blob_store=self._registry.description, num_adapters=num_adapters,
                num_versions=num_versions, host_entries=len(cache), host_bytes=cache.num_bytes,
                host_capacity_bytes=cache.capacity_bytes, host_hits=stats.hits,
                host_misses=stats.misses, host_joined=stats.joined, blob_reads=stats.blob_reads,
                blob_bytes_read=stats.bytes_read, checksum_failures=stats.checksum_failures,
                host_evictions=stats.evictions, fetches=self._num_fetches)

    async def RegisterBaseModel(self, request, context) -> pb.BaseModelInfo:
        async with grpc_errors(context):
            self._keys.require(context, Role.ADMIN)
            return base_to_pb(await self._registry.base_models.register(
                request.model_id, request.config_json, request.revision, request.fingerprint,
                list(request.names)))

    async def GetBaseModel(self, request, context) -> pb.BaseModelInfo:
        async with grpc_errors(context):
            caller = self._keys.require(context, Role.TENANT, Role.SERVICE, Role.ADMIN)
            key = request.WhichOneof("key")
            if key is None:
                raise InvalidArgument("give a base model's name (its id or another name) or its "
                                      "fingerprint")
            if key == "fingerprint":
                check_fingerprint(request.fingerprint, "fingerprint")
                base = await self._registry.base_models.find(fingerprint=request.fingerprint)
            else:
                base = await self._registry.base_models.find(name=request.name)
            if base is None:
                raise NotFound(f"no registered base model has {key} {getattr(request, key)!r}; "
                               "register it with loraplex adapters base add MODEL_DIR --id ID")
            return base_to_pb(base, caller.role is Role.TENANT)

    async def ListBaseModels(self, request, context) -> pb.ListBaseModelsResponse:
        async with grpc_errors(context):
            caller = self._keys.require(context, Role.TENANT, Role.SERVICE, Role.ADMIN)
            return pb.ListBaseModelsResponse(base_models=[
                base_to_pb(b, caller.role is Role.TENANT)
                for b in await self._registry.base_models.all()])

    async def ReportResidency(self, request, context) -> pb.ResidencyAck:
        async with grpc_errors(context):
            self._keys.require(context, Role.SERVICE, Role.ADMIN)
            ttl = request.ttl_seconds or self._config.lease_ttl_s
            if not 0 < ttl <= 3600:
                raise InvalidArgument(f"ttl_seconds must be within (0, 3600], got {ttl}")
            await self._leases.report(request.holder, [
                _ref(pb, f"adapters[{i}]") for i, pb in enumerate(request.adapters)], ttl)
            return pb.ResidencyAck(ttl_seconds=ttl)


@dataclasses.dataclass
class RunningStore:
    """A started store; `address` is "host:port" with the bound port."""

    config: StoreConfig
    service: server.Service
    blobs: BlobStore
    registry: Registry
    cache: HostCache
    sweeps: asyncio.Task  # of unreferenced weights (orphans.py), until stopped

    @property
    def address(self) -> str:
        return f"{self.config.address.rsplit(':', 1)[0]}:{self.service.port}"

    async def stop(self, grace: float = 5.0) -> None:
        self.sweeps.cancel()
        await self.service.stop(grace)
        await asyncio.gather(self.sweeps, return_exceptions=True)
        await self.blobs.close()


async def start_store(config: StoreConfig, blobs: BlobStore | None = None,
                      keys: KeyRing | None = None) -> RunningStore:
    """Open the blob store (or use `blobs`), load the registry, then serve and report SERVING.
    `keys` overrides the keys the config's sources name."""
    blobs = blobs if blobs is not None else await open_blob_store(config)
    try:
        registry = Registry(blobs, max_rank=config.max_rank,
                            require_base_model=config.require_base_model,
                            register_s=config.push_register_s, blob_grace_s=config.blob_grace_s)
        await registry.load()
        cache = HostCache(blobs, config.host_cache_bytes, config.read_attempts,
                          piece_bytes=config.chunk_bytes, fill_wait_s=config.host_fill_wait_s)
        keys = config.keys.load() if keys is None else keys
        if keys.is_open:
            log.warning("adapter store: no keys configured, every caller is an operator (open "
                        "access); configure --api-keys-file/--admin-keys-file/--service-key-file")
        servicer = AdapterStoreServicer(config, registry, cache, LeaseBook(blobs), keys)
        service = server.Service(
            "adapter_store", config.address,
            lambda s: adapter_store_pb2_grpc.add_AdapterStoreServicer_to_server(servicer, s),
            [pb.DESCRIPTOR.services_by_name["AdapterStore"].full_name])
        await service.start()
    except BaseException:
        await blobs.close()
        raise
    await service.mark_serving()
    sweeps = asyncio.create_task(registry.orphans.run(config.blob_grace_s / 4))
    return RunningStore(config, service, blobs, registry, cache, sweeps)


async def serve(config: StoreConfig) -> None:
    """Serve until SIGTERM/SIGINT, then drain in-flight RPCs and close the blob store."""
    store = await start_store(config)
    serve_metrics(config.metrics_port, store_registry(store.cache))
    server.announce("adapter_store", store.address)
    try:
        await server.run_until_signalled(store.service, grace=config.grace_s)
    finally:
        store.sweeps.cancel()
        await store.blobs.close()


def main(argv: Sequence[str] | None = None) -> None:
    server.configure_logging("adapter_store")
    config = parse_args(argv)
    keep_freed_memory()  # Fetch streams MiB-sized messages: no page faults for each
    server.run(lambda: serve(config))


if __name__ == "__main__":
    main()
