"""A served model's family, detected from its config.json, and every quirk of it read from there
into ModelConfig's fields (executor/model/config.py). transformers 4 and 5 layouts alike; absent
fields mean what they mean to transformers (common/model_families.py fills in its defaults).

    llama, mistral, qwen2   the LLaMA layout (qwen2: q/k/v biases; mistral: every layer slides)
    qwen3                   + per-head q/k RMSNorm, head_dim from the config
    gemma2                  (1 + w) RMSNorm, norms before and after attention and the MLP, GELU
                            (tanh), embeddings times sqrt(hidden), query_pre_attn_scalar, soft-
                            capped attention scores and logits, sliding layers between global ones
    gemma3_text             Gemma 2's, + q/k norms, its own layer pattern, a RoPE base of its own
                            on sliding layers, linear RoPE scaling on global ones; no score cap
    phi3                    fused qkv_proj / gate_up_proj (adapters target them), every layer
                            slides when sliding_window is set, longrope read from the config
                            (Phi-3-128k, Phi-3.5): served up to max_position_embeddings, short
                            factors within original_max_position_embeddings, long ones past it
                            (executor/model/rope.py)
    gemma3 (multimodal)     its language model, a gemma3_text (text_config, common/model_families
                            .py), as Gemma3ForConditionalGeneration computes text-only input: no
                            final soft cap (its forward applies none); the weights under its
                            language model, the vision tower's skipped
    qwen3_moe               Qwen3's attention; the MLP of every layer but its mlp_only_layers
                            (and those off decoder_sparse_step) is num_experts experts of
                            moe_intermediate_size, top num_experts_per_tok by softmax, renormalised
                            with norm_topk_prob, weights cast to the activations' dtype; every
                            layer slides when use_sliding_window is set
    qwen2, qwen3            with use_sliding_window, a window on the layers layer_types names
                            (by default those from max_window_layers on)
    mixtral                 the LLaMA layout's attention (sliding when sliding_window is set);
                            every MLP is num_local_experts experts of intermediate_size, top
                            num_experts_per_tok by softmax, renormalised, weights kept in fp32
    gpt_oss                 q/k/v/o biases, each head's attention sink, sliding layers between
                            full ones (layer_types), YaRN RoPE, norms scaled in fp32; every MLP
                            experts with biases behind a router with a bias, top k of its logits
                            then softmax, gate and up interleaved under a clamped SwiGLU; its
                            MXFP4 expert weights (quantization_config mxfp4) dequantized at load

A quantized base of a dense family (quantization_config: compressed-tensors, fp8, gptq, awq,
bitsandbytes) is read by executor/model/quant_config.py, which refuses what it does not serve by
name.

Anything a family may state that loraplex does not compute is refused with the field's name:
never served approximately.
"""

from __future__ import annotations

from typing import Any

from common.model_families import (
    FUSED_MODEL_TYPES,
    is_multimodal,
    moe_layers,
    num_experts,
    read_config,
)
from executor.model.config import FULL, SLIDING, alternating_layers
from executor.model.quant_config import parse_quantization
from executor.model.rope import Rope, parse_rope

# Families whose attention_bias puts a bias on q, k, v and o alike (transformers' modeling code)
BIAS_FROM_CONFIG = ("llama", "qwen3", "gemma2", "gemma3_text", "qwen3_moe")


def _qwen_window(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen2's and Qwen3's window, as transformers reads it: none without use_sliding_window;
    with it, on the layers layer_types says slide, by default those from max_window_layers
    (28) on."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    if window is None:
        return {"sliding_window": None}
    first = cfg.get("max_window_layers", 28)
    return {"sliding_window": window, "layer_types": tuple(cfg.get("layer_types") or (
        SLIDING if i >= first else FULL for i in range(cfg["num_hidden_layers"])))}


def config_fields(raw: dict[str, Any], generation_config: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's fields (all but model_id) of an HF config.json dict."""
    cfg = read_config(raw)
    model_type = cfg["model_type"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "vocab_size"):
        if cfg.get(key) is None:
            raise ValueError(f"model config: missing required field {key!r}")
    if cfg.get("mlp_bias"):
        raise ValueError("model config: mlp_bias=true is not supported")
    # (a multimodal checkpoint states it beside its text_config)
    stated = raw.get("quantization_config") or cfg.get("quantization_config")
    method = stated.get("quant_method") if isinstance(stated, dict) else stated
    if stated and num_experts(cfg) and not (model_type == "gpt_oss" and method == "mxfp4"):
        raise ValueError(f"model config: quantization_config {method!r} is not supported on a "
                         f"mixture of experts ({model_type}: quantized experts are served for "
                         "gpt-oss's mxfp4 only)")
    quantization = parse_quantization(stated, model_type)
    is_gemma = model_type in ("gemma2", "gemma3_text")
    # (Gemma's MLP reads hidden_activation; its hidden_act is a leftover transformers ignores)
    act = cfg.get("hidden_activation") if is_gemma else cfg.get("hidden_act", "silu")
    heads = cfg["num_attention_heads"]
    # (these families' q, k, v and o projections all carry a bias with attention_bias; Qwen2's
    # q, k, v always do, its o never; Mistral, Mixtral and Phi-3 ignore the flag)
    attention_bias = model_type in BIAS_FROM_CONFIG and bool(cfg.get("attention_bias"))
    fields: dict[str, Any] = dict(
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        vocab_size=cfg["vocab_size"],
        head_dim=cfg.get("head_dim") or 0,
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        max_position_embeddings=cfg["max_position_embeddings"],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=model_type in ("qwen2", "gpt_oss") or attention_bias,
        o_bias=attention_bias,
        qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe"),
        eos_token_ids=_eos_ids(cfg, generation_config),
        hidden_act=act,
        fused_projections=model_type in FUSED_MODEL_TYPES,
        quantization=quantization,
    )
    head_dim = fields["head_dim"] or fields["hidden_size"] // heads
    if model_type == "qwen3_moe":  # (every layer slides, with use_sliding_window only)
        fields["sliding_window"] = cfg.get("sliding_window") if cfg.get("use_sliding_window") \
            else None
    elif model_type in ("qwen2", "qwen3"):
        fields.update(_qwen_window(cfg))
    else:
        fields["sliding_window"] = cfg.get("sliding_window")
    if num_experts(cfg):
        fields.update(_experts(cfg))
    if model_type == "gpt_oss":
        fields.update(_gpt_oss(cfg))
    if is_gemma:
        fields.update(_gemma(cfg, model_type))
    if is_multimodal(raw):
        # (Gemma3ForConditionalGeneration's head is lm_head alone: text_config's cap is unread)
        fields.update(multimodal_checkpoint=True, final_logit_softcap=None)
    if model_type == "gemma3_text":
        global_rope, local_theta = _gemma3_ropes(cfg, head_dim, fields["max_position_embeddings"])
        fields.update(rope_theta=global_rope.theta, rope_scaling=global_rope.scaling,
                      local_rope_theta=local_theta)
    else:
        rope = _rope(cfg, head_dim)
        fields.update(rope_theta=rope.theta, rope_scaling=rope.scaling)
    return fields


def _experts(cfg: dict[str, Any]) -> dict[str, Any]:
    is_qwen = cfg["model_type"] == "qwen3_moe"
    return dict(num_experts=num_experts(cfg), num_experts_per_tok=cfg["num_experts_per_tok"],
                moe_intermediate_size=(cfg["moe_intermediate_size"] if is_qwen
                                       else cfg["intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob")) if is_qwen else True,
                routing_in_fp32=not is_qwen, moe_layers=moe_layers(cfg))


def _gpt_oss(cfg: dict[str, Any]) -> dict[str, Any]:
    layer_types = cfg.get("layer_types") or alternating_layers(cfg["num_hidden_layers"], 2)
    return dict(o_bias=True, attention_sinks=True, norm_fp32_weight=True,
                layer_types=tuple(layer_types), routing="topk_softmax", moe_bias=True,
                swiglu_limit=float(cfg["swiglu_limit"]), swiglu_alpha=float(cfg["swiglu_alpha"]),
                norm_topk_prob=False, routing_in_fp32=False)


def _gemma(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"model config: {model_type} use_bidirectional_attention=true is not "
                         "supported (a decoder serves causal attention)")
    num_layers = cfg["num_hidden_layers"]
    layer_types = cfg.get("layer_types")
    if not layer_types:  # transformers' defaults: Gemma 2 alternates; Gemma 3 by its pattern
        every = 2 if model_type == "gemma2" else cfg["sliding_window_pattern"]
        if not isinstance(every, int) or isinstance(every, bool) or every <= 0:
            raise ValueError(f"model config: sliding_window_pattern must be a positive integer, "
                             f"got {every!r}")
        layer_types = alternating_layers(num_layers, every)
    return dict(
        norm_unit_offset=True, sandwich_norms=True, scale_embeddings=True,
        query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]),
        # (Gemma 3's attention never passes its cap on: transformers ignores the field there)
        attn_logit_softcap=(_cap(cfg, "attn_logit_softcapping") if model_type == "gemma2"
                            else None),
        final_logit_softcap=_cap(cfg, "final_logit_softcapping"),
        layer_types=tuple(layer_types))


def _cap(cfg: dict[str, Any], key: str) -> float | None:
    value = cfg.get(key)
    return None if value is None else float(value)


def _rope(cfg: dict[str, Any], head_dim: int) -> Rope:
    """One rope for every layer: `rope_scaling` + `rope_theta` (tf4) or `rope_parameters` (tf5)."""
    params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta") or cfg["rope_theta"])
    scaling = cfg.get("rope_scaling") or params
    if cfg["model_type"] == "phi3" and (scaling.get("rope_type") or scaling.get("type")) == "yarn":
        scaling = {**scaling, "rope_type": "longrope"}  # (transformers reads Phi-3's so)
    if float(cfg.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ValueError(f"model config: partial_rotary_factor {cfg['partial_rotary_factor']} is "
                         "not supported (only 1.0)")
    return parse_rope(scaling, theta=theta, head_dim=head_dim,
                      max_position_embeddings=cfg["max_position_embeddings"],
                      original_max_position_embeddings=cfg.get("original_max_position_embeddings"))


def _gemma3_ropes(cfg: dict[str, Any], head_dim: int, max_pos: int) -> tuple[Rope, float]:
    """(global layers' rope, sliding layers' base): tf5 keeps one rope_parameters per layer type,
    tf4 rope_theta / rope_scaling (global) and rope_local_base_freq."""
    params = cfg.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        full, local = params.get(FULL) or {}, params.get(SLIDING) or {}
        theta = float(full.get("rope_theta") or cfg["rope_theta"])
        local_theta = float(local.get("rope_theta") or cfg["rope_local_base_freq"])
        if (local.get("rope_type") or "default") != "default":
            raise ValueError(f"model config: rope type {local['rope_type']!r} on sliding layers "
                             "is not supported (only default)")
    else:
        full = cfg.get("rope_scaling") or params
        theta = float(params.get("rope_theta") or cfg["rope_theta"])
        local_theta = float(cfg["rope_local_base_freq"])
    return parse_rope(full, theta=theta, head_dim=head_dim, max_position_embeddings=max_pos), \
        local_theta


def _eos_ids(cfg: dict[str, Any], gen: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (cfg.get("eos_token_id"), gen.get("eos_token_id")):
        for token in source if isinstance(source, list) else [source]:
            if token is not None and token not in ids:
                ids.append(int(token))
    return tuple(ids)
