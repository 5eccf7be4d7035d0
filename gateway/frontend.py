"""The request path of the gateway, shared by its gRPC and HTTP faces: who is calling, which pool
and adapter version a model name means, the prompt as token ids, the tenant's rate limit, and the
token stream from the pool: from the cell that ranks first for the adapter, or from the next one
when a cell cannot be reached, or is found down, before its first token (after that, the stream's
error is the client's: its tokens so far cannot be taken back).

The gateway tokenizes (the scheduler then does not), with its pool's PoolModel.prompts: the
tenant's token rate limit counts real tokens, a prompt too long for the pool is refused before it
travels, and chat prompts, whose template already placed the special tokens, are tokenized
without adding any. Prompts (common/prompt_bounds.py), output and usage (common/generate_pb.py)
are made by the same code as in a scheduler's own Generate.
"""

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

import grpc

from common import wire
from common.adapter_ref import AdapterRef
from common.base_fingerprint import same_model_hint
from common.credentials import KeyRing, Role, request_tenant
from common.detokenizer import FINISH_PB, OutputProcessor, check_stops
from common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    LoraplexError,
    NotFound,
    Unavailable,
    relayed_status,
)
from common.generate_pb import max_new_tokens, output_processor, stop_fields, usage_pb
from common.ratelimit import RateLimiter
from common.registry_client import RegistryClient
from common.token_logprobs import prompt_tokens_pb, top_logprobs_pb
from gateway.cell_stream import Cell, CellStream
from gateway.metrics import GatewayMetrics
from gateway.pools import Pool, PoolModel, Pools
from protos import common_pb2, scheduler_pb2

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Route:
    """Where a request goes: a pool, with its model facts, and the exact adapter version."""

    pool: Pool
    model: PoolModel
    adapter: common_pb2.AdapterInfo | None  # None: the base model alone

    @property
    def ref(self) -> AdapterRef | None:
        """The exact adapter version (None: the base model)."""
        return AdapterRef.of(self.adapter) if self.adapter is not None else None

    @property
    def adapter_ref(self) -> common_pb2.AdapterRef | None:
        """What the scheduler is asked for (GenerateRequest.adapter_ref): the exact version, so
        every cell and every retry serves the version resolved here (an alias moved meanwhile
        changes nothing) and no scheduler resolves the name again."""
        return self.ref.to_pb() if self.adapter is not None else None


class Frontend:
    def __init__(self, pools: Pools, registry: RegistryClient, limiter: RateLimiter,
                 keys: KeyRing, request_timeout_s: float = 600.0,
                 metrics: GatewayMetrics | None = None):
        self._pools = pools
        self.metrics = metrics or GatewayMetrics()
        self._registry = registry
        self._limiter = limiter
        self._keys = keys
        self._request_timeout_s = request_timeout_s

    @property
    def pools(self) -> Pools:
        return self._pools

    def tenant(self, key: str, on_behalf_of: str = "") -> str:
        """The tenant a request is for: a tenant key's own, or the one a service key names (an
        internal caller); DEFAULT_TENANT when the gateway runs open."""
        caller = self._keys.check(self._keys.authenticate(key), Role.TENANT, Role.SERVICE)
        return request_tenant(caller, self._keys.is_open, on_behalf_of, f"a service key names "
                              f"the tenant it calls for in '{wire.ON_BEHALF_OF}'")

    async def route(self, model: str | AdapterRef, tenant: str) -> Route:
        """`model`: a base model id (a pool's), an adapter reference the tenant may use
        ("name", "name@3", "name@prod"), or an exact version (a gRPC request's adapter_ref)."""
        if not model:
            raise InvalidArgument(f"model is required: a base model ({self._served()}) or an "
                                  "adapter (name, name@VERSION or name@ALIAS)")
        adapter = None
        pool = None if isinstance(model, AdapterRef) else self._pools.get(model)
        if pool is None:
            adapter = await self.adapter(model, tenant)
            pool = self._pools.get(adapter.base_model)
            if pool is None:
                raise FailedPrecondition(
                    f"adapter {AdapterRef.of(adapter)} is for base model "
                    f"{adapter.base_model!r}, which no pool behind this gateway serves "
                    f"({self._served()}). " + same_model_hint(adapter.base_model))
        if not any(c.is_up for c in pool.cells.values()):
            await self._pools.settle(pool)  # (a cell a broken stream took down: its probe)
        if pool.model is None or not any(c.is_up for c in pool.cells.values()):
            raise Unavailable(f"the pool serving {pool.model_id!r} is down ({pool.why_down()}); "
                              "retry later")
        return Route(pool, pool.model, adapter)

    async def adapter(self, model: str | AdapterRef, tenant: str) -> common_pb2.AdapterInfo:
        """The exact adapter version `model` (a reference, or an exact version) names for
        `tenant`. NOT_FOUND when it names none the tenant may use, also when it is not of an
        adapter reference's form ("org/model-7b", "my model"): a model that is no base model
        served here either, unknown like any name nobody has."""
        try:  # (NOT_FOUND if the tenant may not see it)
            if isinstance(model, AdapterRef):
                return await self._registry.lookup(model, tenant)
            return await self._registry.resolve_model(model, tenant)
        except NotFound as err:
            raise NotFound(f"{err}; it is not a base model served here either "
                           f"({self._served()})") from None

    def only_model(self, field: str) -> str:
        """The base model of a request that names none: the one this gateway serves
        (INVALID_ARGUMENT naming `field` when it serves several, or none)."""
        served = self._pools.model_ids()
        if len(served) != 1:
            raise InvalidArgument(f"{field}: name an adapter or a base model (this gateway "
                                  f"serves {', '.join(served) or 'none'})")
        return served[0]

    def _served(self) -> str:
        return "served: " + (", ".join(self._pools.model_ids()) or "none")

    def admit(self, tenant: str, num_tokens: int) -> None:
        """Charge the tenant's rate limit (RESOURCE_EXHAUSTED with retry-after when over) for a
        request's prompt and max_new_tokens; `generate` gives back the new tokens it did not
        make."""
        self._limiter.admit(tenant, num_tokens)

    async def generate(self, route: Route, request: scheduler_pb2.GenerateRequest, tenant: str,
                       timeout_s: float | None = None
                       ) -> AsyncIterator[scheduler_pb2.GenerateResponse]:
        """The pool's stream for `request` (prompt as token ids, adapter as route.adapter_ref),
        as Generate's messages: from the cell that ranks first, or the next one while nothing
        was delivered; when every cell failed it so, once more on those a probe then finds up
        (a stream that broke under a healthy scheduler)."""
        start = time.monotonic()
        deadline = start + (timeout_s or self._request_timeout_s)
        last: LoraplexError | None = None
        made = 0  # new tokens delivered (the last message's usage counts them all)
        try:
            for again in (False, True):
                if again:
                    if last is None or not any(c.unprobed for c in route.pool.cells.values()):
                        break
                    await self._pools.settle(route.pool)
                for cell in route.pool.cells_for(route.adapter.name if route.adapter else None):
                    if deadline - time.monotonic() <= 0:
                        break
                    if route.pool.cells.get(cell.address) is not cell:  # it left the pool
                        continue
                    try:
                        # (closed at once when our caller stops reading: its request is
                        # cancelled there)
                        async with contextlib.aclosing(self._from_cell(
                                cell, route, request, tenant, start, deadline)) as answer:
                            async for message in answer:
                                made = (message.usage.completion_tokens
                                        if message.HasField("usage") else made + 1)
                                yield message
                        return
                    except _NothingDelivered as failed:
                        log.warning("scheduler %s of pool %s did not serve a request (%s); it "
                                    "moves on", cell.address, route.pool.model_id, failed.error)
                        self.metrics.failovers.inc()
                        last = failed.error
        finally:  # (admit charged max_new_tokens)
            self._limiter.refund(tenant, request.max_new_tokens - made)
        raise Unavailable(f"no scheduler of the pool serving {route.pool.model_id!r} answered"
                          f"{f' ({last})' if last else ''}; retry later")

    async def _from_cell(self, cell: Cell, route: Route, request: scheduler_pb2.GenerateRequest,
                         tenant: str, start: float, deadline: float
                         ) -> AsyncIterator[scheduler_pb2.GenerateResponse]:
        """One cell's answer, through the gateway's stream to it: token ids in, Generate's
        messages out, detokenized here with the stop strings applied here (a match cancels the
        request at the scheduler; tokens past it are never shown). _NothingDelivered when the
        cell fails the request before its first token."""
        check_stops(request.stop)
        output = output_processor(request, route.model.tokenizer,
                                  route.model.answer.eos_token_ids)
        upstream = scheduler_pb2.GenerateRequest()
        upstream.CopyFrom(request)
        del upstream.stop[:]
        upstream.max_new_tokens = max_new_tokens(request)
        stream = self._stream_to(cell)
        log.debug("request %s (tenant %s, %s) to scheduler %s", request.request_id, tenant,
                  route.ref or "base model", cell.address)
        stream_id, updates = stream.submit(upstream, tenant, deadline - time.monotonic())
        # One timer for the whole request, not one per token: at the deadline it queues
        # _DEADLINE behind the updates already there.
        expiry = asyncio.get_running_loop().call_later(
            max(deadline - time.monotonic(), 0.0), updates.put_nowait, _DEADLINE)
        started, prompt_tokens = scheduler_pb2.StreamStart(), len(request.token_ids.ids)
        try:
            while True:
                update = await updates.get()
                if update is _DEADLINE:
                    raise DeadlineExceeded(f"the request's deadline passed ({output.num_tokens} "
                                           "tokens delivered)")
                if isinstance(update, LoraplexError):  # the stream closed
                    if _unreachable(update) and cell.is_up:
                        self._pools.cell_failed(cell, str(update))
                    raise _failed(update, cell, output.num_tokens, cut=True)
                if update.start is not None:
                    started = update.start
                    self.metrics.first_token.observe(time.monotonic() - start)
                for i, (token_id, logprob) in enumerate(zip(update.token_ids, update.logprobs,
                                                            strict=True)):
                    tops = (top_logprobs_pb(output, *update.tops[i])  # (before the token)
                            if update.tops and update.tops[i][0] else ())
                    text, finish = output.append(token_id)
                    message = scheduler_pb2.GenerateResponse(
                        token_id=token_id, logprob=logprob, text=text,
                        token_text=output.token_text, top_logprobs=tops,
                        adapter_inactive=update.start is not None and not i
                        and update.start.adapter_inactive)
                    if update.prompt_logprobs is not None and not i:  # (with the first token)
                        message.prompt_tokens.extend(prompt_tokens_pb(
                            route.model.tokenizer, request.token_ids.ids, update.prompt_logprobs))
                    yield message
                    if finish is not None:
                        yield self._last(FINISH_PB[finish], output, route, started,
                                         prompt_tokens)
                        return
                if update.end is None:
                    continue
                if update.end.error_code:
                    raise _failed(relayed_status(update.end.error_code, update.end.error_message,
                                                 update.end.retry_after),
                                  cell, output.num_tokens, cut=False)
                # (Not reached: the scheduler ends a request where our own count ends it.)
                yield self._last(update.end.finish_reason, output, route, started, prompt_tokens,
                                 text=output.close())
                return
        finally:
            expiry.cancel()
            stream.cancel(stream_id)  # (a request that finished there is no longer open)

    def _stream_to(self, cell: Cell) -> CellStream:
        if cell.stream is None or not cell.stream.takes_requests:
            cell.stream = CellStream(cell, STREAM_WRITE_S)
        return cell.stream

    def _last(self, reason: int, output: OutputProcessor, route: Route,
              started: scheduler_pb2.StreamStart, prompt_tokens: int,
              text: str = "") -> scheduler_pb2.GenerateResponse:
        """The final message: `reason` (a FinishReason) and the usage (`started`: how its
        first token came)."""
        self.metrics.tokens.inc(output.num_tokens)
        return scheduler_pb2.GenerateResponse(
            finish_reason=reason, text=text,
            usage=usage_pb(started, prompt_tokens, output.num_tokens, route.ref),
            **stop_fields(output))


STREAM_WRITE_S = 30.0  # a cell's scheduler that takes no message of its stream this long is down
CLIENT_WRITE_S = 30.0  # a client that takes no message this long (it stopped reading) is cut off


_DEADLINE = object()  # queued in a request's updates when its deadline passes


class _NothingDelivered(Exception):
    """A cell failed a request before its first token: another cell may serve it."""

    def __init__(self, error: LoraplexError):
        super().__init__(str(error))
        self.error = error


def _failed(error: LoraplexError, cell: Cell, delivered: int, cut: bool) -> Exception:
    """What a request that `cell` failed raises: _NothingDelivered when another cell may serve
    it; once tokens were delivered, `error` with their count in its message and in the trailer
    wire.TOKENS_DELIVERED, as UNAVAILABLE (retry) when the stream was `cut` (its cell lost)."""
    if not delivered:
        return _NothingDelivered(error) if _unreachable(error) else error
    if cut:
        told = Unavailable(f"scheduler {cell.address} was lost after {delivered} tokens were "
                           f"delivered ({error}); the rest will not come: retry the request")
    else:
        told = type(error)(f"{error} (after {delivered} tokens were delivered)")
        told.trailers = error.trailers
    told.trailers = (*told.trailers, (wire.TOKENS_DELIVERED, str(delivered)))
    return told


def _unreachable(error: LoraplexError) -> bool:
    """The cell could not serve it: UNAVAILABLE without a scheduler's own retry-after (a
    scheduler that sheds load says when to come back, and another cell would not know better)."""
    return (error.code == grpc.StatusCode.UNAVAILABLE
            and wire.RETRY_AFTER not in dict(error.trailers))
