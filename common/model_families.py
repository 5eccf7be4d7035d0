"""The base-model families loraplex serves, by config.json's `model_type`, defined once: executors
read a model's numerics through it (executor/model/family_quirks.py), adapter stores the shapes a
pushed adapter must fit (adapter_store/base_models.py).

A config.json leaves out what its transformers config class assumes, and the classes assume
differently (Gemma's head_dim is 256 whatever hidden / heads is; its embeddings are tied unless
said otherwise). `read_config` fills those in, so a field absent from the file means what it
means to transformers.

A multimodal model (MULTIMODAL_MODEL_TYPES: Gemma 3's 4B, 12B and 27B, Gemma3ForConditional-
Generation, model_type "gemma3") is served as its language model, text in and text out: its
config.json nests that model's fields under "text_config", often only those that differ from
Gemma3TextConfig's defaults (gemma-3-4b states no heads), and `read_config` reads it as the text
model it holds. Its vision tower is never run (no request carries an image), so its config and
weights (executor/model/weights.py) and any LoRA on them (common/peft/modules.py) are skipped.
"""

from __future__ import annotations

from typing import Any

from common.peft.layout import BaseShapes
from common.peft.modules import projection_shapes

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3",
               "qwen3_moe", "mixtral", "gpt_oss")
# Mixture-of-experts families: some or all layers' MLP is experts behind a router (moe_layers)
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "gpt_oss")
# model_type of a multimodal model -> its language model's (text_config's), which is served
MULTIMODAL_MODEL_TYPES = {"gemma3": "gemma3_text"}
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
    "qwen3": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 32768,
              "head_dim": 128},
    "gemma2": {**_GEMMA, "rope_theta": 10000.0, "max_position_embeddings": 8192,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3_text": {**_GEMMA, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0,
                    "max_position_embeddings": 131072, "sliding_window_pattern": 6,
                    # (a multimodal checkpoint's text_config leaves these out where they hold)
                    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
                    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4},
    "phi3": {"rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
             "original_max_position_embeddings": 4096},
    "qwen3_moe": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 32768,
                  "num_local_experts": 128, "num_experts_per_tok": 8,
                  "moe_intermediate_size": 768,
                  "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "sliding_window": 4096},
    "mixtral": {"rms_norm_eps": 1e-5, "rope_theta": 1_000_000.0,
                "max_position_embeddings": 4096 * 32, "num_local_experts": 8,
                "num_experts_per_tok": 2},
    "gpt_oss": {"rms_norm_eps": 1e-5, "rope_theta": 150000.0, "max_position_embeddings": 131072,
                "num_local_experts": 128, "num_experts_per_tok": 4, "head_dim": 64,
                "sliding_window": 128, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
                "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "truncate": False,
                                    "original_max_position_embeddings": 4096}},
}


# A null in config.json turns these off; any other null means the default.
_NULL_IS_OFF = ("sliding_window", "attn_logit_softcapping", "final_logit_softcapping")


def is_multimodal(cfg: dict[str, Any]) -> bool:
    """Whether config.json is a multimodal model's, whose language model loraplex serves."""
    return cfg.get("model_type") in MULTIMODAL_MODEL_TYPES


def read_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json's fields with its family's defaults under them (a multimodal model's: its
    language model's, see the module docstring); ValueError naming the model_type when loraplex
    does not serve its family."""
    if is_multimodal(cfg):
        cfg = _language_model_config(cfg)
    model_type = cfg.get("model_type", "llama")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model config: model_type {model_type!r} is not supported "
                         f"(supported: {', '.join(MODEL_TYPES)})")
    given = {k: v for k, v in cfg.items() if v is not None or k in _NULL_IS_OFF}
    return {**DEFAULTS[model_type], **given, "model_type": model_type}


def _language_model_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config.json's text_config, with what transformers reads for its language model
    from the top level: the end-of-sequence ids (Google's files state them there), and whether
    the output head is the embeddings (Gemma3ForConditionalGeneration ties by the top-level
    field, True by default, whatever text_config says: transformers 5)."""
    text = cfg.get("text_config") or {}
    if not isinstance(text, dict):
        raise ValueError(f"model config: text_config must be an object, got {text!r}")
    eos = [t for source in (text.get("eos_token_id"), cfg.get("eos_token_id"))
           for t in (source if isinstance(source, list) else [source]) if t is not None]
    out = {**text, "model_type": MULTIMODAL_MODEL_TYPES[cfg["model_type"]],
           "tie_word_embeddings": cfg.get("tie_word_embeddings", True),
           "eos_token_id": list(dict.fromkeys(eos)) or None}
    if "_name_or_path" in cfg:
        out["_name_or_path"] = cfg["_name_or_path"]
    return out


def num_experts(cfg: dict[str, Any]) -> int:
    """Experts per MoE layer of a read_config'd config (0: a dense model). transformers takes
    num_experts as another name of num_local_experts: a file states either (Qwen's hub configs
    num_experts, transformers 5 writes num_local_experts); the defaults fill the latter only."""
    if cfg["model_type"] not in MOE_MODEL_TYPES:
        return 0
    return cfg.get("num_experts") or cfg.get("num_local_experts") or 0


def moe_layers(cfg: dict[str, Any]) -> tuple[int, ...]:
    """The layers whose MLP is a mixture of experts, as transformers builds them: every layer of
    Mixtral; Qwen3-MoE's but its mlp_only_layers and those off its decoder_sparse_step."""
    if not num_experts(cfg):
        return ()
    layers = range(cfg["num_hidden_layers"])
    if cfg["model_type"] != "qwen3_moe":
        return tuple(layers)
    step, dense = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or ())
    if not _is_count(step):
        raise ValueError(f"decoder_sparse_step must be a positive integer, got {step!r}")
    return tuple(i for i in layers if i not in dense and (i + 1) % step == 0)


def base_shapes(cfg: dict[str, Any]) -> BaseShapes:
    """What an adapter must fit in the model of a config.json (its model_id left ""); ValueError
    naming the field at fault."""
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
    experts, moe = num_experts(cfg), moe_layers(cfg)
    expert_size = cfg.get("moe_intermediate_size") if cfg["model_type"] == "qwen3_moe" else \
        values["intermediate_size"]
    if experts and not (_is_count(experts) and _is_count(expert_size)):
        raise ValueError("the number of experts and their intermediate size must be positive "
                         "integers")
    return BaseShapes("", values["num_hidden_layers"], projection_shapes(
        hidden, values["intermediate_size"], heads, kv_heads, head_dim,
        fused=cfg["model_type"] in FUSED_MODEL_TYPES, num_experts=experts,
        moe_intermediate_size=expert_size or 0,
        dense_mlp=len(moe) < values["num_hidden_layers"]), frozenset(moe),
        gate_up_interleaved=cfg["model_type"] == "gpt_oss")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
