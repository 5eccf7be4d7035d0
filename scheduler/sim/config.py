"""Simulator configuration: a TOML file read into frozen dataclasses, validated on load.

    seed = 0
    num_requests = 1000000
    [arrivals]   process = "poisson" | "bursty", rate_per_s, burst_factor, burst_period_s
    [lengths]    prompt_mean, prompt_max, output_mean, output_max   (geometric-like, capped)
    [adapters]   count, zipf_s, ranks = [8, 16, 32], rank_shares = [0.7, 0.2, 0.1] (default:
                 equal), bytes_per_rank, heavy_share (the share of requests for adapter a0 alone,
                 one heavy tenant's; the rest Zipf over all)
    [tenants]    count, weights = [...]  (adapters are split among tenants round-robin)
    [executors]  count, slots, kv_blocks, block_size, memory = "slots" (adapters in slots beside
                 the blocks) | "pages" (in pages of the blocks, by their ranks) | "padded" (in
                 pages, every adapter at the largest rank), and the model's shapes for the pages:
                 num_layers, hidden, intermediate, kv_heads, head_dim (default Llama-3-8B)
    [cost]       step_base_s, step_per_token_s, step_per_adapter_s, load_latency_s,
                 load_bytes_per_s   (`loraplex fit-cost` fits them to a scheduler's --timings-out),
                 step_per_lora_token_s (LoRA work per token of an adapter's row, none where the
                 adapter is merged into the executor; not fitted)
    [limits]     any field of scheduler.executor_state.Limits (max_num_seqs, max_batched_tokens...)
"""

import tomllib
from dataclasses import dataclass, field, fields
from typing import Any

from common.adapter_pages import PageGeometry
from common.peft.modules import projection_shapes
from scheduler.limits import Limits


@dataclass(frozen=True)
class Arrivals:
    process: str = "poisson"
    rate_per_s: float = 400.0
    burst_factor: float = 4.0  # bursty: rate multiplier during bursts (same mean rate)
    burst_period_s: float = 10.0  # bursty: one burst per period, lasting 1/burst_factor of it

    def __post_init__(self) -> None:
        if self.process not in ("poisson", "bursty"):
            raise ValueError("arrivals.process must be 'poisson' or 'bursty', got "
                             f"{self.process!r}")
        if self.rate_per_s <= 0 or self.burst_factor < 1 or self.burst_period_s <= 0:
            raise ValueError("arrivals: rate_per_s > 0, burst_factor >= 1, burst_period_s > 0")


@dataclass(frozen=True)
class Lengths:
    prompt_mean: int = 256
    prompt_max: int = 2048
    output_mean: int = 32
    output_max: int = 256

    def __post_init__(self) -> None:
        if not (1 <= self.prompt_mean <= self.prompt_max
                and 1 <= self.output_mean <= self.output_max):
            raise ValueError("lengths: need 1 <= mean <= max for prompts and outputs")


@dataclass(frozen=True)
class Adapters:
    count: int = 1000
    zipf_s: float = 1.0
    ranks: tuple[int, ...] = (8, 16, 32)
    bytes_per_rank: int = 5_242_880  # an 8B model, 7 projections: ~5.2 MB per unit of rank (bf16)
    heavy_share: float = 0.0  # requests for a0 alone (one heavy tenant), before the Zipf draw
    rank_shares: tuple[float, ...] = ()  # adapters of each rank (default: as many of each)

    def __post_init__(self) -> None:
        if self.count < 1 or self.zipf_s < 0 or not self.ranks:
            raise ValueError("adapters: count >= 1, zipf_s >= 0, at least one rank")
        if self.rank_shares and (len(self.rank_shares) != len(self.ranks)
                                 or min(self.rank_shares) < 0 or not sum(self.rank_shares) > 0):
            raise ValueError("adapters: one rank_share >= 0 per rank, not all 0")
        if not 0 <= self.heavy_share <= 1:
            raise ValueError("adapters: heavy_share in [0, 1]")


@dataclass(frozen=True)
class Tenants:
    count: int = 8
    weights: tuple[float, ...] = ()  # per tenant; default all 1

    def __post_init__(self) -> None:
        if self.count < 1 or (self.weights and len(self.weights) != self.count):
            raise ValueError("tenants: count >= 1 and one weight per tenant when weights are given")


@dataclass(frozen=True)
class Executors:
    count: int = 4
    slots: int = 32
    kv_blocks: int = 4096
    block_size: int = 16
    memory: str = "slots"
    num_layers: int = 32
    hidden: int = 4096
    intermediate: int = 14336
    kv_heads: int = 8
    head_dim: int = 128

    def __post_init__(self) -> None:
        if self.memory not in ("slots", "pages", "padded"):
            raise ValueError("executors.memory must be 'slots', 'pages' or 'padded', got "
                             f"{self.memory!r}")

    def geometry(self) -> PageGeometry | None:
        """Where adapters' pages lie in the blocks (None: fixed slots)."""
        if self.memory == "slots":
            return None
        shapes = projection_shapes(self.hidden, self.intermediate, self.hidden // self.head_dim,
                                   self.kv_heads, self.head_dim)
        return PageGeometry(self.num_layers, self.block_size * self.kv_heads * self.head_dim,
                            shapes)


@dataclass(frozen=True)
class Cost:
    """Step time = base + per_token * tokens + per_adapter * distinct adapters + per_lora_token *
    tokens of adapter rows (neither for an adapter merged into the executor); load = latency +
    bytes / bandwidth (loads on one executor go one at a time)."""

    step_base_s: float = 0.012
    step_per_token_s: float = 0.00004
    step_per_adapter_s: float = 0.0002
    load_latency_s: float = 0.002
    load_bytes_per_s: float = 20e9
    step_per_lora_token_s: float = 0.0


@dataclass(frozen=True)
class SimConfig:
    seed: int = 0
    num_requests: int = 100_000
    arrivals: Arrivals = field(default_factory=Arrivals)
    lengths: Lengths = field(default_factory=Lengths)
    adapters: Adapters = field(default_factory=Adapters)
    tenants: Tenants = field(default_factory=Tenants)
    executors: Executors = field(default_factory=Executors)
    cost: Cost = field(default_factory=Cost)
    limits: Limits = field(default_factory=Limits)

    @classmethod
    def load(cls, path: str) -> "SimConfig":
        with open(path, "rb") as f:
            return cls.from_dict(tomllib.load(f))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "SimConfig":
        known = {f.name: f for f in fields(cls)}
        unknown = set(raw) - set(known)
        if unknown:
            raise ValueError(f"simulator config: unknown keys {sorted(unknown)}")
        args: dict[str, Any] = {}
        for name, value in raw.items():
            kind = known[name].default_factory if isinstance(value, dict) else None
            args[name] = _section(kind(), value, name) if kind else value
        return cls(**args)


def _section(default: Any, values: dict[str, Any], name: str) -> Any:
    names = {f.name for f in fields(default)}
    unknown = set(values) - names
    if unknown:
        raise ValueError(f"simulator config [{name}]: unknown keys {sorted(unknown)}")
    return type(default)(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})
