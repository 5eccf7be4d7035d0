"""The records of a soak run (bench/soak.py): the kinds of request a tenant sends, what each
call gave back and how it counts, the faults injected, and the tables they make."""

import statistics
from collections import Counter
from dataclasses import dataclass, field

import grpc

from loraplex import client
from protos import scheduler_pb2

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.DEADLINE_EXCEEDED}
MAX_NEW_TOKENS = 32
RECOVER_S = 5.0  # a request counts against a fault if it overlaps the fault or this long after


@dataclass(frozen=True)
class Combo:
    """One kind of request a tenant sends; its expected answer comes from the reference."""

    tenant: str
    adapter: str  # "" = the base model
    prompt: str
    seed: int | None = None  # seeded sampling at temperature 0.8; None = greedy

    def request(self) -> scheduler_pb2.GenerateRequest:
        sampling = {} if self.seed is None else {"temperature": 0.8, "seed": self.seed}
        return client.generate_request(self.adapter, self.prompt, MAX_NEW_TOKENS, **sampling)


@dataclass
class Reply:
    """What one call gave back: streamed tokens, then a finish reason or a status (or neither)."""

    start: float
    end: float = 0.0
    tokens: list[int] = field(default_factory=list)
    finish: int = 0
    code: grpc.StatusCode | None = None
    detail: str = ""
    is_hung: bool = False

    @property
    def answer(self) -> tuple:
        return tuple(self.tokens), self.finish

    def kind(self, expected: tuple) -> str:
        if list(expected[0][:len(self.tokens)]) != self.tokens:
            return "wrong"
        if self.is_hung:
            return "hung"
        if self.code is None:
            return "correct" if self.answer == expected else "wrong"
        return "retryable" if self.code in RETRYABLE else "failed"


@dataclass
class Fault:
    kind: str
    at_s: float  # after the soak starts
    start: float = 0.0  # monotonic, once it ran
    end: float = 0.0
    note: str = ""


def pct(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def outcome_table(rows: list[tuple[Combo, str, Reply]], faults: list[Fault], t0: float) -> list:
    """Every request; those overlapping no fault; those overlapping each fault."""
    def hit(r: Reply, f: Fault) -> bool:
        return f.end > 0 and r.start <= f.end + RECOVER_S and r.end >= f.start

    def counts_row(label: str, rows: list[tuple[Combo, str, Reply]]) -> str:
        kinds = Counter(kind for _, kind, _ in rows)
        codes = Counter(r.code.name for _, kind, r in rows if kind == "retryable")
        by_code = f" ({', '.join(f'{c} {n}' for c, n in codes.most_common())})" if codes else ""
        return (f"| {label} | {len(rows)} | {kinds['correct']} | {kinds['wrong']} | "
                f"{kinds['retryable']}{by_code} | {kinds['failed']} | {kinds['hung']} |")

    return ["| requests | sent | completed, correct | wrong | failed retryably | failed otherwise "
            "| hung |", "|---|---:|---:|---:|---:|---:|---:|", counts_row("all", rows),
            counts_row("overlapping no fault",
                       [x for x in rows if not any(hit(x[2], f) for f in faults)]),
            *(counts_row(f"overlapping {f.kind} ({f.start - t0:.0f}-{f.end - t0:.0f} s "
                         f"+ {RECOVER_S:.0f} s)", [x for x in rows if hit(x[2], f)])
              for f in faults if f.end)]


def latency_table(rows: list[tuple[Combo, str, Reply]], tenants: list[str]) -> list:
    """p50 and p99 of each tenant's correct completions, rolled up over the tenants."""
    per_tenant = [[r.end - r.start for c, k, r in rows if k == "correct" and c.tenant == t]
                  for t in tenants]
    lines = ["| latency of correct completions (s) | min over tenants | median | max |",
             "|---|---:|---:|---:|"]
    for q in (50, 99):
        if v := [pct(seconds, q) for seconds in per_tenant if seconds]:
            lines.append(f"| p{q} per tenant | {min(v):.2f} | {statistics.median(v):.2f} | "
                         f"{max(v):.2f} |")
    return lines
