"""A model's family from its config.json (executor/model/family_quirks.py): for every served
model_type, what ModelConfig reads is what transformers' own model of that config does, layer by
layer (its attention's window and scale, its rotary frequencies, its tied head); a model_type
loraplex does not serve is refused when the executor starts, naming it."""

import json
import subprocess
import sys

import pytest
import torch

from common.model_families import MODEL_TYPES
from executor.model.config import ACTIVATIONS, ModelConfig
from executor.model.layer_ops import activation
from loraplex import fixtures

# Per family, a config with every quirk away from its default (tf5 layout, as transformers
# writes it), so a field read wrongly, or assumed, shows.
QUIRKS = {
    "llama": {"tie_word_embeddings": True, "head_dim": 48},
    "mistral": {"sliding_window": 7},
    "qwen2": {"tie_word_embeddings": True, "use_sliding_window": True, "sliding_window": 6,
              "max_window_layers": 2},
    "qwen3": {"head_dim": 48, "use_sliding_window": True, "sliding_window": 5,
              "max_window_layers": 1},
    "gemma2": {"sliding_window": 5, "query_pre_attn_scalar": 40, "head_dim": 32,
               "layer_types": ["full_attention", "sliding_attention"] * 2},
    "gemma3_text": {"sliding_window": 9, "sliding_window_pattern": 3, "rope_local_base_freq": 77.0,
                    "rope_scaling": {"rope_type": "linear", "factor": 2.0},
                    "tie_word_embeddings": True},
    "phi3": {"sliding_window": 11},
    "qwen3_moe": {"num_experts": 6, "num_experts_per_tok": 3, "moe_intermediate_size": 40,
                  "mlp_only_layers": [2], "decoder_sparse_step": 1, "norm_topk_prob": True,
                  "use_sliding_window": True, "sliding_window": 13},
    "mixtral": {"num_local_experts": 5, "num_experts_per_tok": 2, "sliding_window": 7},
    "gpt_oss": {"num_local_experts": 5, "num_experts_per_tok": 3, "sliding_window": 9,
                "head_dim": 32, "swiglu_limit": 3.0, "max_position_embeddings": 512},
}


@pytest.mark.parametrize("attention_bias", [False, True])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_each_family_is_read_as_transformers_builds_it(model_type, attention_bias):
    """(attention_bias: some families put a bias on q, k, v and o with it, Qwen2 on q, k, v
    always, others ignore it)"""
    from transformers import AutoModelForCausalLM

    hf_config = fixtures.tiny_config(model_type, **QUIRKS[model_type],
                                     **({"attention_bias": True} if attention_bias else {}))
    ours = ModelConfig.from_hf_dict(json.loads(hf_config.to_json_string()))
    model = AutoModelForCausalLM.from_config(hf_config)
    assert ours.tie_word_embeddings == (model.lm_head.weight is model.model.embed_tokens.weight)
    rotary = model.model.rotary_emb
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        # (Mistral's and Phi-3's attention passes the config's window to every layer)
        window = (attn.sliding_window if hasattr(attn, "sliding_window")
                  else getattr(hf_config, "sliding_window", None))
        assert ours.layer_window(i) == window
        assert (ours.attention_scale or ours.head_dim ** -0.5) == attn.scaling
        assert attn.head_dim == ours.head_dim
        kind = hf_config.layer_types[i] if model_type == "gemma3_text" else ""
        inv_freq = getattr(rotary, f"{kind}_inv_freq" if kind else "inv_freq")
        assert torch.equal(ours.layer_rope(i).inv_freq(ours.head_dim), inv_freq)
        assert ours.rope.attention_factor == getattr(rotary, "attention_scaling", 1.0)
        experts = getattr(layer.mlp, "experts", None)
        assert ours.is_moe_layer(i) == (experts is not None)
        if experts is not None:
            assert experts.gate_up_proj.shape[0] == ours.num_experts
            assert tuple(experts.down_proj.shape[1:]) == (
                (ours.moe_intermediate_size, ours.hidden_size) if ours.gate_up_interleaved
                else (ours.hidden_size, ours.moe_intermediate_size))
            router = getattr(layer.mlp, "gate", None) or layer.mlp.router
            assert router.top_k == ours.num_experts_per_tok
            assert getattr(router, "norm_topk_prob", True) == ours.norm_topk_prob or \
                ours.routing == "topk_softmax"
    attn = model.model.layers[0].self_attn
    qkv = getattr(attn, "q_proj", None) or attn.qkv_proj
    assert ours.attention_bias == (qkv.bias is not None)
    assert ours.o_bias == (attn.o_proj.bias is not None)
    assert ours.fused_projections == hasattr(model.model.layers[0].self_attn, "qkv_proj")
    assert ours.qk_norm == hasattr(model.model.layers[0].self_attn, "q_norm")
    assert ours.sandwich_norms == hasattr(model.model.layers[0], "post_feedforward_layernorm")


@pytest.mark.parametrize("config, name", [({"model_type": "gpt2"}, "'gpt2'"),
                                          ({"model_type": "paligemma"}, "'paligemma'"),
                                          ({"model_type": "qwen2_moe"}, "'qwen2_moe'")])
def test_an_unserved_model_type_is_refused_at_executor_start(tmp_path, config, name):
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": 64}))
    run = subprocess.run(
        [sys.executable, "-m", "loraplex.cli", "serve", "executor", "--model", str(tmp_path),
         "--store", "127.0.0.1:1", "--address", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 1
    assert f"model_type {name}" in run.stderr and "is not supported" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "mistral", "phi3"])
def test_a_config_without_head_dim_means_transformers_default(model_type):
    """Qwen3's config class says 128 whatever hidden / heads is; the others hidden / heads."""
    hf_config = fixtures.tiny_config(model_type)
    raw = json.loads(hf_config.to_json_string())
    raw.pop("head_dim", None)
    theirs = type(hf_config)(**raw)
    assert ModelConfig.from_hf_dict(raw).head_dim == (
        getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads)


ROPES = {"llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
         "yarn": {"factor": 4.0}, "longrope": {"short_factor": [1.0] * 32,
                                               "long_factor": [2.0] * 32}}


@pytest.mark.parametrize("rope_type", list(ROPES))
@pytest.mark.parametrize("top_level, in_dict", [(None, 64), (16, 64), (16, None), (None, None)])
def test_original_max_position_embeddings_is_read_as_transformers_reads_it(rope_type, top_level,
                                                                           in_dict):
    """The config's top-level value wins over the rope dict's; with neither,
    max_position_embeddings (transformers' standardize_rope_params)."""
    from transformers import AutoModelForCausalLM

    rope = {"rope_type": rope_type, "rope_theta": 10000.0, **ROPES[rope_type]}
    if in_dict is not None:
        rope["original_max_position_embeddings"] = in_dict
    extra = {} if top_level is None else {"original_max_position_embeddings": top_level}
    hf_config = fixtures.tiny_config("llama", rope_parameters=rope, max_position_embeddings=256,
                                     **extra)
    ours = ModelConfig.from_hf_dict(json.loads(hf_config.to_json_string()))
    rotary = AutoModelForCausalLM.from_config(hf_config).model.rotary_emb
    assert ours.rope.scaling.original_max_position_embeddings == (top_level or in_dict or 256)
    assert torch.equal(ours.rope.inv_freq(ours.head_dim), rotary.inv_freq)
    assert ours.rope.attention_factor == pytest.approx(rotary.attention_scaling, rel=1e-12)


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_each_activation_is_transformers_own_bit_for_bit(name):
    from transformers.activations import ACT2FN

    x = torch.randn(64, 33, generator=torch.Generator().manual_seed(0)) * 4
    assert torch.equal(activation(name)(x), ACT2FN[name](x))
