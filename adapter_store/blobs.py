"""Blob stores: the durable tier under the registry, keyed by "/"-separated relative keys.

Two implementations with one async interface: local files (the embedded default) and S3 via
aiobotocore. A missing key raises NotFound; any fault of the backend (connection refused, timeout,
throttling, server error) raises Unavailable, which callers may retry.
"""

import abc
import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import botocore.config
import botocore.exceptions
from aiobotocore.session import get_session

from adapter_store.config import StoreConfig
from loraplex.errors import NotFound, Unavailable

log = logging.getLogger(__name__)

_MISSING_KEY_CODES = {"NoSuchKey", "404", "NotFound"}
_TEMP_SUFFIX = ".loraplex-tmp"


def check_key(key: str) -> None:
    """Keys are relative, "/"-separated, without empty, "." or ".." parts."""
    parts = key.split("/")
    if not key or any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"invalid blob key {key!r}")


class BlobStore(abc.ABC):
    """Async get/put/list of whole objects. Implementations are safe for concurrent use."""

    # Where the blobs live, for logs and messages (e.g. "file:///data", "s3://bucket/prefix/").
    description: str

    @abc.abstractmethod
    async def get(self, key: str) -> bytes:
        """The whole object; NotFound if there is none."""

    @abc.abstractmethod
    async def put(self, key: str, data: bytes) -> None:
        """Create or replace an object; readers see the old or the new bytes, never a mix."""

    @abc.abstractmethod
    async def list_keys(self, prefix: str) -> list[str]:
        """Keys starting with `prefix`, sorted."""

    async def close(self) -> None:
        """Release connections."""


class FileBlobStore(BlobStore):
    """Blobs as files under `root`; blocking IO runs in worker threads."""

    def __init__(self, root: Path):
        self.root = root
        self.description = root.as_uri()

    def _path(self, key: str) -> Path:
        check_key(key)
        return self.root / key

    async def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return await asyncio.to_thread(path.read_bytes)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise NotFound(f"no blob {key!r} in {self.description}") from None
        except OSError as exc:
            raise Unavailable(f"cannot read {key!r} in {self.description}: {exc}") from exc

    async def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        try:
            await asyncio.to_thread(_write_atomically, path, data)
        except OSError as exc:
            raise Unavailable(f"cannot write {key!r} in {self.description}: {exc}") from exc

    async def list_keys(self, prefix: str) -> list[str]:
        return await asyncio.to_thread(self._list_sync, prefix)

    def _list_sync(self, prefix: str) -> list[str]:
        # Walk only the directory the prefix names ("a/b/c" -> root/a/b), then filter.
        top = self.root / prefix.rpartition("/")[0]
        keys = []
        for dirpath, _, filenames in os.walk(top):
            rel_dir = Path(dirpath).relative_to(self.root).as_posix()
            for name in filenames:
                if _is_temp_file(name):  # a write in progress, or one that crashed
                    continue
                key = name if rel_dir == "." else f"{rel_dir}/{name}"
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)


def _is_temp_file(name: str) -> bool:
    return name.startswith(".") and name.endswith(_TEMP_SUFFIX)


def _write_atomically(path: Path, data: bytes) -> None:
    """Write to a temp file beside `path`, fsync, then rename over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}{_TEMP_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class S3BlobStore(BlobStore):
    """Blobs as objects under s3://bucket/prefix. Build with `await S3BlobStore.open(config)`."""

    def __init__(self, client, bucket: str, prefix: str, exit_stack: contextlib.AsyncExitStack):
        self._client = client
        self._bucket = bucket
        self._prefix = prefix
        self._exit_stack = exit_stack
        self.description = f"s3://{bucket}/{prefix}"

    @classmethod
    async def open(cls, config: StoreConfig) -> "S3BlobStore":
        """Connect and check that the bucket answers (Unavailable if it does not)."""
        access_key, secret_key = config.s3_access_key_id, config.s3_secret_access_key
        if access_key is None and config.s3_endpoint_url is not None:
            access_key, secret_key = "loraplex", "loraplex"  # SeaweedFS without auth takes any
        client_config = botocore.config.Config(
            s3={"addressing_style": "path" if config.s3_path_style else "auto"},
            retries={"max_attempts": 3, "mode": "standard"},
            connect_timeout=5, read_timeout=60, max_pool_connections=32)
        stack = contextlib.AsyncExitStack()
        client = await stack.enter_async_context(get_session().create_client(
            "s3", endpoint_url=config.s3_endpoint_url, region_name=config.s3_region,
            aws_access_key_id=access_key, aws_secret_access_key=secret_key, config=client_config))
        store = cls(client, config.s3_bucket, config.s3_prefix, stack)
        try:
            with store._errors(f"bucket {config.s3_bucket!r}", is_key=False):
                await client.head_bucket(Bucket=config.s3_bucket)
        except BaseException:
            await stack.aclose()
            raise
        return store

    @contextlib.contextmanager
    def _errors(self, what: str, *, is_key: bool = True) -> Iterator[None]:
        """Map botocore/aiohttp failures to NotFound (a missing key) or Unavailable (the rest)."""
        try:
            yield
        except botocore.exceptions.ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if is_key and code in _MISSING_KEY_CODES:
                raise NotFound(f"no blob {what} in {self.description}") from None
            raise Unavailable(f"S3 error on {what} in {self.description}: {exc}") from exc
        except (botocore.exceptions.BotoCoreError, aiohttp.ClientError, asyncio.TimeoutError,
                OSError) as exc:
            raise Unavailable(f"S3 unreachable for {what} in {self.description}: {exc}") from exc

    async def get(self, key: str) -> bytes:
        check_key(key)
        with self._errors(repr(key)):
            response = await self._client.get_object(Bucket=self._bucket, Key=self._prefix + key)
            async with response["Body"] as body:
                return await body.read()

    async def put(self, key: str, data: bytes) -> None:
        check_key(key)
        with self._errors(repr(key)):
            await self._client.put_object(Bucket=self._bucket, Key=self._prefix + key, Body=data)

    async def list_keys(self, prefix: str) -> list[str]:
        keys = []
        with self._errors(f"listing {prefix!r}", is_key=False):
            paginator = self._client.get_paginator("list_objects_v2")
            async for page in paginator.paginate(Bucket=self._bucket, Prefix=self._prefix + prefix):
                keys.extend(obj["Key"][len(self._prefix):] for obj in page.get("Contents", []))
        return sorted(keys)

    async def close(self) -> None:
        await self._exit_stack.aclose()


async def open_blob_store(config: StoreConfig) -> BlobStore:
    """The blob store `config.url` names."""
    if config.is_s3:
        store: BlobStore = await S3BlobStore.open(config)
    else:
        config.file_root.mkdir(parents=True, exist_ok=True)
        store = FileBlobStore(config.file_root)
    log.info("blob store: %s", store.description)
    return store
