"""gpt-oss bases (issue 41): its published checkpoints keep the experts in MXFP4
(executor/model/mxfp4.py). A tiny gpt-oss whose experts are written in MXFP4 by an encoder that
follows the format's published layout (16 bytes of E2M1 pairs, low nibble first, and a power-of-two
scale per group of 32): loraplex dequantizes exactly what transformers dequantizes (bit for bit)
and serves HF's greedy tokens (logits 1e-4); an adapter on an expert's own gate / up is refused
(gpt-oss interleaves them); another quantization_config is refused by name."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from executor.model.config import ModelConfig
from executor.model.mxfp4 import E2M1, dequantize_mxfp4
from executor.runner import ModelRunner
from loraplex import fixtures
from tests.executor.test_moe_oracle import FAMILIES, SHAPE
from tests.oracle import hf_greedy
from tests.runner_driver import BLOCK, prompts, run

NUM_TOKENS = 6


def to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., rows, cols] -> (blocks uint8 [..., rows, cols / 32, 16], scales uint8
    [..., rows, cols / 32]): each group's scale the power of two that brings its largest value
    within E2M1's 6, each value its nearest code."""
    groups = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    exponent = torch.floor(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0))
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - torch.tensor(E2M1)).abs().argmin(-1)  # [..., G, 32]
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8)


def test_dequantizing_is_exact_on_e2m1_values_and_checks_its_shapes():
    codes = torch.arange(32) % 16
    blocks = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8).view(1, 1, 16)
    values = dequantize_mxfp4(blocks, torch.tensor([[128]], dtype=torch.uint8), torch.float32)
    assert values.flatten().tolist() == [2 * v for v in E2M1 * 2]  # (scale 2^1)
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_mxfp4(blocks, torch.zeros(1, 2, dtype=torch.uint8), torch.float32)


@pytest.fixture(scope="module")
def mxfp4_model(tmp_path_factory):
    """(folder of a tiny gpt-oss with MXFP4 experts, HF's model of it, dequantized)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    out = tmp_path_factory.mktemp("gpt-oss")
    plain = fixtures.save_tiny_model(out / "plain", "gpt_oss", seed=5, **SHAPE,
                                     **FAMILIES["gpt_oss"])
    folder = out / "mxfp4"
    shutil.copytree(plain, folder)
    tensors = {}
    for name, t in load_file(plain / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out]
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = to_mxfp4(
                t.transpose(1, 2).contiguous())
        else:
            tensors[name] = t
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (folder / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                              quantization_config=Mxfp4Config(dequantize=True))
    return folder, hf.eval()


def test_an_mxfp4_checkpoint_serves_hfs_tokens(mxfp4_model):
    folder, hf = mxfp4_model
    runner = ModelRunner.from_pretrained(folder, num_kv_blocks=256, block_size=BLOCK,
                                         num_slots=1, max_rank=16, lora_backend="torch")
    for ours, theirs in zip(runner.weights.layers, hf.model.layers):
        experts = theirs.mlp.experts  # [E, in, out] as HF keeps them
        assert torch.equal(ours.experts_gate_up, experts.gate_up_proj.transpose(1, 2))
        assert torch.equal(ours.experts_down, experts.down_proj.transpose(1, 2))
    requests = {sid: (p, -1) for sid, p in enumerate(prompts(3, 2))}
    got = run(runner, requests, NUM_TOKENS, chunk=5, admit=3)
    for sid, (prompt, _) in requests.items():
        tokens, logits = hf_greedy(hf, prompt, NUM_TOKENS)
        assert got[sid][0] == tokens
        torch.testing.assert_close(got[sid][1], logits, atol=1e-4, rtol=0)


def test_another_quantization_is_refused_by_name():
    config = {"model_type": "gpt_oss", "hidden_size": 64, "intermediate_size": 32,
              "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 128,
              "quantization_config": {"quant_method": "gptq"}}
    with pytest.raises(ValueError, match="quantization_config 'gptq' is not supported"):
        ModelConfig.from_hf_dict(config)
