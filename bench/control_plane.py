"""The control plane alone: what a scheduler and a gateway cost per streamed token, with benchmark
executors (--benchmark-step-s: no forward pass, made-up tokens, fixed step time).

    .venv/bin/python bench/control_plane.py [--quick] [--step-s 0.02] [--window-s 8]
                                            [--only generate]

For E in 1, 2, 4, 8 executors (one pool: a store on local files, E benchmark executors on random
tiny weights, one scheduler, a gateway in front) and R in 64, 256 rows per executor step: E x R
closed-loop streams (one tenant, base model, 3-token prompts, 256 new tokens, EOS ignored; a
stream that ends is replaced at once), from this one client process, measured twice:
- through the gateway's gRPC Generate (a message per token per client): tokens/s the scheduler
  scheduled and tokens/s delivered to the clients, the scheduler's CPU microseconds per scheduled
  token and the gateway's per delivered token;
- straight into the scheduler's Stream, as a gateway calls it (a message per step for all
  requests): tokens/s delivered and the scheduler's CPU microseconds per token. The client then
  costs little, so this is the scheduler's own figure, and how it changes with E.
Then one scheduler's capacity: 8 executors x 256 rows straight into its Stream again, with steps
of --capacity-step-s (10 ms: the rate a faster GPU step asks of the scheduler). Then, at 2
executors x 256 rows, the gateway path again through 1 and 2 gateway replicas (the streams spread
evenly). Last, a client's direct path: straight into the scheduler's Generate, one gRPC stream
per request, as the streaming gRPC client does (loraplex/client.py: a message per token), at 64
and 192 concurrent streams, with the scheduler's CPU microseconds per delivered token. That line
runs the demo model (loraplex/demo_assets: one executor, --threads 1, a real forward pass), so
the scheduler detokenizes every token as it does for a client, and the demo's two adapters
(greedy held-out prompts, GENERATE_TOKENS new tokens each, EOS ignored); `--only generate` runs
it alone (about a minute, nothing written). CPU is /proc utime + stime over a window after a
warm-up; p99 inter-token latency is the gap between a token's arrival and the previous one's in
its stream. Every process shares this machine's CPUs (the client included): read ratios of one
run. Writes bench/results/control-plane-cpu.md unless --quick or --only.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import pathlib
import sys
import tempfile
import time

import grpc
from direct_generate import direct_generate
from stream_measures import cpu_seconds, p99_ms, tokens_until

from common import credentials
from common.server import insecure_channel, run
from loraplex import client
from loraplex.launch import Fleet, FleetKeys, start_gateway
from protos import scheduler_pb2, scheduler_pb2_grpc

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "control-plane-cpu.md"
KEY = "control-plane-bench-tenant-key-01"
NEW_TOKENS = 256


async def measure(gateways: list[str], pids: dict[str, int], streams: int, warmup_s: float,
                  window_s: float) -> dict[str, float]:
    """`streams` closed-loop streams, spread over `gateways`; figures over the window after the
    warm-up ('cpu' also holds this client's own, as "client")."""
    arrivals: list[float] = []
    gaps: list[float] = []
    stop = time.perf_counter() + warmup_s + window_s
    channels = [insecure_channel(address) for address in gateways]
    stubs = [scheduler_pb2_grpc.SchedulerStub(channel) for channel in channels]
    metadata = client.metadata(KEY)

    async def loop(i: int) -> None:
        while time.perf_counter() < stop:
            req = client.generate_request("", [3, 4, 5 + i % 100], NEW_TOKENS, ignore_eos=True)
            messages = stubs[i % len(stubs)].Generate(req, metadata=metadata, timeout=120)
            if await tokens_until(messages, stop, arrivals, gaps):
                return

    tasks = [asyncio.create_task(loop(i)) for i in range(streams)]
    await asyncio.sleep(warmup_s)
    start, cpu = time.perf_counter(), {name: cpu_seconds(pid) for name, pid in pids.items()}
    wall_start, client_cpu = time.time(), time.process_time()
    first_gap = len(gaps)
    await asyncio.sleep(window_s)
    end, used = time.perf_counter(), {n: cpu_seconds(p) - cpu[n] for n, p in pids.items()}
    used["client"] = time.process_time() - client_cpu
    wall_end = time.time()
    window_gaps = gaps[first_gap:]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for channel in channels:
        await channel.close()
    tokens = sum(1 for t in arrivals if start <= t < end)
    return {"tokens/s": tokens / (end - start), "window": (wall_start, wall_end),
            "cpu": used, "delivered": tokens, "ITL p99 ms": p99_ms(window_gaps)}


async def measure_stream(scheduler: str, service_key: str, pid: int, streams: int,
                         warmup_s: float, window_s: float) -> dict[str, float]:
    """`streams` closed-loop requests on one Stream straight to the scheduler; figures over the
    window after the warm-up."""
    ids = itertools.count(1)
    last: dict[int, float] = {}  # request id -> arrival of its latest token
    counted = {"tokens": 0, "messages": 0}
    gaps: list[float] = []
    window: list[float] = []  # [start, end] once the window opened
    async with insecure_channel(scheduler) as channel:
        call = scheduler_pb2_grpc.SchedulerStub(channel).Stream(
            metadata=credentials.metadata(service_key))

        def submits(n: int) -> scheduler_pb2.StreamRequest:
            return scheduler_pb2.StreamRequest(submits=[scheduler_pb2.StreamSubmit(
                id=next(ids), tenant="bench", request=client.generate_request(
                    "", [3, 4, 5 + i % 100], NEW_TOKENS, ignore_eos=True))
                for i in range(n)])

        async def read() -> None:
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:
                    raise RuntimeError("the scheduler ended the benchmark's Stream")
                now = time.perf_counter()
                if window and now < window[-1]:
                    counted["tokens"] += len(message.token_ids)
                    counted["messages"] += 1
                    gaps.extend(now - last[r] for r in message.token_request_ids if r in last)
                last.update(dict.fromkeys(message.token_request_ids, now))
                for end in message.ends:
                    if end.error_code:
                        raise RuntimeError(f"request failed: {end.error_message}")
                    last.pop(end.id, None)
                if message.ends:
                    await call.write(submits(len(message.ends)))

        await call.write(submits(streams))
        reading = asyncio.create_task(read())
        await asyncio.sleep(warmup_s)
        start, cpu, wall_start = time.perf_counter(), cpu_seconds(pid), time.time()
        window[:] = [start, start + window_s]
        await asyncio.sleep(window_s)
        used = cpu_seconds(pid) - cpu
        if reading.done():
            reading.result()  # (its error)
        reading.cancel()
        call.cancel()
    return {"tokens/s": counted["tokens"] / window_s, "cpu": {"scheduler": used},
            "delivered": counted["tokens"], "messages/s": counted["messages"] / window_s,
            "window": (wall_start, wall_start + window_s), "ITL p99 ms": p99_ms(gaps)}


def scheduled_tokens(timings: pathlib.Path, window: tuple[float, float]) -> int:
    """Tokens of the steps the scheduler finished within `window` (its --timings-out lines)."""
    total = 0
    for line in timings.read_text().splitlines():
        record = json.loads(line)
        if "step" in record and window[0] <= record["at"] < window[1]:
            total += record["tokens"]
    return total


def bench_fleet(tmp: pathlib.Path, name: str, executors: int, rows: int, keys: FleetKeys,
                step_s: float, scheduler_args: list[str] = ()) -> Fleet:
    """A pool of `executors` benchmark executors (tiny random weights, a step every `step_s`,
    KV for `rows` sequences) and a scheduler admitting up to `rows` per executor, unstarted."""
    return Fleet(model="random:tiny", store_url=(tmp / f"store{name}").as_uri(),
                 log_dir=tmp / f"logs{name}", num_executors=executors, keys=keys,
                 executor_args=["--benchmark-step-s", str(step_s), "--kv-blocks", str(rows * 20),
                                "--adapter-slots", "1", "--max-rank", "8", "--threads", "1"],
                 scheduler_args=["--max-num-seqs", str(rows), "--max-queued-per-tenant", "0",
                                 *scheduler_args])


def capacity(tmp: pathlib.Path, keys: FleetKeys, step_s: float, window_s: float,
             executors: int = 8, rows: int = 256) -> tuple[int, int, dict]:
    """The scheduler-alone figures of `executors` x `rows` at steps of `step_s`: how many tokens
    per second one scheduler process sends, and at what CPU."""
    print(f"capacity: {executors} executors x {rows} rows, {1e3 * step_s:g} ms steps ...",
          flush=True)
    with bench_fleet(tmp, "capacity", executors, rows, keys, step_s) as fleet:
        figures = run(lambda: measure_stream(
            fleet.scheduler, keys.service, fleet.by_name("scheduler")[0].process.pid,
            executors * rows, 3.0, window_s))
    return executors, rows, figures | {"step_s": step_s}


def gateway_replicas(tmp: pathlib.Path, keys: FleetKeys, args: argparse.Namespace,
                     executors: int = 2, rows: int = 256) -> list[str]:
    """The same closed loop through 1, then 2 gateways in front of one pool (the streams spread
    evenly): the results file's section, its table included."""
    header = ["gateways", "streams", "tokens/s delivered", "gateway us/token (all replicas)",
              "scheduler us/token", "client CPU %", "ITL p99 ms"]
    lines = [
        "## Gateway replicas", "",
        (f"{executors} executors x {rows} rows, the same closed loop spread evenly over 1, then 2 "
         "gateways in front of the pool (each gateway keeps its own Stream to the scheduler): "
         "'client CPU %' is this one client process's share of a core. Replicas share nothing "
         "but the scheduler, so what one more adds shows where the machine runs out: on a 2-core "
         "machine the client and the gateways compete for the same CPUs."), "",
        "| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    with bench_fleet(tmp, "replicas", executors, rows, keys, args.step_s) as fleet:
        scheduler = fleet.by_name("scheduler")[0].process.pid
        for count in (1, 2):
            print(f"{count} gateway(s), {executors} executors x {rows} rows ...", flush=True)
            gateways = [start_gateway({"tiny": [fleet.scheduler]}, fleet.stores,
                                      fleet.log_dir, keys, name=f"gateway{i}")
                        for i in range(count)]
            try:
                pids = {"scheduler": scheduler} | {
                    f"gateway{i}": g.process.pid for i, g in enumerate(gateways)}
                f = run(lambda: measure([g.address for g in gateways], pids, executors * rows,
                                        3.0, args.window_s))
            finally:
                for gateway in gateways:
                    gateway.stop()
            tokens = max(f["delivered"], 1)
            gateway_cpu = sum(v for k, v in f["cpu"].items() if k.startswith("gateway"))
            seconds = f["window"][1] - f["window"][0]
            lines.append(f"| {count} | {executors * rows} | {f['tokens/s']:,.0f} "
                         f"| {1e6 * gateway_cpu / tokens:.0f} "
                         f"| {1e6 * f['cpu']['scheduler'] / tokens:.1f} "
                         f"| {100 * f['cpu']['client'] / seconds:.0f} "
                         f"| {f['ITL p99 ms']:.0f} |")
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 and 2 executors, 64 rows")
    parser.add_argument("--step-s", type=float, default=0.02, help="benchmark step time")
    parser.add_argument("--window-s", type=float, default=8.0)
    parser.add_argument("--capacity-step-s", type=float, default=0.01,
                        help="step time of the capacity line (8 executors x 256 rows)")
    parser.add_argument("--only", choices=["generate"],
                        help="generate: only the direct Generate line (demo model, 64 and 192 "
                             "streams); nothing is written")
    args = parser.parse_args()
    counts, rows = ([1, 2], [64]) if args.quick else ([1, 2, 4, 8], [64, 256])
    load = os.getloadavg()[0]
    command = " ".join([".venv/bin/python bench/control_plane.py", *sys.argv[1:]])
    machine = (f"- machine: nproc {len(os.sched_getaffinity(0))}, python "
               f"{sys.version.split()[0]}, 1-min load average at start {load:.1f}; the client, "
               "the scheduler, the gateway and the executors share these CPUs")
    results, direct = [], []  # through the gateway, straight into the scheduler's Stream
    keys = FleetKeys(tenants={KEY: "bench"})
    with tempfile.TemporaryDirectory(prefix="loraplex-control-") as tmp_name:
        tmp = pathlib.Path(tmp_name)
        if args.only == "generate":
            lines = direct_generate(tmp, keys, args.window_s, KEY)
            print("\n" + "\n".join([*lines, machine, f"- command: `{command}`", ""]))
            return
        for n in counts:
            fleet = bench_fleet(tmp, str(n), n, max(rows), keys, args.step_s,
                                ["--timings-out", str(tmp / f"timings{n}.jsonl")])
            with fleet:
                gateway = start_gateway({"tiny": [fleet.scheduler]}, fleet.stores,
                                        fleet.log_dir, keys)
                try:
                    pids = {"scheduler": fleet.by_name("scheduler")[0].process.pid,
                            "gateway": gateway.process.pid}
                    if n == 1:  # one row per step: what a step costs whatever its rows
                        direct.append((n, 1, run(lambda: measure_stream(
                            fleet.scheduler, keys.service, pids["scheduler"], 1, 3.0,
                            args.window_s))))
                    for r in rows:
                        print(f"{n} executor(s) x {r} rows ...", flush=True)
                        figures = run(lambda: measure([gateway.address], pids, n * r, 3.0,
                                                      args.window_s))
                        results.append((n, r, figures))
                        direct.append((n, r, run(lambda: measure_stream(
                            fleet.scheduler, keys.service, pids["scheduler"], n * r, 3.0,
                            args.window_s))))
                finally:
                    gateway.stop()
            for m, r, figures in results:  # (the log is complete once the scheduler stopped)
                if m == n:
                    figures["scheduled"] = scheduled_tokens(tmp / f"timings{n}.jsonl",
                                                            figures["window"])
        if not args.quick:
            direct.append(capacity(tmp, keys, args.capacity_step_s, args.window_s))
        replicas = [] if args.quick else gateway_replicas(tmp, keys, args)
        generate = direct_generate(tmp, keys, args.window_s, KEY)
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
    header = ["executors", "rows per step", "step ms", "streams", "tokens/s", "ideal",
              "messages/s", "scheduler us/token", "scheduler us/step", "scheduler cores",
              "ITL p99 ms"]
    direct_lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for n, r, f in direct:
        step_s = f.get("step_s", args.step_s)
        us = 1e6 * f["cpu"]["scheduler"] / max(f["delivered"], 1)
        cores = f["cpu"]["scheduler"] / (f["window"][1] - f["window"][0])
        direct_lines.append(
            f"| {n} | {r} | {1e3 * step_s:g} | {n * r} | {f['tokens/s']:,.0f} "
            f"| {n * r / step_s:,.0f} | {f['messages/s']:,.0f} | {us:.1f} | {us * r:,.0f} "
            f"| {cores:.2f} | {f['ITL p99 ms']:.0f} |")
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
        "## The scheduler alone: its Stream, as a gateway calls it", "",
        ("The same pool and streams, the client speaking the scheduler's Stream RPC itself (a "
         "message per step carries every request's tokens as columns): the client costs little, "
         "so the scheduler's CPU per token shows on its own (its --timings-out log included). "
         "'us/step': per executor step (us/token x rows); the 1-row line is what a step costs "
         "whatever it carries (its step-stream message and answer, the Stream message, the "
         "event loop's wake-ups), so at R rows a token cannot cost less than that / R. The last "
         "line is one scheduler's capacity: the same 8 x 256 with shorter steps; 'scheduler "
         "cores' is its CPU seconds per second."),
        "", *direct_lines, "",
        *replicas, *generate, machine, f"- command: `{command}`", ""])
    print("\n" + text)
    if not args.quick:
        RESULTS.write_text("# The control plane alone: CPU per streamed token\n\n" + text)
        print(f"wrote {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
