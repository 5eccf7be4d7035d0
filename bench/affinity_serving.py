"""Slot pressure on the real services (CPU, tiny model): admission by load alone vs affinity
batching vs the anti-starvation rule, with more adapters wanted than slots.

    .venv/bin/python bench/affinity_serving.py [--quick] [--rounds N]

One pool of the three services per policy (bench/affinity.py names them), side by side on the
same model and one shared store: an executor with ADAPTER_SLOTS slots for NUM_ADAPTERS adapters
(rank 16 on all 7 projections, made with peft), a scheduler with that policy's
--affinity-max-wait-s and --starvation-wait-s. A round sends NUM_REQUESTS requests open-loop at
drawn Poisson times (RATE_PER_S): adapter k with Zipf(1) popularity, owned by tenant k mod
NUM_TENANTS (weighted by its share of the requests, as in the simulator), prompts of 8-24
random tokens, NEW_TOKENS greedy tokens. Every pool gets the same requests at the same times;
rounds alternate between the pools (their order rotating, since these CPUs are shared), and each
pool reports the medians over its rounds of: generated tokens/s (and its ratio to load alone's
on the same round), TTFT mean / p99 / max (the longest wait of any request: starvation), adapter
loads. The full run writes bench/results/affinity-serving-cpu.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import random
import statistics
import sys
import tempfile
import time

import torch
from serving import machine_line, make_adapters, pct

from common.server import insecure_channel, run
from loraplex import client, fixtures
from loraplex.launch import Fleet, FleetKeys
from protos import scheduler_pb2, scheduler_pb2_grpc

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "affinity-serving-cpu.md"
NUM_ADAPTERS, ADAPTER_SLOTS, NUM_TENANTS = 32, 4, 4
NUM_REQUESTS, RATE_PER_S, NEW_TOKENS = 256, 32.0, 24
ROUNDS = 7
KEYS = {f"bench-tenant-key-{t:04d}": f"tenant{t}" for t in range(NUM_TENANTS)}
# name -> (--affinity-max-wait-s, --starvation-wait-s)
POLICIES = {"load": (0.0, 0.0), "affinity 2s": (2.0, 0.0), "load +starve 1s": (0.0, 1.0),
            "load +starve 5s": (0.0, 5.0), "affinity 2s +starve 5s": (2.0, 5.0)}


def popularity() -> list[float]:
    return [1.0 / (k + 1) for k in range(NUM_ADAPTERS)]


def tenant_weights() -> list[str]:
    shares = [sum(popularity()[t::NUM_TENANTS]) for t in range(NUM_TENANTS)]
    return [f for t, share in enumerate(shares) for f in ("--tenant-weight", f"tenant{t}={share}")]


def workload(num_requests: int, vocab: int, seed: int) -> list[tuple[float, int, list[int]]]:
    """(send time from the round's start, adapter index, prompt) per request."""
    rng, at, out = random.Random(seed), 0.0, []
    for _ in range(num_requests):
        at += rng.expovariate(RATE_PER_S)
        k = rng.choices(range(NUM_ADAPTERS), weights=popularity())[0]
        out.append((at, k, [rng.randrange(2, vocab) for _ in range(rng.randint(8, 24))]))
    return out


async def one_round(stub, requests: list[tuple[float, int, list[int]]]):
    """Every request at its time; (seconds to the last token, their Generations)."""
    keys = list(KEYS)
    start = time.perf_counter()

    async def send(at: float, k: int, prompt: list[int]) -> client.Generation:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        req = client.generate_request(f"a{k}", prompt, NEW_TOKENS, ignore_eos=True)
        return await client.generate(stub, req, keys[k % NUM_TENANTS])

    gens = await asyncio.gather(*(send(*r) for r in requests))
    return time.perf_counter() - start, gens


async def adapter_loads(stub, admin_key: str) -> int:
    stats = await stub.Stats(scheduler_pb2.StatsRequest(), metadata=client.metadata(admin_key))
    return sum(e.adapter_loads for e in stats.executors)


async def measure(fleets: dict[str, Fleet], adapter_dir: pathlib.Path, vocab: int,
                  rounds: int, num_requests: int) -> dict[str, list[tuple]]:
    """Push the adapters once (the pools share the store), warm each pool up with one round,
    then `rounds` rounds of every pool in turn. Per pool, (seconds, gens, loads) per round."""
    names = list(fleets)
    admin = fleets[names[0]].keys.admin
    for i in range(NUM_ADAPTERS):
        await client.push_adapter(fleets[names[0]].stores[0], adapter_dir / f"a{i}", f"a{i}",
                                  key=admin)
    channels = {name: insecure_channel(f.scheduler) for name, f in fleets.items()}
    results: dict[str, list[tuple]] = {name: [] for name in fleets}
    try:
        stubs = {name: scheduler_pb2_grpc.SchedulerStub(ch) for name, ch in channels.items()}
        for name in names:
            await one_round(stubs[name], workload(num_requests // 4, vocab, seed=1))
        for r in range(rounds):
            requests = workload(num_requests, vocab, seed=100 + r)
            for name in names[r % len(names):] + names[:r % len(names)]:
                before = await adapter_loads(stubs[name], fleets[name].keys.admin)
                seconds, gens = await one_round(stubs[name], requests)
                after = await adapter_loads(stubs[name], fleets[name].keys.admin)
                results[name].append((seconds, gens, after - before))
    finally:
        for ch in channels.values():
            await ch.close()
    return results


def round_numbers(seconds: float, gens: list[client.Generation], loads: int) -> dict[str, float]:
    ttfts = [g.ttft_seconds for g in gens]
    return {"tok_s": sum(len(g.token_ids) for g in gens) / seconds,
            "ttft_mean": statistics.mean(ttfts), "ttft_p99": pct(ttfts, 99),
            "ttft_max": max(ttfts), "loads": loads}


def report(results: dict[str, list[tuple]], rounds: int, num_requests: int, threads: int,
           load: float, command: str) -> str:
    numbers = {name: [round_numbers(*r) for r in rs] for name, rs in results.items()}
    base = numbers["load"]

    def median(name: str, key: str) -> float:
        return statistics.median(n[key] for n in numbers[name])

    lines = ["| policy | generated tok/s | vs load (same round) | TTFT mean (ms) | TTFT p99 (ms) "
             "| longest TTFT (ms) | adapter loads |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, ns in numbers.items():
        ratio = statistics.median(n["tok_s"] / b["tok_s"] for n, b in zip(ns, base))
        lines.append(f"| {name} | {median(name, 'tok_s'):.0f} | {ratio:.3f} | "
                     f"{median(name, 'ttft_mean') * 1e3:.0f} | "
                     f"{median(name, 'ttft_p99') * 1e3:.0f} | "
                     f"{median(name, 'ttft_max') * 1e3:.0f} | {median(name, 'loads'):.0f} |")
    per_round = [f"{name}: " + ", ".join(f"{n['tok_s']:.0f} tok/s {n['ttft_max'] * 1e3:.0f} ms"
                                         for n in ns) for name, ns in numbers.items()]
    return "\n".join([
        (f"{num_requests} requests per round at {RATE_PER_S:g}/s (Poisson, the same times and "
         f"requests in every pool), {NUM_ADAPTERS} adapters (Zipf 1) on {ADAPTER_SLOTS} slots, "
         f"{NUM_TENANTS} tenants weighted by their share; prompts 8-24 tokens, {NEW_TOKENS} "
         f"greedy new tokens (EOS ignored); {rounds} rounds per pool, the pools' rounds "
         "alternating (their order rotating); every column is the median over rounds, the ratio "
         "the median of each round's ratio to load alone's on the same requests; tiny LLaMA (4 "
         f"layers, hidden 256), float32, CPU, {threads} torch thread(s) per executor."),
        "", *lines, "",
        "Each round's generated tok/s and longest TTFT, in round order:", "",
        *[f"- {line}" for line in per_round], "",
        machine_line(load), f"- command: `{command}`", ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="1 round of 64 requests; writes no file")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rounds, num_requests = (1, 64) if args.quick else (args.rounds, NUM_REQUESTS)
    load = os.getloadavg()[0]
    manifest = fixtures.ensure(REPO / ".fixtures")
    with tempfile.TemporaryDirectory(prefix="loraplex-affinity-") as tmp_name:
        tmp = pathlib.Path(tmp_name)
        print(f"making {NUM_ADAPTERS} adapters with peft ...", flush=True)
        model = make_adapters(manifest["model_dir"], manifest["model_id"], NUM_ADAPTERS,
                              tmp / "adapters")
        keys = FleetKeys(tenants=KEYS)
        first = None
        fleets = {}
        for i, (name, (affinity_s, starve_s)) in enumerate(POLICIES.items()):
            fleets[name] = Fleet(
                model=manifest["model_dir"], store_url=(tmp / "store").as_uri(),
                log_dir=tmp / f"logs-{i}", keys=keys,
                store_addresses=first.stores if first else [],
                executor_args=["--adapter-slots", str(ADAPTER_SLOTS), "--max-rank", "16",
                               "--kv-blocks", "2048", "--threads", str(args.threads)],
                scheduler_args=["--max-num-seqs", "64", "--max-queued-per-tenant", "0",
                                "--affinity-max-wait-s", str(affinity_s),
                                "--starvation-wait-s", str(starve_s), *tenant_weights()])
            fleets[name].start()
            first = first or fleets[name]
        try:
            print(f"{len(fleets)} pools up; {rounds} rounds each, alternating ...", flush=True)
            results = run(lambda: measure(fleets, tmp / "adapters", model.config.vocab_size,
                                          rounds, num_requests))
        finally:
            for fleet in reversed(fleets.values()):
                fleet.stop()
    command = " ".join([".venv/bin/python bench/affinity_serving.py", *sys.argv[1:]])
    text = report(results, rounds, num_requests, args.threads, load, command)
    print("\n" + text)
    if not args.quick:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text("# Slot pressure on the real services (CPU): load alone, affinity, "
                           "anti-starvation\n\n" + text)
        print(f"wrote {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
