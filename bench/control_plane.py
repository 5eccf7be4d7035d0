"""The control plane alone: what a scheduler and a gateway cost per streamed token, with benchmark
executors (--benchmark-step-s: no forward pass, made-up tokens, fixed step time).

    .venv/bin/python bench/control_plane.py [--quick] [--step-s 0.02] [--window-s 8]

For E in 1, 2, 4, 8 executors (one pool: a store on local files, E benchmark executors on random
tiny weights, one scheduler, a gateway in front) and R in 64, 256 rows per executor step: E x R
closed-loop streams through the gateway's gRPC Generate (one tenant, base model, 3-token prompts,
256 new tokens, EOS ignored; a stream that ends is replaced at once), from this one client process.
Measured over a window after a warm-up: tokens/s the scheduler scheduled and tokens/s delivered to
the clients, the scheduler's CPU microseconds per scheduled token and the gateway's per delivered
token (/proc utime + stime), and the p99 inter-token latency (gap between a token's arrival and the
previous one's in its stream). Every process shares this machine's CPUs (the client included): read
ratios of one run, and expect the client to bound throughput at high stream counts. Writes
bench/results/control-plane-cpu.md unless --quick.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

from common.server import insecure_channel, run
from loraplex import client
from loraplex.launch import Fleet, FleetKeys, start_gateway
from protos import scheduler_pb2_grpc

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "control-plane-cpu.md"
KEY = "control-plane-bench-tenant-key-01"
NEW_TOKENS = 256
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


async def measure(gateway: str, pids: dict[str, int], streams: int, warmup_s: float,
                  window_s: float) -> dict[str, float]:
    """`streams` closed-loop streams; figures over the window after the warm-up."""
    arrivals: list[float] = []
    gaps: list[float] = []
    stop = time.perf_counter() + warmup_s + window_s
    async with insecure_channel(gateway) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        metadata = client.metadata(KEY)

        async def loop(i: int) -> None:
            while time.perf_counter() < stop:
                req = client.generate_request("", [3, 4, 5 + i % 100], NEW_TOKENS,
                                              ignore_eos=True)
                last = None
                async for message in stub.Generate(req, metadata=metadata, timeout=120):
                    now = time.perf_counter()
                    if message.HasField("token_id"):
                        arrivals.append(now)
                        if last is not None:
                            gaps.append(now - last)
                        last = now
                    if now >= stop:
                        return

        tasks = [asyncio.create_task(loop(i)) for i in range(streams)]
        await asyncio.sleep(warmup_s)
        start, cpu = time.perf_counter(), {name: cpu_seconds(pid) for name, pid in pids.items()}
        wall_start = time.time()
        first_gap = len(gaps)
        await asyncio.sleep(window_s)
        end, used = time.perf_counter(), {n: cpu_seconds(p) - cpu[n] for n, p in pids.items()}
        wall_end = time.time()
        window_gaps = gaps[first_gap:]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    tokens = sum(1 for t in arrivals if start <= t < end)
    p99 = statistics.quantiles(window_gaps, n=100)[98] if len(window_gaps) > 100 else float("nan")
    return {"tokens/s": tokens / (end - start), "window": (wall_start, wall_end),
            "cpu": used, "delivered": tokens, "ITL p99 ms": 1e3 * p99}


def scheduled_tokens(timings: pathlib.Path, window: tuple[float, float]) -> int:
    """Tokens of the steps the scheduler finished within `window` (its --timings-out lines)."""
    total = 0
    for line in timings.read_text().splitlines():
        record = json.loads(line)
        if "step" in record and window[0] <= record["at"] < window[1]:
            total += record["tokens"]
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 and 2 executors, 64 rows")
    parser.add_argument("--step-s", type=float, default=0.02, help="benchmark step time")
    parser.add_argument("--window-s", type=float, default=8.0)
    args = parser.parse_args()
    counts, rows = ([1, 2], [64]) if args.quick else ([1, 2, 4, 8], [64, 256])
    load = os.getloadavg()[0]
    results = []
    keys = FleetKeys(tenants={KEY: "bench"})
    with tempfile.TemporaryDirectory(prefix="loraplex-control-") as tmp_name:
        tmp = pathlib.Path(tmp_name)
        for n in counts:
            fleet = Fleet(model="random:tiny", store_url=(tmp / f"store{n}").as_uri(),
                          log_dir=tmp / f"logs{n}", num_executors=n, keys=keys,
                          executor_args=["--benchmark-step-s", str(args.step_s), "--kv-blocks",
                                         str(max(rows) * 20), "--adapter-slots", "1",
                                         "--max-rank", "8", "--threads", "1"],
                          scheduler_args=["--max-num-seqs", str(max(rows)),
                                          "--max-queued-per-tenant", "0",
                                          "--timings-out", str(tmp / f"timings{n}.jsonl")])
            with fleet:
                gateway = start_gateway({"tiny": [fleet.scheduler]}, fleet.stores,
                                        tmp / f"logs{n}", keys)
                try:
                    pids = {"scheduler": next(s.process.pid for s in fleet.services
                                              if s.name == "scheduler"),
                            "gateway": gateway.process.pid}
                    for r in rows:
                        print(f"{n} executor(s) x {r} rows ...", flush=True)
                        figures = run(lambda: measure(gateway.address, pids, n * r, 3.0,
                                                      args.window_s))
                        results.append((n, r, figures))
                finally:
                    gateway.stop()
            for m, r, figures in results:  # (the log is complete once the scheduler stopped)
                if m == n:
                    figures["scheduled"] = scheduled_tokens(tmp / f"timings{n}.jsonl",
                                                            figures["window"])
    header = ["executors", "rows per step", "streams", "tokens/s scheduled", "ideal",
              "tokens/s delivered", "scheduler us/token scheduled",
              "gateway us/token delivered", "ITL p99 ms"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for n, r, f in results:
        seconds = f["window"][1] - f["window"][0]
        lines.append(f"| {n} | {r} | {n * r} | {f['scheduled'] / seconds:,.0f} "
                     f"| {n * r / args.step_s:,.0f} | {f['tokens/s']:,.0f} "
                     f"| {1e6 * f['cpu']['scheduler'] / max(f['scheduled'], 1):.0f} "
                     f"| {1e6 * f['cpu']['gateway'] / max(f['delivered'], 1):.0f} "
                     f"| {f['ITL p99 ms']:.0f} |")
    command = " ".join([".venv/bin/python bench/control_plane.py", *sys.argv[1:]])
    text = "\n".join([
        (f"Benchmark executors (--benchmark-step-s {args.step_s}: no forward pass), closed-loop "
         f"gRPC streams through the gateway from one client process, {NEW_TOKENS} new tokens "
         f"each; {args.window_s:g} s measured after a 3 s warm-up. 'scheduled': tokens of the "
         "steps the scheduler completed in the window (its --timings-out log; 256 generated per "
         "3 prompt tokens), the scheduler's CPU divided by them; 'delivered': tokens that reached "
         "the client, the gateway's CPU divided by them (when the gateway or the client cannot "
         "keep up, tokens wait in buffers and delivered < scheduled); 'ideal' = every stream gets "
         "a token every step."),
        "", *lines, "",
        (f"- machine: nproc {len(os.sched_getaffinity(0))}, python {sys.version.split()[0]}, "
         f"1-min load average at start {load:.1f}; the client, the scheduler, the gateway and "
         "the executors share these CPUs"),
        f"- command: `{command}`", ""])
    print("\n" + text)
    if not args.quick:
        RESULTS.write_text("# The control plane alone: CPU per streamed token\n\n" + text)
        print(f"wrote {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
