"""Adapters of ranks 1, 8, 16, 64 and 256 (one with a rank_pattern) in pages of the KV blocks,
served alone and all in one batch beside base-model rows: greedy tokens equal HF transformers +
PEFT's, with the torch backend and with the Triton one (interpreter). Each takes pages in
proportion to its ranks: the rank-1 adapter a sliver of the rank-256 one's."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit is defined

import pytest  # noqa: E402

from executor.runner import ModelRunner  # noqa: E402
from loraplex import fixtures  # noqa: E402
from tests.oracle import assert_matches_hf, made_adapters  # noqa: E402
from tests.runner_driver import BLOCK, load_folders, prompts, run  # noqa: E402

ALL = fixtures.ATTN + fixtures.MLP
# name -> LoraConfig arguments (alpha keeps each adapter's contribution of one size).
RANKS = {
    "r1": {"r": 1, "lora_alpha": 1, "target_modules": ALL},
    "r8": {"r": 8, "lora_alpha": 4, "target_modules": fixtures.MLP},
    "r16": {"r": 16, "lora_alpha": 4, "target_modules": ALL},
    "r64": {"r": 64, "lora_alpha": 8, "target_modules": fixtures.ATTN},
    "r256_pattern": {"r": 256, "lora_alpha": 16, "target_modules": ALL,
                     "rank_pattern": {"q_proj": 8, "layers.1.mlp.down_proj": 64}},
}
MAX_RANK = 256


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    """The adapters' folders, made with PEFT on the tiny base, and HF + PEFT with all loaded."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("ranks")
    base = AutoModelForCausalLM.from_pretrained(tiny["model_dir"])
    return out, made_adapters(base, out, RANKS, seed=100)


def make_runner(tiny, folder, backend: str) -> ModelRunner:
    runner = ModelRunner.from_pretrained(tiny["model_dir"], num_kv_blocks=4096, block_size=BLOCK,
                                         num_slots=len(RANKS), max_rank=MAX_RANK,
                                         lora_backend=backend)
    return load_folders(runner, [folder / name for name in RANKS])


def test_pages_follow_the_ranks_each_module_uses(tiny, adapters):
    runner = make_runner(tiny, adapters[0], "torch")
    pages = {name: len(runner.pool.contents(slot).pages) for slot, name in enumerate(RANKS)}
    assert pages["r1"] < pages["r8"] < pages["r16"] < pages["r256_pattern"]
    layer0 = runner.pool.contents(len(RANKS) - 1).targets
    assert layer0[(0, "q_proj")][0] == 8 and layer0[(1, "down_proj")][0] == 64
    assert layer0[(0, "down_proj")][0] == 256


@pytest.mark.parametrize("backend, num_tokens", [("torch", 12), ("triton", 2)])
def test_mixed_ranks_alone_and_in_one_batch_match_hf_peft(tiny, adapters, backend, num_tokens):
    """(Triton: two tokens under the interpreter, the prefill chunks and a decode step.)"""
    folder, hf = adapters
    runner = make_runner(tiny, folder, backend)
    names = [*RANKS, None, "r256_pattern", "r1"]  # base-only rows; two adapters twice
    slots = [list(RANKS).index(n) if n else -1 for n in names]
    requests = {sid: (p, slot) for sid, (p, slot) in enumerate(zip(prompts(len(names), 7),
                                                                    slots))}
    batched = run(runner, requests, num_tokens, chunk=8, admit=len(names))
    assert_matches_hf(hf, requests, names, batched, num_tokens, atol=2e-4, what=f"{backend}: ")
    for sid in (1, 4):  # alone: the same tokens as in the batch
        alone = run(runner, {sid: requests[sid]}, num_tokens)
        assert alone[sid][0] == batched[sid][0], f"{backend}: {names[sid]} depends on its batch"
