"""The AdapterStore gRPC service: a thin servicer over Registry and HostCache, and its entry point.

    python -m adapter_store.service --url file:///data/adapters --port 50053
    python -m adapter_store.service --url s3://bucket/prefix --s3-endpoint-url http://127.0.0.1:8333

Prints "adapter_store listening on HOST:PORT" on stdout once it serves; stops on SIGTERM/SIGINT.
"""

import dataclasses
import logging
import sys
from collections.abc import AsyncIterator, Sequence


from adapter_store.blobs import BlobStore, open_blob_store
from adapter_store.config import StoreConfig, parse_args
from adapter_store.host_cache import HostCache
from adapter_store.registry import AdapterRecord, Registry, check_name
from adapter_store.validation import WEIGHTS_FILENAME, check_weights_file
from loraplex import server
from loraplex.errors import InvalidArgument, grpc_errors
from protos import adapter_store_pb2, adapter_store_pb2_grpc, common_pb2

log = logging.getLogger(__name__)

# Largest adapter a Push may carry (a rank-256 adapter on all projections of a 70B model is ~5 GB
# in fp32; split such pushes later, with ranged uploads).
MAX_PUSH_BYTES = 2 * 1024**3


def record_to_pb(record: AdapterRecord) -> common_pb2.AdapterInfo:
    fields = dataclasses.asdict(record)
    return common_pb2.AdapterInfo(**fields)


async def receive_push(
    requests: AsyncIterator[adapter_store_pb2.PushRequest], max_bytes: int = MAX_PUSH_BYTES,
) -> tuple[adapter_store_pb2.PushHeader, bytes]:
    """The header and the weights of a Push stream, checked against the header's num_bytes."""
    header, data = None, bytearray()
    async for request in requests:
        kind = request.WhichOneof("payload")
        if header is None:
            if kind != "header":
                raise InvalidArgument("the first Push message must carry the header")
            header = request.header
            # Refuse what would fail anyway before receiving the bytes.
            check_name(header.name)
            if header.weights_filename != WEIGHTS_FILENAME:
                check_weights_file(header.weights_filename, b"")
            if header.num_bytes > max_bytes:
                raise InvalidArgument(f"adapter of {header.num_bytes} bytes exceeds the "
                                      f"{max_bytes}-byte push limit")
        elif kind == "chunk":
            if len(data) + len(request.chunk) > header.num_bytes:
                raise InvalidArgument(f"the Push stream carries more than the {header.num_bytes} "
                                      "bytes its header announced")
            data += request.chunk
        else:
            raise InvalidArgument("a Push stream carries one header, then only chunks")
    if header is None:
        raise InvalidArgument("empty Push stream: send the header first")
    if len(data) != header.num_bytes:
        raise InvalidArgument(f"the Push stream carried {len(data)} bytes but its header announced "
                              f"{header.num_bytes} (interrupted upload?)")
    return header, bytes(data)


class AdapterStoreServicer(adapter_store_pb2_grpc.AdapterStoreServicer):
    def __init__(self, registry: Registry, cache: HostCache, chunk_bytes: int):
        self._registry = registry
        self._cache = cache
        self._chunk_bytes = chunk_bytes

    async def Push(self, request_iterator, context) -> common_pb2.AdapterInfo:
        async with grpc_errors(context):
            header, data = await receive_push(request_iterator)
            record = await self._registry.push(header.name, header.owner_tenant,
                                               header.config_json, header.weights_filename, data)
            return record_to_pb(record)

    async def GetAdapter(self, request, context) -> common_pb2.AdapterInfo:
        async with grpc_errors(context):
            return record_to_pb(
                await self._registry.get(request.name, request.version, request.tenant))

    async def ListAdapters(self, request, context) -> adapter_store_pb2.ListAdaptersResponse:
        async with grpc_errors(context):
            records = await self._registry.list_visible(request.tenant)
            return adapter_store_pb2.ListAdaptersResponse(adapters=map(record_to_pb, records))

    async def Fetch(self, request, context) -> AsyncIterator[adapter_store_pb2.FetchResponse]:
        async with grpc_errors(context):
            record = await self._registry.get(request.name, request.version)
            data = await self._cache.get(record)
            yield adapter_store_pb2.FetchResponse(info=record_to_pb(record))
            view = memoryview(data)
            for offset in range(0, len(data), self._chunk_bytes):
                chunk = view[offset:offset + self._chunk_bytes]
                yield adapter_store_pb2.FetchResponse(chunk=bytes(chunk))


@dataclasses.dataclass
class RunningStore:
    """A started store; `address` is "host:port" with the bound port."""

    config: StoreConfig
    service: server.Service
    blobs: BlobStore
    registry: Registry
    cache: HostCache

    @property
    def address(self) -> str:
        return f"{self.config.address.rsplit(':', 1)[0]}:{self.service.port}"

    async def stop(self, grace: float = 5.0) -> None:
        await self.service.stop(grace)
        await self.blobs.close()


async def start_store(config: StoreConfig, blobs: BlobStore | None = None) -> RunningStore:
    """Open the blob store (or use `blobs`), load the registry, then serve and report SERVING."""
    blobs = blobs if blobs is not None else await open_blob_store(config)
    try:
        registry = Registry(blobs)
        await registry.load()
        cache = HostCache(blobs, config.host_cache_bytes)
        servicer = AdapterStoreServicer(registry, cache, config.chunk_bytes)
        service = server.Service(
            "adapter_store", config.address,
            lambda s: adapter_store_pb2_grpc.add_AdapterStoreServicer_to_server(servicer, s))
        await service.start()
    except BaseException:
        await blobs.close()
        raise
    await service.mark_serving()
    return RunningStore(config, service, blobs, registry, cache)


async def serve(config: StoreConfig) -> None:
    """Serve until SIGTERM/SIGINT, then drain in-flight RPCs and close the blob store."""
    store = await start_store(config)
    print(f"adapter_store listening on {store.address}", flush=True)
    try:
        await server.run_until_signalled(store.service)
    finally:
        await store.blobs.close()


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = parse_args(argv)
    server.run(lambda: serve(config))


if __name__ == "__main__":
    main()
