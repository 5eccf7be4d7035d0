"""The scheduler's gRPC face: authenticate, validate, queue, stream; admin RPCs convert their
messages and delegate (from_pb -> core or residency/prewarm.py -> to_pb). Policy lives in
scheduler.core."""

import asyncio
import collections
import dataclasses
import functools
import hashlib
import itertools
import logging
import secrets

from tokenizers import Tokenizer

from common import wire
from common.adapter_ref import AdapterRef
from common.alora import activation_start
from common.credentials import DEFAULT_TENANT, Caller, KeyRing, Role, request_tenant
from common.detokenizer import FINISH_PB, check_stops
from common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
    WriteBound,
    grpc_errors,
)
from common.generate_pb import max_new_tokens, output_processor, stop_fields, usage_pb
from common.metrics import serve_metrics
from common.prompt_bounds import ModelPrompts
from common.ratelimit import RateLimiter
from common.registry_client import RegistryClient
from common.request_ids import checked_request_id
from common.sampling import SamplingParams
from common.server import Service, announce, configure_logging, run, run_until_signalled
from common.token_logprobs import prompt_tokens_pb
from protos import executor_pb2, scheduler_pb2, scheduler_pb2_grpc
from scheduler import validation
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.request import Ask, ErrorEvent, Event, FinishEvent, Request, Status, TokenSink
from scheduler.residency import prewarm
from scheduler.stats import PoolStats
from scheduler.stats_pb import stats_pb
from scheduler.streams import StreamConnection, check_no_stops, started_pb
from scheduler.timings import TimingLog

log = logging.getLogger(__name__)


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, config: SchedulerConfig, engine: Engine, registry: RegistryClient,
                 keys: KeyRing):
        self._config = config
        self._keys = keys
        self._engine = engine
        self._registry = registry
        self._info = info = engine.first_info.result()
        self._tokenizer = Tokenizer.from_str(info.tokenizer_json) if info.tokenizer_json else None
        self._ids = itertools.count(1)
        self._rate_limiter = RateLimiter(config.rate_limits, config.default_rate_limit)
        self._model = _model_pb(info)
        self._prompts = ModelPrompts(info.model_id, self._tokenizer, self._model.max_model_len)
        self._servables = validation.Servables(info)

    async def Generate(self, request, context):
        events = _Events()
        async with grpc_errors(context):
            req = await self._make_request(request, self._tenant(context), events.put,
                                           timeout_s=context.time_remaining())
            self._rate_limiter.admit(req.ask.tenant, req.max_tokens)
            self._engine.core.submit(req)
        # (a client that stopped reading: one timer for the stream's writes)
        with WriteBound(self._config.timeouts.stream_write_s) as bound:
            async with grpc_errors(context):
                try:
                    pending, prompt_sent, first_sent = events.pending, False, False
                    while True:
                        if not pending:
                            await events.wait()
                        event = pending.popleft()
                        if isinstance(event, ErrorEvent):
                            raise event.error
                        if isinstance(event, FinishEvent):
                            await bound.write(context, scheduler_pb2.GenerateResponse(
                                finish_reason=FINISH_PB[event.reason], usage=usage_pb(
                                    started_pb(req), len(req.ask.prompt_ids),
                                    req.output.num_tokens, req.ask.adapter),
                                **stop_fields(req.output)))
                            return
                        message = scheduler_pb2.GenerateResponse(
                            token_id=event.token_id, logprob=event.logprob, text=event.text,
                            token_text=event.token_text, top_logprobs=event.top_logprobs)
                        # (its prompt's logprobs come with its first token, and go once)
                        if req.prompt_logprobs is not None and not prompt_sent:
                            message.prompt_tokens.extend(prompt_tokens_pb(
                                self._tokenizer, req.ask.prompt_ids, req.prompt_logprobs))
                            prompt_sent = True
                        if req.ask.adapter_inactive and not first_sent:
                            message.adapter_inactive = True
                        first_sent = True
                        await bound.write(context, message)
                finally:  # (before the call's status is sent)
                    if req.status is not Status.FINISHED:  # the client left, or stopped reading
                        self._engine.core.cancel(req)
                    self._engine.metrics.on_finish(req, self._engine.core.clock())

    async def Stream(self, request_iterator, context):
        """A gateway's requests over one stream, their tokens in batches (streams.py)."""
        async with grpc_errors(context):
            caller = self._keys.require(context, Role.SERVICE)
        connection = StreamConnection(self._engine.core, self._engine.metrics, context.write,
                                      self._config.timeouts.stream_write_s)
        reading = asyncio.create_task(self._read_stream(request_iterator, connection, caller))
        try:
            async with grpc_errors(context):
                await connection.send(reading)
        finally:
            reading.cancel()
            connection.close()
            await asyncio.gather(reading, return_exceptions=True)

    async def _read_stream(self, request_iterator, connection: StreamConnection,
                           caller: Caller) -> None:
        async for message in request_iterator:
            for submit in message.submits:  # (before the cancels: a message may cancel its own)
                connection.submit(submit.id, functools.partial(self._stream_request, submit,
                                                               connection, caller))
            for stream_id in message.cancels:
                connection.cancel(stream_id)

    async def _stream_request(self, submit: scheduler_pb2.StreamSubmit,
                              connection: StreamConnection, caller: Caller) -> Request:
        """A Stream's request, checked as Generate checks one, without detokenization."""
        check_no_stops(submit.request)
        tenant = request_tenant(caller, self._keys.is_open, submit.tenant, "a Stream submit "
                                "names the tenant it is for (StreamSubmit.tenant)")
        req = await self._make_request(submit.request, tenant, connection.emitter(submit.id),
                                       detokenize=False,
                                       timeout_s=submit.timeout_seconds
                                       if submit.timeout_seconds > 0 else None,
                                       sink=connection.sink, sink_id=submit.id)
        self._rate_limiter.admit(req.ask.tenant, req.max_tokens)
        return req

    def _tenant(self, context) -> str:
        """Who a Generate is for: a tenant key's tenant, or the tenant a service (a gateway)
        names in metadata; DEFAULT_TENANT when the scheduler runs open."""
        caller = self._keys.require(context, Role.TENANT, Role.SERVICE)
        named = dict(context.invocation_metadata() or ()).get(wire.ON_BEHALF_OF, "")
        return request_tenant(caller, self._keys.is_open, named, f"a service calling Generate "
                              f"names the tenant it calls for in metadata '{wire.ON_BEHALF_OF}'")

    def _check_admin(self, context) -> None:
        self._keys.require(context, Role.ADMIN)

    async def _make_request(self, pb: scheduler_pb2.GenerateRequest, tenant: str, emit,
                            detokenize: bool = True, timeout_s: float | None = None,
                            sink: TokenSink | None = None, sink_id: int = 0) -> Request:
        """`pb` checked and made a Request for `tenant`, due within `timeout_s` (the client's
        deadline; None: none), its events to `emit` (its tokens to `sink`, as `sink_id`'s)."""
        info = self._info
        request_id = checked_request_id(pb.request_id)
        sampling = SamplingParams.from_pb(pb.sampling)
        if sampling.grammar is not None:  # (compiled off the loop, then validate finds it)
            await sampling.grammar.prepare()
        sampling = sampling.validate(info.vocab_size)
        if sampling.grammar is not None and not info.tokenizer_json:
            raise InvalidArgument("sampling.grammar: this model has no tokenizer, which "
                                  "constrained decoding needs")
        if sampling.seed is None:  # one of its own, so a recompute draws the same tokens
            sampling = dataclasses.replace(sampling, seed=secrets.randbits(64))
        check_stops(pb.stop, self._config.max_stop_strings, self._config.max_stop_chars)
        validation.check_stop_token_ids(pb.stop_token_ids, info.vocab_size)
        validation.check_cache_salt(pb.cache_salt)
        adapter = await self._adapter(pb, tenant)
        max_new = max_new_tokens(pb)
        is_text = pb.WhichOneof("prompt") == "text"
        prompt = await self._prompts.ids(pb.text if is_text else None,
                                         None if is_text else pb.token_ids.ids, max_new)
        if adapter is not None:
            validation.check_pages(len(prompt) + max_new, adapter.ref, adapter.num_pages, info)
        validation.check_vocabulary(prompt, info.vocab_size)
        prompt = tuple(prompt)  # (copied once checked: it may hold millions of ids)
        output = output_processor(pb, self._tokenizer if detokenize else None,
                                  info.eos_token_ids)
        deadline = None if timeout_s is None else self._engine.core.clock() + timeout_s
        lora_from, inactive = 0, False
        if adapter is not None and adapter.alora_invocation:  # (an activated LoRA)
            start = activation_start(prompt, adapter.alora_invocation)
            if start is None:  # its invocation is not in the prompt: the base model's output
                adapter, inactive = None, True
                self._engine.metrics.on_alora_inactive(tenant)
            else:
                lora_from = start
        ask = Ask(tenant, adapter and adapter.ref, adapter.num_bytes if adapter else 0, prompt,
                  sampling, request_id=request_id, adapter_ranks=adapter and adapter.ranks,
                  deadline=deadline, cache_salt=pb.cache_salt, lora_from=lora_from,
                  adapter_inactive=inactive)
        return Request(next(self._ids), ask, output, emit, sink=sink, sink_id=sink_id)

    async def _adapter(self, pb: scheduler_pb2.GenerateRequest,
                       tenant: str) -> validation.Servable | None:
        """The exact version the request is for, checked to fit the pool: a reference the
        registry resolves, or the version a gateway resolved (adapter_ref); None: the base."""
        if pb.HasField("adapter_ref"):
            if pb.adapter:
                raise InvalidArgument("set adapter or adapter_ref, not both")
            found = await self._registry.lookup(AdapterRef.from_pb(pb.adapter_ref), tenant)
        elif pb.adapter:
            try:
                found = await self._registry.resolve(pb.adapter, tenant)
            except NotFound as err:
                raise NotFound(f"{err}; this pool serves base model {self._model.model_id!r} "
                               "(for it, name no adapter)") from None
        else:
            return None
        return self._servables.of(found)

    async def Stats(self, request, context):
        """Everything for admins and services; a tenant key sees its own counters only."""
        async with grpc_errors(context):
            caller = self._keys.require(context, Role.TENANT, Role.SERVICE, Role.ADMIN)
            stats = self._engine.operators.stats()
            if caller.role is Role.TENANT:
                stats = PoolStats(executors=(), tenants=tuple(
                    t for t in stats.tenants if t.tenant == caller.tenant))
            return stats_pb(stats)

    async def Model(self, request, context):
        """Any caller: what a gateway or client needs to know of the pool's base model."""
        async with grpc_errors(context):
            self._keys.require(context, Role.TENANT, Role.SERVICE, Role.ADMIN)
            if request.known_fingerprint == self._model.fingerprint:
                return scheduler_pb2.ModelResponse(
                    model_id=self._model.model_id, max_model_len=self._model.max_model_len,
                    vocab_size=self._model.vocab_size, max_lora_rank=self._model.max_lora_rank,
                    eos_token_ids=self._model.eos_token_ids, fingerprint=self._model.fingerprint)
            return self._model

    async def _servable(self, text: str) -> validation.Servable:
        """An operator's adapter reference, resolved and checked to fit the pool."""
        return self._servables.of(await self._registry.resolve(text, ""))

    async def Prewarm(self, request, context):
        async with grpc_errors(context):
            self._check_admin(context)
            adapter = await self._servable(request.adapter)
            key = adapter.ref
            chosen = self._engine.operators.prewarm(key, adapter.num_bytes,
                                                    request.num_executors or 1, request.pin,
                                                    adapter.ranks)
            if request.wait:
                failed = await prewarm.loads_done(self._engine.core.residency, chosen, key)
                if failed:
                    raise Unavailable(f"loading {key} failed on {', '.join(failed)}; see the "
                                      "executor logs")
            return scheduler_pb2.PrewarmResponse(adapter=key.to_pb(),
                                                 executors=[ex.address for ex in chosen])

    async def Evict(self, request, context):
        async with grpc_errors(context):
            self._check_admin(context)
            found = await self._registry.resolve(request.adapter, "")
            num = self._engine.operators.evict(AdapterRef.of(found), request.executor)
            return scheduler_pb2.EvictResponse(num_evicted=num)

    async def Drain(self, request, context):
        async with grpc_errors(context):
            self._check_admin(context)
            ex = self._engine.operators.find_executor(request.executor)
            self._engine.core.drain(ex)
            return scheduler_pb2.DrainResponse(
                running=len(self._engine.core.steps_of(ex).running))

    async def Merge(self, request, context):
        async with grpc_errors(context):
            self._check_admin(context)
            adapter = await self._servable(request.adapter)
            if adapter.alora_invocation:
                raise FailedPrecondition(f"adapter {adapter.ref} is an activated LoRA: it "
                                         "applies from its invocation on, which weights with it "
                                         "merged cannot do; serve it unmerged")
            chosen = self._engine.operators.merge(adapter.ref, adapter.num_bytes,
                                                  request.num_executors or 1, adapter.ranks)
            return scheduler_pb2.MergeResponse(adapter=adapter.ref.to_pb(),
                                               executors=[ex.address for ex in chosen])

    async def Unmerge(self, request, context):
        async with grpc_errors(context):
            self._check_admin(context)
            key = None
            if request.adapter:
                found = await self._registry.resolve(request.adapter, "")
                key = AdapterRef.of(found)
            if request.executor:
                self._engine.operators.find_executor(request.executor)
            released = self._engine.operators.unmerge(key, request.executor)
            return scheduler_pb2.UnmergeResponse(executors=released)

    async def Resume(self, request, context):
        async with grpc_errors(context):
            self._check_admin(context)
            ex = self._engine.operators.find_executor(request.executor)
            self._engine.core.resume(ex)
            return scheduler_pb2.ResumeResponse(queued=self._engine.core.placement.num_queued(ex))


class _Events:
    """A Generate's events as the core emits them (it never blocks): a deque, and a future the
    handler waits on only when the deque is empty (an asyncio.Queue's get() per event costs a
    loop look-up and its getter bookkeeping each time)."""

    __slots__ = ("pending", "_waiter", "_loop")

    def __init__(self) -> None:
        self.pending: collections.deque[Event] = collections.deque()
        self._waiter: asyncio.Future | None = None
        # (asyncio.get_running_loop() makes a getpid() system call each time, on Python 3.11)
        self._loop = asyncio.get_running_loop()

    def put(self, event: Event) -> None:
        self.pending.append(event)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self) -> None:
        """Until an event is pending."""
        self._waiter = waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None


def _model_pb(info: executor_pb2.InfoResponse) -> scheduler_pb2.ModelResponse:
    model = scheduler_pb2.ModelResponse(
        model_id=info.model_id, max_model_len=validation.context_limit(info),
        vocab_size=info.vocab_size, max_lora_rank=info.max_lora_rank,
        tokenizer_json=info.tokenizer_json, chat_template=info.chat_template,
        special_tokens=info.special_tokens, eos_token_ids=info.eos_token_ids)
    model.fingerprint = hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()
    return model


async def serve(config: SchedulerConfig, ready_timeout: float = 300.0) -> None:
    keys = config.keys.load()
    if keys.is_open:
        log.warning("scheduler: no keys configured, open access as tenant %r; configure "
                    "--api-keys-file/--admin-keys-file/--service-key-file", DEFAULT_TENANT)
    t = config.timeouts
    registry = RegistryClient(config.stores, keys.service_key, resolve_s=t.resolve_s,
                              resolve_ttl_s=t.resolve_ttl_s, warm_s=t.warm_s)
    engine = Engine(config.executors, config.weights, config.limits, config.discovery_interval_s,
                    TimingLog(config.timings_out) if config.timings_out else None,
                    warm_host=registry.warm, service_key=keys.service_key, timeouts=t)
    engine.start()
    # Tokenizer and model facts come from the executors: wait for the first one.
    async with asyncio.timeout(ready_timeout):
        await asyncio.shield(engine.first_info)
    servicer = SchedulerServicer(config, engine, registry, keys)
    service = Service(
        "scheduler", config.address,
        lambda server: scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server),
        [scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name])
    port = await service.start()
    serve_metrics(config.metrics_port, engine.metrics.registry)
    await service.mark_serving()
    announce("scheduler", f"{config.address.rsplit(':', 1)[0]}:{port}")
    await run_until_signalled(service, on_stop=engine.stop, grace=config.grace_s)


def main(argv: list[str] | None = None) -> None:
    configure_logging("scheduler")
    run(lambda: serve(SchedulerConfig.from_args(argv)))


if __name__ == "__main__":
    main()
