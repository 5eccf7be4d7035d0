"""Adapters of other layouts at a push (adapter_store/validation.py, common/model_families.py):
a registered Phi-3 base has fused projections, so an adapter on qkv_proj / gate_up_proj fits it,
its B spanning the fused output, and one on q_proj does not (nor a fused one a LLaMA base);
Gemma's shapes come from its config with transformers' defaults (head_dim 256 when absent), a
multimodal Gemma 3's from its text_config."""

import json

import pytest
import safetensors.torch

from adapter_store.base_models import BaseModel
from adapter_store.validation import validate_adapter
from common.errors import FailedPrecondition, InvalidArgument
from tests.store.helpers import FFN, HIDDEN, KV, WEIGHTS, lora_config, lora_tensors

SHAPE = {"hidden_size": HIDDEN, "intermediate_size": FFN, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 2}
FUSED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def base(model_type: str, **extra) -> BaseModel:
    return BaseModel.from_config(f"org/{model_type}",
                                 json.dumps({**SHAPE, "model_type": model_type, **extra}))


def validate(targets, on: BaseModel, tensors=None):
    data = safetensors.torch.save(tensors or lora_tensors(targets))
    return validate_adapter(lora_config(targets), WEIGHTS, data, base=on)


def test_a_fused_adapter_fits_a_phi3_base_and_not_a_llama_one():
    phi3, llama = base("phi3"), base("llama")
    assert phi3.module_shapes == {"qkv_proj": (HIDDEN, HIDDEN + 2 * KV), "o_proj": (HIDDEN, HIDDEN),
                                  "gate_up_proj": (HIDDEN, 2 * FFN), "down_proj": (FFN, HIDDEN)}
    for targets in (FUSED, ("qkv_proj",), ("gate_up_proj", "down_proj")):
        assert validate(targets, phi3).target_modules == tuple(sorted(targets))
    all_linear = validate_adapter(  # (PEFT's keyword: whichever projections the model has)
        json.dumps({**json.loads(lora_config()), "target_modules": "all-linear"}), WEIGHTS,
        safetensors.torch.save(lora_tensors(FUSED)), base=phi3)
    assert all_linear.target_modules == tuple(sorted(FUSED))
    with pytest.raises(FailedPrecondition, match="'org/phi3' has no q_proj"):
        validate(("q_proj", "v_proj"), phi3)
    with pytest.raises(FailedPrecondition, match="'org/llama' has no qkv_proj"):
        validate(("qkv_proj",), llama)
    short = {k: t[:HIDDEN] if "lora_B" in k else t  # B of q alone: not the fused output
             for k, t in lora_tensors(("qkv_proj",)).items()}
    with pytest.raises(FailedPrecondition, match="256 output features, but qkv_proj of "
                                                 "'org/phi3' has 512"):
        validate(("qkv_proj",), phi3, short)


def test_gemma_shapes_take_transformers_defaults():
    gemma = base("gemma2")  # no head_dim in the file: Gemma's is 256, not hidden / heads
    assert gemma.module_shapes["q_proj"] == (HIDDEN, 4 * 256)
    assert base("gemma3_text", head_dim=64).module_shapes["k_proj"] == (HIDDEN, 2 * 64)
    # A multimodal Gemma 3's are its language model's (text_config; the top level's are not)
    multimodal = base("gemma3", text_config={**SHAPE, "head_dim": 64})
    assert multimodal.module_shapes == base("gemma3_text", head_dim=64).module_shapes
    with pytest.raises(InvalidArgument, match="text_config must be an object"):
        base("gemma3", text_config=[SHAPE])
