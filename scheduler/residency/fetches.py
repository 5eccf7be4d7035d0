"""The fetches of adapters onto one executor (its ExecutorResidency's): since when each is under
way (a staging or a load, or failing and backing off), and those that fail retryably, with when
to try again.

A fetch that fails retryably (UNAVAILABLE: a store or S3 down or frozen) backs off, doubling
from load_backoff_s to max_load_backoff_s; its requests wait meanwhile (within max_load_wait_s
of its start: core.py). Any other failure is the error its waiting requests fail with.
"""

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass

from common.adapter_ref import AdapterRef
from common.errors import LoraplexError, Unavailable
from scheduler.limits import Limits

log = logging.getLogger(__name__)


@dataclass
class LoadFailure:
    """An adapter whose loads keep failing on an executor, retryably: when to try again."""

    count: int
    retry_at: float  # scheduler clock
    error: LoraplexError
    is_due: bool = False  # the executors were woken once its backoff passed


class Fetches:
    def __init__(self, limits: Limits, clock: Callable[[], float], address: str):
        self._limits, self._clock, self._address = limits, clock, address
        self._since: dict[AdapterRef, float] = {}
        self._failures: dict[AdapterRef, LoadFailure] = {}

    def since(self, adapter: AdapterRef | None) -> float | None:
        """Since when `adapter` is being fetched, if it is."""
        return self._since.get(adapter)

    def failure(self, adapter: AdapterRef | None) -> LoadFailure | None:
        """Its last failure, while its fetches fail retryably and none has succeeded since."""
        return self._failures.get(adapter)

    def has_failures(self) -> bool:
        return bool(self._failures)

    def is_backing_off(self, adapter: AdapterRef) -> bool:
        """Its last failed fetch is too recent to try again."""
        failure = self._failures.get(adapter)
        return failure is not None and failure.retry_at > self._clock()

    def begin(self, adapter: AdapterRef) -> None:
        """A staging or a load of `adapter` starts (counted from the first, across retries)."""
        self._since.setdefault(adapter, self._clock())

    def came(self, adapter: AdapterRef) -> None:
        """Its bytes came: its failures are over."""
        self._failures.pop(adapter, None)

    def end(self, adapter: AdapterRef) -> None:
        """Nothing is under way for it any more (it loaded, waits for a slot, or its staged
        bytes were gone)."""
        self._since.pop(adapter, None)

    def forget(self, adapter: AdapterRef) -> None:
        """Given up: neither under way nor failing."""
        self._failures.pop(adapter, None)
        self._since.pop(adapter, None)

    def failed(self, adapter: AdapterRef, error: LoraplexError) -> LoraplexError | None:
        """A staging or load of `adapter` failed: back off when it may succeed later (a store or
        S3 down or frozen: None), else the error."""
        limits = self._limits
        if isinstance(error, Unavailable):  # (a downstream DEADLINE_EXCEEDED arrives as this)
            previous = self._failures.get(adapter)
            count = previous.count + 1 if previous else 1
            backoff = min(limits.max_load_backoff_s, limits.load_backoff_s * 2 ** (count - 1))
            self._failures[adapter] = LoadFailure(count, self._clock() + backoff, error)
            log.warning("fetching %s onto %s failed (%d in a row), trying again in %.1fs: %s",
                        adapter, self._address, count, backoff, error)
            return None
        self.forget(adapter)
        log.warning("fetching %s onto %s failed: %s", adapter, self._address, error)
        return error

    def expire(self, wanted: Collection[AdapterRef | None], now: float) -> bool:
        """Failures of adapters nobody waits for (not `wanted`) are forgotten; whether a backoff
        just passed (a fetch may be tried again)."""
        is_due = False
        for adapter, failure in list(self._failures.items()):
            if adapter not in wanted:
                self.forget(adapter)  # nobody waits for it here any more
            elif failure.retry_at <= now and not failure.is_due:
                failure.is_due = is_due = True  # its backoff just passed: try again
        return is_due

    def reset(self) -> None:
        """The executor was lost: nothing is under way (its failures are still worth a
        backoff)."""
        self._since.clear()
