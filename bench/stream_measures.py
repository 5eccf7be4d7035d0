"""What the benchmarks read: a process's CPU time so far, a stream's token arrivals and the p99
of their gaps."""

import os
import pathlib
import statistics
import time

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all its threads) so far."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime: fields 14, 15 of stat


def p99_ms(gaps: list[float]) -> float:
    """The 99th percentile of inter-token gaps (seconds), in ms (NaN below 100 gaps)."""
    return 1e3 * statistics.quantiles(gaps, n=100)[98] if len(gaps) > 100 else float("nan")


async def tokens_until(messages, stop: float, arrivals: list[float], gaps: list[float]) -> bool:
    """Read a Generate stream's `messages`, appending each token's arrival (perf_counter) and its
    gap to the stream's previous token; True when `stop` came first, False when it ended."""
    last = None
    async for message in messages:
        now = time.perf_counter()
        if message.HasField("token_id"):
            arrivals.append(now)
            if last is not None:
                gaps.append(now - last)
            last = now
        if now >= stop:
            return True
    return False
