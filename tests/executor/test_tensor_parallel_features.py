"""Tensor parallelism with what else a runner does: the families of issue 32 (Gemma 2 and 3:
sandwich norms after the all-reduce, soft caps on cut logits, per-layer windows; Phi-3: fused
qkv_proj / gate_up_proj cut part by part, adapters on them) and issue 33's sampling (penalties,
logit_bias, seeded draws, alternatives, prompt logprobs made through the vocabulary gather, a
grammar's mask). Two ranks in a gloo group (tests/rank_threads.py) give TP=1's tokens, and logits
and logprobs within TP_ATOL; the families also HF + PEFT's tokens."""

import pytest
import torch

from common.grammar import Grammar, GrammarKind
from common.sampling import SamplingParams
from executor.runner import ModelRunner
from loraplex import fixtures
from tests.executor.test_tensor_parallel_oracle import TP_ATOL, tp_runners
from tests.oracle import assert_matches_hf, made_adapters
from tests.rank_threads import RankThreads
from tests.runner_driver import BLOCK, load_folders, make_runner, prompts, run

NUM_TOKENS = 6
ALL = fixtures.ATTN + fixtures.MLP
FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
FAMILIES = {  # model_type -> (its config's quirks, its adapters' target modules)
    "gemma2": ({"sliding_window": 6, "query_pre_attn_scalar": 32, "head_dim": 96,
                "attn_logit_softcapping": 1.0, "final_logit_softcapping": 3.0}, ALL),
    "gemma3_text": ({"sliding_window": 6, "query_pre_attn_scalar": 32, "head_dim": 48,
                     "sliding_window_pattern": 2, "rope_local_base_freq": 100.0,
                     "final_logit_softcapping": 3.0}, ALL),
    "phi3": ({"sliding_window": 10}, FUSED),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_families_at_two_ranks_give_tp1_and_hf_peft(family, tmp_path):
    from transformers import AutoModelForCausalLM

    overrides, targets = FAMILIES[family]
    model_dir = fixtures.save_tiny_model(tmp_path / "model", family, seed=5, **overrides)
    specs = {"all_r8": {"r": 8, "lora_alpha": 16, "target_modules": targets},
             "mlp_r4": {"r": 4, "lora_alpha": 8, "target_modules": targets[-2:]}}
    hf = made_adapters(AutoModelForCausalLM.from_pretrained(model_dir), tmp_path, specs, seed=60)
    folders = [tmp_path / name for name in specs]

    def make(**kw) -> ModelRunner:
        return ModelRunner.from_pretrained(model_dir, num_kv_blocks=1024, block_size=BLOCK,
                                           num_slots=len(specs), max_rank=16, **kw)

    names = ["all_r8", None, "mlp_r4", "all_r8"]
    requests = {sid: (p, list(specs).index(n) if n else -1)
                for sid, (p, n) in enumerate(zip(prompts(len(names), 3), names))}
    want = run(load_folders(make(), folders), requests, NUM_TOKENS, admit=len(names))
    ranks = RankThreads(2, lambda tp: make(tp=tp))
    got = run(load_folders(ranks, folders), requests, NUM_TOKENS, admit=len(names))
    ranks.close()
    assert_matches_hf(hf, requests, names, got, NUM_TOKENS, atol=2e-4, what=f"{family} TP=2: ")
    for sid in requests:
        assert got[sid][0] == want[sid][0]
        torch.testing.assert_close(got[sid][1], want[sid][1], atol=TP_ATOL, rtol=0)


def test_sampling_extras_and_a_grammar_at_two_ranks_give_tp1s(tiny):
    """Seeded draws with penalties and a logit_bias, alternatives, prompt logprobs (their
    logits gathered from both ranks' vocabulary parts) and a choice grammar (rank 0's mask):
    the same tokens, logprobs, alternatives and prompt logprobs as one rank."""
    slot = tiny["valid"].index("r16_all")
    sampled = dict(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5,
                   frequency_penalty=0.4, logit_bias=((7, 5.0),), top_logprobs=3)
    requests = {
        0: (prompts(1, 1)[0], slot, SamplingParams(seed=11, **sampled)),
        1: (prompts(1, 2)[0], -1, SamplingParams(seed=12, prompt_logprobs=2, top_logprobs=2,
                                                 min_p=0.05, temperature=0.7)),
        2: (prompts(1, 3)[0], slot, SamplingParams(
            grammar=Grammar(GrammarKind.CHOICE, choices=("river", "stone quiet")))),
        3: (prompts(1, 4)[0], -1, SamplingParams()),
    }
    one = make_runner(tiny)
    want_samples, got_samples = {}, {}
    want = run(one, requests, NUM_TOKENS, admit=4, samples=want_samples)
    ranks = tp_runners(tiny, 2)
    got = run(ranks, requests, NUM_TOKENS, admit=4, samples=got_samples)
    ranks.close()
    for sid in requests:
        assert got[sid][0] == want[sid][0]
        for g, w in zip(got_samples[sid], want_samples[sid], strict=True):
            assert g.logprob == pytest.approx(w.logprob, abs=TP_ATOL)
            assert (g.top is None) == (w.top is None)
            if w.top:
                assert g.top.token_ids == w.top.token_ids
                assert g.top.logprobs == pytest.approx(w.top.logprobs, abs=TP_ATOL)
    prompt, want_prompt = got_samples[1][0].prompt, want_samples[1][0].prompt
    assert prompt.token_ids == want_prompt.token_ids == requests[1][0][1:]
    assert prompt.logprobs == pytest.approx(want_prompt.logprobs, abs=TP_ATOL)
    assert prompt.top_token_ids == want_prompt.top_token_ids
