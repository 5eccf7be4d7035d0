"""What the churn soak (bench/soak_churn.py) measures inside its executor: the statuses its
errors become, and what its memory holds.

The probe goes in through a sitecustomize.py on PYTHONPATH that starts it only in a process run
as `-m executor.service` (the other services ignore it).
- Statuses: every error the executor maps to a status other than INTERNAL (those it logs itself)
  is logged as a WARNING line with its frames. A step that fails with INVALID_ARGUMENT or
  FAILED_PRECONDITION ends the Step stream and logs nothing, and the scheduler, still writing to
  the stream, may read only grpc's "Internal error from Core".
- Memory, with an output file: every `interval_s` a JSON line of
  - RSS and anonymous memory (/proc/self/status);
  - glibc malloc's account (mallinfo2, over all arenas): bytes in use, bytes free inside its heaps
    (kept by the process, not given back), mmapped blocks;
  - anonymous memory by mapping (/proc/self/smaps), Python's allocated blocks, threads;
  - with tracemalloc (slow), the Python allocations and the source lines holding most;
  - with the tensor census, live torch tensors (see tensor_census).
  When the file `<out>.trim` appears it calls malloc_trim(0) once, recording the RSS before and
  after: how much of the RSS was freed memory glibc had kept.
"""

from __future__ import annotations

import collections
import ctypes
import gc
import itertools
import json
import os
import pathlib
import sys
import threading
import time

ENV_ON = "SOAK_PROBE"
ENV_OUT = "SOAK_PROBE_HEAP_OUT"
ENV_INTERVAL = "SOAK_PROBE_HEAP_INTERVAL_S"
ENV_TRACEMALLOC = "SOAK_PROBE_TRACEMALLOC"
ENV_CENSUS = "SOAK_PROBE_TENSORS"
MIB = 1 << 20
_SITECUSTOMIZE = """\
import os, sys
if "executor.service" in getattr(sys, "orig_argv", ()) and os.environ.get("{on}"):
    sys.path.insert(0, {bench!r})
    import soak_probe
    soak_probe.start()
"""


def proc_status(pid: int | str = "self") -> dict[str, float]:
    """VmRSS, RssAnon, RssFile, VmHWM of a process, in MiB (empty once it is gone)."""
    out = {}
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(value.split()[0]) / 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


def probe_env(folder: pathlib.Path, heap_out: pathlib.Path | None = None,
              interval_s: float = 30.0, tracemalloc: bool = False,
              tensors: bool = False) -> dict[str, str]:
    """Environment that starts the probe in an executor started with it; the memory samples go
    to `heap_out` (None: no memory samples)."""
    folder.mkdir(parents=True, exist_ok=True)
    bench = str(pathlib.Path(__file__).resolve().parent)
    (folder / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(on=ENV_ON, bench=bench))
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, ENV_ON: "1", ENV_OUT: str(heap_out or ""),
            ENV_INTERVAL: str(interval_s), ENV_TRACEMALLOC: "1" if tracemalloc else "",
            ENV_CENSUS: "1" if tensors else ""}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _libc():
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return libc


def malloc_account(libc) -> dict[str, float]:
    """glibc's view, MiB: heap_in_use (allocated from the arenas' heaps), heap_free (free
    chunks the heaps keep), mmapped (blocks with a mapping of their own)."""
    info = libc.mallinfo2()
    return {"heap_in_use": info.uordblks / MIB, "heap_free": info.fordblks / MIB,
            "mmapped": info.hblkhd / MIB, "heap_total": info.arena / MIB}


def anon_map() -> dict[str, float]:
    """Anonymous memory by where it sits (/proc/self/smaps), MiB: the main arena's brk heap, and
    mappings without a name (other threads' malloc arenas, Python's obmalloc arenas, thread
    stacks, big malloc blocks) and how many; plus Python's allocated blocks and threads."""
    out = {"brk_heap": 0.0, "nameless": 0.0, "num_nameless": 0}
    name = ""
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:  # a mapping's first line
            name = head[5] if len(head) > 5 else ""
        elif head[0] == "Anonymous:":
            kb = int(head[1])
            if name == "[heap]":
                out["brk_heap"] += kb / 1024
            elif not name and kb:
                out["nameless"] += kb / 1024
                out["num_nameless"] += 1
    out["py_blocks"] = sys.getallocatedblocks()
    out["threads"] = threading.active_count()
    return out


def tensor_census(top: int = 8) -> dict:
    """Bytes of the distinct storages of live CPU tensors, and the largest classes (by the shape
    of the first tensor seen on each storage: a view's, sometimes).

    gc.get_objects() hands every object a second reference while the list lives, and a tuple
    another thread is building (tuple() of a generator) then fails to grow: SystemError
    "bad argument to internal function" (CPython gh-39117). It took an executor's step down once
    here. So the list lives only while no other thread may take the GIL (the switch interval
    raised, threads already waiting let through first) and is filtered in C calls alone."""
    import torch

    kinds = {torch.Tensor, torch.nn.Parameter}
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        time.sleep(0.05)  # (a thread waiting with the old interval takes the GIL meanwhile)
        objects = gc.get_objects()
        tensors = list(itertools.compress(objects, map(kinds.__contains__, map(type, objects))))
        del objects
    finally:
        sys.setswitchinterval(interval)
    seen: dict[int, int] = {}
    classes: collections.Counter = collections.Counter()
    for t in tensors:
        if t.device.type != "cpu":
            continue
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if ptr and ptr not in seen:
            seen[ptr] = nbytes
            classes[f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"] += nbytes
    return {"tensor_mib": sum(seen.values()) / MIB, "num_storages": len(seen),
            "top": [(k, round(v / MIB, 2)) for k, v in classes.most_common(top)]}


def _traced(top: int = 8) -> dict:
    import tracemalloc

    if not tracemalloc.is_tracing():
        return {}
    snap = tracemalloc.take_snapshot()
    stats = snap.statistics("lineno")
    return {"traced_mib": sum(s.size for s in stats) / MIB,
            "traced_top": [(f"{s.traceback[0].filename.rsplit('/', 2)[-1]}:"
                            f"{s.traceback[0].lineno}", round(s.size / MIB, 2), s.count)
                           for s in stats[:top]]}


def _loop(out: pathlib.Path, interval_s: float) -> None:
    libc = _libc()
    trim = out.with_suffix(out.suffix + ".trim")
    start, next_at, trimmed = time.monotonic(), 0.0, False
    while True:
        now = time.monotonic() - start
        record = None
        if not trimmed and trim.exists():
            before = proc_status()
            libc.malloc_trim(0)
            record = {"trim": True, "before": before, "after": proc_status(),
                      "malloc": malloc_account(libc)}
            trimmed = True
        elif now >= next_at:
            next_at = now + interval_s
            record = {"status": proc_status(), "malloc": malloc_account(libc),
                      "anon": anon_map(), **_traced(),
                      **(tensor_census() if os.environ.get(ENV_CENSUS) else {})}
        if record is not None:
            record["t"] = round(time.time(), 3)
            with open(out, "a") as f:
                f.write(json.dumps(record) + "\n")
        time.sleep(1.0)


def log_statuses() -> None:
    """Wrap common.errors.status_for (every error of a servicer becomes a status there) to log
    each status but INTERNAL as a WARNING line, its frames on the same line."""
    import logging
    import traceback

    import grpc

    from common import errors

    plain, log = errors.status_for, logging.getLogger("soak_probe")

    def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
        code, message = plain(exc)
        if code != grpc.StatusCode.INTERNAL:
            frames = " < ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}"
                                for f in reversed(traceback.extract_tb(exc.__traceback__)))
            log.warning("status %s (%s): %s [%s]", code.name, type(exc).__name__, message,
                        frames)
        return code, message

    errors.status_for = status_for


def start() -> None:
    """In the executor (sitecustomize): the status log, and the memory samples' thread
    (tracemalloc started first) when asked for."""
    log_statuses()
    if not os.environ.get(ENV_OUT):
        return
    if os.environ.get(ENV_TRACEMALLOC):
        import tracemalloc

        tracemalloc.start(1)
    out = pathlib.Path(os.environ[ENV_OUT])
    interval_s = float(os.environ.get(ENV_INTERVAL, "30"))
    threading.Thread(target=_loop, args=(out, interval_s), daemon=True,
                     name="soak-heap-probe").start()


def read(out: pathlib.Path) -> list[dict]:
    if not out.exists():
        return []
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


_COLUMNS = {  # heading -> a sample's figure (MiB unless said), None where it was not measured
    "RSS": lambda r: r["status"].get("VmRSS"),
    "anonymous": lambda r: r["status"].get("RssAnon"),
    "malloc in use": lambda r: r["malloc"]["heap_in_use"] + r["malloc"]["mmapped"],
    "malloc free, kept": lambda r: r["malloc"]["heap_free"],
    "anonymous outside malloc": lambda r: r["status"].get("RssAnon", 0) - r["malloc"][
        "heap_in_use"] - r["malloc"]["mmapped"] - r["malloc"]["heap_free"],
    "Python blocks (k)": lambda r: r["anon"]["py_blocks"] / 1000,
    "live tensors": lambda r: r.get("tensor_mib"),
    "Python (tracemalloc)": lambda r: r.get("traced_mib"),
}


def heap_table(records: list[dict], start: float, end: float) -> list[str]:
    """The probe's samples while the traffic ran, per half: mean (max); and its trim."""
    samples = [r for r in records if not r.get("trim") and start <= r["t"] <= end]
    mid = start + (end - start) / 2
    halves = {"first half": [r for r in samples if r["t"] < mid],
              "last half": [r for r in samples if r["t"] >= mid]}
    columns = {k: f for k, f in _COLUMNS.items() if samples and f(samples[-1]) is not None}
    lines = [f"| executor memory (MiB; bench/soak_probe.py), mean (max) | {' | '.join(columns)} |",
             f"|---|{'---:|' * len(columns)}"]
    for label, half in halves.items():
        if half:
            cells = [f"{sum(map(f, half)) / len(half):.0f} ({max(map(f, half)):.0f})"
                     for f in columns.values()]
            lines.append(f"| {label} ({len(half)} samples) | {' | '.join(cells)} |")
    if samples and samples[-1].get("top"):
        lines += ["", f"- largest live tensor classes at the end (MiB): {samples[-1]['top'][:6]}"]
    if samples and samples[-1].get("traced_top"):
        lines.append(f"- Python allocations by line at the end: {samples[-1]['traced_top'][:6]}")
    lines += ["", *(f"- malloc_trim(0) after the run: RSS {r['before']['VmRSS']:.0f} -> "
                    f"{r['after']['VmRSS']:.0f} MiB" for r in records if r.get("trim"))]
    return lines


if __name__ == "__main__":  # a probe's file, a line per sample
    for r in read(pathlib.Path(sys.argv[1])):
        if r.get("trim"):
            print(f"trim: RSS {r['before']['VmRSS']:.0f} -> {r['after']['VmRSS']:.0f} MiB")
            continue
        print(f"{time.strftime('%H:%M:%S', time.gmtime(r['t']))} " + ", ".join(
            f"{k} {v:.0f}" for k, f in _COLUMNS.items() if (v := f(r)) is not None)
              + f" {r.get('top', [])[:2]} {r.get('traced_top', [])[:3]}")
