"""Prefix caching on CPU: a shared 512-token system prompt, then short user turns.

    .venv/bin/python bench/prefix_cache.py [--quick]

8 tenants x 4 adapters (rank 16 on all 7 projections, public, made with peft): 32 clients, one
per (tenant, adapter), each sending TURNS requests one after another: the system prompt, then a
user turn of 8-40 random tokens, 16 greedy new tokens. Two pools of the three services run side
by side on the same model, one with the scheduler's --prefix-cache tenant (the default: a tenant
reuses its own blocks) and one with --prefix-cache off; rounds alternate between them (the CPUs
are shared: a burst of other work hits both) and each reports its median round by wall time:
TTFT p50 / p99, generated tokens/s, and the prefix hit rate of that round's prompt tokens (from
the tenants' cached prompt tokens in Stats). Before timing, each pool answers one request per
(tenant, adapter): its adapters are loaded and, in the cached pool, each tenant's system prompt
is cached for each adapter; the turns in the timed rounds are new. The full run writes
bench/results/prefix-cache-cpu.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import random
import sys
import tempfile
import time

import torch
from serving import machine_line, make_adapters, median_round, pct

from common.server import insecure_channel, run
from loraplex import client, fixtures
from loraplex.launch import Fleet, FleetKeys
from protos import scheduler_pb2, scheduler_pb2_grpc

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "prefix-cache-cpu.md"
SYSTEM_TOKENS, NEW_TOKENS = 512, 16
NUM_TENANTS, NUM_ADAPTERS = 8, 4
KEYS = {f"bench-tenant-key-{t:04d}": f"tenant{t}" for t in range(NUM_TENANTS)}


def turns(rng: random.Random, vocab: int, n: int) -> list[list[int]]:
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(8, 40))] for _ in range(n)]


async def one_round(stub, system: list[int], rng: random.Random, vocab: int,
                    num_turns: int) -> tuple[float, list[client.Generation]]:
    """32 clients, each num_turns requests in a row; (seconds, every Generation)."""

    async def conversation(key: str, adapter: str) -> list[client.Generation]:
        out = []  # (its turns are drawn before its first wait: the same in every pool)
        for turn in turns(rng, vocab, num_turns):
            req = client.generate_request(adapter, system + turn, NEW_TOKENS, ignore_eos=True)
            out.append(await client.generate(stub, req, key))
        return out

    start = time.perf_counter()
    convs = await asyncio.gather(*(conversation(key, f"a{i}") for key in KEYS
                                   for i in range(NUM_ADAPTERS)))
    return time.perf_counter() - start, [g for conv in convs for g in conv]


async def cached_and_prompt_tokens(stub, admin_key: str) -> tuple[int, int]:
    stats = await stub.Stats(scheduler_pb2.StatsRequest(), metadata=client.metadata(admin_key))
    return (sum(t.cached_prompt_tokens for t in stats.tenants),
            sum(t.prompt_tokens for t in stats.tenants))


async def measure(fleets: dict[str, Fleet], adapter_dir: pathlib.Path, vocab: int, rounds: int,
                  num_turns: int) -> dict[str, list[tuple]]:
    system = [random.Random(0).randrange(2, vocab) for _ in range(SYSTEM_TOKENS)]
    results: dict[str, list[tuple]] = {name: [] for name in fleets}
    channels = {name: insecure_channel(f.scheduler) for name, f in fleets.items()}
    try:
        stubs = {name: scheduler_pb2_grpc.SchedulerStub(ch) for name, ch in channels.items()}
        for name, fleet in fleets.items():
            for i in range(NUM_ADAPTERS):
                await client.push_adapter(fleet.stores[0], adapter_dir / f"a{i}", f"a{i}",
                                          key=fleet.keys.admin)
            await one_round(stubs[name], system, random.Random(1), vocab, 1)  # warm-up
        for r in range(rounds):
            for name, fleet in fleets.items():
                before = await cached_and_prompt_tokens(stubs[name], fleet.keys.admin)
                seconds, gens = await one_round(stubs[name], system, random.Random(100 + r),
                                                vocab, num_turns)
                after = await cached_and_prompt_tokens(stubs[name], fleet.keys.admin)
                hit = (after[0] - before[0]) / max(after[1] - before[1], 1)
                results[name].append((seconds, gens, hit))
    finally:
        for ch in channels.values():
            await ch.close()
    return results


def report(results: dict[str, list[tuple]], rounds: int, num_turns: int, threads: int,
           load: float, command: str) -> str:
    lines = ["| prefix cache | TTFT p50 (ms) | TTFT p99 (ms) | generated tok/s | requests/s "
             "| prefix hit rate |", "|---|---:|---:|---:|---:|---:|"]
    p50 = {}
    for name, rs in results.items():
        seconds, gens, hit = median_round(rs)
        ttfts = [g.ttft_seconds for g in gens]
        p50[name] = pct(ttfts, 50)
        lines.append(f"| {name} | {p50[name] * 1e3:.0f} | {pct(ttfts, 99) * 1e3:.0f} | "
                     f"{sum(len(g.token_ids) for g in gens) / seconds:.0f} | "
                     f"{len(gens) / seconds:.1f} | {hit:.1%} |")
    pairs = [(a, b) for ra, rb in zip(results["tenant"], results["off"])
             for a, b in zip(ra[1], rb[1])]  # the same turns went to both pools, round by round
    same = sum(a.token_ids == b.token_ids for a, b in pairs)
    return "\n".join([
        (f"{NUM_TENANTS} tenants x {NUM_ADAPTERS} adapters = {NUM_TENANTS * NUM_ADAPTERS} "
         f"clients, each {num_turns} requests in a row: a {SYSTEM_TOKENS}-token system prompt + "
         f"a user turn of 8-40 tokens, {NEW_TOKENS} greedy new tokens; median of {rounds} "
         "rounds per pool, the pools' rounds alternating; tiny LLaMA (4 layers, hidden 256), "
         f"float32, CPU, {threads} torch thread(s) per executor, block size 16."),
        "", *lines, "",
        f"TTFT p50, cached / off: {p50['off'] / p50['tenant']:.1f}x better with the cache.",
        "",
        f"- requests whose greedy tokens are the same in both pools: {same}/{len(pairs)}",
        machine_line(load), f"- command: `{command}`", ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 round of 1 turn; writes no file")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rounds, num_turns = (1, 1) if args.quick else (3, 3)
    load = os.getloadavg()[0]
    manifest = fixtures.ensure(REPO / ".fixtures")
    with tempfile.TemporaryDirectory(prefix="loraplex-prefix-") as tmp_name:
        tmp = pathlib.Path(tmp_name)
        print(f"making {NUM_ADAPTERS} adapters with peft ...", flush=True)
        model = make_adapters(manifest["model_dir"], manifest["model_id"], NUM_ADAPTERS,
                              tmp / "adapters")
        fleets = {
            scope: Fleet(model=manifest["model_dir"], store_url=(tmp / f"store-{scope}").as_uri(),
                         log_dir=tmp / f"logs-{scope}", keys=FleetKeys(tenants=KEYS),
                         executor_args=["--adapter-slots", str(NUM_ADAPTERS), "--max-rank", "16",
                                        "--kv-blocks", "4096", "--block-size", "16",
                                        "--threads", str(args.threads)],
                         scheduler_args=["--prefix-cache", scope, "--max-num-seqs", "64"])
            for scope in ("tenant", "off")}
        print(f"starting two pools; {rounds} rounds each, alternating ...", flush=True)
        with fleets["tenant"], fleets["off"]:
            results = run(lambda: measure(fleets, tmp / "adapters", model.config.vocab_size,
                                          rounds, num_turns))
    command = " ".join([".venv/bin/python bench/prefix_cache.py", *sys.argv[1:]])
    text = report(results, rounds, num_turns, args.threads, load, command)
    print("\n" + text)
    if not args.quick:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text("# Prefix caching on CPU: shared system prompt, short turns\n\n" + text)
        print(f"wrote {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
