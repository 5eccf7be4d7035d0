"""Phi-3 bases (issue 32): q/k/v and gate/up are single weights (qkv_proj, gate_up_proj) and PEFT
adapters target those fused modules, an adapter's B spanning the fused output (q | k | v, gate |
up). A tiny random Phi-3 made with transformers, adapters on every module, MLP only, qkv_proj
only, a rank_pattern and rsLoRA: greedy tokens and logits equal HF + PEFT's alone and batched
beside base rows with the torch and Triton (interpreter) LoRA backends, merged too (longrope:
test_longrope_oracle.py). Serving a fused adapter's slices any other way (q's rows
alone, gate and up swapped) moves the tokens off HF's: the tests can fail."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit is defined

import dataclasses  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from common.errors import FailedPrecondition  # noqa: E402
from executor.lora.peft_adapter import parse_peft_adapter  # noqa: E402
from executor.lora.slot_pool import LoraWeights  # noqa: E402
from executor.runner import ModelRunner  # noqa: E402
from loraplex import fixtures  # noqa: E402
from tests.oracle import assert_matches_hf, hf_greedy, made_adapters  # noqa: E402
from tests.runner_driver import BLOCK, load_folders, prompts, read_folder, run  # noqa: E402

FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
ADAPTERS = {
    "all_r8": {"r": 8, "lora_alpha": 16, "target_modules": FUSED},
    "mlp_r4": {"r": 4, "lora_alpha": 8, "target_modules": ["gate_up_proj", "down_proj"]},
    "qkv_r6": {"r": 6, "lora_alpha": 12, "target_modules": ["qkv_proj"]},
    "pattern": {"r": 8, "lora_alpha": 16, "target_modules": FUSED,
                "rank_pattern": {"qkv_proj": 16, "layers.1.mlp.down_proj": 2}},
    "rslora": {"r": 16, "lora_alpha": 8, "target_modules": FUSED, "use_rslora": True},
}
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """A tiny Phi-3 (GQA, every layer sliding over 10 keys), its adapters, and HF + PEFT with
    all of them loaded."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("phi3")
    model_dir = fixtures.save_tiny_model(out / "model", "phi3", seed=8, sliding_window=10)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    return model_dir, out, made_adapters(base, out, ADAPTERS, seed=70)


def make_runner(model_dir, folder, backend="torch") -> ModelRunner:
    runner = ModelRunner.from_pretrained(model_dir, num_kv_blocks=1024, block_size=BLOCK,
                                         num_slots=len(ADAPTERS), max_rank=16,
                                         lora_backend=backend)
    return load_folders(runner, [folder / name for name in ADAPTERS])


def batch(names, seed):
    slots = [list(ADAPTERS).index(n) if n else -1 for n in names]
    return {sid: (p, slot) for sid, (p, slot) in enumerate(zip(prompts(len(names), seed), slots))}


def test_the_config_and_the_adapters_are_read_as_fused(phi3):
    model_dir, folder, _ = phi3
    runner = make_runner(model_dir, folder)
    c = runner.config
    assert c.fused_projections and c.sliding_window == 10 and not c.layer_types
    assert runner.pool.modules == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    assert c.module_shape("qkv_proj") == (256, 256 + 2 * 128)
    assert c.module_shape("gate_up_proj") == (256, 2 * 688)
    targets = runner.pool.contents(list(ADAPTERS).index("qkv_r6")).targets
    assert set(targets) == {(layer, "qkv_proj") for layer in range(4)}
    llama = fixtures.save_tiny_model(folder / "llama", seed=1)  # q_proj ... on a fused model
    with pytest.raises(FailedPrecondition, match="has no q_proj"):
        parse_peft_adapter(*read_folder(_llama_adapter(llama, folder)), c,
                           check_base_model=False)


def _llama_adapter(model_dir, folder):
    from transformers import AutoModelForCausalLM

    made_adapters(AutoModelForCausalLM.from_pretrained(model_dir), folder / "llama_adapters",
                  {"q": {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}}, seed=1)
    return folder / "llama_adapters" / "q"


@pytest.mark.parametrize("backend, num_tokens", [("torch", NUM_TOKENS), ("triton", 2)])
def test_fused_adapters_alone_and_batched_match_hf_peft(phi3, backend, num_tokens):
    """(Triton: two tokens under the interpreter, the prefill chunks and a decode step.)"""
    model_dir, folder, hf = phi3
    runner = make_runner(model_dir, folder, backend)
    names = [*ADAPTERS, None, "qkv_r6"]
    requests = batch(names, 3)
    batched = run(runner, requests, num_tokens, chunk=6, admit=len(names))
    assert_matches_hf(hf, requests, names, batched, num_tokens, atol=1e-4, what=f"{backend}: ")
    for sid in (2, 3):
        assert run(runner, {sid: requests[sid]}, num_tokens)[sid][0] == batched[sid][0]


@pytest.mark.parametrize("name", ["all_r8", "qkv_r6"])
def test_a_merged_fused_adapter_gives_hf_peft_tokens(phi3, name):
    model_dir, folder, hf = phi3
    runner = make_runner(model_dir, folder)
    slot = list(ADAPTERS).index(name)
    runner.merge(slot)
    requests = {sid: (p, slot) for sid, p in enumerate(prompts(2, seed=6))}
    got = run(runner, requests, NUM_TOKENS, chunk=5)
    for sid, (prompt, _) in requests.items():
        tokens, logits = hf_greedy(hf, prompt, NUM_TOKENS, name)
        assert got[sid][0] == tokens
        torch.testing.assert_close(got[sid][1], logits, atol=1e-4, rtol=0)


def _sliced(weights: LoraWeights, module: str, change) -> LoraWeights:
    return LoraWeights({key: dataclasses.replace(w, b=change(w.b)) if key[1] == module else w
                        for key, w in weights.modules.items()})


def _q_rows_only(b: torch.Tensor) -> torch.Tensor:
    kept = b.clone()
    kept[256:] = 0  # (q is the first 256 rows of qkv_proj's B; k and v's dropped)
    return kept


def _gate_up_swapped(b: torch.Tensor) -> torch.Tensor:
    return torch.cat(b.chunk(2)[::-1])


@pytest.mark.parametrize("module, change", [("qkv_proj", _q_rows_only),
                                            ("gate_up_proj", _gate_up_swapped)],
                         ids=["qkv_as_q_only", "gate_up_swapped"])
def test_the_fused_slices_matter(phi3, module, change):
    """An adapter served with its fused B cut differently (only q's slice, or gate's and up's
    halves swapped) does not give HF's tokens: the oracle sees the slices."""
    model_dir, folder, hf = phi3
    runner = make_runner(model_dir, folder)
    name = "qkv_r6" if module == "qkv_proj" else "mlp_r4"
    weights = parse_peft_adapter(*read_folder(folder / name), runner.config,
                                 check_base_model=False)
    runner.load_adapter(0, _sliced(weights, module, change))
    requests = {sid: (p, 0) for sid, p in enumerate(prompts(4, seed=11))}
    got = run(runner, requests, NUM_TOKENS)
    assert any(got[sid][0] != hf_greedy(hf, req[0], NUM_TOKENS, name)[0]
               for sid, req in requests.items())
