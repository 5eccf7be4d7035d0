"""Adapter lookups in the store's registry, from the scheduler, cached so that the store and S3
are off the path of requests for adapters the scheduler already knows.

A reference is resolved once, when the request arrives: the request then carries the exact
AdapterRef for its whole life, so moving an alias never changes a running sequence.

    name@version   immutable: its AdapterInfo is kept (LRU, max_entries) and asked again only
                   once VERSION_TTL_S old (a deleted version stops resolving within that); it
                   answers from the cache only a caller who may see it (its owner, or anyone
                   when it is public): anyone else is asked of the store, as for a name that
                   does not exist, so the answer, its words and its time are a missing name's
    name, alias    asked again once resolve_ttl_s old; when every store replica fails
                   (UNAVAILABLE: down, frozen past resolve_s, S3 behind it down) the last answer
                   is used however old (stale-while-error) and kept another resolve_ttl_s, so
                   requests for adapters the pool serves keep flowing through a store outage
                   without each paying the lookup's deadline
    NOT_FOUND      never kept: a push is visible at once

Concurrent lookups of one reference share one question to the stores, and the questions of one
turn of the event loop go in one GetAdapters call (a burst of requests over 64 adapters, their
names' answers expired, waited 25-45 ms for 64 GetAdapter calls on a 2-core machine).

A moved alias is seen by new requests within resolve_ttl_s.
"""

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

import grpc

from common.adapter_ref import AdapterQuery, AdapterRef
from common.errors import (
    InvalidArgument,
    LoraplexError,
    NotFound,
    Unavailable,
    from_rpc_error,
    relayed_status,
)
from common.lru import Lru
from common.server import insecure_channel
from protos import adapter_store_pb2, adapter_store_pb2_grpc, common_pb2

log = logging.getLogger(__name__)


VERSION_TTL_S = 60.0


@dataclasses.dataclass
class _Answer:
    info: common_pb2.AdapterInfo
    at: float  # clock time of the store's answer (or of its last use while stores failed)


@dataclasses.dataclass
class _Question:
    request: adapter_store_pb2.GetAdapterRequest
    answer: asyncio.Future  # -> AdapterInfo


# Questions in one GetAdapters call at most (the store's limit).
MAX_QUERIES = 1024


# A name's (or alias's) resolution is reused this long by default: a version pushed or an alias
# moved reaches new requests within it (the scheduler's and the gateway's --resolve-ttl-s).
RESOLVE_TTL_S = 1.0


class RegistryClient:
    def __init__(self, stores: tuple[str, ...], service_key: str = "", *,
                 resolve_s: float = 2.0, resolve_ttl_s: float = RESOLVE_TTL_S,
                 warm_s: float = 60.0,
                 max_entries: int = 100_000, clock: Callable[[], float] = time.monotonic):
        channels = [(a, insecure_channel(a, service_key)) for a in stores]
        self._stores = [(a, adapter_store_pb2_grpc.AdapterStoreStub(c)) for a, c in channels]
        self._resolve_s, self._ttl_s, self._warm_s = resolve_s, resolve_ttl_s, warm_s
        self._clock = clock
        # The last answers: of exact versions, and of (tenant, query).
        self._versions: Lru[AdapterRef, _Answer] = Lru(max_entries)
        self._names: Lru[tuple[str, AdapterQuery], _Answer] = Lru(max_entries)
        self._asking: dict[tuple[str, AdapterQuery], asyncio.Future] = {}  # lookups under way
        self._next: list[_Question] = []  # the questions of the next GetAdapters call
        self._calls: set[asyncio.Task] = set()  # GetAdapters calls under way

    async def warm(self, adapter: AdapterRef) -> None:
        """Have the first store that answers bring the version into its RAM tier (best effort:
        the executor's load reads it either way). Executors fetch from the first store that
        answers too, so with the same store list both meet at the same replica."""
        request = adapter_store_pb2.HostPrewarmRequest(name=adapter.name, version=adapter.version)
        for address, stub in self._stores:
            try:
                await stub.Prewarm(request, timeout=self._warm_s)
                return
            except grpc.aio.AioRpcError as err:
                log.warning("warming %s in store %s: %s", adapter, address, err.details())
                if err.code() != grpc.StatusCode.UNAVAILABLE:
                    return

    async def resolve(self, ref: str, tenant: str) -> common_pb2.AdapterInfo:
        """The exact adapter version `ref` names for `tenant` (NOT_FOUND if it may not see it)."""
        return await self._resolve(AdapterQuery.parse(ref), tenant, ref)

    async def resolve_model(self, ref: str, tenant: str) -> common_pb2.AdapterInfo:
        """`resolve`, as a generation request's model name is read: a name not of an adapter
        reference's form ("org/model-7b", "my model") is NOT_FOUND, unknown like any name nobody
        has (vLLM and OpenAI answer an unknown model so), not INVALID_ARGUMENT."""
        try:
            query = AdapterQuery.parse(ref)
        except InvalidArgument as err:
            raise NotFound(str(err)) from None
        return await self._resolve(query, tenant, ref)

    async def lookup(self, ref: AdapterRef, tenant: str) -> common_pb2.AdapterInfo:
        """The record of the exact version `ref` (one a gateway resolved already), as `tenant`
        may see it: no name or alias is resolved."""
        return await self._resolve(AdapterQuery(ref.name, version=ref.version), tenant, str(ref))

    async def _resolve(self, query: AdapterQuery, tenant: str, ref: str
                       ) -> common_pb2.AdapterInfo:
        now = self._clock()
        if query.version:
            version = AdapterRef(query.name, query.version)
            answer = self._versions.get(version)
            if answer is not None and not _is_visible(answer.info, tenant):
                answer = None  # (the store answers it, as it answers a missing name)
            if answer is not None and now - answer.at < VERSION_TTL_S:
                return answer.info
            key, ttl = (tenant, query), VERSION_TTL_S
        else:
            key, ttl = (tenant, query), self._ttl_s
            answer = self._names.get(key)
            if answer is not None and now - answer.at < ttl:
                return answer.info
        asking = self._asking.get(key)
        if asking is None:
            asking = self._asking[key] = asyncio.ensure_future(self._ask(query, tenant))
            asking.add_done_callback(lambda _: self._asking.pop(key, None))
        try:
            info = await asyncio.shield(asking)
        except Unavailable as err:
            if answer is None:
                raise
            log.warning("adapter registry unavailable (%s); resolving %s from an answer %.0fs "
                        "old", err, ref[:200], now - answer.at)
            # used again without asking for resolve_ttl_s from now, the lookup's failure (from
            # its start, a failure that took the lookup's deadline left nothing to reuse: every
            # request paid that deadline while the store was frozen)
            answer.at = self._clock() - ttl + self._ttl_s
            return answer.info
        self._versions.put(AdapterRef.of(info), _Answer(info, self._clock()))
        if not query.version:
            self._names.put(key, _Answer(info, self._clock()))
        return info

    def _ask(self, query: AdapterQuery, tenant: str) -> asyncio.Future:
        """The store's answer (an AdapterInfo), asked in the next GetAdapters call: every
        question of this turn of the event loop goes in one."""
        loop = asyncio.get_running_loop()
        if not self._next:
            loop.call_soon(self._send)
        question = _Question(adapter_store_pb2.GetAdapterRequest(
            name=query.name, version=query.version, tenant=tenant, alias=query.alias),
            loop.create_future())
        self._next.append(question)
        return question.answer

    def _send(self) -> None:
        questions, self._next = self._next, []
        for start in range(0, len(questions), MAX_QUERIES):
            call = asyncio.ensure_future(self._call(questions[start:start + MAX_QUERIES]))
            self._calls.add(call)
            call.add_done_callback(self._calls.discard)

    async def _call(self, questions: list[_Question]) -> None:
        """Answer `questions` from the stores: replicas in order, the next one for the
        questions a replica could not answer (UNAVAILABLE: the call, or a question's own)."""
        last: LoraplexError = Unavailable("no adapter store configured")
        for _, stub in self._stores:
            try:
                response = await stub.GetAdapters(adapter_store_pb2.GetAdaptersRequest(
                    queries=[q.request for q in questions]), timeout=self._resolve_s)
            except grpc.aio.AioRpcError as err:
                last = from_rpc_error(err, "adapter registry")
                if isinstance(last, Unavailable):
                    continue
                break
            if len(response.answers) != len(questions):
                last = Unavailable(f"adapter registry: {len(response.answers)} answers to "
                                   f"{len(questions)} questions")
                continue
            unanswered = []
            for question, answer in zip(questions, response.answers):
                if not answer.error_code:
                    _settle(question.answer, result=answer.info)
                    continue
                error = relayed_status(answer.error_code,
                                       f"adapter registry: {answer.error_message}")
                if isinstance(error, Unavailable):
                    last = error
                    unanswered.append(question)
                else:
                    _settle(question.answer, error=error)
            questions = unanswered
            if not questions:
                return
        for question in questions:
            _settle(question.answer, error=type(last)(str(last)))


def _settle(future: asyncio.Future, *, result=None, error: BaseException | None = None) -> None:
    if future.done():  # (nobody waits for it any more)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _is_visible(info: common_pb2.AdapterInfo, tenant: str) -> bool:
    """The store's visibility rule: its owner's, or public (an operator, tenant "", sees all)."""
    return not tenant or info.is_public or info.owner_tenant == tenant
