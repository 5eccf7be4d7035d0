"""What the benchmarks read of a process: its CPU time so far, and a stream's p99 gap."""

import os
import pathlib
import statistics

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all its threads) so far."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime: fields 14, 15 of stat


def p99_ms(gaps: list[float]) -> float:
    """The 99th percentile of inter-token gaps (seconds), in ms (NaN below 100 gaps)."""
    return 1e3 * statistics.quantiles(gaps, n=100)[98] if len(gaps) > 100 else float("nan")
