"""Adapters of a mixture-of-experts base at a push (issue 41; common/peft/experts.py): a
registered Qwen3-MoE base (4 experts of 32, a dense layer) and a Mixtral one. PEFT's
target_parameters pairs and per-expert modules fit it; the store refuses, naming what it cannot
apply: LoRA on the router, an expert past the base's count, a dense MLP module in an MoE layer,
a targeted weight without tensors, a pair whose experts do not add up, both layouts in one file,
a target_parameters entry that is not an expert weight. Nothing is silently dropped."""

import json

import pytest
import safetensors.torch
import torch

from adapter_store.base_models import BaseModel
from adapter_store.validation import validate_adapter
from common.errors import FailedPrecondition, InvalidArgument
from tests.store.helpers import WEIGHTS

H, I_MOE, E, R = 64, 32, 4, 2
QWEN = {"model_type": "qwen3_moe", "hidden_size": H, "intermediate_size": 48,
        "moe_intermediate_size": I_MOE, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_hidden_layers": 2, "num_experts": E, "num_experts_per_tok": 2,
        "mlp_only_layers": [1]}
MIXTRAL = {"model_type": "mixtral", "hidden_size": H, "intermediate_size": I_MOE,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
           "num_local_experts": E, "num_experts_per_tok": 2}
PREFIX = "base_model.model.model.layers"


def base(config: dict) -> BaseModel:
    return BaseModel.from_config(f"org/{config['model_type']}", json.dumps(config))


def fused(layers=(0,), experts=E, which=("gate_up_proj", "down_proj")) -> dict:
    """PEFT target_parameters tensors: per layer one pair per expert weight (the inner one under
    base_layer. when both)."""
    g = torch.Generator().manual_seed(1)
    shapes = {"gate_up_proj": (H, 2 * I_MOE), "down_proj": (I_MOE, H)}
    out = {}
    for layer in layers:
        for depth, name in enumerate(reversed(which)):  # (the first registered: innermost)
            wrap = "base_layer." * (len(which) - 1 - depth)
            d_in, d_out = shapes[name]
            key = f"{PREFIX}.{layer}.mlp.experts.{wrap}"
            out[f"{key}lora_A.weight"] = torch.randn(R * experts, d_in, generator=g)
            out[f"{key}lora_B.weight"] = torch.randn(d_out, R * experts, generator=g)
    return out


def per_expert(parts=("gate_proj", "up_proj", "down_proj"), experts=range(E), block="mlp",
               layer=0) -> dict:
    g = torch.Generator().manual_seed(2)
    shapes = {"gate_proj": (H, I_MOE), "up_proj": (H, I_MOE), "down_proj": (I_MOE, H),
              "w1": (H, I_MOE), "w3": (H, I_MOE), "w2": (I_MOE, H)}
    out = {}
    for e in experts:
        for part in parts:
            key = f"{PREFIX}.{layer}.{block}.experts.{e}.{part}"
            out[f"{key}.lora_A.weight"] = torch.randn(R, shapes[part][0], generator=g)
            out[f"{key}.lora_B.weight"] = torch.randn(shapes[part][1], R, generator=g)
    return out


def config(target_modules=(), target_parameters=None, **extra) -> str:
    return json.dumps({"peft_type": "LORA", "r": R, "lora_alpha": 4,
                       "target_modules": list(target_modules),
                       "target_parameters": target_parameters, "base_model_name_or_path": "x",
                       **extra})


def validate(config_json: str, tensors: dict, on: BaseModel):
    return validate_adapter(config_json, WEIGHTS, safetensors.torch.save(tensors), base=on)


EXPERT_WEIGHTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def test_both_layouts_fit_an_moe_base_and_record_their_ranks_per_expert():
    qwen, mixtral = base(QWEN), base(MIXTRAL)
    assert qwen.moe_layers == (0,) and mixtral.moe_layers == (0, 1)
    spec = validate(config(target_parameters=EXPERT_WEIGHTS), fused(), qwen)
    assert spec.target_modules == ("experts.down_proj", "experts.gate_up_proj")
    assert spec.module_ranks == {f"experts.{e}.{p}": R for e in range(E)
                                 for p in ("gate_up_proj", "down_proj")}
    mixed = validate(config(["w1", "w3", "w2"]), per_expert(("w1", "w3", "w2"),
                                                            block="block_sparse_moe"), mixtral)
    assert mixed.module_ranks["experts.3.gate_up_proj"] == 2 * R  # gate's and up's rows
    one_sided = validate(config(target_parameters=EXPERT_WEIGHTS[:1]),
                         fused(which=("gate_up_proj",)), qwen)
    assert set(one_sided.module_ranks) == {f"experts.{e}.gate_up_proj" for e in range(E)}


@pytest.mark.parametrize("case", ["router", "router-in-targets", "expert past E", "dense in moe",
                                  "experts in a dense layer", "weight without tensors",
                                  "experts do not add up", "both layouts", "not an expert"])
def test_what_cannot_be_applied_is_refused_by_name(case):
    qwen = base(QWEN)
    c, t, error, match = {
        "router": (config(["gate_proj"]), {**per_expert(("gate_proj",)),
                                           f"{PREFIX}.0.mlp.gate.lora_A.weight": torch.zeros(2, H),
                                           f"{PREFIX}.0.mlp.gate.lora_B.weight": torch.zeros(E, 2)},
                   InvalidArgument, "router"),
        "router-in-targets": (config(["gate"]), per_expert(), InvalidArgument, "router"),
        "expert past E": (config(["down_proj"]), per_expert(("down_proj",), experts=[E]),
                          FailedPrecondition, f"expert {E} does not exist"),
        "dense in moe": (config(["down_proj"]), {
            f"{PREFIX}.0.mlp.down_proj.lora_A.weight": torch.zeros(R, 48),
            f"{PREFIX}.0.mlp.down_proj.lora_B.weight": torch.zeros(H, R)},
            FailedPrecondition, "is a mixture of experts"),
        "experts in a dense layer": (config(target_parameters=EXPERT_WEIGHTS),
                                     fused(layers=(1,)), FailedPrecondition, "has no experts"),
        "weight without tensors": (config(target_parameters=EXPERT_WEIGHTS),
                                   fused(which=("gate_up_proj",)), InvalidArgument,
                                   "other's tensors are missing"),
        "experts do not add up": (config(target_parameters=EXPERT_WEIGHTS),
                                  {**fused(), f"{PREFIX}.0.mlp.experts.lora_B.weight":
                                   torch.zeros(H, R * E - 1)}, InvalidArgument,
                                  "not \\[r \\* experts, in\\]"),
        "both layouts": (config(["down_proj"], EXPERT_WEIGHTS),
                         {**fused(), **per_expert(("down_proj",))}, InvalidArgument,
                         "one adapter uses one layout"),
        "not an expert": (config(target_parameters=["mlp.gate.weight"]), fused(),
                          InvalidArgument, "not supported: only an MoE layer's fused expert"),
    }[case]
    with pytest.raises(error, match=match):
        validate(c, t, qwen)


def test_an_expert_adapter_does_not_fit_a_dense_base():
    llama = BaseModel.from_config("org/llama", json.dumps({
        "model_type": "llama", "hidden_size": H, "intermediate_size": I_MOE,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}))
    with pytest.raises(FailedPrecondition, match="not a mixture-of-experts model"):
        validate(config(target_parameters=EXPERT_WEIGHTS), fused(), llama)


def test_a_gpt_oss_base_takes_fused_expert_lora_and_refuses_an_experts_own_gate():
    """gpt-oss interleaves its experts' gate and up: PEFT's target_parameters pairs fit it, an
    expert's own gate_proj / up_proj LoRA (no such adapters exist for it) is refused by name."""
    gpt_oss = base({"model_type": "gpt_oss", "hidden_size": H, "intermediate_size": I_MOE,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                    "num_hidden_layers": 2, "num_local_experts": E, "num_experts_per_tok": 2})
    assert gpt_oss.moe_layers == (0, 1) and gpt_oss.gate_up_interleaved
    assert validate(config(target_parameters=EXPERT_WEIGHTS), fused(), gpt_oss).module_ranks
    with pytest.raises(FailedPrecondition, match="interleaves its experts' gate and up"):
        validate(config(["gate_proj", "up_proj"]), per_expert(("gate_proj", "up_proj")),
                 gpt_oss)
    assert validate(config(["down_proj"]), per_expert(("down_proj",)), gpt_oss).module_ranks


def test_a_16_bit_experts_gate_and_up_of_different_scales_fold_at_fp32():
    """An expert's gate and up become one module, each part's scale folded into its block of B
    where the two differ: at fp32 (PEFT computes a 16-bit adapter's LoRA in fp32), so a bf16 file
    gives what an fp32 file of the same values gives (rounding the product to bf16 moved logits
    by ~4e-3)."""
    from common.peft.config import parse_config
    from common.peft.layout import plan_adapter
    from common.peft.safetensors_header import parse_header
    from common.peft.tensors import as_uint8, expert_tensors

    lora = parse_config(config(["gate_proj", "up_proj"], alpha_pattern={"up_proj": 3.0}))
    bf16 = {k: v.bfloat16() for k, v in per_expert(("gate_proj", "up_proj")).items()}

    def modules(tensors: dict) -> dict:
        raw = as_uint8(safetensors.torch.save(tensors))
        return expert_tensors(raw, plan_adapter(lora, parse_header(raw.numpy())))

    got, want = modules(bf16), modules({k: v.float() for k, v in bf16.items()})
    assert set(got) == set(want) and len(got) == E
    for key, (a, b, scale) in want.items():
        assert scale == 1.0  # (the parts' scales differ: folded into B)
        assert torch.equal(got[key][0].float(), a) and torch.equal(got[key][1].float(), b)
