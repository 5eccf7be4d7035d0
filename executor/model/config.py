"""ModelConfig: the shape and numerics of a served base model, every family quirk a field.

Built from a Hugging Face `config.json` by executor/model/family_quirks.py (which reads each
family's fields, tf4 or tf5 layout, and refuses a model_type it does not serve), or taken from
`NAMED_CONFIGS` for random-weight benchmarks. The forward (executor/model/transformer.py) reads only
these fields: nothing is assumed from a family's name.
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

from common.kv_layout import KVLayout
from common.peft.modules import projection_shapes
from executor.model.quant_config import Quantization
from executor.model.rope import LinearRopeScaling, Llama3RopeScaling, Rope, RopeScaling

# the MLP's act(gate) * up, by transformers' names (layer_ops.activation)
ACTIVATIONS = ("silu", "swish", "gelu_pytorch_tanh", "gelu", "gelu_new", "relu")
SLIDING, FULL = "sliding_attention", "full_attention"  # HF's layer_types


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
    rope_scaling: RopeScaling | None = None  # (on the global layers, when they differ)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and of k, before RoPE (Qwen3, Gemma 3)
    sliding_window: int | None = None  # a sliding layer's query sees only its last this many keys
    eos_token_ids: tuple[int, ...] = ()
    model_id: str = ""
    hidden_act: str = "silu"  # one of ACTIVATIONS (Gemma: gelu_pytorch_tanh)
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + weight), in fp32 (Gemma)
    sandwich_norms: bool = False  # also a norm on attention's and the MLP's outputs (Gemma)
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size) in the weights' dtype
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this), not 1/sqrt(D)
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    layer_types: tuple[str, ...] = ()  # SLIDING or FULL per layer; (): every layer slides when
    # sliding_window is set (Mistral, Phi-3)
    local_rope_theta: float | None = None  # sliding layers' RoPE base, default RoPE (Gemma 3)
    fused_projections: bool = False  # qkv_proj and gate_up_proj are single weights (Phi-3)
    # The checkpoint is a multimodal model's (Gemma 3 4B+): the text weights are its language
    # model's, beside a vision tower and projector that are never loaded (executor/model/weights.py)
    multimodal_checkpoint: bool = False
    # Mixture of experts (executor/model/moe.py; 0 experts: a dense model). The MLP of each of
    # `moe_layers` is `num_experts` experts of moe_intermediate_size, num_experts_per_tok of
    # them per token by a router: softmax over the experts in fp32, the top k, renormalised to
    # sum to 1 with norm_topk_prob; routing weights in fp32 with routing_in_fp32 (Mixtral),
    # else cast to the activations' dtype first (Qwen3-MoE). The other layers' MLP is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    routing_in_fp32: bool = False
    moe_layers: tuple[int, ...] = ()
    # gpt-oss's experts: the router's top k of its logits (a bias added), softmax over those
    # ("topk_softmax"; else "softmax_topk" as above); experts with biases; gate and up
    # interleaved (gate's outputs the even ones) under a clamped SwiGLU:
    #   (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g),  g = min(gate, limit)
    routing: str = "softmax_topk"
    moe_bias: bool = False
    swiglu_limit: float | None = None  # None: act(gate) * up, gate and up side by side
    swiglu_alpha: float = 1.702
    # gpt-oss's attention: o_proj has a bias too; each head a learned sink logit (a softmax
    # column with no value); its norms scale the fp32 normed input before the cast
    o_bias: bool = False
    attention_sinks: bool = False
    norm_fp32_weight: bool = False
    # A quantized base (executor/model/quant_config.py): how its projections' weights are stored and
    # served (executor/model/quant.py); None: full precision (gpt-oss's MXFP4 experts: dequantized
    # at load, None here too)
    quantization: Quantization | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size", "max_position_embeddings", "head_dim"):
            if name == "head_dim" and self.head_dim == 0:
                object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"model config: {name} must be a positive integer, got {value!r}")
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "moe_layers", tuple(self.moe_layers))
        self._check_experts()
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model config: num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        for name in ("rms_norm_eps", "rope_theta", "local_rope_theta", "query_pre_attn_scalar",
                     "attn_logit_softcap", "final_logit_softcap"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"model config: {name} must be > 0, got {value!r}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"model config: sliding_window must be > 0, got {self.sliding_window}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"model config: hidden_act {self.hidden_act!r} is not supported "
                             f"(supported: {', '.join(ACTIVATIONS)})")
        self._check_layer_types()
        if any(not 0 <= t < self.vocab_size for t in self.eos_token_ids):
            raise ValueError(f"model config: eos_token_ids {list(self.eos_token_ids)} must lie in "
                             f"[0, vocab_size={self.vocab_size})")

    def _check_experts(self) -> None:
        if not self.num_experts:
            if self.moe_layers:
                raise ValueError("model config: moe_layers without num_experts")
            return
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"model config: {name} must be a positive integer, got "
                                 f"{value!r}")
        if self.routing not in ("softmax_topk", "topk_softmax"):
            raise ValueError(f"model config: routing {self.routing!r} is not supported")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"model config: num_experts_per_tok ({self.num_experts_per_tok}) "
                             f"exceeds num_experts ({self.num_experts})")
        if any(not 0 <= i < self.num_hidden_layers for i in self.moe_layers):
            raise ValueError(f"model config: moe_layers {list(self.moe_layers)} lie outside "
                             f"the {self.num_hidden_layers} layers")

    def _check_layer_types(self) -> None:
        if not self.layer_types:
            return
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"model config: layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_hidden_layers} layers")
        unknown = set(self.layer_types) - {SLIDING, FULL}
        if unknown:
            raise ValueError(f"model config: layer type {sorted(unknown)[0]!r} is not supported "
                             f"({SLIDING}, {FULL})")
        if SLIDING in self.layer_types and self.sliding_window is None:
            raise ValueError("model config: sliding_attention layers need a sliding_window")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def attention_scale(self) -> float | None:
        """What q k^T is multiplied by before the softmax; None: 1 / sqrt(head_dim)."""
        return None if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar ** -0.5

    def is_sliding(self, layer: int) -> bool:
        if self.sliding_window is None:
            return False
        return not self.layer_types or self.layer_types[layer] == SLIDING

    def layer_window(self, layer: int) -> int | None:
        """The keys a query of `layer` sees: its last sliding_window, or all (None)."""
        return self.sliding_window if self.is_sliding(layer) else None

    def kv_layout(self, window_blocks: bool = True) -> KVLayout:
        """Which KV each layer keeps and where (common/kv_layout.py): with `window_blocks`, the
        sliding layers' own, for their window only."""
        return KVLayout.of([self.layer_window(layer) for layer in range(self.num_hidden_layers)],
                           window_blocks)

    @property
    def rope(self) -> Rope:
        """The rotary embedding of global layers (of every layer, but with local_rope_theta)."""
        return Rope(self.rope_theta, self.rope_scaling)

    @property
    def rope_switch_len(self) -> int:
        """A sequence of more tokens than this is computed with longrope's long factors, every
        position of it (executor/model/rope.py); 0: the model's RoPE has no switch."""
        return self.rope.switch_len

    def layer_rope(self, layer: int) -> Rope:
        if self.local_rope_theta is not None and self.is_sliding(layer):
            return Rope(self.local_rope_theta)
        return self.rope

    def is_moe_layer(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts."""
        return layer in self.moe_layers

    @property
    def gate_up_interleaved(self) -> bool:
        """Its experts' gate and up outputs interleave (gpt-oss: gate's are the even ones),
        which its clamped SwiGLU reads so; else gate's all come first."""
        return self.swiglu_limit is not None

    @property
    def has_dense_mlp(self) -> bool:
        """Some layer's MLP is dense (every layer's, in a dense model)."""
        return len(self.moe_layers) < self.num_hidden_layers

    @property
    def lora_modules(self) -> tuple[str, ...]:
        """The projections an adapter of this model may target, in the pool's order."""
        return tuple(self.projection_shapes())

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each LoRA-targetable projection."""
        return projection_shapes(self.hidden_size, self.intermediate_size,
                                 self.num_attention_heads, self.num_key_value_heads,
                                 self.head_dim, fused=self.fused_projections,
                                 num_experts=self.num_experts,
                                 moe_intermediate_size=self.moe_intermediate_size,
                                 dense_mlp=self.has_dense_mlp)

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of one of the LoRA-targetable projections."""
        shapes = self.projection_shapes()
        if module not in shapes:
            raise ValueError(f"the model has no {module} (its projections: "
                             f"{', '.join(shapes)})")
        return shapes[module]

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], *, generation_config: dict[str, Any] | None = None,
                     model_id: str = "") -> ModelConfig:
        """Build from the dict of an HF config.json (transformers 4 or 5 layout); ValueError
        naming the model_type when its family is not served (executor/model/family_quirks.py)."""
        from executor.model.family_quirks import config_fields

        return cls(**config_fields(cfg, generation_config or {}),
                   model_id=model_id or cfg.get("_name_or_path") or "")

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


def alternating_layers(num_layers: int, every: int) -> tuple[str, ...]:
    """Layer types of `num_layers` with every `every`-th layer global, the others sliding
    (transformers' default for Gemma 2, every 2nd, and Gemma 3, its sliding_window_pattern)."""
    return tuple(SLIDING if (i + 1) % every else FULL for i in range(num_layers))


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
    "mistral-7b-v0.1": ModelConfig(  # (v0.1: every layer slides over 4096 keys)
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=32768, sliding_window=4096, eos_token_ids=(2,),
        model_id="mistralai/Mistral-7B-v0.1"),
    "qwen3-8b": ModelConfig(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=151936, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960, qk_norm=True,
        eos_token_ids=(151645,), model_id="Qwen/Qwen3-8B"),
    "gemma-2-9b": ModelConfig(
        hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
        num_key_value_heads=8, vocab_size=256000, head_dim=256, rms_norm_eps=1e-6,
        max_position_embeddings=8192, tie_word_embeddings=True, sliding_window=4096,
        eos_token_ids=(1, 107), model_id="google/gemma-2-9b", hidden_act="gelu_pytorch_tanh",
        norm_unit_offset=True, sandwich_norms=True, scale_embeddings=True,
        query_pre_attn_scalar=256, attn_logit_softcap=50.0, final_logit_softcap=30.0,
        layer_types=alternating_layers(42, 2)),
    "gemma-3-12b": ModelConfig(
        hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
        num_key_value_heads=8, vocab_size=262208, head_dim=256, rms_norm_eps=1e-6,
        rope_theta=1000000.0, rope_scaling=LinearRopeScaling(8.0),
        max_position_embeddings=131072, tie_word_embeddings=True, qk_norm=True,
        sliding_window=1024, eos_token_ids=(1, 106), model_id="google/gemma-3-12b-pt",
        hidden_act="gelu_pytorch_tanh", norm_unit_offset=True, sandwich_norms=True,
        scale_embeddings=True, query_pre_attn_scalar=256, layer_types=alternating_layers(48, 6),
        local_rope_theta=10000.0),
    "qwen3-30b-a3b": ModelConfig(  # 128 experts of 768, top 8; every layer's MLP experts
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, vocab_size=151936, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960, qk_norm=True,
        eos_token_ids=(151645,), model_id="Qwen/Qwen3-30B-A3B", num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        moe_layers=tuple(range(48))),
    "mixtral-8x7b": ModelConfig(  # 8 experts of 14336, top 2
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, rms_norm_eps=1e-5, rope_theta=1000000.0,
        max_position_embeddings=32768, eos_token_ids=(2,),
        model_id="mistralai/Mixtral-8x7B-v0.1", num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=14336, routing_in_fp32=True, moe_layers=tuple(range(32))),
    "phi-3-mini": ModelConfig(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32064, rms_norm_eps=1e-5,
        max_position_embeddings=4096, sliding_window=2047, eos_token_ids=(32000, 32001, 32007),
        model_id="microsoft/Phi-3-mini-4k-instruct", fused_projections=True),
})
