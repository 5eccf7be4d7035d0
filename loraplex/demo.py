"""The main job: three services on embedded defaults and a streaming workload from many tenants.

Starts an adapter store (local files), an executor (the tiny trained demo model on CPU), a
scheduler and a gateway as separate processes, pushes seven task adapters owned by four tenants,
streams concurrent requests from all of them through one shared batch (three in four over gRPC to
the scheduler, one in four through the gateway's OpenAI API with the official `openai` client),
then prints sample outputs (each adapter doing its task on prompts it never saw in training) and a
per-tenant summary.

The model and adapters are committed in loraplex/demo_assets/ (made by loraplex/train_demo.py).
"""

import argparse
import asyncio
import pathlib
import random
import secrets
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field

from common.adapter_ref import AdapterRef
from common.server import insecure_channel, run
from loraplex import client
from loraplex.demo_tasks import TASKS_BY_NAME, held_out
from loraplex.launch import Fleet, FleetKeys, start_gateway
from protos import scheduler_pb2, scheduler_pb2_grpc

ASSETS = pathlib.Path(__file__).parent / "demo_assets"
MODEL_DIR = ASSETS / "loraplex-demo-tiny"
MODEL_ID = MODEL_DIR.name  # the executor's model id: adapters' base_model_name_or_path
OPENAI_EVERY = 4  # one request in four goes through the gateway's OpenAI API
TENANTS = {  # tenant -> the task adapters it owns (each pushes its own with its API key)
    "acme": ["support-reply", "profile"],
    "globex": ["reverse-words", "rotate-words"],
    "initech": ["spell-digits", "count-words"],
    "umbrella": ["and-list"],
}
BASE = "(base model)"
ADAPTER_SLOTS = 4  # fewer than the 7 adapters: the demo shows loads, hits and LRU eviction
NUM_SAMPLES = 3  # sample outputs printed per adapter
# The tiny model is overhead-bound and three processes share the CPU: one torch thread is fastest.
EXECUTOR_THREADS = "1"


def adapter_dir(name: str) -> pathlib.Path:
    return ASSETS / "adapters" / name


@dataclass
class Result:
    tenant: str
    adapter: str  # "" = the base model
    prompt: str
    expected: str  # the task's answer; for the base model, the prompt echoed
    got: client.Generation
    via: str = "grpc"  # or "openai": the gateway's OpenAI API


@dataclass
class Workload:
    results: list[Result] = field(default_factory=list)
    elapsed: float = 0.0
    stats: scheduler_pb2.StatsResponse | None = None


def plan(num_requests: int, seed: int = 0) -> list[tuple[str, str, str, str]]:
    """(tenant, adapter, prompt, expected) per request: held-out prompts, one in eight unadapted."""
    rng = random.Random(seed)
    prompts = {name: held_out(TASKS_BY_NAME[name], 40) for owned in TENANTS.values()
               for name in owned}
    out = []
    for i in range(num_requests):
        tenant = list(TENANTS)[i % len(TENANTS)]
        owned = TENANTS[tenant]
        name = rng.choice(owned)
        prompt, answer = rng.choice(prompts[name])
        if rng.random() < 0.125:
            out.append((tenant, "", prompt, prompt))  # the base model alone echoes its input
        else:
            out.append((tenant, name, prompt, answer))
    rng.shuffle(out)
    return out


async def _openai_generate(api, adapter: str, prompt: str) -> client.Generation:
    """One streamed /v1/completions through the gateway, collected like a gRPC Generate."""
    out, start = client.Generation(), time.perf_counter()
    stream = await api.completions.create(model=adapter or MODEL_ID, prompt=prompt, max_tokens=48,
                                          temperature=0, stream=True,
                                          stream_options={"include_usage": True})
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.text and not out.text:
                out.ttft_seconds = time.perf_counter() - start
            out.text += choice.text
            out.finish_reason = choice.finish_reason or out.finish_reason
        if chunk.usage:
            out.token_ids = [0] * chunk.usage.completion_tokens  # (ids are not in the API)
    out.total_seconds = time.perf_counter() - start
    return out


async def _workload(scheduler: str, gateway_http: str, num_requests: int, concurrency: int,
                    keys: FleetKeys) -> Workload:
    import openai

    work, gate = Workload(), asyncio.Semaphore(concurrency)
    key_of = {tenant: key for key, tenant in keys.tenants.items()}
    apis = {tenant: openai.AsyncOpenAI(base_url=f"http://{gateway_http}/v1", api_key=key,
                                       max_retries=0, timeout=120)
            for tenant, key in key_of.items()}

    async def one(i: int, stub, tenant: str, adapter: str, prompt: str, expected: str) -> None:
        async with gate:
            if i % OPENAI_EVERY == 0:
                got, via = await _openai_generate(apis[tenant], adapter, prompt), "openai"
            else:
                request = client.generate_request(adapter, prompt, max_new_tokens=48)  # greedy
                got, via = await client.generate(stub, request, key_of[tenant]), "grpc"
        work.results.append(Result(tenant, adapter, prompt, expected, got, via))

    async with insecure_channel(scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        start = time.perf_counter()
        await asyncio.gather(*(one(i, stub, *job) for i, job in enumerate(plan(num_requests))))
        work.elapsed = time.perf_counter() - start
        work.stats = await stub.Stats(scheduler_pb2.StatsRequest(),
                                      metadata=client.metadata(keys.admin))
    return work


def _pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


def _print_samples(work: Workload) -> None:
    by_adapter: dict[str, list[Result]] = defaultdict(list)
    for r in work.results:
        by_adapter[r.adapter or BASE].append(r)
    print("\nSample outputs (greedy; every prompt is held out: no adapter saw it in training):")
    for tenant, owned in TENANTS.items():
        for name in owned:
            print(f"\n  {name} (tenant {tenant}): {TASKS_BY_NAME[name].description}")
            _print_rows(by_adapter[name])
    print(f"\n  {BASE} (any tenant, no adapter): pre-trained only to echo its input")
    _print_rows(by_adapter[BASE])
    print(f"\n{'adapter':16s}{'requests':>9s}{'exact answers':>15s}")
    for name in [*(n for owned in TENANTS.values() for n in owned), BASE]:
        rows = by_adapter[name]
        exact = sum(r.got.text == r.expected for r in rows)
        print(f"{name:16s}{len(rows):9d}{exact:10d} ({exact / max(1, len(rows)):4.0%})")
    _print_misses(work.results)


def _print_misses(results: list[Result]) -> None:
    """Every answer that was not exact, what it should have been, and which API it came by."""
    misses = [r for r in results if r.got.text != r.expected]
    if not misses:
        print("\nevery answer was exact.")
        return
    print(f"\nanswers that were not exact ({len(misses)}):")
    for r in sorted(misses, key=lambda r: (r.adapter, r.prompt)):
        print(f"  {r.adapter or BASE:16s}{r.prompt!r:34s} -> {r.got.text!r}, expected "
              f"{r.expected!r} [{r.via}]")


def _print_rows(rows: list[Result]) -> None:
    seen = set()
    for r in rows:
        if r.prompt in seen or len(seen) == NUM_SAMPLES:
            continue
        seen.add(r.prompt)
        mark = "ok" if r.got.text == r.expected else f"expected {r.expected!r}"
        print(f"    {r.prompt!r:34s} -> {r.got.text!r}  [{mark}, {r.via}]")


def _print_summary(work: Workload) -> None:
    stats = work.stats
    tenants = {t.tenant: t for t in stats.tenants}
    print(f"\n{'tenant':10s}{'requests':>9s}{'tokens':>8s}{'tok/s':>8s}{'TTFT p50':>10s}"
          f"{'TTFT p99':>10s}{'adapter loads':>15s}{'adapter hits':>14s}")
    for tenant in TENANTS:
        rows = [r for r in work.results if r.tenant == tenant]
        tokens = sum(len(r.got.token_ids) for r in rows)
        ttfts = [r.got.ttft_seconds * 1000 for r in rows]
        loads = tenants[tenant].adapter_loads_caused
        hits = sum(1 for r in rows if r.adapter) - loads  # adapter admissions that needed no load
        print(f"{tenant:10s}{len(rows):9d}{tokens:8d}{tokens / work.elapsed:8.1f}"
              f"{_pct(ttfts, 50):8.0f}ms{_pct(ttfts, 99):8.0f}ms{loads:15d}{hits:14d}")
    for ex in stats.executors:
        held = ", ".join(client.ref_text(s.adapter) or "-" for s in ex.slots)
        print(f"\nexecutor {ex.address}: {ex.steps} batched steps, {ex.adapter_loads} adapter "
              f"loads, {ex.adapter_hits} admissions found their adapter resident; "
              f"{len(ex.slots)} slots now hold: {held}")
    for via, what in (("grpc", "gRPC Generate to the scheduler"),
                      ("openai", "the gateway's OpenAI API (openai client, streamed)")):
        rows = [r for r in work.results if r.via == via]
        exact = sum(r.got.text == r.expected for r in rows if r.adapter)
        print(f"through {what}: {len(rows)} requests, {exact} of "
              f"{sum(1 for r in rows if r.adapter)} adapter answers exact")
    total = sum(len(r.got.token_ids) for r in work.results)
    print(f"total: {len(work.results)} requests, {total} tokens in {work.elapsed:.1f}s "
          f"= {total / work.elapsed:.0f} tokens/s")


async def _push_all(store: str, keys: FleetKeys) -> None:
    for key, tenant in keys.tenants.items():
        for name in TENANTS[tenant]:
            info = await client.push_adapter(store, adapter_dir(name), name, key=key)
            print(f"  pushed {AdapterRef.of(info)} for {tenant:9s} "
                  f"(rank {info.rank:2d}, "
                  f"{len(info.target_modules)} modules, {info.num_bytes / 1024:4.0f} KiB): "
                  f"{TASKS_BY_NAME[name].description}")


def main(args: argparse.Namespace) -> None:
    """Run the demo on the model and adapters committed under demo_assets/."""
    with tempfile.TemporaryDirectory(prefix="loraplex-demo-") as tmp:
        store_url = pathlib.Path(tmp, "store").as_uri()
        # Every service authenticates its callers: a key per tenant, an admin key, a service key.
        keys = FleetKeys(tenants={secrets.token_hex(16): tenant for tenant in TENANTS})
        fleet = Fleet(model=str(MODEL_DIR), store_url=store_url, log_dir=pathlib.Path(tmp, "logs"),
                      executor_args=["--adapter-slots", str(ADAPTER_SLOTS),
                                     "--threads", EXECUTOR_THREADS],
                      keys=keys)
        print(f"model: {MODEL_DIR.name}, a 4-layer LLaMA trained on CPU to echo text; "
              "each LoRA adapter teaches it one task.")
        print("starting adapter_store, executor, scheduler and gateway as separate processes ...",
              flush=True)
        with fleet:
            gateway = start_gateway({MODEL_ID: [fleet.scheduler]}, fleet.stores, fleet.log_dir,
                                    keys)
            fleet.services.append(gateway)
            for s in fleet.services:
                print(f"  {s.name:16s} listening on {s.address}")
            http = gateway.announced["gateway-http"]
            print(f"  {'(OpenAI API)':16s} listening on http://{http}/v1")
            run(lambda: _push_all(fleet.stores[0], keys))
            print(f"streaming {args.requests} requests from {len(TENANTS)} tenants at once, "
                  f"{args.concurrency} in flight, {ADAPTER_SLOTS} adapter slots ...", flush=True)
            work = run(lambda: _workload(fleet.scheduler, http, args.requests, args.concurrency,
                                         keys))
            _print_samples(work)
            _print_summary(work)
        print("\nall services stopped.")
