"""bench/control_plane.py's last line: a client's direct path, straight into the scheduler's
Generate with a gRPC stream per request (the streaming gRPC client's way), on the demo model,
beside a bare gRPC server's floor (bench/grpc_floor.py). `control_plane.py --only generate` runs
it alone."""

import asyncio
import itertools
import pathlib
import time

from grpc_floor import floor_server
from stream_measures import cpu_seconds, p99_ms, tokens_until

from common.server import insecure_channel, run
from loraplex import client, demo
from loraplex.demo_tasks import TASKS_BY_NAME, held_out
from loraplex.launch import Fleet, FleetKeys
from protos import scheduler_pb2_grpc

GENERATE_STREAMS = (64, 192)  # the direct Generate line's concurrent streams
GENERATE_ADAPTERS = ("reverse-words", "rotate-words")  # demo adapters, alternating per request
GENERATE_TOKENS = 32  # new tokens per direct Generate request (the demo model's context is 256)


async def measure_generate(scheduler: str, pid: int, streams: int, warmup_s: float,
                           window_s: float, key: str) -> dict[str, float]:
    """`streams` closed-loop Generate calls straight to the scheduler, a gRPC stream per request
    (client.stream, as the streaming gRPC client calls it); figures over the window after the
    warm-up."""
    prompts = [(a, p) for a in GENERATE_ADAPTERS
               for p, _ in held_out(TASKS_BY_NAME[a], 8)]
    arrivals: list[float] = []
    gaps: list[float] = []
    stop = time.perf_counter() + warmup_s + window_s
    async with insecure_channel(scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)

        async def loop(i: int) -> None:
            for n in itertools.count(i):
                adapter, prompt = prompts[n % len(prompts)]
                req = client.generate_request(adapter, prompt, GENERATE_TOKENS, ignore_eos=True)
                if await tokens_until(client.stream(stub, req, key), stop, arrivals, gaps):
                    return

        tasks = [asyncio.create_task(loop(i)) for i in range(streams)]
        await asyncio.sleep(warmup_s)
        start, cpu, wall_start = time.perf_counter(), cpu_seconds(pid), time.time()
        first_gap = len(gaps)
        await asyncio.sleep(window_s)
        end, used = time.perf_counter(), cpu_seconds(pid) - cpu
        window_gaps = gaps[first_gap:]
        for task in tasks:
            if task.done():
                task.result()  # (its error)
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    tokens = sum(1 for t in arrivals if start <= t < end)
    return {"tokens/s": tokens / (end - start), "cpu": {"scheduler": used}, "delivered": tokens,
            "window": (wall_start, wall_start + window_s), "ITL p99 ms": p99_ms(window_gaps)}


def direct_generate(tmp: pathlib.Path, keys: FleetKeys, window_s: float, key: str) -> list[str]:
    """The direct Generate line at GENERATE_STREAMS, on the demo model, as tenant `key` (one of
    `keys`): the results file's section, its table included."""
    rows = max(GENERATE_STREAMS)
    blocks = rows * (-(-(64 + GENERATE_TOKENS) // 16) + 1)  # (16-token blocks; prompts < 64)
    fleet = Fleet(model=str(demo.MODEL_DIR), store_url=(tmp / "store-generate").as_uri(),
                  log_dir=tmp / "logs-generate", keys=keys,
                  executor_args=["--threads", "1", "--adapter-slots", str(len(GENERATE_ADAPTERS)),
                                 "--kv-blocks", str(blocks)],
                  scheduler_args=["--max-num-seqs", str(rows), "--max-queued-per-tenant", "0"])
    header = ["streams", "tokens/s delivered", "scheduler us/token delivered",
              "scheduler cores", "ITL p99 ms", "floor us/message", "scheduler / floor"]
    lines = [
        "## A client's direct path: the scheduler's Generate, a stream per request", "",
        ("Straight into the scheduler's Generate, one gRPC stream per request, as the streaming "
         "gRPC client does (loraplex/client.py; a message per token): the demo model "
         "(one executor, --threads 1, a real forward pass), its two adapters "
         f"{', '.join(GENERATE_ADAPTERS)} in turn, held-out prompts, {GENERATE_TOKENS} new "
         "tokens each (EOS ignored), closed loop. The scheduler detokenizes every token (the "
         "model has a tokenizer) and writes it as its own message; 'scheduler us/token': its "
         "CPU over the window over the tokens this client received in it. 'floor': the same "
         "client against a bare gRPC server that only writes those messages, one per stream "
         "per step at the scheduler's step rate (bench/grpc_floor.py: StreamFloor), its CPU per "
         "message: what this machine's gRPC costs that day, which moves 2-3x between "
         "sessions here, so the ratio is the figure to compare across runs."), "",
        "| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    with fleet:
        pid = fleet.by_name("scheduler")[0].process.pid

        async def push() -> None:
            for name in GENERATE_ADAPTERS:
                await client.push_adapter(fleet.stores[0], demo.adapter_dir(name), name, key=key)

        run(push)
        for streams in GENERATE_STREAMS:
            print(f"direct Generate, demo model, {streams} streams ...", flush=True)
            f = run(lambda: measure_generate(fleet.scheduler, pid, streams, 3.0, window_s,
                                           key))
            seconds = f["window"][1] - f["window"][0]
            us = 1e6 * f["cpu"]["scheduler"] / max(f["delivered"], 1)
            with floor_server(step_s=streams / max(f["tokens/s"], 1.0)) as (port, floor_pid):
                bare = run(lambda: measure_generate(f"127.0.0.1:{port}", floor_pid, streams,
                                                    3.0, window_s, key))
            floor = 1e6 * bare["cpu"]["scheduler"] / max(bare["delivered"], 1)
            lines.append(f"| {streams} | {f['tokens/s']:,.0f} | {us:.1f} "
                         f"| {f['cpu']['scheduler'] / seconds:.2f} | {f['ITL p99 ms']:.0f} "
                         f"| {floor:.1f} | {us / floor:.2f} |")
    return lines + [""]
