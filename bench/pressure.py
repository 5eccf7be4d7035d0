"""Adapters under memory pressure (issue 47): 64 distinct adapters whose pages share 1,024 KV
blocks with the requests' KV, two schedulers side by side, their rounds alternating.

    .venv/bin/python bench/pressure.py --old-root /tmp/old [--rounds 5] [--requests 64]

`--old-root` is a checkout of the code to compare with (`git worktree add /tmp/old <commit>`,
its .venv and .fixtures linked to this one's). One adapter store and two CPU executors run its
code (the same code on both sides), with 1,024 blocks each (the adapters' pages: 19 per rank-16
adapter, 64 of them 1,216: they cannot all stay beside the KV); one scheduler runs its code, the
other this checkout's. A round sends every request at once (request i on adapter a{i mod 64},
prompts 8-24 tokens, 32 greedy tokens, EOS ignored) to one scheduler, then the other, and reads
each scheduler's Stats before and after: the adapter loads, early evictions (adapters evicted
before they served anyone since their load; counted by schedulers that have
ExecutorStats.adapter_early_evictions) and steps of the round. One untimed round each first.
`--kv-blocks 2560` runs the same work without pressure (every adapter fits beside the KV).
Results: bench/results/pressure-cpu.md (with --write).

Run it with this checkout first on the path (`PYTHONPATH=.`) when the virtual environment's
editable install points at another checkout: the script itself reads Stats with this checkout's
protos.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
from serving import MAX_NEW_TOKENS, adapter_names, machine_line, make_adapters, make_prompts, pct

from common.server import insecure_channel, run
from loraplex import client, fixtures
from loraplex.launch import ServiceProcess, start_service
from protos import scheduler_pb2, scheduler_pb2_grpc

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "pressure-cpu.md"
NUM_ADAPTERS = 64
KV_BLOCKS = 1024


@dataclass
class Side:
    """One scheduler under test and what its rounds measured."""

    name: str
    address: str
    timings: pathlib.Path  # its --timings-out
    rounds: list[dict] = field(default_factory=list)


def start(root: pathlib.Path, name: str, module: str, args: list[str],
          log_dir: pathlib.Path) -> ServiceProcess:
    """A service of the code at `root` (`python -m` finds its packages in the working folder)."""
    with contextlib.chdir(root):
        return start_service(name, module, args, log_dir)


async def counters(stub) -> tuple[int, int, int]:
    """(adapter loads, early evictions, steps) of the scheduler's executors so far."""
    stats = await stub.Stats(scheduler_pb2.StatsRequest())
    return (sum(e.adapter_loads for e in stats.executors),
            sum(e.adapter_early_evictions for e in stats.executors),
            sum(e.steps for e in stats.executors))


def steps_between(timings: pathlib.Path, start: float, end: float) -> list[dict]:
    """The scheduler's timing lines of the steps it was done with between `start` and `end`."""
    lines = [json.loads(line) for line in timings.read_text().splitlines()]
    return [r for r in lines if "step" in r and start <= r["at"] <= end]


async def one_round(stub, prompts: list[list[int]], names: list[str],
                    timings: pathlib.Path) -> dict:
    before = await counters(stub)
    start, began = time.time(), time.perf_counter()
    gens = await asyncio.gather(*(
        client.generate(stub, client.generate_request(n, p, MAX_NEW_TOKENS, ignore_eos=True))
        for p, n in zip(prompts, names)))
    seconds = time.perf_counter() - began
    after = await counters(stub)
    ttfts = [g.ttft_seconds for g in gens]
    steps = steps_between(timings, start, time.time())
    return {"seconds": seconds, "tok_s": sum(len(g.token_ids) for g in gens) / seconds,
            "ttft_p50": pct(ttfts, 50), "ttft_p99": pct(ttfts, 99),
            "loads": after[0] - before[0], "early": after[1] - before[1],
            "steps": after[2] - before[2], "tokens": [g.token_ids for g in gens],
            "compute": sum(r["seconds"] for r in steps),
            "shapes": [(r["tokens"], r["adapters"]) for r in steps]}


async def measure(sides: list[Side], prompts: list[list[int]], rounds: int) -> None:
    names = adapter_names(len(prompts), NUM_ADAPTERS)
    async with contextlib.AsyncExitStack() as stack:
        stubs = []
        for side in sides:
            channel = await stack.enter_async_context(insecure_channel(side.address))
            stubs.append(scheduler_pb2_grpc.SchedulerStub(channel))
        for side, stub in zip(sides, stubs):  # untimed: every adapter staged and loaded once
            await one_round(stub, prompts, names, side.timings)
        for _ in range(rounds):
            for side, stub in zip(sides, stubs):
                side.rounds.append(await one_round(stub, prompts, names, side.timings))


def median(side: Side, key: str) -> float:
    return statistics.median(r[key] for r in side.rounds)


def report(sides: list[Side], args, load: float, old_commit: str) -> str:
    old, new = sides
    rows = [("| scheduler | tok/s | TTFT p50 (ms) | TTFT p99 (ms) | adapter loads per round | "
             "early evictions per round | steps per round | executor compute per round (s) |"),
            "|:---|---:|---:|---:|---:|---:|---:|---:|"]
    for side in sides:
        early = f"{median(side, 'early'):.0f}" if side is new else "(not counted)"
        rows.append(f"| {side.name} | {median(side, 'tok_s'):.0f} | "
                    f"{median(side, 'ttft_p50') * 1e3:.0f} | {median(side, 'ttft_p99') * 1e3:.0f} "
                    f"| {median(side, 'loads'):.0f} | {early} | {median(side, 'steps'):.0f} "
                    f"| {median(side, 'compute'):.2f} |")
    same = sum(a == b for r_old, r_new in zip(old.rounds, new.rounds)
               for a, b in zip(r_old["tokens"], r_new["tokens"]))
    total = sum(len(r["tokens"]) for r in new.rounds)
    per_round = [f"{s.name}: " + ", ".join(f"{r['loads']} loads / {r['steps']} steps / "
                                           f"{r['tok_s']:.0f} tok/s" for r in s.rounds)
                 for s in sides]
    ratio = median(new, "tok_s") / median(old, "tok_s")
    command = " ".join([".venv/bin/python bench/pressure.py", *sys.argv[1:]])
    return "\n".join([
        (f"{args.requests} requests sent at once to one scheduler, then the same to the other, "
         f"{args.rounds} alternating rounds after an untimed one each; request i on adapter "
         f"a{{i mod {NUM_ADAPTERS}}} ({NUM_ADAPTERS} distinct, rank 16 on all 7 projections: "
         f"19 pages each); prompts 8-24 tokens, {MAX_NEW_TOKENS} greedy tokens each, EOS "
         f"ignored; tiny LLaMA (4 layers, hidden 256), float32, one CPU executor per scheduler "
         f"with {args.kv_blocks} blocks for KV and adapters' pages alike (the executors and the "
         "store run the old commit's code: only the scheduler differs). Medians over the "
         "rounds."),
        "", *rows, "",
        f"- new / old tok/s: {ratio:.2f}",
        f"- every request's tokens equal between the two schedulers, round by round: "
        f"{same}/{total}",
        "- per round: " + "; ".join(per_round),
        f"- old: commit {old_commit}; new: this commit's scheduler",
        machine_line(load), f"- command: `{command}`",
        ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old-root", type=pathlib.Path, required=True,
                        help="a checkout of the code to compare with (its stores and executors "
                             "serve both sides)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--kv-blocks", type=int, default=KV_BLOCKS,
                        help="each executor's blocks (2,560 hold every adapter beside the KV: "
                             "the same work without pressure)")
    parser.add_argument("--write", action="store_true", help=f"write {RESULTS.name}")
    parser.add_argument("--shapes", action="store_true",
                        help="print each side's last round, step by step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    old_root = args.old_root.resolve()
    old_commit = os.popen(f"git -C {old_root} rev-parse --short HEAD").read().strip()
    load = os.getloadavg()[0]
    manifest = fixtures.ensure(REPO / ".fixtures")
    with tempfile.TemporaryDirectory(prefix="loraplex-pressure-") as tmp_name:
        tmp = pathlib.Path(tmp_name)
        print(f"making {NUM_ADAPTERS} adapters with peft ...", flush=True)
        model = make_adapters(manifest["model_dir"], manifest["model_id"], NUM_ADAPTERS,
                              tmp / "adapters")
        prompts = make_prompts(args.requests, model.config.vocab_size)
        del model
        services: list[ServiceProcess] = []
        try:
            store = start(old_root, "store", "adapter_store.service",
                          ["--url", (tmp / "store").as_uri(), "--address", "127.0.0.1:0"],
                          tmp / "logs")
            services.append(store)
            sides = []
            for name, root in (("old", old_root), ("new", REPO)):
                executor = start(old_root, f"executor-{name}", "executor.service",
                                 ["--model", manifest["model_dir"], "--address", "127.0.0.1:0",
                                  "--store", store.address, "--adapter-slots",
                                  str(NUM_ADAPTERS), "--max-rank", "32", "--kv-blocks",
                                  str(args.kv_blocks), "--threads", "1"], tmp / "logs")
                services.append(executor)
                scheduler = start(root, f"scheduler-{name}", "scheduler.service",
                                  ["--address", "127.0.0.1:0", "--store", store.address,
                                   "--executor", executor.address, "--max-num-seqs",
                                   str(args.requests), "--timings-out",
                                   str(tmp / f"timings-{name}.jsonl")], tmp / "logs")
                services.append(scheduler)
                sides.append(Side(name, scheduler.address, tmp / f"timings-{name}.jsonl"))
            for i in range(NUM_ADAPTERS):
                run(lambda i=i: client.push_adapter(store.address, tmp / "adapters" / f"a{i}",
                                                    f"a{i}"))
            print(f"{args.rounds} alternating rounds ...", flush=True)
            run(lambda: measure(sides, prompts, args.rounds))
        finally:
            for service in reversed(services):
                service.stop()
    text = report(sides, args, load, old_commit)
    if args.shapes:
        for side in sides:
            print(f"{side.name}'s last round, (tokens, adapters) per step:",
                  side.rounds[-1]["shapes"])
    print("\n" + text)
    if args.write:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text("# Adapters under memory pressure on CPU: old vs new scheduler\n\n"
                           + text)
        print(f"wrote {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
