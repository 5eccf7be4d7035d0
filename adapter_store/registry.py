"""The adapter registry: names, versions, owners, kept as manifests beside the bytes in a blob store.

Layout of one version (the manifest is written last, so a half-written version is invisible):
  adapters/{name}/v{version}/adapter_model.safetensors
  adapters/{name}/v{version}/adapter_config.json
  adapters/{name}/v{version}/manifest.json      the AdapterRecord as JSON
"""

import asyncio
import dataclasses
import json
import logging
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
    """Every adapter version in a blob store, indexed in memory; pushes assign versions 1, 2, ..."""

    def __init__(self, blobs: BlobStore):
        self._blobs = blobs
        self._versions: dict[str, dict[int, AdapterRecord]] = {}  # name -> version -> record
        self._push_locks: dict[str, asyncio.Lock] = {}  # name -> lock held while pushing it

    async def load(self) -> int:
        """Read every manifest in the blob store; returns the number of versions found."""
        keys = [k for k in await self._blobs.list_keys(ROOT) if k.endswith("/" + MANIFEST_FILENAME)]
        limit = asyncio.Semaphore(_LOAD_CONCURRENCY)

        async def read(key: str) -> AdapterRecord | None:
            async with limit:
                return self._parse_manifest(key, await self._blobs.get(key))

        for record in await asyncio.gather(*(read(k) for k in keys)):
            if record is not None:
                self._versions.setdefault(record.name, {})[record.version] = record
        num_versions = sum(len(v) for v in self._versions.values())
        log.info("registry: %d adapters, %d versions in %s",
                 len(self._versions), num_versions, self._blobs.description)
        return num_versions

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
            self._versions.setdefault(name, {})[record.version] = record
        log.info("pushed %s v%d (%d bytes, rank %d, owner %r)", name, record.version,
                 record.num_bytes, record.rank, owner_tenant)
        return record

    def get(self, name: str, version: int = 0, tenant: str = "") -> AdapterRecord:
        """One version (0 = latest). Another tenant's private adapter reads as missing."""
        check_name(name)
        versions = self._versions.get(name)
        if not versions or not versions[max(versions)].is_visible_to(tenant):
            raise NotFound(f"adapter {name!r} not found; push it first or check the name")
        if version == 0:
            return versions[max(versions)]
        if version not in versions:
            raise NotFound(f"adapter {name!r} has no version {version}; "
                           f"the latest is {max(versions)}")
        return versions[version]

    def list_visible(self, tenant: str = "") -> list[AdapterRecord]:
        """Latest version of every adapter `tenant` may use, sorted by name."""
        latest = (versions[max(versions)] for versions in self._versions.values())
        return sorted((r for r in latest if r.is_visible_to(tenant)), key=lambda r: r.name)

