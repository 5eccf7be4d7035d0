"""The base-model families loraplex serves, by config.json's `model_type`, defined once: executors
read a model's numerics through it (executor/model_families.py), adapter stores the shapes a
pushed adapter must fit (adapter_store/base_models.py).

A config.json leaves out what its transformers config class assumes, and the classes assume
differently (Gemma's head_dim is 256 whatever hidden / heads is; its embeddings are tied unless
said otherwise). `read_config` fills those in, so a field absent from the file means what it
means to transformers.
"""

from __future__ import annotations

from typing import Any

from common.peft.modules import projection_shapes

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3")
# q/k/v and gate/up are single weights (qkv_proj, gate_up_proj), and adapters target them so
FUSED_MODEL_TYPES = ("phi3",)

_GEMMA = {"head_dim": 256, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
          "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
          "sliding_window": 4096}
# transformers' config class defaults for the fields loraplex reads (absent from the file)
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048},
    "mistral": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                "max_position_embeddings": 4096 * 32, "sliding_window": 4096},
    "qwen2": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 32768},
    "qwen3": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 32768},
    "gemma2": {**_GEMMA, "rope_theta": 10000.0, "max_position_embeddings": 8192,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3_text": {**_GEMMA, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0,
                    "max_position_embeddings": 131072, "sliding_window_pattern": 6},
    "phi3": {"rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
             "original_max_position_embeddings": 4096},
}


# A null in config.json turns these off; any other null means the default.
_NULL_IS_OFF = ("sliding_window", "attn_logit_softcapping", "final_logit_softcapping")


def read_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json's fields with its family's defaults under them; ValueError naming the
    model_type when loraplex does not serve its family."""
    model_type = cfg.get("model_type", "llama")
    if model_type == "gemma3":
        raise ValueError("model config: model_type 'gemma3' (Gemma 3 with its vision tower) is "
                         "not supported; serve its text model (model_type gemma3_text, "
                         "Gemma3ForCausalLM)")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model config: model_type {model_type!r} is not supported "
                         f"(supported: {', '.join(MODEL_TYPES)})")
    given = {k: v for k, v in cfg.items() if v is not None or k in _NULL_IS_OFF}
    return {**DEFAULTS[model_type], **given, "model_type": model_type}


def base_shapes(cfg: dict[str, Any]) -> tuple[int, dict[str, tuple[int, int]]]:
    """(layers, (in, out) features of each LoRA-targetable projection) of a config.json;
    ValueError naming the field at fault."""
    cfg = read_config(cfg)
    values = {}
    for field in ("hidden_size", "intermediate_size", "num_attention_heads",
                  "num_hidden_layers"):
        value = cfg.get(field)
        if not _is_count(value):
            raise ValueError(f"{field} must be a positive integer, got {value!r}")
        values[field] = value
    hidden, heads = values["hidden_size"], values["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    if not (_is_count(kv_heads) and _is_count(head_dim)):
        raise ValueError("num_key_value_heads and head_dim must be positive integers")
    return values["num_hidden_layers"], projection_shapes(
        hidden, values["intermediate_size"], heads, kv_heads, head_dim,
        fused=cfg["model_type"] in FUSED_MODEL_TYPES)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
