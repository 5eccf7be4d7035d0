"""ModelConfig: the shape and numerics of a LLaMA-family base model (Llama, Mistral, Qwen2).

Parsed from a Hugging Face `config.json` (+ `generation_config.json` for extra eos ids), or taken
from `NAMED_CONFIGS` for random-weight benchmarks.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from common.peft.modules import projection_shapes

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 frequency-dependent RoPE scaling (rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int = 0  # 0 = hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and of k, before RoPE (Qwen3)
    sliding_window: int | None = None  # Mistral: a query sees only its last `sliding_window` keys
    eos_token_ids: tuple[int, ...] = ()
    model_id: str = ""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size", "max_position_embeddings", "head_dim"):
            if name == "head_dim" and self.head_dim == 0:
                object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"model config: {name} must be a positive integer, got {value!r}")
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model config: num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise ValueError(f"model config: rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ValueError(f"model config: rope_theta must be > 0, got {self.rope_theta!r}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"model config: sliding_window must be > 0, got {self.sliding_window}")
        if any(not 0 <= t < self.vocab_size for t in self.eos_token_ids):
            raise ValueError(f"model config: eos_token_ids {list(self.eos_token_ids)} must lie in "
                             f"[0, vocab_size={self.vocab_size})")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of one of the 7 LoRA-targetable projections."""
        return projection_shapes(self.hidden_size, self.intermediate_size,
                                 self.num_attention_heads, self.num_key_value_heads,
                                 self.head_dim)[module]

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], *, generation_config: dict[str, Any] | None = None,
                     model_id: str = "") -> ModelConfig:
        """Build from the dict of an HF config.json (transformers 4 or 5 layout)."""
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model config: model_type {model_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"model config: hidden_act must be 'silu', got {cfg['hidden_act']!r}")
        if cfg.get("mlp_bias"):
            raise ValueError("model config: mlp_bias=true is not supported")
        if model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
            raise ValueError(f"model config: {model_type} use_sliding_window=true is not "
                             "supported")
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "vocab_size"):
            if key not in cfg:
                raise ValueError(f"model config: missing required field {key!r}")
        rope = _rope_fields(cfg)
        # (Qwen's sliding_window applies only with use_sliding_window, refused above)
        sliding = None if model_type in ("qwen2", "qwen3") else cfg.get("sliding_window")
        return cls(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            vocab_size=cfg["vocab_size"],
            head_dim=cfg.get("head_dim") or 0,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope[0],
            rope_scaling=rope[1],
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=sliding,
            eos_token_ids=_eos_ids(cfg, generation_config or {}),
            model_id=model_id or cfg.get("_name_or_path") or "",
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, *, model_id: str = "") -> ModelConfig:
        """Read `model_dir/config.json` (+ `generation_config.json` when present)."""
        model_dir = Path(model_dir)
        path = model_dir / "config.json"
        if not path.is_file():
            raise ValueError(f"model config: {path} not found")
        gen_path = model_dir / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else None
        cfg = json.loads(path.read_text())
        return cls.from_hf_dict(cfg, generation_config=gen,
                                model_id=model_id or cfg.get("_name_or_path") or model_dir.name)

    @classmethod
    def named(cls, name: str) -> ModelConfig:
        if name not in NAMED_CONFIGS:
            raise ValueError(f"unknown model config name {name!r} "
                             f"(known: {', '.join(NAMED_CONFIGS)})")
        return NAMED_CONFIGS[name]


def _rope_fields(cfg: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, llama3 scaling or None) from `rope_scaling` (tf4) or `rope_parameters` (tf5)."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or params
    theta = float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"model config: rope type {rope_type!r} is not supported "
                         "(supported: default, llama3)")
    try:
        return theta, Llama3RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
    except KeyError as err:
        raise ValueError(f"model config: llama3 rope scaling is missing {err.args[0]!r}") from None


def _eos_ids(cfg: dict[str, Any], gen: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (cfg.get("eos_token_id"), gen.get("eos_token_id")):
        for token in source if isinstance(source, list) else [source]:
            if token is not None and token not in ids:
                ids.append(int(token))
    return tuple(ids)


NAMED_CONFIGS: Mapping[str, ModelConfig] = MappingProxyType({
    "tiny": ModelConfig(
        hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1024, rms_norm_eps=1e-6,
        max_position_embeddings=2048, eos_token_ids=(1,), model_id="tiny"),
    "llama-3-8b": ModelConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                       original_max_position_embeddings=8192),
        max_position_embeddings=131072, eos_token_ids=(128001, 128008, 128009),
        model_id="meta-llama/Llama-3.1-8B"),
    "llama-3-70b": ModelConfig(  # (140 GB in bf16: served with --tensor-parallel)
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                       original_max_position_embeddings=8192),
        max_position_embeddings=131072, eos_token_ids=(128001, 128008, 128009),
        model_id="meta-llama/Llama-3.1-70B"),
    "mistral-7b": ModelConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32768, rms_norm_eps=1e-5, rope_theta=1000000.0,
        max_position_embeddings=32768, eos_token_ids=(2,), model_id="mistralai/Mistral-7B-v0.3"),
    "qwen3-8b": ModelConfig(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=151936, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960, qk_norm=True,
        eos_token_ids=(151645,), model_id="Qwen/Qwen3-8B"),
})
