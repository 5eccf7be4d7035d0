"""Merging an adapter into the base weights (executor/lora/merge.py, ModelRunner.merge): the merged
executor gives HF PEFT's tokens for that adapter with no LoRA work, and unmerging restores every
base weight bit for bit."""

import hashlib

import pytest
import torch

from common.sampling import SamplingParams
from executor.runner import Row
from tests.oracle import hf_greedy
from tests.runner_driver import make_runner, prompts, run

NUM_TOKENS = 16


def weights_digest(runner) -> str:
    h = hashlib.sha256()
    w = runner.weights
    for t in [w.embed, w.norm, w.lm_head] + [getattr(layer, name) for layer in w.layers
                                             for name in ("wqkv", "wo", "w_gate_up", "w_down",
                                                          "input_norm", "post_attention_norm")]:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("name", ["r16_all", "r8_rslora", "r12_vo"])
def test_merged_serving_gives_the_oracles_tokens_and_unmerge_restores_every_bit(tiny, hf_peft,
                                                                               name):
    runner = make_runner(tiny)
    slot = tiny["valid"].index(name)
    before = weights_digest(runner)
    runner.merge(slot)
    assert runner.merged_slot == slot and weights_digest(runner) != before
    requests = {sid: (p, slot) for sid, p in enumerate(prompts(3, seed=4))}
    got = run(runner, requests, NUM_TOKENS, chunk=5)
    for sid, (prompt, _) in requests.items():
        tokens, logits = hf_greedy(hf_peft, prompt, NUM_TOKENS, name)
        assert got[sid][0] == tokens
        torch.testing.assert_close(got[sid][1], logits, atol=1e-4, rtol=0)
    runner.unmerge()
    assert runner.merged_slot is None and weights_digest(runner) == before
    base = run(runner, {0: (requests[0][0], -1)}, 4)[0][0]
    assert base == hf_greedy(hf_peft, requests[0][0], 4)[0], "the base model serves again"


def test_a_sequence_running_across_a_merge_keeps_the_oracles_tokens(tiny, hf_peft):
    runner = make_runner(tiny)
    slot = tiny["valid"].index("r16_all")
    prompt = prompts(1, seed=9)[0]
    runner.add_sequence(1, prompt, SamplingParams(), slot)
    tokens = [runner.step([Row(1, len(prompt), tuple(range(8)))])[0].token_id]
    runner.merge(slot)
    for _ in range(5):
        tokens.append(runner.step([Row(1, 1)])[0].token_id)
    runner.unmerge()
    for _ in range(4):
        tokens.append(runner.step([Row(1, 1)])[0].token_id)
    assert tokens == hf_greedy(hf_peft, prompt, 10, "r16_all")[0]


def test_a_merged_runner_runs_only_its_adapters_rows(tiny):
    runner = make_runner(tiny)
    with pytest.raises(ValueError, match="holds no adapter"):
        make_runner(tiny, num_slots=len(tiny["valid"]) + 1).merge(len(tiny["valid"]))
    runner.add_sequence(1, [3, 4, 5], SamplingParams(), 2)
    with pytest.raises(ValueError, match="while sequences of other adapters"):
        runner.merge(0)
    runner.free_sequence(1)
    runner.merge(0)
    with pytest.raises(ValueError, match="merged already"):
        runner.merge(1)
    for slot in (-1, 1):
        runner.add_sequence(2, [3, 4, 5], SamplingParams(), slot)
        with pytest.raises(ValueError, match="only its rows may run here"):
            runner.step([Row(2, 3, (0,))])
        runner.free_sequence(2)


def test_unmerge_restores_bf16_weights_bit_for_bit(tiny):
    """At bf16, W + BA - BA is not W: unmerging copies the saved originals back."""
    runner = make_runner(tiny, dtype=torch.bfloat16)
    before = weights_digest(runner)
    runner.merge(tiny["valid"].index("r32_all"))
    assert weights_digest(runner) != before
    runner.unmerge()
    assert weights_digest(runner) == before
