"""What a store replica knows of the registry (registry.py): every adapter version and each
name's index, read from the blob store into memory, and the lookups answered from it.

Versions are immutable, so a replica re-reads manifests only on a miss, and at most `refresh_s`
late for "latest", listings and deletions made on another replica. Alias lookups re-read the
name's index (one small GET), so a moved alias is seen at once by every replica. When the blob
store fails (S3 down or frozen), lookups it can answer from memory are answered
(stale-while-error); only what it has never seen fails.
"""

import asyncio
import logging
import math
import re
import time

from adapter_store.blobs import BlobStore
from adapter_store.records import (
    INDEX_FILENAME,
    MANIFEST_FILENAME,
    ROOT,
    AdapterRecord,
    NameIndex,
    version_prefix,
)
from common.adapter_ref import check_alias, check_name, not_found
from common.errors import InvalidArgument, NotFound, Unavailable

log = logging.getLogger(__name__)

_MANIFEST_RE = re.compile(r"^adapters/([^/]+)/v(\d+)/manifest\.json$")
_LOAD_CONCURRENCY = 32  # manifests read at once while loading the registry
REFRESH_WAIT_S = 1.0  # a lookup of a known name waits this long for its refresh


class RegistryView:
    """Every adapter version in a blob store, indexed in memory (see the module docstring)."""

    def __init__(self, blobs: BlobStore, *, refresh_s: float = 2.0):
        self._blobs = blobs
        self._refresh_s = refresh_s
        self._versions: dict[str, dict[int, AdapterRecord]] = {}  # name -> version -> record
        self._indexes: dict[str, NameIndex] = {}
        self._index_etags: dict[str, str] = {}  # name -> etag of index.json as last listed
        self._refreshed_at: dict[str | None, float] = {}  # name (None: all) -> monotonic time
        self._refreshing: dict[str, asyncio.Future] = {}  # name -> its refresh under way
        self._unreadable: set[str] = set()  # manifest keys last read unreadable

    # ----- reading the blob store -----

    async def load(self) -> int:
        """Read every manifest and index; returns the number of versions known."""
        await self.refresh()
        num_versions = sum(len(v) for v in self._versions.values())
        log.info("registry: %d adapters, %d versions in %s",
                 len(self._versions), num_versions, self._blobs.description)
        return num_versions

    async def refresh(self, name: str | None = None) -> dict[str, str]:
        """Index new manifests and changed index documents of `name` (None: of every adapter).
        Returns the listing it indexed from (key -> etag of everything under the name(s))."""
        started = time.monotonic()
        listed = await self._blobs.list_objects(ROOT if name is None else f"{ROOT}{name}/")
        manifests, indexes = [], []
        for key, etag in listed.items():
            match = _MANIFEST_RE.match(key)
            if match and int(match[2]) not in self._versions.get(match[1], {}):
                manifests.append(key)
            elif key.endswith("/" + INDEX_FILENAME):
                adapter = key[len(ROOT):-len(INDEX_FILENAME) - 1]
                if self._index_etags.get(adapter) != etag:
                    indexes.append((adapter, etag))
        limit = asyncio.Semaphore(_LOAD_CONCURRENCY)

        async def read_manifest(key: str) -> None:
            async with limit:
                record = self._parse_manifest(key, await self._blobs.get(key))
            if record is None:
                self._unreadable.add(key)
            else:
                self._unreadable.discard(key)
                self._versions.setdefault(record.name, {})[record.version] = record

        async def read_index(adapter: str, etag: str) -> None:
            async with limit:
                await self._read_index(adapter)
            self._index_etags[adapter] = etag

        await asyncio.gather(*(read_manifest(k) for k in manifests),
                             *(read_index(a, e) for a, e in indexes))
        if name is None or name in self._versions:  # not remembered for names asked in vain
            self._refreshed_at[name] = started
        return listed

    async def _read_index(self, name: str) -> tuple[NameIndex, str | None]:
        """The name's index as stored now, and its etag (None when there is none yet)."""
        try:
            data, etag = await self._blobs.get_with_etag(f"{ROOT}{name}/{INDEX_FILENAME}")
        except NotFound:
            index, etag = NameIndex(), None
        else:
            try:
                index = NameIndex.from_json(data)
            except (ValueError, TypeError, AttributeError) as exc:
                raise Unavailable(f"index of adapter {name!r} is unreadable ({exc}); "
                                  "repair or remove it") from None
        if etag is not None or name in self._versions:  # names asked in vain leave nothing
            self._indexes[name] = index
        return index, etag

    def _is_stale(self, name: str | None) -> bool:
        refreshed_at = max(self._refreshed_at.get(name, -math.inf),
                           self._refreshed_at.get(None, -math.inf))
        return time.monotonic() - refreshed_at > self._refresh_s

    @staticmethod
    def _parse_manifest(key: str, data: bytes) -> AdapterRecord | None:
        """A record, or None (logged) when the manifest is unreadable or not where it claims."""
        try:
            record = AdapterRecord.from_json(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, TypeError) as exc:
            log.error("skipping unreadable manifest %s: %s", key, exc)
            return None
        if key != version_prefix(record.name, record.version) + MANIFEST_FILENAME:
            log.error("skipping manifest %s: it describes %s v%d", key, record.name, record.version)
            return None
        return record

    # ----- lookups -----

    async def get(self, name: str, version: int = 0, tenant: str = "",
                  alias: str = "") -> AdapterRecord:
        """One version: exact, by alias, or the latest (version 0, no alias). Another tenant's
        private adapter, and a deleted version, read as missing."""
        check_name(name)
        if alias and version:
            raise InvalidArgument("give a version or an alias, not both")
        known = self._versions.get(name, {})
        if alias:
            check_alias(alias)
            if not known:
                await self.refresh(name)
            index = await self._index_or_known(name)  # fresh when it can be: aliases move
            version = index.aliases.get(alias, -1)
        if version > 0 and version not in self._versions.get(name, {}):
            await self.refresh(name)  # versions are immutable: re-read only on a miss
        elif version == 0 and (not known or self._is_stale(name)):
            await self._refresh_or_known(name)
        elif version > 0 and self._is_stale(name):
            self._refresh_flight(name)  # (answered now; a deletion elsewhere is seen next time)
        versions = self._versions.get(name)
        if not versions or not versions[min(versions)].is_visible_to(tenant):
            raise not_found(name)
        index = self._indexes.get(name, NameIndex())
        live = [v for v in versions if v not in index.deleted]
        if version == -1:
            raise NotFound(f"adapter {name!r} has no alias {alias!r}; "
                           f"its aliases: {sorted(index.aliases) or 'none'}")
        if version == 0:
            if not live:
                raise NotFound(f"adapter {name!r} has no versions left (all deleted)")
            return versions[max(live)]
        if version in index.deleted:
            raise NotFound(f"adapter {name!r} version {version} was deleted")
        if version not in versions:
            raise NotFound(f"adapter {name!r} has no version {version}; "
                           f"the latest is {max(live, default=0)}")
        return versions[version]

    async def _refresh_or_known(self, name: str) -> None:
        """Refresh `name` (one refresh for concurrent lookups); when the blob store fails, or
        takes over REFRESH_WAIT_S while this replica knows the name, go on with the versions it
        knows (stale-while-error: a listing of S3 that fails or hangs must not fail, or hold,
        lookups it can answer). The refresh goes on in the background."""
        flight = self._refresh_flight(name)
        is_known = bool(self._versions.get(name))
        try:
            async with asyncio.timeout(REFRESH_WAIT_S if is_known else None):
                await asyncio.shield(flight)
        except (Unavailable, TimeoutError) as err:
            if not is_known:
                raise
            log.warning("blob store slow or unavailable, %s answered from what this replica "
                        "knows: %s", name, err or "no answer yet")

    def _refresh_flight(self, name: str) -> asyncio.Future:
        """The refresh of `name` under way, started if none is (one for concurrent lookups)."""
        flight = self._refreshing.get(name)
        if flight is None:
            flight = self._refreshing[name] = asyncio.ensure_future(self.refresh(name))
            flight.add_done_callback(lambda f: (self._refreshing.pop(name, None),
                                                f.cancelled() or f.exception()))
        return flight

    async def _index_or_known(self, name: str) -> NameIndex:
        """The name's index read fresh, or (the blob store failing) the last one read."""
        try:
            return (await self._read_index(name))[0]
        except Unavailable as err:
            if name not in self._indexes:
                raise
            log.warning("blob store unavailable, aliases of %s from the last index read: %s",
                        name, err)
            return self._indexes[name]

    async def check_live(self, record: AdapterRecord) -> None:
        """NotFound if `record` was deleted, read fresh (e.g. on another replica, moments ago)."""
        index, _ = await self._read_index(record.name)
        if record.version in index.deleted:
            raise NotFound(f"adapter {record.name!r} version {record.version} was deleted")

    @property
    def description(self) -> str:
        return self._blobs.description

    def counts(self) -> tuple[int, int]:
        """(names with a live version, live versions) known to this replica."""
        live = [(name, v) for name, versions in self._versions.items() for v in versions
                if v not in self._indexes.get(name, NameIndex()).deleted]
        return len({name for name, _ in live}), len(live)

    def weights_in_use(self, name: str) -> set[str] | None:
        """The weights keys of `name`'s live versions, as last refreshed; None when a manifest of
        it was unreadable (what it uses is unknown)."""
        if any(_MANIFEST_RE.match(key)[1] == name for key in self._unreadable):
            return None
        deleted = self._indexes.get(name, NameIndex()).deleted
        return {r.weights_key for v, r in self._versions.get(name, {}).items()
                if v not in deleted}

    def aliases_of(self, record: AdapterRecord) -> list[str]:
        return self._indexes.get(record.name, NameIndex()).aliases_of(record.version)

    async def list_visible(self, tenant: str = "", name: str = "",
                           all_versions: bool = False) -> list[AdapterRecord]:
        """Versions `tenant` may use, sorted by name then version: the latest of each name, or
        every live version; only `name` when given. Without a name, up to `refresh_s` behind
        other replicas."""
        if name:  # one name is one LIST: always current
            check_name(name)
            await self.refresh(name)
        elif self._is_stale(None):
            await self.refresh()
        found = []
        for adapter, versions in sorted(self._versions.items()):
            if name and adapter != name or not versions[min(versions)].is_visible_to(tenant):
                continue
            deleted = self._indexes.get(adapter, NameIndex()).deleted
            live = sorted(v for v in versions if v not in deleted)
            found.extend(versions[v] for v in (live if all_versions else live[-1:]))
        return found
