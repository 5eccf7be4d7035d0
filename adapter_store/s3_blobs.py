"""Blobs as S3 objects, via aiobotocore: conditional puts and parallel ranged GETs, streamed.

A read asks for the first `part_bytes` as a ranged GET; as soon as its headers are in, the
Content-Range gives the object's size and the remaining parts start as ranged GETs,
`max_concurrency` at a time, each pinned to the first part's ETag. `iter_parts` hands every GET's
body on as it arrives, in order, in the pieces the connection delivers (at most `read_bytes`), so
a caller hashes and forwards the first bytes while the rest are still on the wire, and no part is
gathered whole and then copied again. An object of one part costs one request.
One connection reads ~300-500 MiB/s from SeaweedFS here; parallel ranges help where a single
connection is the limit (AWS S3), not on two shared cores.
"""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from urllib.parse import urlparse

import aiohttp
import botocore.config
import botocore.exceptions
from aiobotocore.session import get_session

from adapter_store.blobs import BlobStore, PreconditionFailed, check_key, too_large
from adapter_store.config import StoreConfig
from common.errors import InvalidArgument, NotFound, PermissionDenied, Unavailable

_MISSING_KEY_CODES = {"NoSuchKey", "404", "NotFound"}
_MISSING_BUCKET_CODES = {"NoSuchBucket"}
_DENIED_CODES = {"AccessDenied", "403", "AllAccessDisabled"}
_PRECONDITION_CODES = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}


class S3BlobStore(BlobStore):
    """Blobs as objects under s3://bucket/prefix. Build with `await S3BlobStore.open(config)`."""

    def __init__(self, client, bucket: str, prefix: str, exit_stack: contextlib.AsyncExitStack,
                 part_bytes: int = 8 << 20, max_concurrency: int = 8, read_bytes: int = 1 << 20,
                 max_external_bytes: int = 2 * 1024**3, call_timeout_s: float = 20.0):
        self._client = client
        self._bucket = bucket
        self._prefix = prefix
        self._exit_stack = exit_stack
        self._part_bytes = part_bytes
        self._max_concurrency = max_concurrency
        self._read_bytes = read_bytes
        self.max_external_bytes = max_external_bytes
        self._call_timeout_s = call_timeout_s
        self.description = f"s3://{bucket}/{prefix}"

    @classmethod
    async def open(cls, config: StoreConfig) -> "S3BlobStore":
        """Connect and check that the bucket answers (Unavailable if it does not)."""
        access_key, secret_key = config.s3_access_key_id, config.s3_secret_access_key
        if access_key is None and config.s3_endpoint_url is not None:
            access_key, secret_key = "loraplex", "loraplex"  # SeaweedFS without auth takes any
        client_config = botocore.config.Config(
            s3={"addressing_style": "path" if config.s3_path_style else "auto"},
            retries={"max_attempts": config.s3_max_attempts, "mode": "standard"},
            connect_timeout=config.s3_connect_timeout_s, read_timeout=config.s3_read_timeout_s,
            max_pool_connections=max(32, 4 * config.s3_max_concurrency))
        stack = contextlib.AsyncExitStack()
        client = await stack.enter_async_context(get_session().create_client(
            "s3", endpoint_url=config.s3_endpoint_url, region_name=config.s3_region,
            aws_access_key_id=access_key, aws_secret_access_key=secret_key, config=client_config))
        store = cls(client, config.s3_bucket, config.s3_prefix, stack,
                    part_bytes=config.s3_part_bytes, max_concurrency=config.s3_max_concurrency,
                    read_bytes=config.chunk_bytes, max_external_bytes=config.max_adapter_bytes,
                    call_timeout_s=config.s3_call_timeout_s)
        try:
            with store._errors(f"bucket {config.s3_bucket!r}", is_key=False):
                async with store._bounded():
                    await client.head_bucket(Bucket=config.s3_bucket)
        except BaseException:
            await stack.aclose()
            raise
        return store

    def _bounded(self) -> asyncio.Timeout:
        """The bound on one call as a whole (a TimeoutError, which _errors makes UNAVAILABLE)."""
        return asyncio.timeout(self._call_timeout_s)

    @contextlib.contextmanager
    def _errors(self, what: str, *, is_key: bool = True, is_external: bool = False
                ) -> Iterator[None]:
        """Map botocore/aiohttp failures to NotFound (a missing key), PreconditionFailed (a lost
        conditional put) or Unavailable (the rest). `is_external`: a caller's URI, whose missing
        bucket is NotFound and whose refused read is PermissionDenied, not a fault of ours."""
        try:
            yield
        except botocore.exceptions.ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if is_external and code in _MISSING_BUCKET_CODES:
                raise NotFound(f"no bucket for {what}: check the bucket name") from None
            if is_external and code in _DENIED_CODES:
                raise PermissionDenied(f"the store's credentials may not read {what}") from None
            if is_key and code in _MISSING_KEY_CODES:
                raise NotFound(f"no blob {what} in {self.description}") from None
            if code in _PRECONDITION_CODES:
                raise PreconditionFailed(f"{what}: {code}") from None
            raise Unavailable(f"S3 error on {what} in {self.description}: {exc}") from exc
        except (botocore.exceptions.BotoCoreError, aiohttp.ClientError, asyncio.TimeoutError,
                OSError) as exc:
            raise Unavailable(f"S3 unreachable for {what} in {self.description}: {exc}") from exc

    async def get_with_etag(self, key: str) -> tuple[bytes, str]:
        check_key(key)
        return await self._read_all(self._bucket, self._prefix + key, repr(key))

    async def iter_parts(self, key: str) -> AsyncIterator[bytes]:
        check_key(key)
        async with contextlib.aclosing(self._stream(self._bucket, self._prefix + key,
                                                    repr(key))) as pieces:
            async for piece in pieces:  # closing this stream cancels the reads still running
                yield piece

    async def _read_all(self, bucket: str, full_key: str, what: str, *,
                        max_bytes: int | None = None) -> tuple[bytes, str]:
        etag: list[str] = []
        async with contextlib.aclosing(self._stream(bucket, full_key, what, etag,
                                                    max_bytes=max_bytes)) as pieces:
            data = [piece async for piece in pieces]
        return (data[0] if len(data) == 1 else b"".join(data)), etag[0]

    async def _stream(self, bucket: str, full_key: str, what: str,
                      etag_out: list[str] | None = None, *,
                      max_bytes: int | None = None) -> AsyncIterator[bytes]:
        """The object in pieces, in order, as its bytes arrive: a GET of the first part; once its
        headers give the object's size, the other parts as ranged GETs pinned to its ETag, all
        streaming at once (at most `max_concurrency`). The ETag goes into `etag_out` first.
        `max_bytes` (a caller's object): refused by its size before its body is read."""
        limit = asyncio.Semaphore(self._max_concurrency)
        queues: list[asyncio.Queue] = []
        reads: list[asyncio.Future] = []
        try:
            with self._errors(what, is_external=max_bytes is not None):
                await limit.acquire()
                try:
                    first = await self._get_first(bucket, full_key)
                except BaseException:
                    limit.release()
                    raise
                etag = first.get("ETag", "").strip('"')
                first_size = first.get("ContentLength", 0)
                total = _total_size(first.get("ContentRange"), first_size)
                if max_bytes is not None and total > max_bytes:
                    first["Body"].close()
                    raise InvalidArgument(too_large(what, total, max_bytes))
                ranges = [(0, first_size)] + [(begin, min(begin + self._part_bytes, total))
                                              for begin in range(first_size, total,
                                                                 self._part_bytes)]
                for index, (begin, end) in enumerate(ranges):
                    queues.append(asyncio.Queue())
                    reads.append(asyncio.ensure_future(self._read_range(
                        bucket, full_key, what, etag, begin, end, queues[-1], limit,
                        first if index == 0 else None)))
                if etag_out is not None:
                    etag_out.append(etag)
                for queue in queues:
                    while (piece := await queue.get()) is not _END:
                        if isinstance(piece, BaseException):
                            raise piece
                        yield piece
        finally:
            for read in reads:
                read.cancel()
            await asyncio.gather(*reads, return_exceptions=True)

    async def _get_first(self, bucket: str, full_key: str) -> dict:
        """The GetObject response (headers; the body still on the wire) of the first part."""
        try:
            async with self._bounded():
                return await self._client.get_object(Bucket=bucket, Key=full_key,
                                                     Range=f"bytes=0-{self._part_bytes - 1}")
        except botocore.exceptions.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "InvalidRange":
                raise
            async with self._bounded():  # an empty object
                return await self._client.get_object(Bucket=bucket, Key=full_key)

    async def _read_range(self, bucket: str, full_key: str, what: str, etag: str, begin: int,
                          end: int, out: asyncio.Queue, limit: asyncio.Semaphore,
                          response: dict | None = None) -> None:
        """Bytes [begin, end) into `out` as they arrive, then _END, or the exception that
        stopped the read (the reader raises it in order). `response`: a GET already made, which
        holds one of `limit`'s slots."""
        holds_slot = response is not None
        try:
            if response is None:
                await limit.acquire()
                holds_slot = True
                # IfMatch: every part comes from the same version of the object.
                async with self._bounded():
                    response = await self._client.get_object(
                        Bucket=bucket, Key=full_key, Range=f"bytes={begin}-{end - 1}",
                        IfMatch=etag)
            num_read = 0
            async with response["Body"] as body:
                while chunk := await body.read(self._read_bytes):
                    num_read += len(chunk)
                    out.put_nowait(chunk)
            if num_read != end - begin:
                raise Unavailable(f"S3 returned {num_read} bytes for range {begin}-{end - 1} "
                                  f"of {what}")
            out.put_nowait(_END)
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            out.put_nowait(exc)
        finally:
            if holds_slot:
                limit.release()

    async def put(self, key: str, data: bytes, *, if_none_match: bool = False,
                  if_match: str | None = None) -> None:
        check_key(key)
        conditions = {}
        if if_none_match:
            conditions["IfNoneMatch"] = "*"
        elif if_match is not None:
            conditions["IfMatch"] = f'"{if_match}"'
        with self._errors(repr(key)):
            async with self._bounded():
                await self._client.put_object(Bucket=self._bucket, Key=self._prefix + key,
                                              Body=data, **conditions)

    async def delete(self, key: str) -> None:
        check_key(key)
        with self._errors(repr(key)):
            async with self._bounded():
                await self._client.delete_object(Bucket=self._bucket, Key=self._prefix + key)

    async def list_objects(self, prefix: str) -> dict[str, str]:
        found = {}
        with self._errors(f"listing {prefix!r}", is_key=False):
            paginator = self._client.get_paginator("list_objects_v2")
            pages = aiter(paginator.paginate(Bucket=self._bucket, Prefix=self._prefix + prefix))
            while True:
                async with self._bounded():
                    page = await anext(pages, None)
                if page is None:
                    break
                for obj in page.get("Contents", []):
                    found[obj["Key"][len(self._prefix):]] = obj.get("ETag", "").strip('"')
        return found

    async def read_external(self, uri: str) -> bytes:
        """s3://bucket/key with this store's credentials (they decide what may be read)."""
        parsed = urlparse(uri)
        key = parsed.path.lstrip("/")
        if parsed.scheme != "s3" or not parsed.netloc or not key:
            raise ValueError(f"{uri!r}: use s3://bucket/key")
        return (await self._read_all(parsed.netloc, key, repr(uri),
                                     max_bytes=self.max_external_bytes))[0]

    async def close(self) -> None:
        await self._exit_stack.aclose()


_END = object()  # marks the end of one range's chunks in its queue


def _total_size(content_range: str | None, num_read: int) -> int:
    """Object size from "bytes 0-8388607/33554432"; no header means the whole object came back."""
    if not content_range or "/" not in content_range:
        return num_read
    total = content_range.rsplit("/", 1)[1]
    return int(total) if total.isdigit() else num_read
