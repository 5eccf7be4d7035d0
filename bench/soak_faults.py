"""The soak's faults (bench/soak.py): what each does to a process of the fleet and how it ends,
and the check that the pool came back to idle after the load.
"""

import argparse
import asyncio
import contextlib
import os
import signal
import time

import grpc
from soak_records import Fault

from common.server import insecure_channel
from loraplex.launch import Fleet, start_service
from protos import executor_pb2, executor_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

FAULT_KINDS = ("executor-stop", "store-kill", "s3-stop")
DEFAULT_AT = (0.05, 0.25, 0.65)  # when each fault starts, as a fraction of --duration-s
SETTLE_S = 30.0  # how long the pool may take to come back to idle after the load


def thaw(frozen: set[int]) -> None:
    """SIGCONT every process group this run SIGSTOPped (called on every way out)."""
    while frozen:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(frozen.pop(), signal.SIGCONT)


def fault_spec(spec: str) -> Fault:
    kind, _, at = spec.partition("@")
    if kind not in FAULT_KINDS:
        raise argparse.ArgumentTypeError(f"{spec!r}: KIND must be one of {FAULT_KINDS}")
    return Fault(kind, float(at))


async def inject(fault: Fault, fleet: Fleet, s3, frozen: set[int], t0: float, fault_s: float,
                 store_flags: list[str]) -> None:
    await asyncio.sleep(max(0.0, t0 + fault.at_s - time.monotonic()))
    fault.start = time.monotonic()
    if fault.kind == "store-kill":
        store = fleet.by_name("adapter_store")[0]
        store.kill()
        fault.note = f"{store.name} SIGKILL, down {fault_s:.0f} s, restarted on {store.address}"
        await asyncio.sleep(fault_s)
        args = ["--url", fleet.store_url, "--address", store.address, *store_flags,
                *fleet.store_args]

        def restart() -> None:  # records what it started itself, even if the run is cancelled
            fleet.services[fleet.services.index(store)] = start_service(
                store.name, "adapter_store.service", args, fleet.log_dir, timeout=60.0)

        try:
            await asyncio.to_thread(restart)
            fault.note += f", listening {time.monotonic() - fault.start - fault_s:.1f} s later"
        except (RuntimeError, TimeoutError) as exc:
            fault.note += f": restart FAILED: {exc}"
    else:
        target = fleet.by_name("executor")[0] if fault.kind == "executor-stop" else None
        fault.note = f"{target.name if target else 'SeaweedFS'} SIGSTOP, SIGCONT {fault_s:.0f} s on"
        pgid = target.process.pid if target else s3.process.pid  # each leads its process group
        frozen.add(pgid)
        os.killpg(pgid, signal.SIGSTOP)
        try:
            await asyncio.sleep(fault_s)
        finally:
            frozen.discard(pgid)
            thaw({pgid})
    fault.end = time.monotonic()


async def leaks(fleet: Fleet) -> tuple[list[str], list[str], float]:
    """Poll Stats (admin key) and each executor's Info until idle, for at most SETTLE_S:
    (leaks, a line per executor, seconds waited)."""
    start = time.monotonic()
    while True:
        problems, lines = [], []
        try:
            async with insecure_channel(fleet.scheduler, fleet.keys.admin) as channel:
                stats = await scheduler_pb2_grpc.SchedulerStub(channel).Stats(
                    scheduler_pb2.StatsRequest(), timeout=5)
            for ex in stats.executors:
                pins = sum(s.pins for s in ex.slots)
                async with insecure_channel(ex.address, fleet.keys.service) as channel:
                    held = (await executor_pb2_grpc.ExecutorStub(channel).Info(
                        executor_pb2.InfoRequest(), timeout=5)).num_sequences
                pages = sum(s.num_pages for s in ex.slots)  # (resident adapters' blocks)
                lines.append(f"{ex.address}: up {ex.is_up}, running {ex.running}, queued "
                             f"{ex.queued}, free KV blocks {ex.free_kv_blocks}/{ex.num_kv_blocks}"
                             f" and {ex.adapter_pages} adapters' pages, slot pins {pins}; its "
                             f"Info: num_sequences {held}")
                idle = (ex.free_kv_blocks + ex.adapter_pages == ex.num_kv_blocks
                        and ex.adapter_pages == pages)
                if ex.running or ex.queued or pins or not idle:
                    problems.append(f"the scheduler's {ex.address} is not idle")
                stuck = [f"{i} {s.state}" for i, s in enumerate(ex.slots)
                         if s.state in ("loading", "cleaning")]
                if stuck:
                    problems.append(f"{ex.address} slots still bringing an adapter in or "
                                    f"cleaning up: {', '.join(stuck)}")
                if held != 0:
                    problems.append(f"executor {ex.address} holds {held} sequences")
            problems += [f"tenant {t.tenant}: queued {t.queued}, running {t.running}"
                         for t in stats.tenants if t.queued or t.running]
        except grpc.aio.AioRpcError as exc:
            problems = [f"Stats or Info: {exc.code().name}: {exc.details()}"]
        waited = time.monotonic() - start
        if not problems or waited > SETTLE_S:
            return problems, lines, waited
        await asyncio.sleep(0.5)
