"""Activated LoRA in the executor (issue 43): an aLoRA adapter's LoRA applies from its
activation point on (the last occurrence of its invocation in the prompt, common/alora.py), the
rows before it computed as the base model's in the same sequence and step. Against PEFT's aLoRA
model run as a greedy loop of whole forwards with explicit alora_offsets (its generate() does not
activate the adapter with this transformers and PEFT): the invocation at the start, in the
middle, twice, absent, and straddling a prefill chunk; alone and batched beside base rows and an
ordinary LoRA's; the prefix before the activation served from blocks a base request computed."""

import copy

import pytest
import torch

from common.alora import activation_start
from common.sampling import SamplingParams
from executor.runner import ModelRunner, Row
from loraplex import fixtures
from tests.oracle import hf_greedy
from tests.runner_driver import BLOCK, load_folders, run

INVOCATION = [7, 8, 9]
NUM_TOKENS = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(model dir, adapter folders, HF base, PEFT aLoRA model, PEFT plain LoRA model)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("alora")
    model_dir = fixtures.save_tiny_model(out / "model", "llama", seed=3, num_hidden_layers=2)
    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    folders = {}
    for name, extra in (("alora", {"alora_invocation_tokens": INVOCATION}), ("plain", {})):
        torch.manual_seed(11 if extra else 12)
        peft = get_peft_model(copy.deepcopy(base), LoraConfig(
            r=8, lora_alpha=16, init_lora_weights=False,
            target_modules=["q_proj", "k_proj", "v_proj", "down_proj"], **extra))
        peft.save_pretrained(out / name)
        folders[name] = out / name
    alora = PeftModel.from_pretrained(copy.deepcopy(base), folders["alora"]).eval()
    plain = PeftModel.from_pretrained(copy.deepcopy(base), folders["plain"]).eval()
    return model_dir, folders, base, alora, plain


@torch.no_grad()
def alora_greedy(model, prompt: list[int], num_tokens: int):
    """PEFT's aLoRA: whole forwards with explicit offsets, each generated token activated."""
    start = activation_start(prompt, INVOCATION)
    tokens, logits, seq = [], [], list(prompt)
    for _ in range(num_tokens):
        offsets = [None if start is None else len(seq) - start]
        last = model(input_ids=torch.tensor([seq]), alora_offsets=offsets).logits[0, -1]
        tokens.append(int(last.argmax()))
        logits.append(last)
        seq.append(tokens[-1])
    return tokens, torch.stack(logits)


PROMPTS = {
    "middle": [31, 40, 51, 7, 8, 9, 60, 61],
    "start": [7, 8, 9, 12, 13, 14, 15],
    "twice": [7, 8, 9, 20, 21, 7, 8, 9, 22],
    "absent": [7, 8, 30, 9, 31, 32],
    "straddles": [100, 101, 102, 103, 7, 8, 9, 104, 105],  # chunk 5: positions 4 | 5 6
    "at the end": [40, 41, 42, 43, 44, 45, 7, 8, 9],
}


def make_runner(model_dir, folders):
    runner = ModelRunner.from_pretrained(model_dir, num_kv_blocks=512, block_size=BLOCK,
                                         num_slots=2, max_rank=16, lora_backend="torch")
    return load_folders(runner, [folders["alora"], folders["plain"]])


def request(prompt: list[int]) -> tuple:
    """(prompt, slot, sampling, lora_from) of the aLoRA (slot 0): the base model's when its
    invocation is absent."""
    start = activation_start(prompt, INVOCATION)
    return (prompt, -1) if start is None else (prompt, 0, SamplingParams(), start)


def test_alora_rows_alone_and_batched_match_peft(models):
    model_dir, folders, base, alora, plain = models
    runner = make_runner(model_dir, folders)
    requests = {sid: request(p) for sid, p in enumerate(PROMPTS.values())}
    requests[len(requests)] = (PROMPTS["middle"], -1)  # beside a base row
    requests[len(requests)] = (PROMPTS["middle"], 1)  # and an ordinary LoRA's
    batched = run(runner, requests, NUM_TOKENS, chunk=5, admit=len(requests))
    for sid, prompt in enumerate(PROMPTS.values()):
        tokens, logits = alora_greedy(alora, prompt, NUM_TOKENS)
        assert batched[sid][0] == tokens, list(PROMPTS)[sid]
        torch.testing.assert_close(batched[sid][1], logits, atol=1e-4, rtol=0)
        alone = run(runner, {sid: requests[sid]}, NUM_TOKENS, chunk=5)[sid]
        assert alone[0] == tokens
    base_sid, plain_sid = len(PROMPTS), len(PROMPTS) + 1
    assert batched[base_sid][0] == hf_greedy(base, PROMPTS["middle"], NUM_TOKENS)[0]
    assert batched[plain_sid][0] == hf_greedy(plain, PROMPTS["middle"], NUM_TOKENS, "default")[0]
    # the adapter matters after its invocation, and nothing before it
    middle = alora_greedy(alora, PROMPTS["middle"], 1)[1][0]
    assert (middle - hf_greedy(base, PROMPTS["middle"], 1)[1][0]).abs().max() > 1e-2


def test_rows_before_activation_keep_the_base_models_kv(models):
    """A base request computes a prompt's first blocks; an aLoRA request on that prompt plus
    its invocation starts from them (num_cached) and gives the tokens of computing it all."""
    model_dir, folders, _, alora, _ = models
    runner = make_runner(model_dir, folders)
    shared = [50 + i for i in range(3 * BLOCK)]  # 3 whole blocks, before the invocation
    blocks = runner.free_blocks()
    runner.add_sequence(1, shared + [1], SamplingParams(), -1)
    runner.step([Row(1, 3 * BLOCK + 1, tuple(blocks[:4]))])
    prompt = shared + INVOCATION + [61, 62]
    runner.add_sequence(2, prompt, SamplingParams(), 0, num_cached=3 * BLOCK,
                        lora_from=activation_start(prompt, INVOCATION))
    tokens = [runner.step([Row(2, len(prompt) - 3 * BLOCK,
                               (*blocks[:3], *blocks[10:13]))])[0].token_id]
    for i in range(NUM_TOKENS - 1):
        tokens.append(runner.step([Row(2, 1, (blocks[13 + i],) if (len(prompt) + i) % BLOCK == 0
                                       else ())])[0].token_id)
    assert tokens == alora_greedy(alora, prompt, NUM_TOKENS)[0]


def test_an_activated_lora_is_refused_where_it_cannot_apply(models):
    model_dir, folders, _, _, _ = models
    runner = make_runner(model_dir, folders)
    with pytest.raises(ValueError, match="with an adapter slot"):
        runner.add_sequence(1, [1, 2, 3], SamplingParams(), -1, lora_from=1)
    runner.add_sequence(2, [1, 7, 8, 9], SamplingParams(), 0, lora_from=1)
    with pytest.raises(ValueError, match="an activated LoRA applies from"):
        runner.merge(0)


def test_two_ranks_give_the_oracles_tokens(models):
    """TP=2 in a gloo group: the activated LoRA's rows split at the same point on every rank."""
    from executor.tp.collectives import TensorParallel
    from tests.rank_threads import RankThreads

    model_dir, folders, _, alora, _ = models

    def make(tp: TensorParallel) -> ModelRunner:
        return ModelRunner.from_pretrained(model_dir, num_kv_blocks=512, block_size=BLOCK,
                                           num_slots=2, max_rank=16, lora_backend="torch", tp=tp)

    ranks = RankThreads(2, make)
    try:
        load_folders(ranks, [folders["alora"], folders["plain"]])
        requests = {sid: request(p) for sid, p in enumerate(
            [PROMPTS["middle"], PROMPTS["straddles"], PROMPTS["absent"]])}
        got = run(ranks, requests, NUM_TOKENS, chunk=5, admit=3)
        for sid in (0, 1):
            assert got[sid][0] == alora_greedy(alora, requests[sid][0], NUM_TOKENS)[0]
    finally:
        ranks.close()
