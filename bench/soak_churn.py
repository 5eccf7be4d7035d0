"""Churn soak: many adapters on real S3, Zipf traffic through the gateway's OpenAI API, and a
block budget that holds about a tenth of them, so adapters come and go all the time.

    .venv/bin/python bench/soak_churn.py [--quick] [--adapters 1000] [--duration-s 600]
                                         [--heap-probe [--tracemalloc]] [--out [PATH]]

SeaweedFS S3, one adapter store, one CPU executor (the demo model, 1 torch thread), a scheduler
and a gateway, as separate processes. Random PEFT adapters (bench/soak_adapters.py: rank 8, 16
or 64 at 70/20/10%; all projections, attention only or MLP only), owned by NUM_TENANTS tenants,
are pushed through the store. The executor's KV blocks hold about BLOCK_SHARE of all the
adapters' pages (plus room for the clients' sequences). CLIENTS closed-loop clients each send
streamed greedy /v1/completions (MAX_TOKENS tokens, EOS ignored) for an adapter drawn by Zipf(1.0)
popularity and one of NUM_PROMPTS prompts (token ids); a checker sends the sampled adapters' in
turn. Every answer of a sampled adapter is compared with HF transformers + PEFT's greedy tokens
(tests/oracle.py), and all answers to one (adapter, prompt) must agree.

It fails (exit 1, saying why) on an ERROR or traceback in a service log, an executor seen down
(Stats is_up false, Stats unreachable, its process gone, the scheduler logging it unreachable),
Stats counters going back, a failed or wrong request, and a pool that does not settle after the
traffic (a slot still loading, queues or sequences left). The executor's RSS is sampled
throughout; a probe inside it (bench/soak_probe.py) logs the statuses its errors become, and with
--heap-probe measures what its memory holds.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import pathlib
import random
import signal
import sys
import tempfile
import time
from collections import Counter, defaultdict

import aiohttp
import grpc
from soak import seaweed
from soak_adapters import ModelShapes, hf_references, sample, specs
from soak_churn_records import (
    Completion,
    Monitor,
    counter_delta,
    judge,
    log_errors,
    mark_cold,
    revision,
    rss_summary,
    rss_timeline,
    ttft_rows,
    warnings_of,
)
from soak_faults import leaks
from soak_probe import heap_table, probe_env, proc_status, read

from common.server import insecure_channel, run
from loraplex import client, demo
from loraplex.launch import Fleet, FleetKeys, start_gateway
from protos import adapter_store_pb2, adapter_store_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "soak-churn-cpu.md"
NUM_TENANTS, CLIENTS, NUM_PROMPTS, MAX_TOKENS, NUM_SAMPLED = 8, 32, 4, 16, 20
BLOCK_SHARE = 0.10  # of all adapters' pages, the executor's KV blocks hold this share
ADAPTER_SLOTS = 128  # more than the blocks hold at once: blocks, not slots, bound residency
STORE = ["--host-cache-mb", "128"]  # a fifth of the adapters' bytes: the cold tail reads S3
PUSH_CONCURRENCY = 8
REQUEST_TIMEOUT_S = 120.0
STATS_EVERY_S, RSS_EVERY_S = 2.0, 5.0


def make_prompts(num: int, vocab: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[0] + [rng.randrange(2, vocab) for _ in range(rng.randint(6, 14))]
            for _ in range(num)]


async def push_all(fleet: Fleet, names: list[str], all_specs, shapes: ModelShapes,
                   key_of: list[str]) -> tuple[float, int]:
    """Every adapter through the store, PUSH_CONCURRENCY at a time: (seconds, bytes)."""
    gate = asyncio.Semaphore(PUSH_CONCURRENCY)
    sizes = []
    channels = {key: insecure_channel(fleet.stores[0], key) for key in set(key_of)}

    async def one(spec) -> None:
        async with gate:
            data = await asyncio.to_thread(spec.weights, shapes.shapes, shapes.num_layers)
            header = adapter_store_pb2.PushHeader(
                name=names[spec.index], config_json=spec.config_json(demo.MODEL_ID),
                weights_filename="adapter_model.safetensors", num_bytes=len(data))
            stub = adapter_store_pb2_grpc.AdapterStoreStub(channels[key_of[spec.index]])
            await client.push(stub, header, data)
            sizes.append(len(data))

    start = time.monotonic()
    try:
        await asyncio.gather(*(one(s) for s in all_specs))
    finally:
        for channel in channels.values():
            await channel.close()
    return time.monotonic() - start, sum(sizes)


async def complete(session: aiohttp.ClientSession, c: Completion, model: str,
                   prompt: list[int], key: str) -> Completion:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    try:
        async with session.post("/v1/completions", json=body,
                                headers={"Authorization": f"Bearer {key}"}) as response:
            if response.status != 200:
                c.error = f"HTTP {response.status}: {(await response.text())[:160]}"
                return c
            async for line in response.content:
                if not line.startswith(b"data:") or (data := line[5:].strip()) == b"[DONE]":
                    continue
                event = json.loads(data)
                if "error" in event:
                    c.error = f"stream error: {str(event['error'])[:160]}"
                    break
                if event.get("choices"):
                    c.ttft = c.ttft if c.ttft is not None else time.time() - c.start
                    c.text += "".join(ch.get("text", "") for ch in event["choices"])
                if event.get("usage"):
                    c.num_tokens = event["usage"]["completion_tokens"]
    except (aiohttp.ClientError, TimeoutError) as exc:
        c.error = f"{type(exc).__name__}: {exc}"[:200]
    c.end = time.time()
    return c


async def traffic(http: str, names: list[str], key_of: list[str], prompts: list[list[int]],
                  checked: list[int], duration_s: float) -> list[Completion]:
    """CLIENTS Zipf clients and one checker, closed loops, until duration_s is up."""
    cum, total = [], 0.0
    for k in range(len(names)):
        total += 1.0 / (k + 1)
        cum.append(total)
    done: list[Completion] = []
    stop_at = time.monotonic() + duration_s
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(f"http://{http}", timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:

        async def zipf_client(i: int) -> None:
            rng = random.Random(i)
            while time.monotonic() < stop_at:
                k = rng.choices(range(len(names)), cum_weights=cum)[0]
                c = Completion(k, rng.randrange(len(prompts)), time.time())
                done.append(await complete(session, c, names[k], prompts[c.prompt], key_of[k]))

        async def checker() -> None:
            pairs = [(k, p) for p in range(len(prompts)) for k in checked]
            for i in range(1 << 30):
                if time.monotonic() >= stop_at:
                    return
                k, p = pairs[i % len(pairs)]
                c = Completion(k, p, time.time(), is_check=True)
                done.append(await complete(session, c, names[k], prompts[p], key_of[k]))

        async def progress() -> None:
            while (left := stop_at - time.monotonic()) > 0:
                await asyncio.sleep(min(30.0, left))
                errors = sum(bool(c.error) for c in done)
                print(f"  {duration_s - max(0.0, stop_at - time.monotonic()):4.0f} s: "
                      f"{len(done)} completions, {errors} failed", flush=True)

        await asyncio.gather(progress(), checker(), *(zipf_client(i) for i in range(CLIENTS)))
    return done


async def monitor(fleet: Fleet, mon: Monitor, stop: asyncio.Event) -> None:
    """Stats every STATS_EVERY_S (is_up, counters that must not go back), the executor's RSS
    every RSS_EVERY_S, until `stop`."""
    executor = fleet.by_name("executor")[0]
    last: dict[str, tuple[int, int, int]] = {}
    next_rss = 0.0
    async with insecure_channel(fleet.scheduler, fleet.keys.admin) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        while not stop.is_set():
            now = time.time()
            if now >= next_rss:
                next_rss = now + RSS_EVERY_S
                mon.rss.append((now, proc_status(executor.process.pid)))
            if executor.process.poll() is not None:
                mon.down.append(f"{now:.0f}: executor process exited "
                                f"({executor.process.returncode})")
                return
            try:
                stats = await stub.Stats(scheduler_pb2.StatsRequest(), timeout=5)
                mon.num_polls += 1
                for ex in stats.executors:
                    if not ex.is_up:
                        mon.down.append(f"{now:.0f}: Stats says {ex.address} is not up")
                    now_counts = (ex.steps, ex.adapter_loads, ex.adapter_hits)
                    before = last.get(ex.address)
                    if before and any(n < b for n, b in zip(now_counts, before)):
                        mon.backwards.append(f"{now:.0f}: {ex.address} (steps, loads, hits) "
                                             f"{before} -> {now_counts}")
                    last[ex.address] = now_counts
                    mon.counters.append((now, ex.address, *now_counts))
            except grpc.aio.AioRpcError as exc:
                mon.down.append(f"{now:.0f}: Stats failed: {exc.code().name} {exc.details()}")
            try:
                await asyncio.wait_for(stop.wait(), STATS_EVERY_S)
            except TimeoutError:
                pass


async def measure(fleet: Fleet, args, names: list[str], key_of: list[str], all_specs,
                  shapes: ModelShapes, prompts: list[list[int]], checked: list[int]) -> dict:
    print(f"pushing {len(names)} adapters through the store to S3 ...", flush=True)
    push_s, push_bytes = await push_all(fleet, names, all_specs, shapes, key_of)
    print(f"pushed in {push_s:.1f} s; gateway ...", flush=True)
    gateway = await asyncio.to_thread(start_gateway, {demo.MODEL_ID: [fleet.scheduler]},
                                      fleet.stores, fleet.log_dir, fleet.keys)
    mon, stop = Monitor(), asyncio.Event()
    try:
        watcher = asyncio.create_task(monitor(fleet, mon, stop))
        print(f"churn: {args.duration_s:.0f} s, {CLIENTS} clients + a checker ...", flush=True)
        start = time.time()
        done = await traffic(gateway.announced["gateway-http"], names, key_of, prompts, checked,
                             args.duration_s)
        end = time.time()
        await asyncio.sleep(RSS_EVERY_S)  # (one sample after the traffic)
        stop.set()
        await watcher
        print("traffic over; waiting for the pool to settle ...", flush=True)
        problems, executors, settle_s = await leaks(fleet)
    finally:
        gateway.stop()
    return dict(done=done, mon=mon, start=start, end=end, push_s=push_s, push_mb=push_bytes / 1e6,
                leaks=problems, executors=executors, settle_s=settle_s)


def check_answers(done: list[Completion], expected: dict[tuple[int, int], str]):
    """(answers compared with HF, wrong ones, (adapter, prompt) pairs whose answers differ)."""
    ok = [c for c in done if not c.error]
    wrong = [c for c in ok if c.num_tokens != MAX_TOKENS
             or ((c.adapter, c.prompt) in expected and c.text != expected[c.adapter, c.prompt])]
    texts: dict[tuple[int, int], Counter] = defaultdict(Counter)
    for c in ok:
        texts[c.adapter, c.prompt][c.text] += 1
    differ = {pair: n for pair, n in texts.items() if len(n) > 1}
    return sum((c.adapter, c.prompt) in expected for c in ok), wrong, differ






def report(r: dict, args, num_kv_blocks: int, pages: int, checked: int, wrong, differ,
           failures: list[str], extra: list[str], load: tuple[float, float]) -> str:
    done, mon, elapsed = r["done"], r["mon"], r["end"] - r["start"]
    zipf = [c for c in done if not c.is_check and not c.error]
    steps, loads, hits = counter_delta(mon, r["start"], r["end"], STATS_EVERY_S)
    rss_lines, rss = rss_summary(mon.rss, r["start"], r["end"])
    return "\n".join([
        (f"{args.adapters} adapters (rank 8/16/64 at 70/20/10%; all projections, attention only "
         f"or MLP only, a third each; {NUM_TENANTS} owner tenants) pushed through one adapter "
         f"store (`{' '.join(STORE)}`) to SeaweedFS S3; {CLIENTS} closed-loop clients through "
         f"the gateway's OpenAI API (streamed /v1/completions, greedy, {MAX_TOKENS} tokens, EOS "
         f"ignored, {NUM_PROMPTS} prompts), adapters drawn by Zipf(1.0), plus a checker cycling "
         f"over {len(r['checked'])} sampled adapters, for {args.duration_s:.0f} s. Demo model, "
         f"one executor (`{' '.join(r['executor_args'])}`): {num_kv_blocks} KV blocks, of which "
         f"{int(BLOCK_SHARE * pages)} = {BLOCK_SHARE:.0%} of all adapters' {pages} pages."), "",
        "| figure | value |", "|---|---:|",
        f"| push | {args.adapters} adapters, {r['push_mb']:.0f} MB in {r['push_s']:.0f} s: "
        f"{args.adapters / r['push_s']:.1f} adapters/s, {r['push_mb'] / r['push_s']:.1f} MB/s |",
        f"| completions | {len(done)} ({len(done) / elapsed:.1f}/s), "
        f"{sum(bool(c.error) for c in done)} failed |",
        f"| admissions that found the adapter resident (Stats hits / (hits + loads)) | "
        f"{hits / max(1, hits + loads):.1%} ({hits} hits, {loads} loads) |",
        f"| adapter loads (executor log, whole run) | {r['num_loaded']} |",
        f"| Zipf requests that waited for a load of their adapter | "
        f"{sum(c.is_cold for c in zipf)} of {len(zipf)} |",
        f"| steps | {steps} |",
        f"| answers compared with HF + PEFT / wrong | {checked} / {len(wrong)} |",
        f"| (adapter, prompt) pairs answered differently | {len(differ)} of "
        f"{len({(c.adapter, c.prompt) for c in done if not c.error})} |",
        f"| executor seen down / scheduler logged it unreachable | {len(mon.down)} / "
        f"{r['unreachable']} |",
        f"| Stats counters monotonic ({mon.num_polls} polls) | "
        f"{'yes' if not mon.backwards else 'NO: ' + '; '.join(mon.backwards[:2])} |",
        f"| pool settled after the traffic (no slot loading, queues empty) | "
        f"{'yes' if not r['leaks'] else 'NO: ' + '; '.join(r['leaks'][:3])} "
        f"({r['settle_s']:.1f} s) |", "",
        *ttft_rows(zipf), "", *rss_lines, "",
        (f"- executor RSS: {rss.get('first', 0):.0f} MiB as traffic began, "
         f"{rss.get('end', 0):.0f} at its end; last half slope "
         f"{rss.get('slope_mib_min', 0):+.1f} MiB/min" if rss else "- executor RSS: no samples"),
        f"- RSS each minute (s from the traffic's start, MiB): {rss_timeline(mon.rss, r['start'])}",
        *extra, *(f"  - {line}" for line in r["executors"]),
        *(f"- FAILED: {f}" for f in failures),
        f"- result: {'PASS' if not failures else 'FAIL'}",
        (f"- machine: nproc {len(os.sched_getaffinity(0))}, 1-min load average {load[0]:.1f} at "
         f"start, {load[1]:.1f} at the end; torch {importlib.metadata.version('torch')}, python "
         f"{sys.version.split()[0]}; speeds on shared cores are noisy"),
        f"- code: {revision(REPO)}", f"- command: `{r['command']}`", ""])


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="100 adapters, 60 s, writes no file")
    p.add_argument("--adapters", type=int, help="how many adapters (1000; 100 with --quick)")
    p.add_argument("--duration-s", type=float, help="traffic length (600; 60 with --quick)")
    p.add_argument("--threads", type=int, default=1, help="the executor's torch threads")
    p.add_argument("--heap-probe", action="store_true",
                   help="measure what the executor's heap holds (bench/soak_probe.py)")
    p.add_argument("--heap-interval-s", type=float, default=30.0)
    p.add_argument("--tracemalloc", action="store_true",
                   help="with --heap-probe: trace the executor's Python allocations (slow)")
    p.add_argument("--tensors", action="store_true",
                   help="with --heap-probe: list the executor's live tensors (through the garbage "
                        "collector: see soak_probe.tensor_census)")
    p.add_argument("--malloc-arena-max", type=int,
                   help="MALLOC_ARENA_MAX for every service (glibc: at most this many arenas)")
    p.add_argument("--out", nargs="?", const=str(RESULTS), metavar="PATH",
                   help=f"also write the report here ({RESULTS.relative_to(REPO)})")
    args = p.parse_args()
    args.adapters = args.adapters or (100 if args.quick else 1000)
    args.duration_s = args.duration_s or (60.0 if args.quick else 600.0)
    return args




def main() -> None:
    import torch
    from transformers import AutoTokenizer

    args = parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # clean up as on Ctrl-C
    load_start = os.getloadavg()[0]
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="loraplex-churn-"))
    model_dir, shapes = demo.MODEL_DIR, ModelShapes.read(demo.MODEL_DIR)
    all_specs = specs(args.adapters)
    names = [s.name for s in all_specs]
    keys = FleetKeys(tenants={os.urandom(16).hex(): f"t{i}" for i in range(NUM_TENANTS)})
    key_of_tenant = {tenant: key for key, tenant in keys.tenants.items()}
    key_of = [key_of_tenant[f"t{k % NUM_TENANTS}"] for k in range(args.adapters)]
    pages = sum(map(shapes.pages, all_specs))
    num_kv_blocks = int(BLOCK_SHARE * pages) + CLIENTS * 4
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(NUM_PROMPTS, vocab)
    chosen = sample(all_specs, NUM_SAMPLED)
    print(f"logs: {log_dir}\nHF + PEFT references for {len(chosen)} adapters ...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    expected = {pair: tokenizer.decode(ids, skip_special_tokens=True) for pair, ids in
                hf_references(model_dir, demo.MODEL_ID, chosen, prompts, MAX_TOKENS,
                              log_dir / "sampled").items() if pair[0] >= 0}
    heap_out = log_dir / "heap.jsonl"
    os.environ.update(probe_env(log_dir / "probe", heap_out if args.heap_probe else None,
                                args.heap_interval_s, args.tracemalloc, args.tensors))
    if args.malloc_arena_max:
        os.environ["MALLOC_ARENA_MAX"] = str(args.malloc_arena_max)
    executor_args = ["--threads", str(args.threads), "--adapter-slots", str(ADAPTER_SLOTS),
                     "--max-rank", "64", "--kv-blocks", str(num_kv_blocks)]
    with seaweed().start(bucket="loraplex-churn") as s3:
        fleet = Fleet(model=str(model_dir), store_url=f"s3://{s3.bucket}/churn", log_dir=log_dir,
                      keys=keys, store_args=["--s3-endpoint-url", s3.endpoint_url, *STORE],
                      executor_args=executor_args)
        with fleet:
            result = run(lambda: measure(fleet, args, names, key_of, all_specs, shapes, prompts,
                                         [s.index for s in chosen]))
            if args.heap_probe:
                heap_out.with_suffix(heap_out.suffix + ".trim").touch()
                time.sleep(3.0)  # (the probe looks for it every second)
    result.update(checked=chosen, executor_args=executor_args,
                  command=" ".join([".venv/bin/python bench/soak_churn.py", *sys.argv[1:]]),
                  unreachable=(log_dir / "scheduler.log").read_text().count(" unreachable: "),
                  num_loaded=mark_cold(result["done"], log_dir / "executor-0.log", names))
    checked, wrong, differ = check_answers(result["done"], expected)
    errors = log_errors(log_dir)
    failures = judge(result, wrong, differ, checked, errors)
    heap = heap_table(read(heap_out), result["start"], result["end"]) if args.heap_probe else []
    extra = ["", *heap,
             f"- WARNING lines per service log: {warnings_of(log_dir) or 'none'}",
             f"- logs: {log_dir}"]
    text = report(result, args, num_kv_blocks, pages, checked, wrong, differ, failures, extra,
                  (load_start, os.getloadavg()[0]))
    print(f"\n{text}")
    if args.out:
        out = pathlib.Path(args.out)
        out.write_text(f"# Churn soak on CPU: {args.adapters} adapters, real S3, Zipf traffic "
                       f"through the gateway\n\n{text}")
        print(f"wrote {out}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
