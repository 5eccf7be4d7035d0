"""Blobs as local files: the embedded default blob store (see adapter_store.blobs)."""

import asyncio
import contextlib
import fcntl
import hashlib
import os
import uuid
from pathlib import Path

from adapter_store.blobs import BlobStore, PreconditionFailed, check_key, too_large
from common.errors import InvalidArgument, NotFound, PermissionDenied, Unavailable

_TEMP_SUFFIX = ".loraplex-tmp"
_LOCK_SUFFIX = ".loraplex-lock"


class FileBlobStore(BlobStore):
    """Blobs as files under `root`; blocking IO runs in worker threads. Safe for several processes
    on one file system (replicas sharing a directory)."""

    def __init__(self, root: Path, max_external_bytes: int = 2 * 1024**3):
        self.root = root
        self.description = root.as_uri()
        self.max_external_bytes = max_external_bytes

    def _path(self, key: str) -> Path:
        check_key(key)
        return self.root / key

    async def get_with_etag(self, key: str) -> tuple[bytes, str]:
        path = self._path(key)
        try:
            data = await asyncio.to_thread(path.read_bytes)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise NotFound(f"no blob {key!r} in {self.description}") from None
        except OSError as exc:
            raise Unavailable(f"cannot read {key!r} in {self.description}: {exc}") from exc
        return data, _etag(data)

    async def put(self, key: str, data: bytes, *, if_none_match: bool = False,
                  if_match: str | None = None) -> None:
        path = self._path(key)
        try:
            await asyncio.to_thread(_write_atomically, path, data, if_none_match, if_match)
        except PreconditionFailed:
            raise
        except OSError as exc:
            raise Unavailable(f"cannot write {key!r} in {self.description}: {exc}") from exc

    async def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            await asyncio.to_thread(path.unlink, missing_ok=True)
        except OSError as exc:
            raise Unavailable(f"cannot delete {key!r} in {self.description}: {exc}") from exc

    async def list_objects(self, prefix: str) -> dict[str, str]:
        return await asyncio.to_thread(self._list_sync, prefix)

    def _list_sync(self, prefix: str) -> dict[str, str]:
        # Walk only the directory the prefix names ("a/b/c" -> root/a/b), then filter. The etag of
        # a listing is the file's mtime and size: it changes whenever the file is replaced.
        top = self.root / prefix.rpartition("/")[0]
        found = {}
        for dirpath, _, filenames in os.walk(top):
            rel_dir = Path(dirpath).relative_to(self.root).as_posix()
            for name in filenames:
                if _is_internal_file(name):  # a write in progress, a crashed one, or a lock
                    continue
                key = name if rel_dir == "." else f"{rel_dir}/{name}"
                if key.startswith(prefix):
                    with contextlib.suppress(FileNotFoundError):
                        stat = os.stat(os.path.join(dirpath, name))
                        found[key] = f"{stat.st_mtime_ns}-{stat.st_size}"
        return found

    async def read_external(self, uri: str) -> bytes:
        """file:// URIs inside this store's root only: a caller must not read arbitrary files."""
        from urllib.parse import unquote, urlparse

        parsed = urlparse(uri)
        path = Path(unquote(parsed.path)).resolve()
        if parsed.scheme != "file" or not path.is_relative_to(self.root.resolve()):
            raise ValueError(f"{uri!r}: this store reads file:// URIs under "
                             f"{self.description} only")
        try:
            return await asyncio.to_thread(_read_at_most, path, self.max_external_bytes, uri)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise NotFound(f"no file {uri!r}") from None
        except PermissionError:
            raise PermissionDenied(f"the store may not read {uri!r}; make it readable") from None
        except OSError as exc:
            raise Unavailable(f"cannot read {uri!r}: {exc}") from exc


def _read_at_most(path: Path, max_bytes: int, uri: str) -> bytes:
    """The file, refused by its size before a byte is read when larger than `max_bytes`."""
    with open(path, "rb") as f:
        num_bytes = os.fstat(f.fileno()).st_size
        data = f.read(max_bytes + 1) if num_bytes <= max_bytes else b""
    if num_bytes > max_bytes or len(data) > max_bytes:  # large, or grew while read
        raise InvalidArgument(too_large(repr(uri), max(num_bytes, len(data)), max_bytes))
    return data


def _etag(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()  # what S3 reports for simple puts


def _is_internal_file(name: str) -> bool:
    return name.startswith(".") and name.endswith((_TEMP_SUFFIX, _LOCK_SUFFIX))


def _write_atomically(path: Path, data: bytes, if_none_match: bool, if_match: str | None) -> None:
    """Write a temp file beside `path`, fsync, then link (create only) or rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}{_TEMP_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if if_none_match:
            try:
                os.link(tmp, path)  # atomic: fails if `path` exists, even across processes
            except FileExistsError:
                raise PreconditionFailed(f"{path.name} exists") from None
        elif if_match is not None:
            with open(path.with_name(f".{path.name}{_LOCK_SUFFIX}"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                try:
                    current = _etag(path.read_bytes())
                except FileNotFoundError:
                    current = None
                if current != if_match:
                    raise PreconditionFailed(f"{path.name} changed")
                os.replace(tmp, path)
        else:
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


