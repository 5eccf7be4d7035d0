"""Blob stores: the durable tier under the registry, keyed by "/"-separated relative keys.

Two implementations with one async interface: local files (the embedded default,
`adapter_store.file_blobs`) and S3 via aiobotocore (`adapter_store.s3_blobs`); `open_blob_store`
(`adapter_store.blob_backends`) opens the one a store URL names. A missing key raises NotFound;
any fault of the backend (connection refused, timeout, throttling, server error) raises
Unavailable, which callers may retry.

Writes can be conditional, which is what makes the registry safe to share between replicas:
  put(key, data, if_none_match=True)   create only; PreconditionFailed if the key exists
  put(key, data, if_match=etag)        replace only if the object still has that etag (CAS)
S3 and SeaweedFS (>= 3.8x, tested on 4.48) implement both natively (HTTP If-None-Match / If-Match
on PutObject, 412 PreconditionFailed, exactly one winner under a race). The file store gets the same
semantics from os.link (atomic create-if-absent) and an flock around compare-and-replace.
"""

import abc
from collections.abc import AsyncIterator

from common.errors import Unavailable


class PreconditionFailed(Exception):
    """A conditional put lost: the key exists (if_none_match) or changed (if_match)."""


def check_key(key: str) -> None:
    """Keys are relative, "/"-separated, without empty, "." or ".." parts."""
    parts = key.split("/")
    if not key or any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"invalid blob key {key!r}")


class BlobStore(abc.ABC):
    """Async get/put/list/delete of whole objects. Implementations are safe for concurrent use."""

    # Where the blobs live, for logs and messages (e.g. "file:///data", "s3://bucket/prefix/").
    description: str

    async def get(self, key: str) -> bytes:
        """The whole object; NotFound if there is none."""
        return (await self.get_with_etag(key))[0]

    async def iter_parts(self, key: str) -> AsyncIterator[bytes]:
        """The object in pieces, in order, each as soon as it and those before it are in;
        NotFound if there is none. This default reads it whole; S3 hands on ranged parts."""
        yield await self.get(key)

    @abc.abstractmethod
    async def get_with_etag(self, key: str) -> tuple[bytes, str]:
        """The object and its etag (an opaque version token for `put(if_match=...)`)."""

    @abc.abstractmethod
    async def put(self, key: str, data: bytes, *, if_none_match: bool = False,
                  if_match: str | None = None) -> None:
        """Create or replace an object; readers see the old or the new bytes, never a mix.
        Conditional forms raise PreconditionFailed when the condition does not hold."""

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Remove an object; a missing one is not an error."""

    @abc.abstractmethod
    async def list_objects(self, prefix: str) -> dict[str, str]:
        """key -> etag of every object whose key starts with `prefix`."""

    async def list_keys(self, prefix: str) -> list[str]:
        """Keys starting with `prefix`, sorted."""
        return sorted(await self.list_objects(prefix))

    async def read_external(self, uri: str) -> bytes:
        """An object named by a URI outside the registry's keys (register from a prefix), of at
        most `max_external_bytes` (INVALID_ARGUMENT, before reading it, when larger)."""
        raise Unavailable(f"{self.description} cannot read {uri!r}")

    async def close(self) -> None:
        """Release connections."""


def too_large(what: str, num_bytes: int, max_bytes: int) -> str:
    return (f"{what} is {num_bytes} bytes, over this store's {max_bytes}-byte limit of an "
            "adapter")
