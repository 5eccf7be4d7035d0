"""The records of bench/gateway.py and the tables made from them: a round is the streams one
path ran at one concurrency for a few seconds, with each token's arrival time and the CPU every
process used meanwhile."""

import statistics
from dataclasses import dataclass, field

RAMP_S = 0.5  # a round's first half second (streams starting, first prefills) is not timed
GOAL_ADDED_MS = 1.0  # issue 14: at most 1 ms p50 added per token ...
GOAL_RATIO = 0.95  # ... and at least 0.95x the direct throughput


@dataclass
class Stream:
    start: float
    times: list[float] = field(default_factory=list)  # each token's arrival (perf_counter)


@dataclass
class Round:
    path: str
    concurrency: int
    start: float
    end: float  # no stream starts after it; tokens after it are not counted in tokens/s
    streams: list[Stream]
    cpu: dict[str, float]  # "client" and each service -> CPU seconds over the round
    pair: "Round | None" = None  # for a gateway round: the direct round just before it

    @property
    def num_tokens(self) -> int:
        return sum(len(s.times) for s in self.streams)

    def tok_s(self) -> float:
        begin = self.start + RAMP_S
        counted = sum(begin <= t <= self.end for s in self.streams for t in s.times)
        return counted / (self.end - begin)

    def gaps(self) -> list[float]:
        return [b - a for s in self.streams for a, b in zip(s.times, s.times[1:])]

    def ttfts(self) -> list[float]:
        return [s.times[0] - s.start for s in self.streams if s.times]


def pct(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def latency_table(rounds: list[Round], concurrency: list[int], paths: list[str]) -> list[str]:
    lines = ["| streams | path | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | tokens/s (median "
             "round) | added ITL p50 (ms) | added TTFT p50 (ms) | tokens/s vs direct (range) "
             "| goal |", "|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for c in concurrency:
        for name in paths:
            mine = [r for r in rounds if r.concurrency == c and r.path == name]
            if not mine:
                continue
            gaps = [g for r in mine for g in r.gaps()]
            ttfts = [t for r in mine for t in r.ttfts()]
            row = (f"| {c} | {name} | {ms(pct(ttfts, 50))} / {ms(pct(ttfts, 99))} | "
                   f"{ms(pct(gaps, 50))} / {ms(pct(gaps, 99))} | "
                   f"{statistics.median(r.tok_s() for r in mine):.0f} |")
            if name == "direct":
                lines.append(row + " | | | |")
                continue
            added = statistics.median(pct(r.gaps(), 50) - pct(r.pair.gaps(), 50) for r in mine)
            added_ttft = statistics.median(pct(r.ttfts(), 50) - pct(r.pair.ttfts(), 50)
                                           for r in mine)
            ratios = [r.tok_s() / r.pair.tok_s() for r in mine]
            ratio = statistics.median(ratios)
            is_met = added * 1e3 <= GOAL_ADDED_MS and ratio >= GOAL_RATIO
            lines.append(f"{row} {added * 1e3:+.2f} | {added_ttft * 1e3:+.2f} | {ratio:.2f}x "
                         f"({min(ratios):.2f}-{max(ratios):.2f}) | "
                         f"{'met' if is_met else 'NOT met'} |")
    return lines


def cpu_table(rounds: list[Round], concurrency: list[int], paths: list[str],
              services: list[str]) -> list[str]:
    columns = ["client", *services]
    lines = ["| streams | path | " + " | ".join(columns) + " | all | CPUs busy |",
             "|---:|---|" + "---:|" * (len(columns) + 2)]
    for c in concurrency:
        for name in paths:
            mine = [r for r in rounds if r.concurrency == c and r.path == name]
            if not mine:
                continue
            tokens = sum(r.num_tokens for r in mine)
            per = {k: sum(r.cpu[k] for r in mine) / tokens * 1e6 for k in columns}
            wall = sum(max(s.times[-1] for s in r.streams if s.times) - r.start for r in mine)
            busy = sum(sum(r.cpu.values()) for r in mine) / wall
            lines.append(f"| {c} | {name} | " + " | ".join(f"{per[k]:.0f}" for k in columns)
                         + f" | {sum(per.values()):.0f} | {busy:.2f} |")
    return lines


def cpu_per_token(rounds: list[Round], concurrency: int, path: str, process: str) -> float:
    """Microseconds of `process`'s CPU per token over a path's rounds (nan when none ran)."""
    mine = [r for r in rounds if r.concurrency == concurrency and r.path == path]
    tokens = sum(r.num_tokens for r in mine)
    return sum(r.cpu[process] for r in mine) / tokens * 1e6 if tokens else float("nan")


def findings(rounds: list[Round], concurrency: list[int], paths: list[str]) -> list[str]:
    """The numbers that hold from run to run on shared CPUs: what each path costs in CPU."""
    top = max(concurrency)
    direct_all = sum(cpu_per_token(rounds, top, "direct", k) for k in rounds[0].cpu)
    lines = []
    for name in [p for p in paths if p in ("gateway gRPC", "gateway SSE")]:
        gateway = cpu_per_token(rounds, top, name, "gateway")
        lines.append(f"- {name} at {top} streams: the gateway process costs {gateway:.0f} us of "
                     f"CPU per token, {gateway / direct_all:.0%} of what all processes spend "
                     f"per token on the direct path ({direct_all:.0f} us); one fully busy core "
                     f"would relay at most ~{1e6 / gateway:.0f} tokens/s this way")
    if "gateway openai" in paths and "gateway SSE" in paths:
        sdk = [cpu_per_token(rounds, c, "gateway openai", "client") for c in concurrency]
        raw = [cpu_per_token(rounds, c, "gateway SSE", "client") for c in concurrency]
        lines.append("- the openai client costs this process "
                     + ", ".join(f"{a:.0f} us" for a in sdk) + " of CPU per token against "
                     + ", ".join(f"{b:.0f} us" for b in raw) + " for raw SSE (at "
                     + ", ".join(map(str, concurrency)) + " streams): on CPUs shared with the "
                     "pool its own cost shows in its rows, so the SSE rows are the HTTP verdict")
    return lines
