"""The scheduler's I/O half: one step loop per executor, adapter loads, reconnects, discovery.

Each loop is three lines of substance: send the next step (`schedule`, then the executor's step
stream), take the oldest step's answer (`on_step_done`), or idle (probing). Everything it decides
comes from scheduler.core; what it learns of an executor's life (connected, gone from discovery,
NOT_SERVING, lost) it tells the core, which keeps its view of each executor (ExecutorState, made
from its Info at each connection) and says when a link may close.

Every call to an executor has a deadline (timeouts.py). An executor that misses one is suspect,
exactly like one whose stream broke: its stream is dropped (whatever it sends late is never
read), the core recomputes its sequences elsewhere, and it rejoins only once Info and an empty
probe step answer in time. An idle executor is probed every probe_interval_s.
"""

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.adapter_ref import AdapterRef
from common.errors import LoraplexError, Unavailable, from_rpc_error
from common.grammar import Grammar
from protos import executor_pb2
from scheduler.core import Scheduler
from scheduler.discovery import resolve
from scheduler.executor_link import ExecutorLink
from scheduler.executor_state import ExecutorShape, ExecutorState
from scheduler.fairness import FairnessWeights
from scheduler.limits import Limits
from scheduler.metrics import SchedulerMetrics
from scheduler.operators import Operators
from scheduler.residency.hooks import Load
from scheduler.steps.sequence import StepPlan
from scheduler.timeouts import Timeouts
from scheduler.timings import TimingLog

log = logging.getLogger(__name__)

RECONNECT_SECONDS = 1.0
TICK_S = 0.1  # how often waiting requests' deadlines and loads' backoffs are checked
WARM_AGAIN_S = 30.0  # an adapter waiting for a slot is brought into a store's RAM this often
# Warms at once: best effort, so a burst of cold adapters neither flushes hot ones from a store's
# RAM tier nor queues its reads ahead of the loads executors are waiting for.
MAX_WARMS_IN_FLIGHT = 4
# A grammar's compile on an executor (PrepareGrammar) past this lets its requests start anyway
PREPARE_GRAMMAR_S = 30.0
# Requests that arrive together start together: an idle executor's first step waits while
# requests keep coming (each at most GATHER_QUIET_S after the one before), for at most
# GATHER_MAX_S, so that a burst's prompts are computed in one step and its requests end together
# (started a step apart, the last would end that many steps after the first). Measured
# (bench/results/pressure-cpu.md): 64 requests at once take 34 steps, not 35-36, and their p99
# time to first token is 0.81x; a lone request waits GATHER_QUIET_S more.
GATHER_QUIET_S = 0.005
GATHER_MAX_S = 0.05


class _Sent(NamedTuple):
    """A step in flight: its plan, when its planning began and when it was sent."""

    plan: StepPlan
    planning_at: float
    sent_at: float


class Engine:
    def __init__(self, executor_specs: tuple[str, ...], weights: FairnessWeights, limits: Limits,
                 discovery_interval_s: float = 5.0, timings: TimingLog | None = None,
                 warm_host: Callable[[AdapterRef], Awaitable[None]] | None = None,
                 service_key: str = "", timeouts: Timeouts = Timeouts()):
        self.links: dict[str, ExecutorLink] = {}
        self._service_key = service_key  # presented to executors
        self.timeouts = timeouts
        self.timings = timings
        self.core = Scheduler(weights, limits, self._start_load, self._wake, self._start_unload,
                              warm_host=self._warm_host, start_stage=self._start_stage,
                              start_grammar=self._start_grammar)
        self.operators = Operators(self.core)
        self._warm = warm_host
        self._warmed: dict[AdapterRef, float] = {}  # adapter -> when last asked for (monotonic)
        self._warming: set[asyncio.Task] = set()
        self.metrics = SchedulerMetrics(self.core)
        self.first_info: asyncio.Future[executor_pb2.InfoResponse] = (
            asyncio.get_running_loop().create_future())
        self._specs = executor_specs
        self._interval = discovery_interval_s
        self._tasks: set[asyncio.Task] = set()
        self._link_tasks: dict[str, list[asyncio.Task]] = {}
        # The core's view of each executor, from its last connection (core.add_executor), and
        # the executors gone from discovery (before they connected, too).
        self._views: dict[str, ExecutorState] = {}
        self._leaving: set[str] = set()
        # (executor, slot) -> its UnloadAdapter on its way: a load into the slot waits for it
        self._unloads: dict[tuple[str, int], asyncio.Task] = {}

    def start(self) -> None:
        self._spawn(self._discover())
        self._spawn(self._tick())

    async def _tick(self) -> None:
        """The core's clock tick: waiting requests whose time is up are dropped, loads whose
        backoff passed are tried again."""
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self.core.expire()
            except Exception:  # a bug: logged, and the tick goes on (deadlines must hold)
                log.exception("the scheduler's clock tick failed")

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for link in self.links.values():
            link.close()
        if self.timings is not None:
            self.timings.close()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_failure)
        return task

    def _wake(self) -> None:
        for link in self.links.values():
            link.woken.set()

    # ---- discovery --------------------------------------------------------------------------
    async def _discover(self) -> None:
        """Re-resolve the executor specs; connect to newcomers, drain those that left."""
        while True:
            try:
                found = await asyncio.to_thread(resolve, self._specs)
            except (OSError, ValueError) as err:
                log.warning("resolving executors failed: %s", err)
                found = set(self.links)
            for address in sorted(found - set(self.links)):
                log.info("executor %s joined", address)
                link = self.links[address] = ExecutorLink(address, self._service_key,
                                                          self.timeouts)
                self._link_tasks[address] = [self._spawn(self._run(link)),
                                             self._spawn(self._watch(link))]
            for address in sorted(set(self.links) - found):
                self._leave(self.links[address])
            await asyncio.sleep(self._interval)

    def _leave(self, link: ExecutorLink) -> None:
        """Stop admitting on a departing executor; its link goes once its sequences finish."""
        if link.address not in self._leaving:
            log.info("executor %s left: draining", link.address)
            self._leaving.add(link.address)
            ex = self._views.get(link.address)
            if ex is not None:
                self.core.leave(ex)

    def _forget(self, link: ExecutorLink) -> None:
        for task in self._link_tasks.pop(link.address, []):
            if task is not asyncio.current_task():
                task.cancel()
        self.links.pop(link.address, None)
        self._leaving.discard(link.address)
        ex = self._views.pop(link.address, None)
        if ex is not None:
            self.core.remove_executor(ex)
        link.close()

    async def _watch(self, link: ExecutorLink) -> None:
        """Drain an executor as soon as its health says NOT_SERVING (it is shutting down)."""
        stub = health_pb2_grpc.HealthStub(link.channel)
        while True:
            try:
                async for status in stub.Watch(health_pb2.HealthCheckRequest(service="")):
                    is_stopping = status.status == health_pb2.HealthCheckResponse.NOT_SERVING
                    ex = self._views.get(link.address)
                    if is_stopping and ex is not None and ex.is_up:
                        self.core.stop(ex)
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(RECONNECT_SECONDS)

    # ---- one executor -----------------------------------------------------------------------
    async def _run(self, link: ExecutorLink) -> None:
        failures = 0
        while True:
            error: LoraplexError | None = None
            try:
                ex = await self._connect(link)
                failures = 0
                await self._step_loop(link, ex)
            except grpc.aio.AioRpcError as err:
                error = from_rpc_error(err, f"executor {link.address}")
            except LoraplexError as err:
                error = err
            except Exception as err:  # a bug: its requests move on, the link reconnects
                log.exception("the step loop of executor %s failed", link.address)
                error = Unavailable(f"the scheduler's link to {link.address} failed: {err!r}")
            if error is not None:
                failures += 1
                if failures == 1:
                    log.warning("executor %s unreachable: %s", link.address, error)
            link.close()
            ex = self._views.get(link.address)
            if ex is not None and ex.is_up:
                self.core.on_executor_lost(ex, error)
            if link.address in self._leaving:
                return self._forget(link)
            await asyncio.sleep(RECONNECT_SECONDS)

    async def _connect(self, link: ExecutorLink) -> ExecutorState:
        """Connect, and give the core a fresh view of the executor from its Info."""
        info = await link.connect()
        if not self.first_info.done():
            self.first_info.set_result(info)
        model_id = self.first_info.result().model_id
        if info.model_id != model_id:
            raise Unavailable(f"executor {link.address} serves {info.model_id!r}, pool is "
                              f"{model_id!r}")
        ex = self._views[link.address] = self.core.add_executor(
            link.address, ExecutorShape.from_info(info), is_leaving=link.address in self._leaving)
        log.info("executor %s up: %d KV blocks, %d slots", link.address, info.num_kv_blocks,
                 info.num_adapter_slots)
        return ex

    async def _step_loop(self, link: ExecutorLink, ex: ExecutorState) -> None:
        """Step until the executor is drained and leaving or stopping: closing the step stream then
        lets a stopping executor exit at once. An operator's Drain keeps it listed, idle.

        Steps are pipelined (Limits.pipeline_depth): the next step is planned and sent as soon as
        one is sent, and answers are read in order. A plan needs no answer to be made: the
        executor keeps each sequence's sampled tokens, and the core counts the samples due
        (Sequence.num_known). A sequence that ends on a sample (EOS, a stop string) may have
        one more token computed in the step behind, which is dropped; tokens reach clients only
        from answers, so a lost executor loses none that were shown."""
        in_flight: collections.deque[_Sent] = collections.deque()
        while in_flight or not self.core.is_retired(ex):
            link.woken.clear()
            if await self._send_next(link, ex, in_flight):
                continue
            if in_flight:  # answers come in order; the executor runs the next meanwhile
                await self._take_answer(link, ex, in_flight.popleft())
            else:
                await self._idle(link)
        log.info("executor %s drained", link.address)

    async def _send_next(self, link: ExecutorLink, ex: ExecutorState,
                         in_flight: collections.deque[_Sent]) -> bool:
        """Plan ex's next step and send it, while fewer than pipeline_depth are in flight;
        whether one was sent (a plan with nothing to do is not)."""
        if len(in_flight) >= self.core.limits.pipeline_depth or self.core.is_retired(ex):
            return False
        if not in_flight and not self.core.steps_of(ex).running:
            await self._gather(ex)
        planning = time.monotonic()
        plan = self.core.schedule(ex)
        if not plan.needs_sending:
            return False
        # Written behind the steps in flight: it may wait for them to be read.
        ahead = sum(self._step_deadline(ex, sent.plan) for sent in in_flight)
        await link.send(plan, ahead + self._step_deadline(ex, plan))
        in_flight.append(_Sent(plan, planning, time.monotonic()))
        return True

    async def _gather(self, ex: ExecutorState) -> None:
        """Ex is idle: while requests keep being queued for it, let the rest of their burst come
        (GATHER_QUIET_S, GATHER_MAX_S)."""
        num_queued, deadline = self.core.placement.num_queued, time.monotonic() + GATHER_MAX_S
        seen = num_queued(ex)
        while seen and ex.is_admitting and time.monotonic() < deadline:
            await asyncio.sleep(GATHER_QUIET_S)
            if num_queued(ex) == seen:
                return
            seen = num_queued(ex)

    async def _take_answer(self, link: ExecutorLink, ex: ExecutorState, sent: _Sent) -> None:
        """The answer to the oldest step in flight, `sent`: its samples to the core."""
        plan = sent.plan
        waiting = time.monotonic()
        samples, seconds = await link.receive(plan, self._step_deadline(ex, plan))
        answered = time.monotonic()
        if plan:  # (a step that only frees sequences computes nothing: not a step to time)
            self.metrics.on_step(link.address, plan, seconds)
        self.core.on_step_done(ex, plan, samples, seconds)
        if plan and self.timings is not None:
            self.timings.step(link.address, plan.num_tokens, plan.num_adapters, seconds,
                              plan_s=sent.sent_at - sent.planning_at, wait_s=answered - waiting,
                              done_s=time.monotonic() - answered)

    async def _idle(self, link: ExecutorLink) -> None:
        """Nothing to send or take: wait for work (a wake), probing the executor when it has
        been silent for probe_interval_s (is it still there?)."""
        silent_s = time.monotonic() - link.answered_at
        if silent_s >= self.timeouts.probe_interval_s:
            await link.probe()
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.timeouts.probe_interval_s - silent_s):
                await link.woken.wait()

    def _step_deadline(self, ex: ExecutorState, plan: StepPlan) -> float:
        merging = plan.merge_slot is not None or plan.unmerge
        return self.timeouts.step(plan.num_tokens, ex.rates, ex.steps_since_up) + \
            merging * self.timeouts.merge_s

    def _start_load(self, ex: ExecutorState, load: Load) -> None:
        link = self.links[ex.address]  # (bound to the step stream of this view of it, now)
        self._spawn(self._load(link, link.stream_id, ex, load))

    async def _load(self, link: ExecutorLink, stream_id: str, ex: ExecutorState,
                    load: Load) -> None:
        adapter = load.adapter
        unloading = self._unloads.get((link.address, load.slot))
        if unloading is not None:
            # Sent after it, the load could still run first: an unload of the same adapter (an
            # evicted one loaded again into its slot) then emptied the slot under running
            # sequences, and the next step failed ("adapter slot 4 holds no adapter"; the churn
            # soak, 1 in 2 runs). The unload is bounded by its own deadline.
            await asyncio.wait({unloading})
        try:
            resp = await link.stub.LoadAdapter(executor_pb2.LoadAdapterRequest(
                adapter=adapter.to_pb(), slot=load.slot, only_staged=load.is_from_staged,
                pages=load.pages, stream_id=stream_id),
                timeout=self.timeouts.load(load.num_bytes, ex.rates))
        except grpc.aio.AioRpcError as err:
            error = from_rpc_error(err, f"loading adapter {adapter} on executor {link.address}")
            self.core.on_load_done(ex, load, error)
        else:
            if not resp.was_resident:
                self.metrics.load.labels(link.address).observe(resp.load_seconds)
                if self.timings is not None:
                    self.timings.load(link.address, resp.num_bytes, resp.load_seconds)
            self.core.on_load_done(ex, load, None, resp.num_bytes, resp.load_seconds)

    def _start_stage(self, ex: ExecutorState, adapter: AdapterRef, num_bytes: int) -> None:
        link = self.links[ex.address]
        self._spawn(self._stage(link, ex, adapter, num_bytes))

    async def _stage(self, link: ExecutorLink, ex: ExecutorState, adapter: AdapterRef,
                     num_bytes: int) -> None:
        try:
            resp = await link.stub.StageAdapter(
                executor_pb2.StageAdapterRequest(adapter=adapter.to_pb()),
                timeout=self.timeouts.load(num_bytes, ex.rates))
        except grpc.aio.AioRpcError as err:
            error = from_rpc_error(err, f"staging adapter {adapter} on executor {link.address}")
            self.core.on_stage_done(ex, adapter, error)
        else:
            self.core.on_stage_done(ex, adapter, None, resp.num_bytes, resp.stage_seconds)

    def _start_grammar(self, ex: ExecutorState, grammar: Grammar) -> None:
        self._spawn(self._prepare_grammar(self.links[ex.address], ex, grammar))

    async def _prepare_grammar(self, link: ExecutorLink, ex: ExecutorState,
                               grammar: Grammar) -> None:
        error = None
        try:
            await link.stub.PrepareGrammar(
                executor_pb2.PrepareGrammarRequest(grammar=grammar.to_pb()),
                timeout=PREPARE_GRAMMAR_S)
        except grpc.aio.AioRpcError as err:
            error = from_rpc_error(err, f"compiling a grammar on executor {link.address}")
            log.warning("%s", error)
        self.core.on_grammar_prepared(ex, grammar, error)

    def _warm_host(self, adapter: AdapterRef) -> None:
        """Ask the store to bring `adapter` into its RAM tier: at most once per WARM_AGAIN_S, and
        not while MAX_WARMS_IN_FLIGHT others are (a later request for it asks again)."""
        now = time.monotonic()
        if (self._warm is None or len(self._warming) >= MAX_WARMS_IN_FLIGHT
                or now - self._warmed.get(adapter, -WARM_AGAIN_S) < WARM_AGAIN_S):
            return
        self._warmed = {a: t for a, t in self._warmed.items() if now - t < WARM_AGAIN_S}
        self._warmed[adapter] = now
        self.metrics.host_prewarms.inc()
        task = self._spawn(self._warm(adapter))
        self._warming.add(task)
        task.add_done_callback(self._warming.discard)

    def _start_unload(self, ex: ExecutorState, slot: int, adapter: AdapterRef,
                      done: Callable[[bool], None] | None = None) -> None:
        """Empty `slot` on ex (only while it holds `adapter`); with `done`, the slot of a failed
        load whose pages wait (residency/): unconditionally, and `done(answered)` after."""
        link = self.links[ex.address]
        if done is None:
            request = executor_pb2.UnloadAdapterRequest(slot=slot, adapter=adapter.to_pb(),
                                                        stream_id=link.stream_id)
            timeout = link.timeouts.rpc_s
        else:  # (the answer waits for a copy that may still run: a load's time)
            request = executor_pb2.UnloadAdapterRequest(slot=slot, stream_id=link.stream_id)
            timeout = self.timeouts.load(0, ex.rates)
        key, task = (ex.address, slot), self._spawn(self._unload(link, request, timeout, done))
        self._unloads[key] = task
        task.add_done_callback(
            lambda _: self._unloads.pop(key) if self._unloads.get(key) is task else None)

    @staticmethod
    async def _unload(link: ExecutorLink, request: executor_pb2.UnloadAdapterRequest,
                      timeout: float, done: Callable[[bool], None] | None) -> None:
        try:
            await link.stub.UnloadAdapter(request, timeout=timeout)
        except grpc.aio.AioRpcError as err:  # the scheduler's table is the truth; this only tidies
            log.warning("unloading slot %d on %s failed: %s%s", request.slot, link.address,
                        err.details(), "; its pages wait for the executor to reconnect"
                        if done else "")
            if done is not None:
                done(False)
        else:
            if done is not None:
                done(True)


def _log_failure(task: asyncio.Task) -> None:
    """A background task that ends with an exception is a bug: say so."""
    if not task.cancelled() and task.exception() is not None:
        log.error("background task %s failed", task.get_name(), exc_info=task.exception())
