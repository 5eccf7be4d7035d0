"""Rotary position embeddings as HF transformers computes them: the variants a served model's
config.json may state (rope_type default, llama3, linear, longrope), parsed once and turned into
inverse frequencies and a cos/sin scale.

    default   inv_freq[i] = 1 / theta^(2i / D)
    llama3    Llama 3.1: low frequencies divided by `factor`, a smooth band between
    linear    every frequency divided by `factor` (Gemma 3's global layers)
    yarn      YaRN (gpt-oss): each frequency between its own and its `factor`-scaled value by a
              linear ramp over the dimensions whose rotations within the original context lie
              between beta_slow and beta_fast; cos and sin times its attention factor
              (0.1 ln(factor) + 1 unless given)
    longrope  Phi-3 (config "su"/"longrope"): inv_freq[i] = 1 / (factor[i] theta^(2i / D)), the
              short factors or the long ones, cos and sin times attention_factor (HF's, the same
              for both). Served up to max_position_embeddings as transformers' generate() serves
              it: a sequence of n tokens is computed with the short factors while
              n <= original_max_position_embeddings (the switch), with the long ones, all its
              KV, once n is past it. (The rotary module alone picks the factors per forward
              call by its highest position, leaving the cached KV as it was; Phi-3's generate()
              drops that cache when the sequence outgrows the switch and recomputes it whole.)
              So a sequence the executor registers with more tokens than the switch computes
              every position with the long factors, any other one with the short factors, and
              the scheduler recomputes a sequence that outgrows the switch
              (scheduler/steps/longrope.py).

A model with sliding-window layers may give them their own base (Gemma 3's rope_local_base_freq):
its local rope is default RoPE at that base.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 frequency-dependent RoPE scaling (rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LinearRopeScaling:
    """Every inverse frequency divided by `factor` (rope_type "linear")."""

    factor: float


@dataclass(frozen=True)
class LongRopeScaling:
    """Phi-3's LongRoPE (rope_type "longrope", formerly "su"): short factors within the original
    context, long ones past it."""

    short_factor: tuple[float, ...]  # [D / 2]
    long_factor: tuple[float, ...]  # [D / 2]
    attention_factor: float  # cos and sin are multiplied by it, short or long
    # The switch: a sequence of more tokens than this is computed with the long factors
    original_max_position_embeddings: int


@dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN (rope_type "yarn"), as transformers computes its frequencies and attention factor."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    truncate: bool  # round the ramp's ends out to whole dimensions
    attention_factor: float


RopeScaling = Llama3RopeScaling | LinearRopeScaling | LongRopeScaling | YarnRopeScaling
ROPE_TYPES = ("default", "llama3", "linear", "longrope", "yarn")


@dataclass(frozen=True)
class Rope:
    """One rotary embedding: its base and scaling."""

    theta: float
    scaling: RopeScaling | None = None

    @property
    def attention_factor(self) -> float:
        """cos and sin are multiplied by this (1 but for longrope and yarn)."""
        if isinstance(self.scaling, LongRopeScaling | YarnRopeScaling):
            return self.scaling.attention_factor
        return 1.0

    @property
    def switch_len(self) -> int:
        """A sequence of more tokens than this is computed with the long factors (longrope's
        original context); 0: one set of frequencies for every length."""
        s = self.scaling
        return s.original_max_position_embeddings if isinstance(s, LongRopeScaling) else 0

    def inv_freq(self, head_dim: int, long: bool = False) -> torch.Tensor:
        """[head_dim // 2] fp32 inverse frequencies (`long`: longrope's long factors; the same
        frequencies for any other rope)."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim  # [D / 2]
        s = self.scaling
        if isinstance(s, LongRopeScaling):
            factors = s.long_factor if long else s.short_factor
            return 1.0 / (torch.tensor(factors, dtype=torch.float32) * self.theta ** exponents)
        if isinstance(s, YarnRopeScaling):
            return _yarn(self.theta, head_dim, s)
        inv_freq = 1.0 / (self.theta ** exponents)
        if isinstance(s, LinearRopeScaling):
            return inv_freq / s.factor
        if isinstance(s, Llama3RopeScaling):
            return _llama3(inv_freq, s)
        return inv_freq


def _llama3(inv_freq: torch.Tensor, s: Llama3RopeScaling) -> torch.Tensor:
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(theta: float, dim: int, s: YarnRopeScaling) -> torch.Tensor:
    """transformers' YaRN frequencies, step for step (its rounding included)."""
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (its guard against a zero-width ramp)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)  # [D / 2]
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (s.factor * pos_freqs) * (1 - extrapolation)
            + 1.0 / pos_freqs * extrapolation)


def rope_cos_sin(rope: Rope, inv_freq: torch.Tensor, positions: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D] of positions [T] (HF's order: in fp32, scaled, then cast to `dtype`);
    inv_freq [D / 2], or [T, D / 2]: each position's own (longrope's short or long)."""
    freqs = positions[:, None].float() * inv_freq  # [T, D / 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    factor = rope.attention_factor
    cos, sin = emb.cos(), emb.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos, sin [T, D] (HF rotate-half layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def parse_rope(params: dict[str, Any], *, theta: float, head_dim: int,
               max_position_embeddings: int,
               original_max_position_embeddings: int | None = None) -> Rope:
    """The rope of an HF `rope_scaling` / `rope_parameters` dict (tf4 or tf5 keys; {} = default)
    at base `theta`; ValueError naming what is not supported."""
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "su":  # (Phi-3's first name for longrope, as transformers reads it)
        rope_type = "longrope"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"model config: rope type {rope_type!r} is not supported "
                         f"(supported: {', '.join(ROPE_TYPES)})")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"model config: partial_rotary_factor "
                         f"{params['partial_rotary_factor']} is not supported (only 1.0)")
    # (llama3, yarn, longrope: transformers takes the config's top-level
    # original_max_position_embeddings over the rope dict's, else max_position_embeddings)
    original = (original_max_position_embeddings
                or params.get("original_max_position_embeddings") or max_position_embeddings)
    scaled = rope_type in ("llama3", "yarn", "longrope")
    if scaled and not (isinstance(original, (int, float)) and math.isfinite(original)
                       and original > 0 and original == int(original)):
        raise ValueError(f"model config: original_max_position_embeddings must be a positive "
                         f"integer, got {original!r}")
    original = int(original) if scaled else 0
    try:
        if rope_type == "default":
            return Rope(theta)
        if rope_type == "linear":
            return Rope(theta, LinearRopeScaling(float(params["factor"])))
        if rope_type == "yarn":
            return Rope(theta, _yarn_scaling(params, max_position_embeddings, original))
        if rope_type == "llama3":
            return Rope(theta, Llama3RopeScaling(
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position_embeddings=original))
        return Rope(theta, _longrope(params, head_dim, max_position_embeddings, original))
    except KeyError as err:
        raise ValueError(f"model config: {rope_type} rope scaling is missing "
                         f"{err.args[0]!r}") from None


def _yarn_scaling(params: dict[str, Any], max_position_embeddings: int,
                  original: int) -> YarnRopeScaling:
    factor = params["factor"]  # (null: the context's growth, as transformers reads it)
    factor = float(factor) if factor is not None else max_position_embeddings / original
    attention = params.get("attention_factor")
    if attention is None:
        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return YarnRopeScaling(factor, original, float(params.get("beta_fast") or 32),
                           float(params.get("beta_slow") or 1),
                           bool(params.get("truncate", True)), float(attention))


def _longrope(params: dict[str, Any], head_dim: int, max_position_embeddings: int,
              original: int) -> LongRopeScaling:
    factors = {}
    for name in ("short_factor", "long_factor"):
        given = params[name]
        if not (isinstance(given, list) and len(given) == head_dim // 2
                and all(isinstance(f, (int, float)) and f > 0 for f in given)):
            raise ValueError(f"model config: longrope {name} must be {head_dim // 2} positive "
                             "numbers (head_dim / 2)")
        factors[name] = tuple(float(f) for f in given)
    # HF's attention factor: given, else from factor (given, else the context's growth)
    attention = params.get("attention_factor")
    if attention is None:
        factor = params.get("factor") or max_position_embeddings / original
        attention = (1.0 if factor <= 1.0
                     else math.sqrt(1 + math.log(factor) / math.log(original)))
    return LongRopeScaling(factors["short_factor"], factors["long_factor"], float(attention),
                           original)
