"""The records of the churn soak (bench/soak_churn.py) and the table made from them: each
completion a client asked for, what the monitor saw of the pool, and the service logs read after.
"""

from __future__ import annotations

import bisect
import datetime
import pathlib
import re
import statistics
import subprocess
from collections import defaultdict
from dataclasses import dataclass, field

from soak_records import pct

# executor/adapter_loader.py: "loaded NAME@V into slot S: ..."; common/server.py's log format
_LOADED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .* loaded (\S+)@\d+ into slot")
_ERROR = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} \S+ (ERROR|CRITICAL) ")


@dataclass
class Completion:
    """One streamed /v1/completions call."""

    adapter: int  # the adapter's index (-1: the base model)
    prompt: int  # index into the prompts
    start: float  # wall clock (time.time(), as the services' logs)
    is_check: bool = False  # sent by the checker (the sampled adapters in turn), not Zipf
    ttft: float | None = None
    end: float = 0.0
    text: str = ""
    num_tokens: int = 0
    error: str = ""
    is_cold: bool = False  # a load of its adapter ended between its start and first token


@dataclass
class Monitor:
    """What the monitor saw while traffic ran: samples of the executor's memory and of Stats."""

    rss: list[tuple[float, dict[str, float]]] = field(default_factory=list)  # (t, MiB fields)
    # (t, address, steps, adapter_loads, adapter_hits)
    counters: list[tuple[float, str, int, int, int]] = field(default_factory=list)
    down: list[str] = field(default_factory=list)  # what showed an executor down, when
    backwards: list[str] = field(default_factory=list)  # counters seen going back
    num_polls: int = 0


def mark_cold(completions: list[Completion], log: pathlib.Path, names: list[str]) -> int:
    """Mark each completion during which a load of its adapter (names[adapter]) ended, from the
    executor's log; the number of loads logged."""
    ends: dict[str, list[float]] = defaultdict(list)
    for line in log.read_text(errors="replace").splitlines():
        if m := _LOADED.match(line):
            at = datetime.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f")
            ends[m[2]].append(at.timestamp())
    for c in completions:
        times = ends.get(names[c.adapter], []) if c.adapter >= 0 else []
        first = c.start + (c.ttft if c.ttft is not None else c.end - c.start)
        i = bisect.bisect_left(times, c.start - 0.002)  # (log times are to the millisecond)
        c.is_cold = i < len(times) and times[i] <= first + 0.002
    return sum(map(len, ends.values()))


def log_errors(log_dir: pathlib.Path) -> dict[str, list[str]]:
    """Per service log: its ERROR/CRITICAL lines and tracebacks (first line of each)."""
    out = {}
    for log in sorted(log_dir.glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()
        bad = [line for line in lines if _ERROR.match(line) or line.startswith("Traceback")]
        if bad:
            out[log.stem] = bad
    return out


def warnings_of(log_dir: pathlib.Path) -> dict[str, int]:
    """Per service log, its WARNING lines (not failures: reported)."""
    return {log.stem: n for log in sorted(log_dir.glob("*.log"))
            if (n := log.read_text(errors="replace").count(" WARNING "))}


def _ms(values: list[float], q: int) -> str:
    return f"{pct(values, q) * 1e3:.0f}" if values else "-"


def ttft_rows(done: list[Completion]) -> list[str]:
    lines = ["| requests (Zipf clients, completed) | count | TTFT p50 (ms) | TTFT p99 (ms) | "
             "completion p50 (ms) |", "|---|---:|---:|---:|---:|"]
    for label, group in (("resident adapter", [c for c in done if not c.is_cold]),
                         ("cold adapter (a load ended during its wait)",
                          [c for c in done if c.is_cold]), ("all", done)):
        ttfts = [c.ttft for c in group]
        lines.append(f"| {label} | {len(group)} | {_ms(ttfts, 50)} | {_ms(ttfts, 99)} | "
                     f"{_ms([c.end - c.start for c in group], 50)} |")
    return lines


def rss_summary(samples: list[tuple[float, dict[str, float]]], start: float,
                end: float) -> tuple[list[str], dict[str, float]]:
    """The executor's RSS over the traffic: per half, mean and max, and the slope of the last
    half (least squares, MiB per minute)."""
    during = [(t, s["VmRSS"], s.get("RssAnon", 0.0)) for t, s in samples
              if start <= t <= end and "VmRSS" in s]
    if len(during) < 4:
        return ["- executor RSS: too few samples"], {}
    mid = start + (end - start) / 2
    halves = [[x for x in during if x[0] < mid], [x for x in during if x[0] >= mid]]
    last = halves[1]
    slope = statistics.linear_regression([t for t, _, _ in last], [r for _, r, _ in last]).slope
    figures = {"first_mean": statistics.mean(r for _, r, _ in halves[0]),
               "last_mean": statistics.mean(r for _, r, _ in last),
               "last_max": max(r for _, r, _ in last), "slope_mib_min": slope * 60,
               "first": during[0][1], "end": during[-1][1]}
    lines = ["| executor RSS (MiB) | mean | max | anonymous, mean |", "|---|---:|---:|---:|"]
    for label, half in zip(("first half", "last half"), halves):
        lines.append(f"| {label} | {statistics.mean(r for _, r, _ in half):.0f} | "
                     f"{max(r for _, r, _ in half):.0f} | "
                     f"{statistics.mean(a for _, _, a in half):.0f} |")
    return lines, figures


def rss_timeline(samples: list[tuple[float, dict[str, float]]], start: float,
                 every_s: float = 60.0) -> str:
    """RSS every `every_s` seconds from `start`, in one line."""
    marks, next_at = [], start
    for t, s in samples:
        if t >= next_at and "VmRSS" in s:
            marks.append(f"{t - start:.0f} s {s['VmRSS']:.0f}")
            next_at = t + every_s
    return ", ".join(marks)


def counter_delta(mon: Monitor, start: float, end: float,
                  margin_s: float) -> tuple[int, int, int]:
    """(steps, loads, hits) the executors' Stats counters gained over the traffic."""
    first, last = {}, {}
    for t, address, *counts in mon.counters:
        if start - margin_s <= t <= end + margin_s:
            first.setdefault(address, counts)
            last[address] = counts
    return tuple(sum(last[a][i] - first[a][i] for a in last) for i in range(3))


def judge(r: dict, wrong: list[Completion], differ: dict, checked: int,
          errors: dict[str, list[str]]) -> list[str]:
    """Why the run failed (empty: it passed)."""
    failed = [c for c in r["done"] if c.error]
    return [
        *(f"{log}: {len(lines)} ERROR/traceback lines, e.g. {lines[0][:200]}"
          for log, lines in errors.items()),
        *([f"executor seen down {len(r['mon'].down)} times, e.g. {r['mon'].down[0]}"]
          if r["mon"].down else []),
        *([f"the scheduler logged the executor unreachable {r['unreachable']} times"]
          if r["unreachable"] else []),
        *([f"counters went back: {r['mon'].backwards[0]}"] if r["mon"].backwards else []),
        *([f"the pool did not settle: {'; '.join(r['leaks'])}"] if r["leaks"] else []),
        *([f"{len(failed)} requests failed, e.g. {failed[0].error}"] if failed else []),
        *([f"{len(wrong)} wrong answers, e.g. adapter {wrong[0].adapter} prompt "
           f"{wrong[0].prompt}: {wrong[0].text!r} ({wrong[0].num_tokens} tokens)"]
          if wrong else []),
        *([f"{len(differ)} (adapter, prompt) pairs answered differently, e.g. "
           f"{next(iter(differ.items()))}"] if differ else []),
        *(["no answer of a sampled adapter came back to compare"] if not checked else [])]


def revision(repo: pathlib.Path) -> str:
    """The commit the services ran from (REPO's HEAD, and whether files differed from it)."""
    def git(*cmd: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *cmd], capture_output=True,
                              text=True).stdout.rstrip()  # (porcelain lines may begin " M")

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return f"{repo} (not a git checkout: say which commit it was exported from)"
    dirty = [line for line in git("status", "--porcelain", "--untracked-files=no").splitlines()
             if not line[3:].startswith("bench/")]
    return f"commit {head}" + (f", {len(dirty)} files changed beside it" if dirty else "")

