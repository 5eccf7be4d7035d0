"""Soak: the pool at saturation from many tenants while its processes are frozen and killed.

    .venv/bin/python bench/soak.py [--quick] [--duration-s 180] [--tenants 40] [--out [PATH]]

A keyed fleet of processes on the demo model: SeaweedFS S3, adapter stores, two CPU executors, a
scheduler; each tenant pushes two adapters of its own with its own key. Every (tenant, adapter,
prompt, sampling) combination is first sent twice, fault-free: the answer both passes agree on is
the expected one. Then every tenant runs a closed loop of streaming Generate calls while faults
run on a schedule: an executor frozen (SIGSTOP, SIGCONT), a store killed and restarted on its
port, SeaweedFS frozen. Each request is correct, wrong (a streamed token differs from the
expected ones, however the call ended), failed retryably, failed otherwise, or hung (no end by
its gRPC deadline plus a margin; a call the pool holds that long ends as DEADLINE_EXCEEDED at
the client's deadline). Then Stats and executors' Info must come back to idle.
"""

import argparse
import asyncio
import dataclasses
import importlib.metadata
import os
import pathlib
import random
import signal
import sys
import tempfile
import time
from collections import Counter

import grpc
from soak_faults import DEFAULT_AT, FAULT_KINDS, fault_spec, inject, leaks, thaw
from soak_records import (
    MAX_NEW_TOKENS,
    Combo,
    Fault,
    Reply,
    latency_table,
    outcome_table,
    pct,
)

from common.server import insecure_channel, run
from loraplex import client, demo
from loraplex.demo_tasks import TASKS, held_out
from loraplex.launch import Fleet, FleetKeys, start_gateway
from protos import scheduler_pb2_grpc
from scheduler.limits import Limits
from scheduler.timeouts import Timeouts

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "soak-cpu.md"
KINDS = ("correct", "wrong", "retryable", "failed", "hung")
HANG_MARGIN_S = 10.0  # a call not ended this long after its gRPC deadline is hung
# Scheduler settings for a run of minutes: 16 sequences per executor keeps a queue (saturation);
# the rest bound the waits on a frozen or dead part. Each goes in only if the scheduler has it.
SCHEDULER = {"max_num_seqs": 16, "step_floor_s": 3.0, "step_warmup_s": 20.0, "rpc_s": 2.0,
             "probe_interval_s": 1.0, "load_floor_s": 5.0, "warm_s": 10.0, "resolve_s": 2.0,
             "max_queue_s": 45.0, "max_load_backoff_s": 4.0}
EXECUTOR = ["--threads", "1", "--adapter-slots", "12", "--max-rank", "16", "--kv-blocks", "512"]
STORE = ["--host-cache-mb", "8"]  # below the adapters' ~35 MB: loads keep reading S3


def plan(num_tenants: int, num_prompts: int) -> dict[str, list[Combo]]:
    """Tenant -> its combinations: two task adapters of its own (t07-<task>), each on num_prompts
    held-out prompts, greedy and seeded; the base model on as many prompts, greedy."""
    prompts = {t.name: [p for p, _ in held_out(t, num_prompts)] for t in TASKS}
    out = {}
    for i in range(num_tenants):
        tenant, tasks = f"t{i:02d}", (TASKS[i % len(TASKS)], TASKS[(i + 3) % len(TASKS)])
        combos = [Combo(tenant, "", p) for p in prompts[tasks[0].name]]
        for task in tasks:
            adapter = f"{tenant}-{task.name}"
            for j, p in enumerate(prompts[task.name]):
                combos += [Combo(tenant, adapter, p), Combo(tenant, adapter, p, 1000 * i + j)]
        out[tenant] = combos
    return out


async def call(stub, combo: Combo, key: str, deadline_s: float) -> Reply:
    reply = Reply(start=time.monotonic())
    stream = stub.Generate(combo.request(), metadata=client.metadata(key), timeout=deadline_s)

    async def consume() -> None:
        async for response in stream:
            if response.HasField("token_id"):
                reply.tokens.append(response.token_id)
            reply.finish = response.finish_reason or reply.finish

    try:
        await asyncio.wait_for(consume(), deadline_s + HANG_MARGIN_S)
    except TimeoutError:
        reply.is_hung = True
        stream.cancel()
    except grpc.aio.AioRpcError as exc:
        reply.code, reply.detail = exc.code(), exc.details() or ""
    reply.end = time.monotonic()
    return reply


async def reference(stub, plans: dict[str, list[Combo]], key_of: dict[str, str],
                    deadline_s: float) -> tuple[dict[Combo, tuple], list[str]]:
    """Two fault-free passes in different orders: combo -> the answer both gave."""
    combos = [c for cs in plans.values() for c in cs]
    gate, passes = asyncio.Semaphore(len(plans)), []

    async def one(combo: Combo) -> Reply:
        async with gate:
            return await call(stub, combo, key_of[combo.tenant], deadline_s)

    for seed in (1, 2):
        order = random.Random(seed).sample(combos, len(combos))
        passes.append(dict(zip(order, await asyncio.gather(*(one(c) for c in order)))))
    failed = {c: p[c] for p in passes for c in combos if p[c].code or p[c].is_hung
              or not p[c].finish}
    unstable = [c for c in combos if c not in failed and passes[0][c].answer != passes[1][c].answer]
    notes = [f"{len(failed)} combinations failed in a pass (left out), e.g. "
             f"{r.code.name if r.code else 'no end'}: {r.detail}" for r in [*failed.values()][:1]]
    notes += [f"{len(unstable)} combinations differ between the passes (left out), e.g. {c}"
              for c in unstable[:1]]
    return {c: passes[0][c].answer for c in combos if c not in failed and c not in unstable}, notes


async def soak(stub, plans: dict[str, list[Combo]], expected: dict[Combo, tuple],
               key_of: dict[str, str], args) -> list[tuple[Combo, Reply]]:
    """Each tenant a closed loop until duration_s is up; every call is awaited to its end."""
    records: list[tuple[Combo, Reply]] = []
    stop_at = time.monotonic() + args.duration_s

    async def tenant_loop(tenant: str, rng: random.Random) -> None:
        combos = [c for c in plans[tenant] if c in expected]
        # Draw weights: the base model 1 in 8, seeded sampling 1 in 4, greedy adapters the rest.
        weights = [1 if not c.adapter else 2 if c.seed is not None else 5 for c in combos]
        while combos and time.monotonic() < stop_at:
            combo = rng.choices(combos, weights)[0]
            records.append((combo, await call(stub, combo, key_of[tenant], args.deadline_s)))

    async def progress() -> None:
        while (left := stop_at - time.monotonic()) > 0:
            await asyncio.sleep(min(15.0, left))
            kinds = Counter(r.kind(expected[c]) for c, r in records)
            print(f"  {args.duration_s - max(0.0, stop_at - time.monotonic()):4.0f} s: "
                  + ", ".join(f"{k} {kinds[k]}" for k in KINDS), flush=True)

    await asyncio.gather(progress(), *(tenant_loop(t, random.Random(t)) for t in plans))
    return records


async def measure(fleet: Fleet, s3, frozen: set[int], plans, faults: list[Fault], args) -> dict:
    key_of = {tenant: key for key, tenant in fleet.keys.tenants.items()}
    gate = asyncio.Semaphore(8)

    async def push(tenant: str, name: str) -> None:  # name: t07-<task>
        async with gate:
            await asyncio.wait_for(client.push_adapter(
                fleet.stores[0], demo.adapter_dir(name.split("-", 1)[1]), name,
                key=key_of[tenant]), args.deadline_s)

    owned = {(c.tenant, c.adapter) for cs in plans.values() for c in cs if c.adapter}
    await asyncio.gather(*(push(tenant, name) for tenant, name in sorted(owned)))
    store_flags = fleet.keys.write(fleet.log_dir / "keys")["store"]
    gateway = None
    if args.through_gateway:
        gateway = await asyncio.to_thread(start_gateway, {demo.MODEL_ID: [fleet.scheduler]},
                                          fleet.stores, fleet.log_dir, fleet.keys)
    try:
        return await _measure_at(gateway.address if gateway else fleet.scheduler, fleet, s3,
                                 frozen, plans, faults, args, key_of, store_flags)
    finally:
        if gateway is not None:
            gateway.stop()


async def _measure_at(address: str, fleet: Fleet, s3, frozen: set[int], plans,
                      faults: list[Fault], args, key_of: dict[str, str],
                      store_flags: list[str]) -> dict:
    """The reference passes, then the soak with its faults, sending to `address` (the
    scheduler, or a gateway in front of it); then the pool must come back to idle."""
    async with insecure_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        print(f"reference: {sum(map(len, plans.values()))} combinations, twice ...", flush=True)
        expected, notes = await reference(stub, plans, key_of, args.deadline_s)
        print(f"soak: {args.duration_s:.0f} s, faults: "
              f"{', '.join(f'{f.kind}@{f.at_s:.0f}s' for f in faults) or 'none'}", flush=True)
        t0 = time.monotonic()

        async def run_faults() -> None:  # one after another: each at its time or once the last ends
            for f in sorted(faults, key=lambda f: f.at_s):
                await inject(f, fleet, s3, frozen, t0, args.fault_s, store_flags)

        injector = asyncio.create_task(run_faults())
        try:
            records = await soak(stub, plans, expected, key_of, args)
            await injector
        finally:
            injector.cancel()
            thaw(frozen)
        elapsed = time.monotonic() - t0
    problems, executors, settle_s = await leaks(fleet)
    return dict(records=records, expected=expected, notes=notes, elapsed=elapsed, t0=t0,
                leaks=problems, executors=executors, settle_s=settle_s)


def report(result: dict, faults: list[Fault], plans, args, load: tuple[float, float],
           command: str) -> str:
    expected, t0, elapsed = result["expected"], result["t0"], result["elapsed"]
    rows = [(combo, reply.kind(expected[combo]), reply) for combo, reply in result["records"]]
    done = [r for _, k, r in rows if k == "correct"]
    seconds = [r.end - r.start for r in done]
    kinds = Counter(k for _, k, _ in rows)
    problems = Counter(f"{k}: {r.code.name if r.code else 'no end'} {r.detail[:160]}".strip()
                       for _, k, r in rows if k in ("retryable", "failed", "hung"))
    wrong = [f"- wrong: {c} got {len(r.tokens)} tokens (expected {len(expected[c][0])}), ended "
             f"{r.code.name if r.code else 'OK'}" for c, k, r in rows if k == "wrong"]
    num_adapters = len({c.adapter for cs in plans.values() for c in cs} - {""})
    is_met = not (kinds["hung"] or kinds["wrong"] or result["leaks"])
    return "\n".join([
        (f"{len(plans)} tenants, each a closed loop of streaming Generate calls "
         f"{'through a gateway (its Stream to the scheduler) ' if args.through_gateway else ''}"
         f"({args.deadline_s:.0f} s gRPC deadline; hung = no end {HANG_MARGIN_S:.0f} s after it) "
         f"for {args.duration_s:.0f} s over {num_adapters} adapters (each tenant pushes 2 demo "
         "task adapters with its own key) and the base model; 1 in 4 requests seeded sampling "
         f"(T 0.8), the rest greedy, up to {MAX_NEW_TOKENS} tokens. Demo model; 2 executors "
         f"(`{' '.join(EXECUTOR)}`); {args.stores} adapter store(s) on SeaweedFS S3 "
         f"(`{' '.join(STORE)}`); scheduler `{' '.join(scheduler_flags())}`."),
        "", *outcome_table(rows, faults, t0), "", *latency_table(rows, list(plans)), "",
        (f"- correct completions: p50 {pct(seconds, 50):.2f} s, p99 {pct(seconds, 99):.2f} s; "
         f"{len(done) / elapsed:.1f} requests/s, {sum(len(r.tokens) for r in done) / elapsed:.0f}"
         f" tokens/s over {elapsed:.0f} s"),
        (f"- reference: {len(expected)} combinations answered alike by two fault-free passes"
         + "".join(f"; {n}" for n in result["notes"])),
        *(f"- fault at {f.start - t0:.0f} s: {f.note}" if f.end else f"- {f.kind}: not run"
          for f in faults),
        *(f"- {n} x {p}" for p, n in problems.most_common(6)), *wrong[:3],
        (f"- leaks after the load (waited {result['settle_s']:.1f} s): "
         f"{'; '.join(result['leaks']) or 'none'}"),
        *(f"  - {line}" for line in result["executors"]),
        (f"- goal (0 hung, 0 wrong, 0 leaked): {'met' if is_met else 'NOT met'}: "
         f"{kinds['hung']} hung, {kinds['wrong']} wrong, {len(result['leaks'])} leaks"),
        (f"- machine: nproc {len(os.sched_getaffinity(0))}, 1-min load average {load[0]:.1f} at "
         f"start, {load[1]:.1f} at the end; torch {importlib.metadata.version('torch')}, python "
         f"{sys.version.split()[0]}"),
        f"- command: `{command}`", ""])


def scheduler_flags() -> list[str]:
    names = {f.name for f in (*dataclasses.fields(Limits), *dataclasses.fields(Timeouts))}
    return [part for name, value in SCHEDULER.items() if name in names
            for part in (f"--{name.replace('_', '-')}", str(value))]


def seaweed():
    """tests/s3server.py's SeaweedS3 (the tests are not an installed package)."""
    sys.path.insert(0, str(REPO))
    from tests.s3server import SeaweedS3

    return SeaweedS3


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration-s", type=float, help="soak length (180; 60 with --quick)")
    p.add_argument("--tenants", type=int, default=40)
    p.add_argument("--stores", type=int, default=2, choices=(1, 2))
    p.add_argument("--deadline-s", type=float, default=60.0, help="gRPC deadline per request")
    p.add_argument("--fault-s", type=float,
                   help="how long a process stays frozen or a store down (15; 10 with --quick)")
    p.add_argument("--fault", action="append", default=[], type=fault_spec, metavar="KIND@S",
                   help=f"KIND: {', '.join(FAULT_KINDS)}; repeatable (default: each once, at "
                        f"{', '.join(f'{a * 100:.0f}%%' for a in DEFAULT_AT)} of the run)")
    p.add_argument("--no-faults", action="store_true")
    p.add_argument("--through-gateway", action="store_true",
                   help="send every request through a gateway in front of the scheduler (its "
                        "Stream: tokens in batches, detokenized and stop strings applied there)")
    p.add_argument("--quick", action="store_true", help="60 s, faults 10 s, 2 prompts per task")
    p.add_argument("--out", nargs="?", const=str(RESULTS), metavar="PATH",
                   help=f"also write the report here ({RESULTS.relative_to(REPO)})")
    args = p.parse_args()
    args.duration_s = args.duration_s or (60.0 if args.quick else 180.0)
    args.fault_s = args.fault_s or (10.0 if args.quick else 15.0)
    args.faults = [] if args.no_faults else args.fault or [
        Fault(kind, at * args.duration_s) for kind, at in zip(FAULT_KINDS, DEFAULT_AT)]
    return args


def main() -> None:
    args = parse_args()
    plans = plan(args.tenants, 2 if args.quick else 3)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # every service: one torch thread
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # clean up as on Ctrl-C
    load_start = os.getloadavg()[0]
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="loraplex-soak-"))
    keys = FleetKeys(tenants={os.urandom(16).hex(): tenant for tenant in plans})
    frozen: set[int] = set()
    print(f"logs: {log_dir}\nstarting SeaweedFS, {args.stores} store(s), 2 executors, a "
          f"scheduler; {args.tenants} tenants push their adapters ...", flush=True)
    with seaweed().start(bucket="loraplex-soak") as s3:
        fleet = Fleet(model=str(demo.MODEL_DIR), store_url=f"s3://{s3.bucket}/soak",
                      log_dir=log_dir, num_executors=2, num_stores=args.stores, keys=keys,
                      store_args=["--s3-endpoint-url", s3.endpoint_url, *STORE],
                      executor_args=EXECUTOR, scheduler_args=scheduler_flags())
        with fleet:
            try:
                result = run(lambda: measure(fleet, s3, frozen, plans, args.faults, args))
            finally:
                thaw(frozen)  # on Ctrl-C or an error too, before anything is stopped
    command = " ".join([".venv/bin/python bench/soak.py", *sys.argv[1:]])
    text = report(result, args.faults, plans, args, (load_start, os.getloadavg()[0]), command)
    print(f"\n{text}\nlogs: {log_dir}")
    if args.out:
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(f"# Soak under faults on CPU\n\n{text}")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
