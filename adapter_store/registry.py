"""The adapter registry: names, immutable versions, aliases and owners, kept in the blob store
beside the bytes, so it survives restarts and is shared by every store replica.

Layout (keys under the store's URL):
  adapters/{name}/weights/{sha256}.safetensors   the weights, content-addressed
  adapters/{name}/v{version}/manifest.json       one immutable AdapterRecord per version
  adapters/{name}/index.json                     mutable: aliases and deleted versions
  base-models/{model_id}/base.json               registered base models (see base_models.py)
  leases/{holder}.json                           executors' resident adapters (see leases.py)

Atomicity, with no lock service and no database: every write that must not be lost to a race is
a conditional put, which S3 (and SeaweedFS, tested) and the file store make atomic.
- A version is claimed by creating its manifest with If-None-Match: *. Two replicas pushing the
  same name at once both write their weights first (content-addressed keys, so they never clash),
  then race for v{N}: exactly one wins; the other re-reads and takes v{N+1}. A manifest is written
  once and never changed, so a reader sees a whole version or none, and a version number is never
  reused, even after a delete (the manifest stays as its tombstone; the index marks it deleted).
- The name's first version decides its owner; a push by another tenant is ALREADY_EXISTS.
- Aliases and deletions are one small document per name, updated by compare-and-swap (If-Match
  on the ETag it was read at, retried on conflict). Moving an alias is one atomic put: a request
  resolving the alias gets the old version or the new, never neither. Because a delete and an
  alias move go through the same document, "refuse to delete a version an alias points at" holds
  under any interleaving across replicas.
- A delete only marks versions deleted: weights are content-addressed, and a push of the same
  bytes in flight (here or on another replica) may be about to register them again. Weights no
  live version uses are removed by a sweep once unused for a grace period longer than any push
  (orphans.py); a push claims its weights before writing them, so no sweep removes them while
  it registers, and registers within `register_s` (UNAVAILABLE, push again, if not).
- What a replica knows and how lookups are answered (fresh, or from memory while the blob
  store fails) is registry_view.py; this module adds the writes.
"""


import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Callable

from adapter_store.base_models import BaseMatch, BaseModels
from adapter_store.blobs import BlobStore, PreconditionFailed
from adapter_store.orphans import OrphanSweeper
from adapter_store.records import (
    INDEX_FILENAME,
    MANIFEST_FILENAME,
    ROOT,
    AdapterRecord,
    NameIndex,
    VersionMeta,
    version_prefix,
)
from adapter_store.registry_view import RegistryView
from adapter_store.validation import AdapterSpec, check_config_rank, validate_adapter
from common.adapter_ref import AdapterQuery, AdapterRef, check_alias, check_name, not_found
from common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from common.peft.config import parse_config

log = logging.getLogger(__name__)

_MAX_CAS_ATTEMPTS = 32


class Registry(RegistryView):
    """The registry's writes on top of what a replica knows (registry_view.py): pushes,
    registrations, aliases and deletions; see the module docstring."""

    def __init__(self, blobs: BlobStore, *, max_rank: int = 256, require_base_model: bool = False,
                 refresh_s: float = 2.0, register_s: float = 120.0, blob_grace_s: float = 7200.0,
                 clock: Callable[[], float] = time.time):
        super().__init__(blobs, refresh_s=refresh_s)
        self._max_rank = max_rank
        self._register_s = register_s
        self._push_locks: dict[str, asyncio.Lock] = {}
        self.base_models = BaseModels(blobs, require_registered=require_base_model)
        self.orphans = OrphanSweeper(blobs, self, blob_grace_s, clock)

    # ----- pushing versions -----

    async def check_push(self, name: str, owner_tenant: str, config_json: str,
                         base_fingerprint: str = "") -> None:
        """What push() would refuse from its header alone, checked before the bytes are sent:
        the name's owner, the rank limit as far as the config tells (check_config_rank), the base
        model (push() checks them all again, the rank on the tensors)."""
        check_name(name)
        check_config_rank(parse_config(config_json), self._max_rank)
        await self.base_models.match(config_json, base_fingerprint)
        await self.refresh(name)
        self._check_owner(name, owner_tenant)

    async def push(self, name: str, owner_tenant: str, config_json: str, weights_filename: str,
                   data: bytes, meta: VersionMeta = VersionMeta(),
                   base_fingerprint: str = "") -> AdapterRecord:
        """Validate and store the next version of `name`; the pushing tenant must own the name.
        `base_fingerprint`: of the local folder the config's base_model_name_or_path names, when
        the pusher has it (see BaseModels.match)."""
        check_name(name)
        meta.check()
        match = await self.base_models.match(config_json, base_fingerprint)
        base = match.base
        spec = await asyncio.to_thread(validate_adapter, config_json, weights_filename, data,
                                       max_rank=self._max_rank, base=base)
        weights_key = f"{ROOT}{name}/weights/{spec.sha256}.safetensors"
        async with self._push_locks.setdefault(name, asyncio.Lock()):
            await self.refresh(name)  # versions other replicas pushed
            self._check_owner(name, owner_tenant)
            registering = asyncio.timeout(self._register_s)
            try:
                async with registering:
                    await self.orphans.claim(weights_key)  # no sweep removes them meanwhile
                    await self._blobs.put(weights_key, data)  # same key <=> same bytes
                    record = await self._claim_version(name, owner_tenant, config_json, spec,
                                                       match, meta, weights_key)
            except TimeoutError:
                if not registering.expired():
                    raise
                raise Unavailable(f"the push of {name!r} was not registered within "
                                  f"{self._register_s:g} s (push_register_s); push again") from None
            self._versions.setdefault(name, {})[record.version] = record
        log.info("pushed %s (%d bytes, rank %d, owner %r, from %s, base %s, match %s)", record.ref,
                 record.num_bytes, record.rank, owner_tenant, record.source, record.base_model,
                 record.base_match)
        return record

    async def _claim_version(self, name: str, owner_tenant: str, config_json: str,
                             spec: AdapterSpec, match: BaseMatch, meta: VersionMeta,
                             weights_key: str) -> AdapterRecord:
        """The next version of `name`, its manifest created (If-None-Match) before any other
        replica's: a version claimed meanwhile elsewhere means the next one."""
        base = match.base
        for _ in range(_MAX_CAS_ATTEMPTS):
            record = AdapterRecord(
                name=name, version=max(self._versions.get(name, {}), default=0) + 1,
                owner_tenant=owner_tenant, is_public=not owner_tenant,
                base_model=match.base_model, rank=spec.rank, alpha=spec.alpha,
                use_rslora=spec.use_rslora, target_modules=spec.target_modules,
                num_bytes=spec.num_bytes, sha256=spec.sha256, crc32=spec.crc32,
                created_unix=time.time(),
                config_json=config_json,
                base_model_revision=meta.base_model_revision or spec.base_model_revision,
                base_config_sha256=base.config_sha256 if base else "", dtype=spec.dtype,
                rank_pattern=spec.rank_pattern, alpha_pattern=spec.alpha_pattern,
                training_dataset=meta.training_dataset, eval_scores=dict(meta.eval_scores),
                source=meta.source or "upload", weights_key=weights_key,
                base_model_name_or_path=spec.base_model, base_match=match.kind.value,
                base_fingerprint=base.fingerprint if base else "", layers_path=spec.layers_path,
                module_ranks=spec.module_ranks,
                alora_invocation_tokens=spec.alora_invocation_tokens)
            key = version_prefix(name, record.version) + MANIFEST_FILENAME
            try:
                await self._blobs.put(key, record.to_json().encode(), if_none_match=True)
                return record
            except PreconditionFailed:  # another replica claimed this version first
                await self.refresh(name)
                self._check_owner(name, owner_tenant)
        raise Unavailable(f"could not claim a version of {name!r}: too many concurrent pushes; "
                          "retry")

    async def register_from_uri(self, uri: str, name: str, owner_tenant: str,
                                meta: VersionMeta = VersionMeta()) -> AdapterRecord:
        """Register the PEFT folder at `uri` (adapter_config.json + adapter_model.safetensors)."""
        check_name(name)
        prefix = uri.rstrip("/") + "/"
        # Both read at once; when both fail, the config's error is the one reported (the first
        # file a user checks), whichever read failed first.
        config, data = await asyncio.gather(
            self._blobs.read_external(prefix + "adapter_config.json"),
            self._blobs.read_external(prefix + "adapter_model.safetensors"),
            return_exceptions=True)
        for result in (config, data):
            if isinstance(result, BaseException):
                raise result
        try:
            config_json = config.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidArgument(f"{prefix}adapter_config.json is not UTF-8") from None
        meta = dataclasses.replace(meta, source=prefix)
        return await self.push(name, owner_tenant, config_json, "adapter_model.safetensors",
                               data, meta)

    def _check_owner(self, name: str, owner_tenant: str) -> None:
        versions = self._versions.get(name)
        if versions and versions[min(versions)].owner_tenant != owner_tenant:
            raise AlreadyExists(f"adapter name {name!r} is taken by another owner; "
                                "choose another name")

    # ----- aliases and deletion (compare-and-swap on the name's index) -----

    async def set_alias(self, name: str, alias: str, version: int, tenant: str = "",
                        expected_version: int | None = None) -> int:
        """Point `alias` at `version` (0 removes it); returns the version it pointed at before
        (0 if none). `expected_version`: refuse unless the alias points there now (0 = unset)."""
        check_alias(alias)
        record = await self._owned(name, version, tenant) if version else None
        if not version:
            await self._owned(name, 0, tenant, allow_deleted=True)
        previous = 0

        def move(index: NameIndex) -> NameIndex:
            nonlocal previous
            previous = index.aliases.get(alias, 0)
            if expected_version is not None and previous != expected_version:
                raise FailedPrecondition(
                    f"alias {AdapterQuery(name, alias=alias)} points at version "
                    f"{previous or 'nothing'}, not "
                    f"{expected_version or 'nothing'}; re-read it and retry")
            if version in index.deleted:
                raise NotFound(f"adapter {name!r} version {version} was deleted")
            aliases = {k: v for k, v in index.aliases.items() if k != alias}
            if version:
                aliases[alias] = version
            return NameIndex(aliases, index.deleted)

        await self._update_index(name, move)
        log.info("alias %s@%s: v%s -> v%s", name, alias, previous or "-",
                 record.version if record else "-")
        return previous

    async def delete(self, name: str, version: int, tenant: str,
                     is_resident) -> list[int]:
        """Delete `version` (0: every live version). Refused while an alias points at it or
        `await is_resident(record)` names a holder. Returns the versions deleted."""
        await self._owned(name, 0, tenant, allow_deleted=True)
        index = (await self._read_index(name))[0]
        versions = self._versions[name]
        if version:
            if version not in versions or version in index.deleted:
                raise NotFound(f"adapter {name!r} has no version {version}")
            targets = [version]
        else:
            targets = sorted(v for v in versions if v not in index.deleted)
        for v in targets:
            holders = await is_resident(versions[v])
            if holders:
                ref = AdapterRef(name, v)
                raise FailedPrecondition(
                    f"adapter {ref} is resident on {', '.join(holders)} (executor host:port); "
                    "it can be deleted once no executor holds it: unload "
                    f"it with `loraplex admin evict {ref}` (an admin key, on the scheduler of "
                    "its pool), or wait for the executors' leases to expire")

        def mark(current: NameIndex) -> NameIndex:
            for v in targets:
                aliases = current.aliases_of(v)
                if aliases:
                    raise FailedPrecondition(
                        f"adapter {AdapterRef(name, v)} is the target of alias(es) "
                        f"{', '.join(aliases)}; "
                        "move or remove them first (loraplex adapters alias)")
            return NameIndex(current.aliases, current.deleted | set(targets))

        # Only unreferenced: a push of the same bytes may be registering them (orphans.py sweeps
        # them later). The manifest stays: the version is never reused.
        await self._update_index(name, mark)
        log.info("deleted %s versions %s", name, targets)
        return targets

    async def _owned(self, name: str, version: int, tenant: str,
                     allow_deleted: bool = False) -> AdapterRecord:
        """A version the caller may change: its own, or any when trusted (tenant "")."""
        if allow_deleted:
            check_name(name)
            await self.refresh(name)
            versions = self._versions.get(name)
            if not versions or not versions[min(versions)].is_visible_to(tenant):
                raise not_found(name)
            record = versions[min(versions)]
        else:
            record = await self.get(name, version, tenant)
        if tenant and record.owner_tenant != tenant:
            raise FailedPrecondition(f"adapter {name!r} is public; only an operator (no tenant) "
                                     "may change its aliases or delete it")
        return record

    async def _update_index(self, name: str, mutate) -> NameIndex:
        """Read, mutate, compare-and-swap, retried while other writers win."""
        key = f"{ROOT}{name}/{INDEX_FILENAME}"
        for attempt in range(_MAX_CAS_ATTEMPTS):
            current, etag = await self._read_index(name)
            updated = mutate(current)
            try:
                await self._blobs.put(key, updated.to_json(), if_none_match=etag is None,
                                      if_match=etag)
            except PreconditionFailed:
                await asyncio.sleep(random.uniform(0, 0.005 * (attempt + 1)))
                continue
            self._indexes[name] = updated
            return updated
        raise Unavailable(f"index of {name!r} is changing too fast (conflicts); retry")
