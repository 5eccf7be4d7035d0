"""The executor's gRPC face: converts messages and delegates to ModelRunner and AdapterLoader.

Forward passes and adapter parsing run in worker threads, so adapter loads, Info and health stay
responsive while a step computes, and a load never stalls the step loop.

With --tensor-parallel N, `main` supervises N rank processes (executor/tp/rank_group.py); rank 0 is
this service, on its part of the model, and tells the other ranks each step, load and unload
(executor/tp/followers.py): the scheduler sees one executor.
"""

import asyncio
import logging
import socket
import sys
import time
from multiprocessing.connection import Connection

import torch

from common import wire
from common.adapter_ref import AdapterRef
from common.allocator import keep_freed_memory
from common.credentials import KeyRing, Role
from common.errors import FailedPrecondition, InvalidArgument, grpc_errors
from common.grammar import Grammar
from common.metrics import serve_metrics
from common.page_geometry_pb import geometry_to_pb, kinds_to_pb
from common.server import Service, announce, configure_logging, run, run_until_signalled
from executor.adapter_loader import FETCH_TIMEOUT_S, AdapterLoader
from executor.benchmark_runner import BenchmarkRunner
from executor.config import ExecutorConfig
from executor.decode_graphs import DecodeGraphs
from executor.lora.backend import resolve_lora_backend
from executor.metrics import ExecutorMetrics
from executor.model.config import ModelConfig
from executor.model_identity import log_identity, resolve_identity
from executor.runner import ModelRunner, Sampled
from executor.step_request import run_step, step_rows
from executor.step_worker import StepWorker
from executor.tokenizer_files import TokenizerFiles
from executor.tp.collectives import SINGLE, TensorParallel, rank_device
from executor.tp.followers import Followers
from executor.tp.rank_group import supervise
from executor.tp.shards import Shard
from protos import common_pb2, executor_pb2, executor_pb2_grpc

log = logging.getLogger(__name__)


def build_runner(config: ExecutorConfig,
                 tp: TensorParallel = SINGLE) -> tuple[ModelRunner, TokenizerFiles]:
    """The model runner (of rank `tp`'s part) and the model's tokenizer files (none for random
    weights)."""
    if config.threads:
        torch.set_num_threads(config.threads)
    kw = dict(num_kv_blocks=config.num_kv_blocks, block_size=config.block_size,
              num_slots=config.adapter_slots, max_rank=config.max_rank,
              lora_backend=config.lora_backend, dtype=getattr(torch, config.dtype),
              device=rank_device(config.device, tp.rank, tp.world), tp=tp,
              window_blocks=config.window_blocks)
    if config.benchmark_step_s:
        log.warning("executor: BENCHMARK MODE: no forward pass, made-up tokens, %.3fs steps",
                    config.benchmark_step_s)
        model = ModelConfig.named(config.random_config)
        kw["num_kv_blocks"] = kv_blocks(config, model)
        runner = BenchmarkRunner.random(model, seed=config.seed, step_s=config.benchmark_step_s,
                                        **kw)
        return runner, TokenizerFiles()
    is_cuda = kw["device"].type == "cuda"
    graphs_off = ("" if not is_cuda else "--no-cuda-graphs" if not config.cuda_graphs
                  else "a tensor-parallel executor" if tp.world > 1 else "")
    graphs = is_cuda and not graphs_off
    kw["scratch_block"] = graphs  # (decode graphs' padding rows write their K/V there)
    if config.random_config is not None:
        model = ModelConfig.named(config.random_config)
        kw["num_kv_blocks"] = kv_blocks(config, model)
        runner, files = ModelRunner.random(model, seed=config.seed, **kw), TokenizerFiles()
    else:
        kw["num_kv_blocks"] = kv_blocks(config, ModelConfig.from_pretrained(config.model))
        runner = ModelRunner.from_pretrained(config.model, model_id=config.model_id, **kw)
        files = TokenizerFiles.read(config.model)
    runner.graphs_off = graphs_off
    if graphs:
        runner.graphs, runner.graphs_off = DecodeGraphs.check(runner)
    if tp.is_first and runner.tokenizer_json and not runner.prepare_grammars():  # (rank 0 samples)
        log.warning("executor: the grammar engine (llguidance) is not installed: requests with "
                    "a grammar (structured outputs, tools) will fail here")
    return runner, files


def kv_blocks(config: ExecutorConfig, model: ModelConfig) -> int:
    """The cache's blocks: --kv-blocks blocks of every layer's memory, in the layout's blocks
    (with window blocks, of fewer layers: as many as that memory holds)."""
    layout = model.kv_layout(config.window_blocks)
    return config.num_kv_blocks * layout.num_layers // layout.layers_per_block


def describe_quantization(config) -> str:
    """InfoResponse.quantization: the base's quantization in words, "" when it has none."""
    return config.quantization.describe() if config.quantization else ""


def quantization_freed(runner: ModelRunner) -> str:
    """The start log's note of what a quantized base frees, in KV tokens ("" when not quantized;
    adapters take pages of the same blocks)."""
    if runner.config.quantization is None:
        return ""
    freed = runner.weights.dense_bytes() - runner.weights.num_bytes()
    layout = runner.kv_layout  # (a token of every layer: num_layers / layers_per_block slots)
    per_token = runner.kv.num_bytes() * layout.num_layers // max(
        1, runner.kv.num_blocks * runner.kv.block_size * layout.layers_per_block)
    return (f"; {describe_quantization(runner.config)}: {freed / 2**20:.1f} MiB freed against "
            f"dense weights, {freed // max(1, per_token):,} KV tokens (or adapters' pages)")


class ExecutorServicer(executor_pb2_grpc.ExecutorServicer):
    def __init__(self, config: ExecutorConfig, runner: ModelRunner, tokenizer: TokenizerFiles,
                 keys: KeyRing, followers: Followers | None = None):
        self.metrics = ExecutorMetrics()
        self._config = config
        self._keys = keys  # every RPC: the scheduler's service key (or an admin's)
        self._runner = runner
        self._tokenizer = tokenizer
        self._followers = followers  # the other ranks of a tensor-parallel executor
        self._loader = AdapterLoader(runner, config.stores, service_key=keys.service_key,
                                     max_staged_bytes=config.staging_mb << 20,
                                     chunk_timeout_s=config.fetch_chunk_timeout_s,
                                     followers=followers)
        self._driver: object | None = None  # the one Step stream allowed at a time
        # The last stream's end: its final step, then free_all.
        self._closing: asyncio.Future | None = None

    def name_lease_holder(self, port: int) -> None:
        """The name the stores' leases give this executor, and an adapter's refused deletion
        shows: host:port, unique (one process listens on a port) and where to find it."""
        self._loader.holder = f"{socket.gethostname()}:{port}"

    async def Info(self, request, context):
        async with grpc_errors(context):
            self._keys.require(context, Role.SERVICE, Role.ADMIN)
        c, budget = self._runner.config, self._runner.memory_budget()
        return executor_pb2.InfoResponse(
            model_id=c.model_id, vocab_size=c.vocab_size, max_model_len=c.max_position_embeddings,
            eos_token_ids=c.eos_token_ids, num_kv_blocks=self._runner.num_kv_blocks,
            block_size=self._config.block_size, num_adapter_slots=self._config.adapter_slots,
            max_lora_rank=self._config.max_rank, tokenizer_json=self._tokenizer.tokenizer_json,
            chat_template=self._tokenizer.chat_template,
            special_tokens=self._tokenizer.special_tokens,
            weight_bytes=budget.weights_bytes, kv_cache_bytes=budget.kv_cache_bytes,
            adapter_pool_bytes=budget.adapter_pool_bytes,
            lora_backend=resolve_lora_backend(self._config.lora_backend, self._config.device),
            device=self._config.device,
            slot_adapters=[a.to_pb() if a else common_pb2.AdapterRef()
                           for a in self._loader.slot_adapters],
            num_sequences=self._runner.num_sequences,
            base_fingerprint=self._runner.base_fingerprint,
            merged_adapter=self._merged_adapter(),
            page_geometry=geometry_to_pb(self._runner.pool.geometry,
                                         self._runner.pool.page_bytes),
            kv_kinds=kinds_to_pb(self._runner.kv_layout),
            tensor_parallel_size=self._runner.tp.world,
            longrope_switch_len=self._runner.rope_switch_len,
            quantization=describe_quantization(c),
            dense_weight_bytes=self._runner.weights.dense_bytes(),
            decode_graph_buckets=self._runner.graphs.buckets if self._runner.graphs else (),
            decode_graphs_off=self._runner.graphs_off)

    def _check_not_merged(self, slot: int) -> None:
        if slot == self._runner.merged_slot:
            raise FailedPrecondition(f"adapter slot {slot} is merged into the weights: unmerge "
                                     "it (a Step with unmerge) before replacing it")

    def _merged_adapter(self) -> common_pb2.AdapterRef | None:
        slot = self._runner.merged_slot
        adapter = None if slot is None else self._loader.slot_adapters[slot]
        return adapter.to_pb() if adapter else None

    async def Step(self, request_iterator, context):
        async with grpc_errors(context):
            self._keys.require(context, Role.SERVICE, Role.ADMIN)
            if self._driver is not None:
                raise FailedPrecondition("executor is already driven by another scheduler stream")
            self._driver = context
        worker: StepWorker | None = None
        reading: asyncio.Future | None = None
        try:
            if self._closing is not None:
                await asyncio.shield(self._closing)
            self._loader.stream_id = dict(context.invocation_metadata()).get(wire.STEP_STREAM)
            # Steps run on the worker's thread, one after another: the scheduler sends the next
            # step before this one's answer (its steps are pipelined), so it starts as soon as
            # this one ends. A step the client stops waiting for runs on, and the next stream
            # starts only after it (same sequence ids, same KV blocks).
            worker = StepWorker(self._step, asyncio.get_running_loop())
            reading = asyncio.ensure_future(_feed(request_iterator, worker,
                                                  self._config.step_idle_s))
            while True:
                async with grpc_errors(context):
                    response = await worker.result()
                if response is None:
                    break
                yield response
        finally:
            if reading is not None and not reading.done():
                reading.cancel()
            if worker is not None:
                worker.stop()
            self._loader.stream_id = None  # its loads and unloads are refused from now on
            self._closing = asyncio.ensure_future(self._close_stream(self._closing, worker))
            self._driver = None

    async def _close_stream(self, previous: asyncio.Future | None,
                            worker: StepWorker | None) -> None:
        """Forget the stream's sequences and adapters once its last step (which a cancel does not
        stop) and the end of the stream before it are over: the blocks they were in are the next
        scheduler's to give (adapters' pages among them), so it finds every slot empty."""
        if previous is not None:
            await asyncio.wait([previous])
        if worker is not None:
            await worker.done
        self._runner.free_all()
        self._runner.unmerge()  # the next scheduler finds the base model as loaded
        if self._followers is not None:
            await asyncio.to_thread(self._followers.end_stream)
        try:
            await self._loader.unload_all()
        except Exception:  # noqa: BLE001 (logged; the next stream's loads then say which slot)
            log.exception("executor: emptying the adapter slots at the stream's end failed")

    def _step(self, req: executor_pb2.StepRequest) -> executor_pb2.StepResponse:
        start = time.perf_counter()
        # (checked before anything changes)
        rows = step_rows(req, len(self._runner.kv_layout.kinds))
        if self._followers is not None:
            self._followers.step(req)  # (they run it beside this rank)
        graph_steps = self._runner.graph_steps
        samples = run_step(self._runner, req, rows)
        self.metrics.step.observe(time.perf_counter() - start)
        self.metrics.graph_steps.inc(self._runner.graph_steps - graph_steps)
        self.metrics.rows.inc(sum(req.row_num_tokens))
        response = executor_pb2.StepResponse(
            sample_seq_ids=[s.seq_id for s in samples],
            sample_token_ids=[s.token_id for s in samples],
            sample_logprobs=[s.logprob for s in samples])
        if any(s.top or s.prompt for s in samples):
            _add_logprobs(response, samples)
        response.step_seconds = time.perf_counter() - start
        return response

    async def StageAdapter(self, request, context):
        async with grpc_errors(context):
            self._keys.require(context, Role.SERVICE, Role.ADMIN)
            result = await self._loader.stage(AdapterRef.from_pb(request.adapter),
                                              _fetch_timeout(context))
            return executor_pb2.StageAdapterResponse(num_bytes=result.num_bytes,
                                                     stage_seconds=result.load_seconds,
                                                     was_staged=result.was_resident)

    async def LoadAdapter(self, request, context):
        async with grpc_errors(context):
            self._keys.require(context, Role.SERVICE, Role.ADMIN)
            self._check_not_merged(request.slot)  # (again where the copy starts: the loader)
            result = await self._loader.load(AdapterRef.from_pb(request.adapter), request.slot,
                                             tuple(request.pages), _fetch_timeout(context),
                                             request.only_staged, request.stream_id)
            if not result.was_resident:
                self.metrics.loads.inc()
                self.metrics.load.observe(result.load_seconds)
                self.metrics.load_bytes.inc(result.num_bytes)
            return executor_pb2.LoadAdapterResponse(num_bytes=result.num_bytes,
                                                    load_seconds=result.load_seconds,
                                                    was_resident=result.was_resident)

    async def UnloadAdapter(self, request, context):
        async with grpc_errors(context):
            self._keys.require(context, Role.SERVICE, Role.ADMIN)
            self._check_not_merged(request.slot)
            await self._loader.unload(request.slot, AdapterRef.from_optional_pb(request.adapter),
                                      request.stream_id)
            return executor_pb2.UnloadAdapterResponse()

    async def PrepareGrammar(self, request, context):
        """Compile a grammar off the step path (the step thread goes on meanwhile)."""
        async with grpc_errors(context):
            self._keys.require(context, Role.SERVICE, Role.ADMIN)
            grammar = Grammar.from_pb(request.grammar)
            try:
                seconds = await asyncio.to_thread(self._runner.prepare_grammar, grammar)
            except ValueError as err:
                raise InvalidArgument(f"grammar: {err}") from None
            if seconds:
                log.info("grammar (%s, %d characters) compiled ahead in %.3fs",
                         grammar.kind.name.lower(), len(grammar.value), seconds)
            return executor_pb2.PrepareGrammarResponse(compile_seconds=seconds)


def _add_logprobs(response: executor_pb2.StepResponse, samples: list[Sampled]) -> None:
    """The samples' alternatives and prompt logprobs, where their sequences asked for them."""
    for s in samples:
        response.sample_num_top.append(len(s.top.token_ids) if s.top else 0)
        if s.top:
            response.top_token_ids.extend(s.top.token_ids)
            response.top_logprobs.extend(s.top.logprobs)
        if s.prompt is not None:
            p = s.prompt
            response.prompt_logprobs.add(seq_id=s.seq_id, tokens=common_pb2.TokenLogprobs(
                token_ids=p.token_ids, logprobs=p.logprobs,
                num_top=[p.num_top] * len(p.token_ids), top_token_ids=p.top_token_ids,
                top_logprobs=p.top_logprobs))


async def _feed(request_iterator, worker: StepWorker, idle_s: float) -> None:
    """Hand the stream's requests to the worker as they arrive, then say there are no more: at
    its end, or once it has sent nothing for `idle_s` while owing the next message (every step
    answered: a step that runs long, a kernel compiling, is no silence of the client's)."""
    requests = aiter(request_iterator)
    reading: asyncio.Future | None = None
    try:
        while True:
            reading = reading or asyncio.ensure_future(anext(requests))
            done, _ = await asyncio.wait([reading], timeout=idle_s)
            if not done:
                if worker.is_idle:
                    log.warning("the Step stream sent nothing for %.0fs: it ends (its scheduler "
                                "hangs or is gone)", idle_s)
                    return
                continue  # (the same read, still waiting)
            try:
                request = reading.result()
            except StopAsyncIteration:
                return
            reading = None
            worker.submit(request)
    finally:
        if reading is not None:
            reading.cancel()
        worker.finish()


def _fetch_timeout(context) -> float:
    """A fetch from the stores ends within the caller's deadline (or FETCH_TIMEOUT_S)."""
    remaining = context.time_remaining()
    return FETCH_TIMEOUT_S if remaining is None else max(0.1, min(remaining, FETCH_TIMEOUT_S))


async def serve(config: ExecutorConfig, tp: TensorParallel = SINGLE,
                channels: list[Connection] = ()) -> None:
    """Serve the executor; as rank 0 of a tensor-parallel group (`tp`), with `channels` to
    ranks 1, 2, ... (executor/tp/rank.py)."""
    keys = config.keys.load()
    # Which base it serves is asked of the stores while the weights load.
    identity, (runner, tokenizer) = await asyncio.gather(
        resolve_identity(config, keys.service_key), asyncio.to_thread(build_runner, config, tp))
    followers = None
    if channels:
        followers = Followers(channels, [Shard(runner.config, r, tp.world)
                                         for r in range(1, tp.world)],
                              config.rank_timeout_s, tp.on_broken)
        followers.start_heartbeats()
    runner.set_identity(identity.model_id or runner.config.model_id, identity.fingerprint)
    log_identity(identity, runner.config.model_id)
    if keys.is_open:
        log.warning("executor: no service key configured, open access; configure "
                    "--service-key-file (or LORAPLEX_SERVICE_KEY)")
    servicer = ExecutorServicer(config, runner, tokenizer, keys, followers)
    service = Service(
        "executor", config.address,
        lambda server: executor_pb2_grpc.add_ExecutorServicer_to_server(servicer, server),
        [executor_pb2.DESCRIPTOR.services_by_name["Executor"].full_name])
    port = await service.start()
    servicer.name_lease_holder(port)
    serve_metrics(config.metrics_port, servicer.metrics.registry)
    await service.mark_serving()
    budget = runner.memory_budget()
    log.info("executor: model %s, weights %.1f MiB, KV %.1f MiB, adapter pool %.1f MiB%s%s",
             runner.config.model_id, budget.weights_bytes / 2**20, budget.kv_cache_bytes / 2**20,
             budget.adapter_pool_bytes / 2**20,
             f" on each of {tp.world} ranks" if tp.world > 1 else "",
             quantization_freed(runner))
    announce("executor", f"{config.address.rsplit(':', 1)[0]}:{port}")
    await run_until_signalled(service, grace=config.grace_s)


def main(argv: list[str] | None = None) -> None:
    configure_logging("executor")
    argv = sys.argv[1:] if argv is None else argv
    config = ExecutorConfig.from_args(argv)
    if config.random_config is None:  # a family it does not serve: refused before anything starts
        try:
            ModelConfig.from_pretrained(config.model)
        except ValueError as err:
            raise SystemExit(f"executor: cannot serve --model {config.model}: {err}") from None
    if config.tensor_parallel > 1:
        sys.exit(supervise(config, argv))
    keep_freed_memory()  # received adapter chunks reuse freed blocks instead of faulting in pages
    run(lambda: serve(config))


if __name__ == "__main__":
    main()
