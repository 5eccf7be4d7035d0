"""The grouped MoE matmul's Triton kernel against its torch reference, and the Triton LoRA
backend's expert path against the torch backend's, through the Triton interpreter on CPU; a tiny
Qwen3-MoE served with both Triton paths against HF + PEFT."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit is defined

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from executor.lora.experts import ExpertRuns  # noqa: E402
from executor.lora.torch_backend import TorchLoraBackend  # noqa: E402
from executor.lora.triton_backend import TritonLoraBackend  # noqa: E402
from executor.model.config import ModelConfig  # noqa: E402
from executor.model.moe import grouped_matmul  # noqa: E402
from kernels.moe_gemm import moe_gemm, moe_tiles  # noqa: E402
from kernels.moe_gemm_ref import moe_gemm_ref  # noqa: E402
from kernels.reference import TOLERANCES  # noqa: E402
from tests.executor.lora_backends import load, make_pool  # noqa: E402
from tests.random_adapters import random_adapter  # noqa: E402

TUNING = {"block_m": 4, "block_n": 16, "block_k": 16}
CONFIG = ModelConfig(hidden_size=40, intermediate_size=24, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                     num_experts=5, num_experts_per_tok=2, moe_intermediate_size=12,
                     moe_layers=(0, 1))


def assert_close(actual, expected, dtype):
    rtol, atol = TOLERANCES[dtype]
    scale = float(expected.float().abs().max()) if expected.numel() else 1.0
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol * scale)


def test_moe_tiles_cut_runs_into_m_tiles():
    tiles = moe_tiles(((0, 6, 2), (6, 7, 5), (7, 7, 1)), 4, torch.device("cpu"))
    assert tiles.T.tolist() == [[0, 4, 2], [4, 6, 2], [6, 7, 5]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("runs", [
    ((0, 9, 0), (9, 10, 3), (10, 17, 4)),  # runs across tiles, a run of one row
    ((0, 3, 1), (3, 3, 2), (3, 11, 1)),  # an empty run; one expert twice
    (),  # no rows routed
])
def test_moe_gemm_matches_its_reference(dtype, runs):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(17, 37, generator=g).to(dtype)  # odd K: masked tails
    w = torch.randn(5, 29, 37, generator=g).to(dtype)  # odd N
    got, want = moe_gemm(x, w, runs, **TUNING), moe_gemm_ref(x, w, runs)
    assert_close(got, want, dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(got, grouped_matmul(x, w, runs) if runs else got,
                                   rtol=1e-5, atol=1e-5)
    covered = torch.zeros(17, dtype=torch.bool)
    for s, e, _ in runs:
        covered[s:e] = True
    assert not got[~covered].any()  # rows in no run stay zero


def test_moe_gemm_refuses_what_does_not_fit():
    x, w = torch.zeros(4, 8), torch.zeros(2, 6, 8)
    with pytest.raises(ValueError, match="outside"):
        moe_gemm(x, w, ((0, 4, 2),))
    with pytest.raises(ValueError, match="do not fit"):
        moe_gemm(x, torch.zeros(2, 6, 9), ((0, 4, 0),))


def test_the_triton_expert_lora_matches_the_torch_path():
    """Pairs of three adapters (ranks 3, 8 and 16, one on gate_up alone) and base rows over 5
    experts: per (expert, adapter) run, Triton's SGMV over the flat offset tables adds what the
    torch path adds."""
    pool = make_pool(CONFIG, num_slots=3, max_rank=16, num_blocks=800)
    modules = [m for m in CONFIG.lora_modules if m.startswith("experts.")]
    load(pool, 0, random_adapter(CONFIG, 3, 1, modules=modules))
    load(pool, 1, random_adapter(CONFIG, 8, 2, modules=modules, same_rank=True))
    load(pool, 2, random_adapter(CONFIG, 16, 3,
                                 modules=[m for m in modules if m.endswith("gate_up_proj")]))
    pair_slots = torch.tensor([-1, 0, 0, 2, -1, 1, 1, 1, 2, 0, 1, -1, 2])
    expert_runs = ((0, 3, 0), (3, 4, 1), (4, 9, 2), (9, 11, 3), (11, 13, 4))
    experts = torch.tensor([e for s, t, e in expert_runs for _ in range(s, t)])
    runs = ExpertRuns.build(pair_slots, expert_runs)
    assert runs.runs[:3] == ((1, 3, 0, 0), (3, 4, 2, 1), (5, 8, 1, 2))
    torch_backend, triton_backend = TorchLoraBackend(pool), TritonLoraBackend(pool)
    g = torch.Generator().manual_seed(5)
    for layer in range(CONFIG.num_hidden_layers):
        for projection, (k, n) in (("gate_up_proj", (40, 24)), ("down_proj", (12, 40))):
            x, base = torch.randn(13, k, generator=g), torch.randn(13, n, generator=g)
            want, got = base.clone(), base.clone()
            torch_backend.apply_experts(layer, projection, x, want,
                                        torch_backend.prepare_experts(pair_slots, experts,
                                                                      expert_runs))
            triton_backend.apply_experts(layer, projection, x, got,
                                         triton_backend.prepare_experts(pair_slots, experts,
                                                                        expert_runs))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert torch.equal(got[pair_slots < 0], base[pair_slots < 0])
            assert not torch.equal(want, base)


def test_a_moe_model_served_by_the_triton_paths_matches_hf_peft(tmp_path):
    """A tiny Qwen3-MoE (a dense layer among MoE ones) with an attention + expert adapter, served
    with the Triton LoRA backend and the grouped MoE kernel: a base request and an adapter's,
    batched, give HF + PEFT's greedy tokens and logits (1e-4)."""
    from transformers import AutoModelForCausalLM

    from executor.runner import ModelRunner
    from loraplex import fixtures
    from tests.executor.moe_oracle import Oracles
    from tests.executor.test_moe_oracle import FAMILIES, SHAPE
    from tests.runner_driver import BLOCK, load_folders, prompts, run

    model_dir = fixtures.save_tiny_model(tmp_path / "model", "qwen3_moe", seed=5, **SHAPE,
                                         **FAMILIES["qwen3_moe"])
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    fixtures._save_adapter(base, tmp_path / "both", 7, {
        "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "o_proj"],
        "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]})
    hf = Oracles(base, {"both": tmp_path / "both"})
    runner = ModelRunner.from_pretrained(model_dir, num_kv_blocks=256, block_size=BLOCK,
                                         num_slots=1, max_rank=16, lora_backend="triton")
    runner.model.moe_matmul = moe_gemm
    load_folders(runner, [tmp_path / "both"])
    requests = {sid: (p, slot) for sid, (p, slot) in enumerate(zip(prompts(2, 6), (-1, 0)))}
    got = run(runner, requests, 3, chunk=8)
    for sid, (prompt, slot) in requests.items():
        tokens, logits = hf.greedy(prompt, 3, "both" if slot == 0 else None)
        assert got[sid][0] == tokens
        torch.testing.assert_close(got[sid][1], logits, atol=1e-4, rtol=0)
