"""Unreferenced weights: removed only by a sweep, a grace period after they were last wanted.

Weights are content-addressed (registry.py: adapters/{name}/weights/{sha256}.safetensors), so a
push of the bytes a version already has writes the same key. A delete therefore only marks its
versions deleted; it never removes weights, which a push of the same bytes may be about to
register (on this replica or another one). Every replica sweeps, every `grace_s / 4`:

  1. Weights no live version of their name uses get a mark, orphans/{key}.json, created only if
     there is none (If-None-Match): {"state": "orphan", "since_unix": now}.
  2. A mark older than `grace_s` is taken by compare-and-swap (If-Match on the etag it was read
     at) to {"state": "removing", "since_unix": now}; the replica that wins reads the name's
     versions again and removes the weights only if still no live version uses them, then the
     mark. A removal holds for at most REMOVAL_BOUND_S; a "removing" mark older than twice that
     (its replica died) is taken over the same way.

A push claims its weights (`claim`) before it writes them and registers its version: a mark it
finds is renewed by compare-and-swap (the grace starts again, and a sweep that read the old mark
loses its swap), and a removal under way is waited for, after which the push writes the weights
afresh. A push that finds no mark registers within push_register_s, and a mark made after that
look is `grace_s` (longer than any push, config.py) from taking effect, so the sweep's re-read
sees the push's version. Marks change only by conditional writes, except their removal by the
one replica holding them "removing", so replicas racing each other and pushes is safe. Marks
compare wall clocks: replicas' clocks must agree to well within the grace (NTP does).
"""

import asyncio
import contextlib
import dataclasses
import json
import logging
import random
import re
import time
from collections.abc import Callable

from adapter_store.blobs import BlobStore, PreconditionFailed
from adapter_store.registry_view import RegistryView
from common.errors import NotFound, Unavailable

log = logging.getLogger(__name__)

MARKS = "orphans/"
REMOVAL_BOUND_S = 60.0  # a sweep's removal of one blob (re-read, two deletes) takes at most this
CLAIM_POLL_S = 0.1  # a push waiting on a removal under way looks again this often
ORPHAN, REMOVING = "orphan", "removing"
# Weights as pushes write them, and where versions written before issue 5 kept theirs.
_WEIGHTS_RE = re.compile(r"^adapters/([^/]+)/(weights/[0-9a-f]{64}\.safetensors"
                         r"|v\d+/adapter_model\.safetensors)$")


@dataclasses.dataclass(frozen=True)
class _Mark:
    state: str  # ORPHAN or REMOVING
    since_unix: float

    def to_json(self) -> bytes:
        return json.dumps({"state": self.state, "since_unix": self.since_unix}).encode()

    @classmethod
    def from_json(cls, data: bytes, now: float) -> "_Mark":
        """The mark; one unreadable reads as an orphan since `now` (rewritten, never trusted)."""
        try:
            raw = json.loads(data)
            mark = cls(str(raw["state"]), float(raw["since_unix"]))
        except (ValueError, TypeError, KeyError):
            return cls(ORPHAN, now)
        return mark if mark.state in (ORPHAN, REMOVING) else cls(ORPHAN, now)


def mark_key(weights_key: str) -> str:
    return f"{MARKS}{weights_key}.json"


class OrphanSweeper:
    """Marks and removes weights no live version uses (see the module docstring)."""

    def __init__(self, blobs: BlobStore, view: RegistryView, grace_s: float,
                 clock: Callable[[], float] = time.time):
        self._blobs = blobs
        self._view = view
        self.grace_s = grace_s
        self._clock = clock

    async def claim(self, weights_key: str) -> None:
        """Before a push writes `weights_key` and registers a version using it: no sweep removes
        them for `grace_s` from now. Waits while a sweep removes them (the push then writes them
        again); bounded by the push's own deadline."""
        key = mark_key(weights_key)
        while True:
            try:
                data, etag = await self._blobs.get_with_etag(key)
            except NotFound:
                return  # unmarked: a mark made from now on takes effect after the grace
            now = self._clock()
            mark = _Mark.from_json(data, now)
            if mark.state == REMOVING and now - mark.since_unix <= 2 * REMOVAL_BOUND_S:
                await asyncio.sleep(CLAIM_POLL_S)
                continue
            with contextlib.suppress(PreconditionFailed, NotFound):  # else changed: look again
                await self._blobs.put(key, _Mark(ORPHAN, now).to_json(), if_match=etag)
                return

    async def sweep(self) -> list[str]:
        """One pass: mark unreferenced weights, remove those marked for longer than the grace.
        Returns the keys removed."""
        listed = await self._view.refresh()
        marked = {k[len(MARKS):-len(".json")]
                  for k in await self._blobs.list_keys(MARKS) if k.endswith(".json")}
        removed = []
        for key in sorted(marked | {k for k in listed if _WEIGHTS_RE.match(k)}):
            match = _WEIGHTS_RE.match(key)
            in_use = self._view.weights_in_use(match[1]) if match else None
            if in_use is None:
                continue  # not weights, or a manifest of the name is unreadable: keep all
            if key in marked:
                if await self._remove_if_due(key, match[1]):
                    removed.append(key)
            elif key not in in_use:
                with contextlib.suppress(PreconditionFailed):  # another replica marked it
                    await self._blobs.put(mark_key(key), _Mark(ORPHAN, self._clock()).to_json(),
                                          if_none_match=True)
        if removed:
            log.info("weights sweep: removed %d unreferenced blob(s): %s", len(removed),
                     ", ".join(removed))
        return removed

    async def _remove_if_due(self, weights_key: str, name: str) -> bool:
        """Take a mark older than the grace (or a stale removal) and remove the weights if still
        unused; True when removed."""
        key = mark_key(weights_key)
        try:
            data, etag = await self._blobs.get_with_etag(key)
        except NotFound:
            return False
        now = self._clock()
        mark = _Mark.from_json(data, now)
        age = now - mark.since_unix
        if age <= (self.grace_s if mark.state == ORPHAN else 2 * REMOVAL_BOUND_S):
            return False
        try:
            await self._blobs.put(key, _Mark(REMOVING, now).to_json(), if_match=etag)
        except (PreconditionFailed, NotFound):
            return False  # a push claimed it, or another replica is removing it
        is_unused = is_deleting = False
        try:
            async with asyncio.timeout(REMOVAL_BOUND_S):
                await self._view.refresh(name)  # a version registered since the sweep began
                in_use = self._view.weights_in_use(name)
                is_unused = in_use is not None and weights_key not in in_use
                if is_unused:
                    is_deleting = True
                    await self._blobs.delete(weights_key)
                await self._blobs.delete(key)
        except (TimeoutError, Unavailable) as err:
            if not is_deleting:  # nothing removed: free the mark for the pushes waiting on it
                with contextlib.suppress(Unavailable):
                    await self._blobs.delete(key)
            log.warning("weights sweep: removing %s failed (%s); left to a later sweep",
                        weights_key, err or f"over {REMOVAL_BOUND_S:g} s")
            return False
        return is_unused

    async def run(self, interval_s: float) -> None:
        """Sweep every `interval_s` (+-10%, so replicas drift apart) until cancelled."""
        while True:
            await asyncio.sleep(interval_s * random.uniform(0.9, 1.1))
            try:
                await self.sweep()
            except Unavailable as err:
                log.warning("weights sweep skipped, blob store unavailable: %s", err)
            except Exception:  # noqa: BLE001 - a bug in one pass must not end the sweeps
                log.exception("weights sweep failed; the next one in %g s", interval_s)
