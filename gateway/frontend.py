"""The request path of the gateway, shared by its gRPC and HTTP faces: who is calling, which pool
and adapter version a model name means, the prompt as token ids, the tenant's rate limit, and the
token stream from the pool: from the cell that ranks first for the adapter, or from the next one
when a cell cannot be reached, or is found down, before its first token (after that, the stream's
error is the client's: its tokens so far cannot be taken back).

The gateway tokenizes (the scheduler then does not): the tenant's token rate limit counts real
tokens, a prompt too long for the pool is refused before it travels, and chat prompts, whose
template already placed the special tokens, are tokenized without adding any.
"""

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

import grpc

from common import wire
from common.adapter_ref import AdapterRef
from common.credentials import KeyRing, Role
from common.errors import FailedPrecondition, InvalidArgument, Unavailable, relayed
from common.prompt_bounds import min_tokens
from common.ratelimit import RateLimiter
from common.registry_client import RegistryClient
from gateway.metrics import GatewayMetrics
from gateway.pools import Cell, Pool, PoolModel, Pools
from protos import common_pb2, scheduler_pb2

log = logging.getLogger(__name__)

DEFAULT_TENANT = "default"  # every caller of a gateway that runs open
DEFAULT_MAX_NEW_TOKENS = 16  # what a pool generates when a request names no bound
_THREAD_TOKENIZE_CHARS = 20_000  # longer texts are tokenized off the event loop


@dataclasses.dataclass(frozen=True)
class Route:
    """Where a request goes: a pool, with its model facts, and the exact adapter version."""

    pool: Pool
    model: PoolModel
    adapter: common_pb2.AdapterInfo | None  # None: the base model alone

    @property
    def adapter_ref(self) -> str:
        """What the scheduler is asked for: the exact version, so every cell and every retry
        serves the version resolved here (an alias moved meanwhile changes nothing)."""
        return str(AdapterRef(self.adapter.name, self.adapter.version)) if self.adapter else ""


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
        internal caller); "default" when the gateway runs open."""
        caller = self._keys.check(self._keys.authenticate(key), Role.TENANT, Role.SERVICE)
        if self._keys.is_open:
            return DEFAULT_TENANT
        if caller.role is Role.TENANT:
            return caller.tenant
        if not on_behalf_of:
            raise InvalidArgument(f"a service key names the tenant it calls for in "
                                  f"'{wire.ON_BEHALF_OF}'")
        return on_behalf_of

    async def route(self, model: str, tenant: str) -> Route:
        """`model`: a base model id (a pool's), or an adapter reference the tenant may use
        ("name", "name@3", "name@prod")."""
        if not model:
            raise InvalidArgument(f"model is required: a base model ({self._served()}) or an "
                                  "adapter (name, name@VERSION or name@ALIAS)")
        adapter = None
        pool = self._pools.get(model)
        if pool is None:
            adapter = await self._registry.resolve(model, tenant)  # NOT_FOUND if not its own
            pool = self._pools.get(adapter.base_model)
            if pool is None:
                raise FailedPrecondition(
                    f"adapter {adapter.name}@{adapter.version} is for base model "
                    f"{adapter.base_model!r}, which no pool behind this gateway serves "
                    f"({self._served()})")
        if pool.model is None or not any(c.is_up for c in pool.cells.values()):
            raise Unavailable(f"the pool serving {pool.model_id!r} is down ({pool.why_down()}); "
                              "retry later")
        return Route(pool, pool.model, adapter)

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

    async def prompt_ids(self, route: Route, text: str | None, ids: list[int] | None,
                         max_new_tokens: int, chat: bool = False) -> list[int]:
        """The prompt as token ids, refused when it cannot fit the pool's context."""
        model = route.model
        if text is not None:
            if model.tokenizer is None:
                raise InvalidArgument(f"model {model.model_id!r} has no tokenizer: send the "
                                      "prompt as token ids")
            fewest = min_tokens(text, model.chars_per_token)
            if fewest + max_new_tokens > model.max_model_len:
                raise InvalidArgument(f"the prompt is at least {fewest} tokens, which with "
                                      f"{max_new_tokens} to generate exceeds the context of "
                                      f"{model.max_model_len} tokens")
            encode = model.tokenizer.encode
            if len(text) > _THREAD_TOKENIZE_CHARS:
                ids = (await asyncio.to_thread(encode, text, add_special_tokens=not chat)).ids
            else:
                ids = encode(text, add_special_tokens=not chat).ids
        if not ids:
            raise InvalidArgument("the prompt is empty")
        if len(ids) + max_new_tokens > model.max_model_len:
            raise InvalidArgument(f"the prompt ({len(ids)} tokens) with {max_new_tokens} to "
                                  f"generate exceeds the context of {model.max_model_len} tokens: "
                                  "shorten it or ask for fewer tokens")
        return ids

    def admit(self, tenant: str, num_tokens: int) -> None:
        """Charge the tenant's rate limit (RESOURCE_EXHAUSTED with retry-after when over)."""
        self._limiter.admit(tenant, num_tokens)

    async def generate(self, route: Route, request: scheduler_pb2.GenerateRequest, tenant: str,
                       timeout_s: float | None = None
                       ) -> AsyncIterator[scheduler_pb2.GenerateResponse]:
        """The pool's stream for `request` (prompt as token ids, adapter as route.adapter_ref)."""
        start = time.monotonic()
        deadline = start + (timeout_s or self._request_timeout_s)
        cells = route.pool.cells_for(route.adapter.name if route.adapter else None)
        last: Exception | None = None
        for cell in cells:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            call = cell.stub.Generate(request, metadata=(*cell.auth, (wire.ON_BEHALF_OF, tenant)),
                                      timeout=remaining)
            messages = aiter(call)
            started = False
            try:
                message = await _first_unless_lost(messages, cell)
                if message is _LOST:
                    log.warning("scheduler %s of pool %s is down; its request moves on",
                                cell.address, route.pool.model_id)
                    self.metrics.failovers.inc()
                    last = Unavailable(f"scheduler {cell.address}: {cell.problem}")
                    continue
                started = True
                self.metrics.first_token.observe(time.monotonic() - start)
                while message is not None:
                    if message.finish_reason:
                        self.metrics.tokens.inc(message.usage.completion_tokens)
                    yield message
                    message = await anext(messages, None)
                return
            except grpc.aio.AioRpcError as err:
                if started or not _unreachable(err):
                    raise relayed(err) from None
                self._cell_failed(route.pool, cell, err)
                last = relayed(err)
            finally:
                call.cancel()
        raise Unavailable(f"no scheduler of the pool serving {route.pool.model_id!r} answered"
                          f"{f' ({last})' if last else ''}; retry later")

    def _cell_failed(self, pool: Pool, cell: Cell, err: grpc.aio.AioRpcError) -> None:
        log.warning("scheduler %s of pool %s unreachable (%s); trying another", cell.address,
                    pool.model_id, err.details())
        self.metrics.failovers.inc()
        self._pools.cell_failed(cell, f"{err.code().name}: {err.details()}")


_LOST = object()  # the cell went down before its first answer


async def _first_unless_lost(messages, cell: Cell):
    """The stream's first message (None: it ended empty), or _LOST when the cell is found down
    first."""
    first = asyncio.ensure_future(anext(messages, None))
    lost = asyncio.ensure_future(cell.lost.wait())
    try:
        await asyncio.wait((first, lost), return_when=asyncio.FIRST_COMPLETED)
    finally:
        lost.cancel()
        if not first.done():
            first.cancel()
    return first.result() if first.done() and not first.cancelled() else _LOST


def _unreachable(err: grpc.aio.AioRpcError) -> bool:
    """The cell was not reached, or stopped answering, before it sent anything: UNAVAILABLE
    without a scheduler's own retry-after (a scheduler that sheds load says when to come back,
    and another cell would not know better)."""
    if err.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    return wire.RETRY_AFTER not in dict(err.trailing_metadata() or ())
