"""What a quantized base is refused for (issue 44), each by name: a method, bit width or layout
not served (at config, before any weight is read); a checkpoint whose tensors do not fit its
weights or its config; a tensor-parallel cut that would split a group; a quantized embedding or
lm_head; merging an adapter into a quantized projection (nothing changes)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from executor.model.config import ModelConfig
from executor.model.weights import load_weights
from executor.runner import ModelRunner
from executor.tp.shards import Shard
from tests.executor import quant_checkpoints as qc
from tests.oracle import made_adapters
from tests.runner_driver import BLOCK, load_folders

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 128}
CT = {"quant_method": "compressed-tensors", "format": "pack-quantized",
      "quantization_status": "compressed"}
INT4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}


def ct(weights=None, activations=None, **top):
    group = {"targets": ["Linear"], "weights": weights or INT4, "input_activations": activations}
    return {**CT, "config_groups": {"group_0": group}, **top}


REFUSED = {  # quantization_config -> what the message names
    "hqq": ({"quant_method": "hqq"}, "quantization_config 'hqq' is not supported"),
    "gptq-3bit": ({"quant_method": "gptq", "bits": 3, "group_size": 128},
                  "'gptq': 3-bit weights"),
    "gptq-marlin": ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"},
                    "checkpoint_format 'marlin'"),
    "gptq-lm-head": ({"quant_method": "gptq", "bits": 4, "lm_head": True},
                     "a quantized lm_head"),
    "awq-gemv": ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version 'gemv'"),
    "awq-8bit": ({"quant_method": "awq", "bits": 8, "version": "gemm"}, "8-bit weights"),
    "bnb-int8": ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "load_in_8bit"),
    "bnb-storage": ({"quant_method": "bitsandbytes", "load_in_4bit": True,
                     "bnb_4bit_quant_storage": "bfloat16"}, "bnb_4bit_quant_storage"),
    "fp8-e5m2": ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]},
                 "fmt 'e5m2'"),
    "fp8-no-blocks": ({"quant_method": "fp8", "activation_scheme": "dynamic"},
                      "weight_block_size None"),
    "fbgemm-bound": ({"quant_method": "fbgemm_fp8", "activation_scale_ub": -1.0},
                     "activation_scale_ub -1.0"),
    "ct-nvfp4": (ct(format="nvfp4-pack-quantized"), "format 'nvfp4-pack-quantized'"),
    "ct-int2": (ct({**INT4, "num_bits": 2}), "int2 weights"),
    "ct-w8a8-int": (ct({**INT4, "num_bits": 8}, {"num_bits": 8, "type": "int"}),
                    "int8 weights with quantized activations"),
    "ct-fp4": (ct({"num_bits": 4, "type": "float", "strategy": "tensor_group"},
                  format="float-quantized"), "float weights of 4 bits"),
    "ct-kv-cache": (ct(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
    "ct-token-groups": (ct({"num_bits": 8, "type": "float", "strategy": "channel"},
                           {"num_bits": 8, "type": "float", "strategy": "group", "dynamic": True},
                           format="float-quantized"), "activation strategy 'group'"),
    "ct-frozen": (ct(quantization_status="frozen"), "quantization_status 'frozen'"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_is_not_served_is_refused_at_config_by_name(case):
    quantization, words = REFUSED[case]
    with pytest.raises(ValueError, match="quantization_config") as err:
        ModelConfig.from_hf_dict({**LLAMA, "quantization_config": quantization})
    assert words in str(err.value)


def test_a_quantized_mixture_of_experts_is_refused_but_gpt_oss_mxfp4_is_read():
    moe = {**LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2,
           "quantization_config": {"quant_method": "awq", "bits": 4}}
    with pytest.raises(ValueError, match="'awq' is not supported on a mixture of experts"):
        ModelConfig.from_hf_dict(moe)
    served = ModelConfig.from_hf_dict({**LLAMA, "quantization_config": ct()})
    assert served.quantization.describe() == "compressed-tensors (pack-quantized): int4 group 128"


@pytest.fixture(scope="module")
def gptq_folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("gptq-refusals")
    base = qc.base_model(out / "base")
    folder, dense = qc.gptq(base, out, group=64)
    return folder, dense


def rewritten(folder, tmp_path, edit=None, config=None):
    """A copy of `folder` with its tensors edited (name -> tensor, None drops) and its
    quantization_config updated."""
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    tensors = load_file(copy / "model.safetensors")
    for name, value in (edit or {}).items():
        if value is None:
            tensors.pop(name)
        else:
            tensors[name] = value
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    if config:
        raw = json.loads((copy / "config.json").read_text())
        raw["quantization_config"].update(config)
        (copy / "config.json").write_text(json.dumps(raw))
    return copy


PREFIX = "model.layers.1.mlp.down_proj"
MISFITS = {  # name -> (tensors edited (given the originals), config, the message's words)
    "scales-shape": (lambda t: {f"{PREFIX}.scales": t[f"{PREFIX}.scales"][:2]}, None,
                     "down_proj (gptq int4 group 64 zero points): its 'scales' has shape (2, 128)"),
    "scales-nan": (lambda t: {f"{PREFIX}.scales": t[f"{PREFIX}.scales"] * float("nan")}, None,
                   "its 'scales' holds non-finite values"),
    "qweight-dtype": (lambda t: {f"{PREFIX}.qweight": t[f"{PREFIX}.qweight"].float()}, None,
                      "its 'qweight' is torch.float32"),
    "g-idx-range": (lambda t: {f"{PREFIX}.g_idx": t[f"{PREFIX}.g_idx"] + 9}, None,
                    "its g_idx names groups outside [0, 4)"),
    "g-idx-missing": (lambda t: {f"{PREFIX}.g_idx": None}, {"desc_act": True},
                      "desc_act is set but its g_idx is missing"),
    "stray-tensor": (lambda t: {f"{PREFIX}.weight": torch.zeros(4)}, None,
                     "unexpected tensor 'weight' beside its quantized weight"),
    "left-dense-by-config": (lambda t: {}, {"modules_to_not_convert": ["down_proj"]},
                             "the quantization_config leaves it in full precision"),
    "quantized-lm-head": (lambda t: {"lm_head.qweight": torch.zeros(2, 2, dtype=torch.int32)},
                          None, "a quantized lm_head is not served"),
}


@pytest.mark.parametrize("case", list(MISFITS))
def test_a_checkpoint_that_does_not_fit_its_weights_is_refused(gptq_folder, tmp_path, case):
    edit, config, words = MISFITS[case]
    folder = rewritten(gptq_folder[0], tmp_path, edit(load_file(gptq_folder[0] /
                                                                "model.safetensors")), config)
    with pytest.raises(ValueError) as err:
        load_weights(folder, ModelConfig.from_pretrained(folder))
    assert words in str(err.value)


def test_a_tensor_parallel_cut_through_a_group_is_refused_naming_the_layer(gptq_folder):
    config = ModelConfig.from_pretrained(gptq_folder[0])  # (o_proj: 128 inputs, groups of 64)
    load_weights(gptq_folder[0], config, shard=Shard(config, 1, 2))  # (64 columns a rank)
    with pytest.raises(ValueError) as err:
        load_weights(gptq_folder[0], config, shard=Shard(config, 0, 4))
    assert str(err.value) == (
        "tensor parallel 4: model.layers.0.self_attn.o_proj (gptq int4 group 64 zero points) "
        "cannot be cut into 4 parts by its input columns: rank 0's columns [0, 32) split a group "
        "of 64 (serve it on fewer ranks, or a checkpoint of smaller groups)")


def test_merging_into_a_quantized_projection_is_refused_and_changes_nothing(gptq_folder,
                                                                           tmp_path):
    from transformers import AutoModelForCausalLM

    folder, dense = gptq_folder
    made_adapters(AutoModelForCausalLM.from_pretrained(dense), tmp_path,
                  {"a": {"r": 4, "lora_alpha": 8, "target_modules": ["v_proj"]}}, seed=3)
    runner = load_folders(ModelRunner.from_pretrained(
        folder, num_kv_blocks=128, block_size=BLOCK, num_slots=1, max_rank=8,
        lora_backend="torch"), [tmp_path / "a"])
    codes = runner.weights.layers[0].wqkv.codes.clone()
    with pytest.raises(ValueError) as err:
        runner.merge(0)
    assert str(err.value) == (
        "cannot merge the adapter in slot 0: layer 0's qkv is a quantized weight (gptq int4 group "
        "64 zero points); folding B @ A into it would requantize the base, which is not exact: "
        "serve the adapter unmerged")
    assert runner.merged_slot is None
    assert torch.equal(runner.weights.layers[0].wqkv.codes, codes)
