"""Where a running Python process spends its time: py-spy records it (speedscope format), and the
functions with the largest shares of its samples come back as table rows.

py-spy is not a project dependency: `.venv/bin/pip install py-spy`. It attaches by pid (ptrace)
and samples Python frames without pausing the process (--nonblocking), keeping only samples of
threads that were running, so a share is of the process's busy time. C code (uvloop, gRPC's
Cython layer and C core, syscalls) shows as the Python frame that called it; with `native` py-spy
pauses the process at each sample to unwind the C frames too, and samples whose leaf is an
epoll wait (idle) are dropped here.

    self    the function itself was running (the leaf frame)
    total   the function was on the stack (it or what it called was running); frames on every
            stack of their thread (the entry point, the event loop) are left out
    layer   the package of the leaf frame; the event loop's own native time and gRPC's poller
            thread apart
"""

import asyncio
import json
import pathlib
import shutil
import sys
from collections import Counter
from dataclasses import dataclass, field

REPO = pathlib.Path(__file__).resolve().parents[1]
PROJECT_DIRS = ("gateway/", "common/", "protos/")  # the gateway's own code, for `total` rows
PROJECT_DIRS_NAMES = tuple(d.rstrip("/") for d in PROJECT_DIRS)
IDLE = {"epoll_wait", "epoll_pwait"}  # native leaves of a waiting thread (with --native)


def py_spy() -> str | None:
    """The py-spy executable: next to this Python's, else on PATH; None when not installed."""
    beside = pathlib.Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


@dataclass
class Profile:
    label: str
    seconds: float
    rate: int
    num_samples: int = 0
    self_counts: Counter = field(default_factory=Counter)
    total_counts: Counter = field(default_factory=Counter)
    layer_counts: Counter = field(default_factory=Counter)
    everywhere: set = field(default_factory=set)  # frames on ~every stack of their thread
    error: str = ""

    @property
    def busy_share(self) -> float:
        """Samples with a running thread over the samples asked for: roughly the share of one
        core the process's Python threads used."""
        return self.num_samples / max(1.0, self.seconds * self.rate)

    def top_self(self, num: int) -> list[tuple[str, float]]:
        return [(f, n / self.num_samples) for f, n in self.self_counts.most_common(num)]

    def layers(self) -> list[tuple[str, float]]:
        return [(name, n / self.num_samples) for name, n in self.layer_counts.most_common()]

    def top_total(self, num: int) -> list[tuple[str, float]]:
        """The project's own functions (gateway/, common/, protos/) by inclusive share."""
        mine = [(f, n) for f, n in self.total_counts.most_common()
                if f.rsplit(" (", 1)[-1].startswith(PROJECT_DIRS) and f not in self.everywhere]
        return [(f, n / self.num_samples) for f, n in mine[:num]]


async def record(pid: int, seconds: float, out: pathlib.Path, label: str, rate: int = 200,
                 native: bool = False) -> Profile:
    """Record `pid` for `seconds` into `out` (speedscope JSON) and summarise it; `native`: with
    the C frames (uvloop, gRPC's Cython layer) under the Python ones."""
    profile = Profile(label, seconds, rate)
    exe = py_spy()
    if exe is None:
        profile.error = "py-spy is not installed (.venv/bin/pip install py-spy)"
        return profile
    proc = await asyncio.create_subprocess_exec(
        exe, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
        "--rate", str(rate), "--function", "--format", "speedscope", "--output", str(out),
        # py-spy pauses the process to unwind native stacks; Python frames alone it reads live
        "--native" if native else "--nonblocking",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    text, _ = await proc.communicate()
    if proc.returncode != 0 or not out.exists():
        profile.error = f"py-spy exited {proc.returncode}: {text.decode()[-300:].strip()}"
        return profile
    summarise(json.loads(out.read_text()), profile)
    return profile


def summarise(speedscope: dict, profile: Profile) -> None:
    """Count self and total samples per function, and self samples per layer, over every
    thread's profile."""
    files = [_short(f.get("file", "")) for f in speedscope["shared"]["frames"]]
    frames = [f"{f['name']} ({file}:{f.get('line') or 0})"
              for f, file in zip(speedscope["shared"]["frames"], files)]
    for thread in speedscope["profiles"]:
        is_poller = "_poll_wrapper" in thread["name"]
        on_thread = Counter()
        for stack in thread["samples"]:  # each a list of frame indices, root first
            leaf = frames[stack[-1]] if stack else ""
            if not stack or leaf.split(" (", 1)[0] in IDLE:
                continue
            profile.num_samples += 1
            profile.self_counts[leaf] += 1
            profile.layer_counts[_layer(leaf, files[stack[-1]], is_poller)] += 1
            names = {frames[i] for i in stack}
            profile.total_counts.update(names)
            on_thread.update(names)
        num = max(on_thread.values(), default=0)
        profile.everywhere |= {name for name, n in on_thread.items() if n >= 0.95 * num}


def _layer(leaf: str, file: str, is_poller: bool) -> str:
    """What a sample's leaf belongs to: a package, the stdlib, or native code under a frame."""
    if is_poller:
        return "gRPC poller thread (C core, completion queue)"
    if leaf.startswith("Runner.run ("):
        return "event loop, native: uvloop, gRPC Cython, syscalls"
    top = file.split("/", 1)[0]
    if top in ("x86_64-linux-gnu", "[vdso]"):
        return "libc: syscalls (sendmsg, write, ...)"
    if top in ("uvloop", "unix") or file in ("src/queue.h", "src/timer.c"):
        return "uvloop, libuv"
    if top in ("parser", "src"):
        return "httptools (llhttp)"
    if (top in ("Modules", "Objects", "Python", "Include", "cpython", "internal", "clinic")
            or "libpython" in file or top == "python3.11" and file.endswith(".h")):
        return "CPython's C"
    if top in ("asyncio", "python3.11", "concurrent", "json", "collections", "_blake2"):
        return "Python stdlib"
    if top == "google":
        return "protobuf"
    if top in PROJECT_DIRS_NAMES:
        return f"{top}/ (project)"
    return top


def _short(path: str) -> str:
    """A file as a reader finds it: repo-relative, package-relative, or the stdlib's last two
    parts (asyncio/events.py)."""
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1]
    try:
        return str(pathlib.Path(path).resolve().relative_to(REPO))
    except ValueError:
        return "/".join(pathlib.Path(path).parts[-2:])


def table(profile: Profile, num: int = 12) -> list[str]:
    """Markdown: the top functions by self share, then the project's by total share."""
    if profile.error:
        return [f"{profile.label}: not profiled: {profile.error}"]
    lines = [f"{profile.label}: {profile.num_samples} samples at {profile.rate} Hz over "
             f"{profile.seconds:.0f} s (busy {profile.busy_share:.0%} of one core's samples)",
             "", "| layer (self samples) | share |", "|---|---:|"]
    lines += [f"| {name} | {share:.1%} |" for name, share in profile.layers()]
    lines += ["", "| function (self: running itself) | share |", "|---|---:|"]
    lines += [f"| `{name}` | {share:.1%} |" for name, share in profile.top_self(num)]
    lines += ["", "| gateway/common function (total: it or its callees) | share |", "|---|---:|"]
    lines += [f"| `{name}` | {share:.1%} |" for name, share in profile.top_total(num)]
    return lines
