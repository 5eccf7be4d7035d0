"""The memory a quantized base takes and frees (issue 44): MemoryBudget.estimate counts each
projection at its layout's bytes (executor/model/quant.py), exactly what a runner loading the
checkpoint holds, whole and per tensor-parallel rank; `loraplex budget --quantization` plans an
8B and a 70B base in bf16, FP8 and INT4 with the KV tokens and adapters that frees."""

from __future__ import annotations

import pytest
import torch

from executor.memory_budget import MemoryBudget
from executor.model.config import ModelConfig
from executor.model.quant_config import preset
from executor.model.weights import load_weights
from executor.runner import ModelRunner
from executor.tp.shards import Shard
from loraplex.budget import plan
from tests.executor import quant_checkpoints as qc

GIB = 2**30
FP8 = {"num_bits": 8, "type": "float", "symmetric": True}
CHECKPOINTS = {
    "gptq-int4-act-order": lambda b, o: qc.gptq(b, o, desc_act=True)[0],
    "gptq-int8-sym": lambda b, o: qc.gptq(b, o, bits=8, sym=True)[0],
    "awq-int4": lambda b, o: qc.awq(b, o)[0],
    "fp8-scale-inv": lambda b, o: qc.fp8_blocks(b, o),
    "ct-fp8-static": lambda b, o: qc.compressed_tensors(
        b, o, "fp8static", {**FP8, "strategy": "tensor"},
        {**FP8, "strategy": "tensor", "dynamic": False}, [5, 9, 40]),
    "bnb-nf4-double-quant": lambda b, o: qc.bitsandbytes(b, o, "nf4", True),
}


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_the_estimate_is_what_a_runner_loading_the_checkpoint_holds(name, tmp_path):
    if name.startswith("bnb"):
        pytest.importorskip("bitsandbytes")
    folder = CHECKPOINTS[name](qc.base_model(tmp_path / "base"), tmp_path)
    runner = ModelRunner.from_pretrained(folder, num_kv_blocks=32, block_size=4, num_slots=2,
                                         max_rank=8, lora_backend="torch")
    config = runner.config
    estimate = MemoryBudget.estimate(config, num_kv_blocks=32, block_size=4, num_slots=2,
                                     max_rank=8)
    assert estimate.weights_bytes == runner.weights.num_bytes()
    assert estimate.dense_weights_bytes == runner.weights.dense_bytes()
    assert estimate.freed_bytes > 0.5 * estimate.dense_weights_bytes * 0.5  # (8 bits or less)
    rank = load_weights(folder, config, shard=Shard(config, 1, 2))
    per_rank = MemoryBudget.estimate(config, num_kv_blocks=32, block_size=4, num_slots=2,
                                     max_rank=8, tensor_parallel=2)
    assert per_rank.weights_bytes == rank.num_bytes()


def budget(model: str, quantization: str | None, tensor_parallel: int = 1):
    config = ModelConfig.named(model)
    if quantization:
        config = config.replace(quantization=preset(quantization))
    return plan(config, dtype=torch.bfloat16, gpu_bytes=80 * GIB, utilization=0.9,
                adapter_slots=64, max_rank=64, block_size=16, max_batched_tokens=2048,
                max_num_seqs=64, context=4096, adapter_ranks={8: 0.7, 16: 0.2, 64: 0.1},
                tensor_parallel=tensor_parallel)


def test_a_quantized_8b_base_leaves_its_freed_bytes_to_kv_and_adapters():
    bf16, fp8, int4 = (budget("llama-3-8b", q) for q in (None, "fp8", "int4"))
    # 8B: 16.06 GB in bf16; FP8 (128 x 128 blocks) and INT4 (groups of 128, fp32 scales: 0.22
    # GB) quantize the projections (6.98B parameters), not the embeddings and lm_head (1.05B)
    assert [round(p.weights_bytes / 1e9, 2) for p in (bf16, fp8, int4)] == [16.06, 9.08, 5.81]
    assert bf16.num_kv_blocks < fp8.num_kv_blocks < int4.num_kv_blocks
    freed = (fp8.num_kv_blocks - bf16.num_kv_blocks) * fp8.page_bytes
    assert freed == pytest.approx(bf16.weights_bytes - fp8.weights_bytes, abs=fp8.page_bytes)


def test_a_70b_base_fits_one_80gb_gpu_quantized_only():
    assert budget("llama-3-70b", None).num_kv_blocks < 1  # (141 GB of bf16)
    assert budget("llama-3-70b", None, tensor_parallel=2).num_kv_blocks >= 1
    assert budget("llama-3-70b", "fp8").num_kv_blocks >= 1
    assert budget("llama-3-70b", "int4").num_kv_blocks > budget("llama-3-70b", "fp8").num_kv_blocks


def test_the_cli_prints_what_quantization_frees(capsys):
    from loraplex.budget import main

    main(["--model", "random:llama-3-8b", "--quantization", "int4", "--max-rank", "64",
          "--adapter-ranks", "8:0.7,16:0.2,64:0.1"])
    out = capsys.readouterr().out
    assert ("  base weights              5.81 GB   (int4 group 128: 10.25 GB freed against "
            "bfloat16 weights, 78,208 KV tokens or 122 adapters of the rank mix)") in out
    main(["--model", "random:llama-3-8b", "--quantization", "none"])
    assert "freed" not in capsys.readouterr().out
