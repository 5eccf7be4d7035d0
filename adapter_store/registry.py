"""The adapter registry: names, versions and owners, kept as manifests beside the bytes.

Layout of one version (the manifest is written last, so a half-written version is invisible):
  adapters/{name}/v{version}/adapter_model.safetensors
  adapters/{name}/v{version}/adapter_config.json
  adapters/{name}/v{version}/manifest.json      the AdapterRecord as JSON
"""

import asyncio
import dataclasses
import json
import logging
import math
import re
import time

from adapter_store.blobs import BlobStore
from adapter_store.validation import WEIGHTS_FILENAME, validate_adapter
from loraplex.errors import AlreadyExists, NotFound

log = logging.getLogger(__name__)

ROOT = "adapters/"
CONFIG_FILENAME = "adapter_config.json"
MANIFEST_FILENAME = "manifest.json"
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
# Manifests read at once while loading the registry.
_LOAD_CONCURRENCY = 32


@dataclasses.dataclass(frozen=True)
class AdapterRecord:
    """One immutable adapter version; the fields of AdapterInfo in common.proto."""

    name: str
    version: int
    owner_tenant: str  # "" for public adapters
    is_public: bool
    base_model: str
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    num_bytes: int
    sha256: str
    created_unix: float
    config_json: str

    @property
    def weights_key(self) -> str:
        return version_prefix(self.name, self.version) + WEIGHTS_FILENAME

    def is_visible_to(self, tenant: str) -> bool:
        """An empty tenant is a trusted caller and sees everything."""
        return not tenant or self.is_public or self.owner_tenant == tenant

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "AdapterRecord":
        raw = json.loads(text)
        fields = {f.name for f in dataclasses.fields(cls)}
        if not fields <= raw.keys():
            raise ValueError(f"manifest lacks {sorted(fields - raw.keys())}")
        values = {k: raw[k] for k in fields}
        values["target_modules"] = tuple(values["target_modules"])
        return cls(**values)


def version_prefix(name: str, version: int) -> str:
    return f"{ROOT}{name}/v{version}/"


def check_name(name: str) -> None:
    if not _NAME_RE.match(name) or name in (".", ".."):
        raise ValueError(f"adapter name {name!r} is invalid: use 1-128 characters of "
                         "A-Z a-z 0-9 . _ - (not '.' or '..')")


class Registry:
    """Every adapter version in a blob store, indexed in memory; pushes assign versions 1, 2, ...

    Several store replicas may share one blob store. A replica learns of another's pushes by
    re-reading manifests: at once when asked for a name or version it does not know, and at most
    `refresh_s` late for "latest" (version 0) and for listings.
    """

    def __init__(self, blobs: BlobStore, refresh_s: float = 2.0):
        self._blobs = blobs
        self._refresh_s = refresh_s
        self._versions: dict[str, dict[int, AdapterRecord]] = {}  # name -> version -> record
        self._manifest_keys: set[str] = set()  # manifests already indexed
        self._refreshed_at: dict[str | None, float] = {}  # name (None: all) -> monotonic time
        self._push_locks: dict[str, asyncio.Lock] = {}  # name -> lock held while pushing it

    async def load(self) -> int:
        """Read every manifest in the blob store; returns the number of versions known."""
        await self.refresh()
        num_versions = len(self._manifest_keys)
        log.info("registry: %d adapters, %d versions in %s",
                 len(self._versions), num_versions, self._blobs.description)
        return num_versions

    async def refresh(self, name: str | None = None) -> None:
        """Index the manifests of `name` (None: of every adapter) that are not indexed yet."""
        started = time.monotonic()
        prefix = ROOT if name is None else f"{ROOT}{name}/"
        keys = [k for k in await self._blobs.list_keys(prefix)
                if k.endswith("/" + MANIFEST_FILENAME) and k not in self._manifest_keys]
        limit = asyncio.Semaphore(_LOAD_CONCURRENCY)

        async def read(key: str) -> tuple[str, AdapterRecord | None]:
            async with limit:
                return key, self._parse_manifest(key, await self._blobs.get(key))

        for key, record in await asyncio.gather(*(read(k) for k in keys)):
            if record is not None:
                self._index(key, record)
        if name is None or name in self._versions:  # not remembered for names asked in vain
            self._refreshed_at[name] = started

    def _index(self, key: str, record: AdapterRecord) -> None:
        self._manifest_keys.add(key)
        self._versions.setdefault(record.name, {})[record.version] = record

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

    async def push(self, name: str, owner_tenant: str, config_json: str, weights_filename: str,
                   data: bytes) -> AdapterRecord:
        """Validate and store the next version of `name`; the pushing tenant must own the name."""
        check_name(name)
        spec = await asyncio.to_thread(validate_adapter, config_json, weights_filename, data)
        async with self._push_locks.setdefault(name, asyncio.Lock()):
            await self.refresh(name)  # versions other replicas pushed
            versions = self._versions.get(name, {})
            if versions and versions[max(versions)].owner_tenant != owner_tenant:
                raise AlreadyExists(f"adapter name {name!r} is taken by another owner; "
                                    "choose another name")
            record = AdapterRecord(
                name=name, version=max(versions, default=0) + 1, owner_tenant=owner_tenant,
                is_public=not owner_tenant, base_model=spec.base_model, rank=spec.rank,
                alpha=spec.alpha, use_rslora=spec.use_rslora, target_modules=spec.target_modules,
                num_bytes=spec.num_bytes, sha256=spec.sha256, created_unix=time.time(),
                config_json=config_json)
            prefix = version_prefix(name, record.version)
            await self._blobs.put(prefix + WEIGHTS_FILENAME, data)
            await self._blobs.put(prefix + CONFIG_FILENAME, config_json.encode("utf-8"))
            await self._blobs.put(prefix + MANIFEST_FILENAME, record.to_json().encode("utf-8"))
            self._index(prefix + MANIFEST_FILENAME, record)
        log.info("pushed %s v%d (%d bytes, rank %d, owner %r)", name, record.version,
                 record.num_bytes, record.rank, owner_tenant)
        return record

    async def get(self, name: str, version: int = 0, tenant: str = "") -> AdapterRecord:
        """One version (0 = latest). Another tenant's private adapter reads as missing."""
        check_name(name)
        known = self._versions.get(name, {})
        if version:  # versions are immutable: re-read only on a miss
            needs_refresh = version not in known
        else:
            needs_refresh = not known or self._is_stale(name)
        if needs_refresh:
            await self.refresh(name)
        versions = self._versions.get(name)
        if not versions or not versions[max(versions)].is_visible_to(tenant):
            raise NotFound(f"adapter {name!r} not found; push it first or check the name")
        if version == 0:
            return versions[max(versions)]
        if version not in versions:
            raise NotFound(f"adapter {name!r} has no version {version}; "
                           f"the latest is {max(versions)}")
        return versions[version]

    async def list_visible(self, tenant: str = "") -> list[AdapterRecord]:
        """Latest version of every adapter `tenant` may use, sorted by name."""
        if self._is_stale(None):
            await self.refresh()
        latest = (versions[max(versions)] for versions in self._versions.values())
        return sorted((r for r in latest if r.is_visible_to(tenant)), key=lambda r: r.name)
