"""Gemma 3 multimodal checkpoints (model_type "gemma3", Gemma3ForConditionalGeneration: Gemma 3
4B and up) served as their language model, text in and text out: a tiny random one saved by
transformers and a copy under the other key layout, with PEFT adapters made on it (one on the
language model's projections by a regex and full-path patterns, one "all-linear" that also adapts
the vision tower) in both namings PEFT writes: greedy tokens and logits equal HF + PEFT's on
text-only input, alone and batched beside a base row. The vision tower's weights are never read,
and its LoRA is set aside, not served."""

import json

import pytest
import torch

from common.peft.modules import LAYERS_PATHS
from executor.lora.peft_adapter import parse_peft_adapter
from executor.model.config import NAMED_CONFIGS, ModelConfig
from executor.runner import ModelRunner
from loraplex import fixtures
from tests import multimodal
from tests.oracle import assert_matches_hf, made_adapters
from tests.runner_driver import BLOCK, prompts, read_folder, run

ADAPTERS = multimodal.ADAPTERS
NUM_TOKENS = 10


# google/gemma-3-12b-it's config.json as transformers 4.50 wrote it: text_config states only what
# differs from Gemma3TextConfig's defaults (not its vocabulary, head_dim or RoPE bases)
GEMMA_3_12B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
    "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
    "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
    "text_config": {"hidden_size": 3840, "intermediate_size": 15360, "model_type": "gemma3_text",
                    "num_attention_heads": 16, "num_hidden_layers": 48, "num_key_value_heads": 8,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16,
                      "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}


def test_the_config_is_read_as_transformers_builds_its_language_model():
    """Per layer, the window, attention scale and rotary frequencies of the language model of
    the Gemma3ForConditionalGeneration built from the config; its head tied by the top-level
    field (True here, text_config's False); end-of-sequence ids from both levels."""
    from transformers import AutoModelForCausalLM

    hf_config = fixtures.tiny_config("gemma3", **multimodal.TEXT)
    hf_config.tie_word_embeddings = True
    raw = {**json.loads(hf_config.to_json_string()), "eos_token_id": [1, 106 % 1024]}
    assert raw["text_config"]["tie_word_embeddings"] is False
    ours = ModelConfig.from_hf_dict(raw)
    model = AutoModelForCausalLM.from_config(hf_config)
    language_model = model.model.language_model
    assert ours.tie_word_embeddings == (model.lm_head.weight is language_model.embed_tokens.weight)
    assert ours.tie_word_embeddings and ours.eos_token_ids == (1, 106)
    for i, layer in enumerate(language_model.layers):
        assert ours.layer_window(i) == layer.self_attn.sliding_window
        assert ours.attention_scale == layer.self_attn.scaling
        kind = hf_config.text_config.layer_types[i]
        inv_freq = getattr(language_model.rotary_emb, f"{kind}_inv_freq")
        assert torch.equal(ours.layer_rope(i).inv_freq(ours.head_dim), inv_freq)
    assert ours.final_logit_softcap is None  # (Gemma3ForConditionalGeneration applies none)
    with pytest.raises(ValueError, match="text_config must be an object"):
        ModelConfig.from_hf_dict({"model_type": "gemma3", "text_config": "gemma3_text"})


def test_gemma_3_12b_is_the_named_config_random_gemma_3_12b():
    """What `loraplex budget --model random:gemma-3-12b` plans is the real checkpoint's text
    model: its sparse text_config read with transformers' defaults."""
    from transformers import Gemma3Config

    ours = ModelConfig.from_hf_dict(GEMMA_3_12B, model_id="google/gemma-3-12b-pt")
    assert ours == NAMED_CONFIGS["gemma-3-12b"].replace(multimodal_checkpoint=True)
    text = Gemma3Config(**GEMMA_3_12B).text_config
    assert (ours.vocab_size, ours.head_dim, ours.query_pre_attn_scalar, ours.layer_types) == (
        text.vocab_size, text.head_dim, text.query_pre_attn_scalar, tuple(text.layer_types))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(folder, the checkpoint as saved, its renamed copy, HF + PEFT with the adapters loaded)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("gemma3")
    model_dir = multimodal.save_model(out / "model")
    renamed = multimodal.renamed_model(model_dir, out / "model_new")
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(base).__name__ == "Gemma3ForConditionalGeneration"
    hf = made_adapters(base, out, ADAPTERS, seed=60)
    for name in ADAPTERS:
        multimodal.old_naming(out / name, out / f"{name}_old")
    return out, model_dir, renamed, hf


def test_the_checkpoint_and_adapters_are_what_transformers_and_peft_write(gemma3):
    out, model_dir, renamed, _ = gemma3
    saved = multimodal.tensor_names(model_dir, "model.safetensors")
    assert "language_model.model.layers.0.self_attn.q_proj.weight" in saved
    assert "language_model.lm_head.weight" in saved
    assert any(n.startswith("vision_tower.") for n in saved)
    assert "lm_head.weight" in multimodal.tensor_names(renamed, "model.safetensors")
    lora = multimodal.tensor_names(out / "all_linear", multimodal.WEIGHTS)
    assert any(n.startswith("base_model.model.model.vision_tower.") for n in lora)
    assert any(n.startswith("base_model.model.model.language_model.layers.") for n in lora)
    assert not any("vision_tower" in n for n in multimodal.tensor_names(out / "lm",
                                                                           multimodal.WEIGHTS))
    config = ModelConfig.from_pretrained(model_dir)
    assert config.multimodal_checkpoint and config.layer_types[:2] == ("sliding_attention",
                                                                       "full_attention")


@pytest.mark.parametrize("layout", ["as_saved", "renamed"])
def test_adapters_alone_and_batched_match_hf_peft(gemma3, layout):
    """The checkpoint as saved with adapters in PEFT's new naming; its renamed copy with them in
    the old one (each pair's tensors are the same)."""
    out, model_dir, renamed, hf = gemma3
    suffix = "" if layout == "as_saved" else "_old"
    runner = ModelRunner.from_pretrained(model_dir if layout == "as_saved" else renamed,
                                         num_kv_blocks=512, block_size=BLOCK,
                                         num_slots=len(ADAPTERS), max_rank=8,
                                         lora_backend="torch")
    for slot, name in enumerate(ADAPTERS):
        weights = parse_peft_adapter(*read_folder(out / f"{name}{suffix}"), runner.config,
                                     check_base_model=False)
        assert {module for _, module in weights.modules} <= set(runner.config.lora_modules)
        runner.load_adapter(slot, weights)
    names = [*ADAPTERS, None, "lm"]
    slots = [list(ADAPTERS).index(n) if n else -1 for n in names]
    requests = {sid: (p, slot) for sid, (p, slot) in enumerate(zip(prompts(len(names), 7), slots))}
    batched = run(runner, requests, NUM_TOKENS, chunk=5, admit=len(names))
    assert_matches_hf(hf, requests, names, batched, NUM_TOKENS, atol=1e-4)
    for sid in (0, 1):
        assert run(runner, {sid: requests[sid]}, NUM_TOKENS)[sid][0] == batched[sid][0]


def test_the_vision_tower_lora_is_set_aside_and_the_layers_named(gemma3):
    from common.peft.config import parse_config
    from common.peft.layout import plan_adapter
    from common.peft.safetensors_header import parse_header

    out, *_ = gemma3
    for suffix, layers in (("", LAYERS_PATHS[1]), ("_old", LAYERS_PATHS[2])):
        config_json, data = read_folder(out / f"all_linear{suffix}")
        layout = plan_adapter(parse_config(config_json), parse_header(data))
        assert layout.layers == layers
        assert layout.target_modules == ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                         "up_proj", "v_proj")
        assert layout.unserved and all("vision_tower" in n for n in layout.unserved)
        assert all(m.path.startswith(layers + ".") for m in layout.modules.values())
    lm = plan_adapter(*[f(x) for f, x in zip((parse_config, parse_header),
                                             read_folder(out / "lm"))])
    assert lm.modules[1, "down_proj"].rank == 4 and lm.modules[2, "o_proj"].alpha == 64
    assert torch.tensor(lm.modules[2, "o_proj"].scale) == 8  # 64 / 8: its full-path alpha
