"""The numerical oracle: ModelRunner (paged KV, mixed batches of many adapters) against HF
transformers + PEFT, plus the executor's loaders, adapter parser, sampling and validation."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from safetensors.torch import load as load_st
from safetensors.torch import save as save_st
from transformers import AutoModelForCausalLM

from common.errors import FailedPrecondition, InvalidArgument, LoraplexError
from common.peft.config import parse_config
from common.peft.layout import plan_adapter
from common.peft.safetensors_header import parse_header
from common.sampling import SamplingParams
from executor.lora.peft_adapter import parse_peft_adapter
from executor.lora.segments import LoraSegments
from executor.memory_budget import MemoryBudget
from executor.model.config import ModelConfig
from executor.runner import ModelRunner, Row
from executor.sampling import DrawStream, filtered_probs, sample
from loraplex import fixtures
from tests.oracle import assert_matches_hf, hf_greedy
from tests.runner_driver import BLOCK, MAX_RANK, make_runner, prompts, read_adapter, run

NUM_TOKENS = 32


@pytest.fixture(scope="module")
def fx(tiny):
    return tiny


def test_mixed_batch_of_adapters_matches_hf_peft(fx, hf_peft):
    runner = make_runner(fx)
    names = [*fx["valid"], "r16_all", None, None]  # two rows share an adapter; two base-only
    slots = [fx["valid"].index(n) if n else -1 for n in names]
    requests = {sid: (p, slot) for sid, (p, slot) in enumerate(zip(prompts(len(names)), slots))}
    got = run(runner, requests, NUM_TOKENS, chunk=8, admit=5)
    assert_matches_hf(hf_peft, requests, names, got, NUM_TOKENS, atol=1e-4)


def test_greedy_alone_equals_inside_batch_of_32(fx):
    runner = make_runner(fx)
    slots = [i % (len(fx["valid"]) + 1) - 1 for i in range(32)]
    requests = {sid: (p, s) for sid, (p, s) in enumerate(zip(prompts(32, seed=1), slots))}
    batched = run(runner, requests, NUM_TOKENS, chunk=6, admit=32)
    for sid, req in requests.items():
        alone = run(runner, {sid: req}, NUM_TOKENS, seed=sid)
        assert alone[sid][0] == batched[sid][0], f"sequence {sid} depends on its batch"


def test_chunked_prefill_equals_one_shot(fx):
    runner = make_runner(fx)
    prompt = prompts(1, seed=3)[0] * 3
    one_shot = run(runner, {0: (prompt, 2)}, 8, chunk=1000)[0]
    chunked = run(runner, {0: (prompt, 2)}, 8, chunk=3, seed=5)[0]
    assert chunked[0] == one_shot[0]
    torch.testing.assert_close(chunked[1], one_shot[1], atol=1e-5, rtol=0)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
VARIANTS = {
    "qwen2_bias": {"model_type": "qwen2"},
    "mistral_sliding": {"model_type": "mistral", "sliding_window": 6},
    # (its layers from max_window_layers on slide, the first does not)
    "qwen2_sliding": {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 6,
                      "max_window_layers": 1},
    "llama3_rope_tied": {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0,
                             "tie_word_embeddings": True},
    "sharded": {"max_shard_size": "500KB"},
    "qwen3_head_dim": {"model_type": "qwen3", "head_dim": 48},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_loader_variant_matches_hf(tmp_path, variant):
    model_dir = fixtures.save_tiny_model(tmp_path / variant, seed=7, **VARIANTS[variant])
    runner = ModelRunner.from_pretrained(model_dir, num_kv_blocks=64, block_size=BLOCK,
                                         num_slots=0, max_rank=8)
    c = runner.config
    expect = {"qwen2_bias": c.attention_bias, "mistral_sliding": c.sliding_window == 6,
              "qwen2_sliding": [c.layer_window(i) for i in range(c.num_hidden_layers)] == [
                  None] + [6] * (c.num_hidden_layers - 1),
              "llama3_rope_tied": c.rope_scaling is not None and c.tie_word_embeddings,
              "sharded": (model_dir / "model.safetensors.index.json").exists(),
              "qwen3_head_dim": c.qk_norm and c.head_dim == 48}
    assert expect[variant] and c.model_id == variant and c.eos_token_ids == (1,)
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompt = prompts(1, seed=4)[0] + [5] * 10
    tokens, logits = run(runner, {0: (prompt, -1)}, 12, chunk=5)[0]
    ref_tokens, ref_logits = hf_greedy(hf, prompt, 12)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)


def test_model_config_layouts_and_errors():
    shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
             "eos_token_id": 1}
    tf4 = {**shape, "rope_theta": 5e5, "rope_scaling": {**LLAMA3_ROPE, "type": "llama3"}}
    tf5 = {**shape, "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 5e5}}
    assert ModelConfig.from_hf_dict(tf4) == ModelConfig.from_hf_dict(tf5)
    gen = ModelConfig.from_hf_dict(tf4, generation_config={"eos_token_id": [1, 7]})
    assert gen.eos_token_ids == (1, 7) and gen.head_dim == 16
    assert ModelConfig.named("llama-3-8b").head_dim == 128
    for bad, match in [({"num_key_value_heads": 3}, "num_key_value_heads"),
                       ({"rope_scaling": {"rope_type": "yarn"}}, "yarn"),
                       ({"hidden_size": None}, "hidden_size"), ({"model_type": "gpt2"}, "gpt2")]:
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf_dict({**shape, **bad})


def _retensor(fn):
    def apply(data: bytes) -> bytes:
        tensors = load_st(data)
        fn(tensors)
        return save_st(tensors)
    return apply


Q0A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
D1B = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
ADAPTER_ERRORS = [  # (adapter, config changes, tensor change, message)
    ("r64", {}, None, r"rank 64 exceeds the executor's max rank 32"),
    ("r16_all", {"target_modules": ["q_proj", "lm_head"]}, None,
     "target module 'lm_head' is not supported"),
    ("r16_all", {"r": 0}, None, "r must be a positive integer"),
    ("r16_all", {"alpha_pattern": {"q_proj": float("nan")}}, None, r"alpha_pattern\['q_proj'\]"),
    ("r16_all", {"use_dora": True}, None, "use_dora"),
    ("r16_all", {"alora_invocation_tokens": [5, -6]}, None, "alora_invocation_tokens must be"),
    ("r16_all", {"alora_invocation_tokens": [5, 5000]}, None,
     "token id 5000, outside the model's vocabulary"),
    ("r16_all", {"layer_replication": [[0, 2], [1, 2]]}, None, "layer_replication"),
    ("r16_all", {"use_qalora": True}, None, "QALoRA"),
    *(("r16_all", {"init_lora_weights": init}, None, f"init_lora_weights '{init}'")
      for init in ("pissa", "pissa_niter_4", "olora", "corda", "loftq", "lora_ga")),
    # tensors PEFT would not load (it adapts only these layers, never these modules): refused,
    # not served as if the config did not say so
    ("r16_all", {"layers_to_transform": [0, 2]}, None,
     r"adapts model\.layers\.1\.\w+\.\w+, which layers_to_transform \[0, 2\] leaves out"),
    ("r16_all", {"layers_to_transform": 99}, None, r"layers_to_transform \[99\] leaves out"),
    ("r16_all", {"exclude_modules": ["self_attn.v_proj"]}, None,
     r"v_proj, which exclude_modules \['self_attn\.v_proj'\] leaves out"),
    ("r16_all", {"exclude_modules": r".*\.3\.mlp\.down_proj"}, None,
     r"layers\.3\.mlp\.down_proj, which exclude_modules"),
    ("r16_all", {"layers_to_transform": ["0"]}, None, "layers_to_transform must be"),
    ("r16_all", {"layers_to_transform": [0], "layers_pattern": "h"}, None, "layers_pattern"),
    ("r16_all", {"lora_alpha": 1e300}, None, "lora_alpha must be a positive number below"),
    ("r16_all", {"alpha_pattern": {"q_proj": 0}}, None, r"alpha_pattern\['q_proj'\] must be"),
    ("r16_all", {}, _retensor(lambda t: t.update({Q0A: torch.zeros(16, 128)})),
     r"q_proj maps 128 -> 256 in other layers"),
    ("r16_all", {}, _retensor(lambda t: t[Q0A].__setitem__((0, 0), math.inf)),
     "1 NaN or infinite"),
    # One check covers the whole data section; a failure still names the tensor at fault, also
    # among tensors of mixed dtypes (then checked one by one).
    ("r16_all", {}, _retensor(lambda t: t[D1B].__setitem__((5, 3), math.nan)),
     rf"{re.escape(D1B)}' has \d+ NaN or infinite"),
    ("r16_all", {}, _retensor(lambda t: t.update({Q0A: t[Q0A].bfloat16(), D1B: t[D1B].clone()
                                                 .index_fill_(0, torch.tensor([2]), -math.inf)})),
     rf"{re.escape(D1B)}' has \d+ NaN or infinite"),
    ("r16_all", {}, _retensor(lambda t: t.update({k.replace(".0.", ".9."): t[k].clone() for k in
                                                  (Q0A, Q0A.replace("lora_A", "lora_B"))})),
     "layer 9 does not exist"),
    ("r16_all", {}, _retensor(lambda t: t.pop(Q0A.replace("lora_A", "lora_B"))),
     r"model\.layers\.0\.self_attn\.q_proj has lora_A but no lora_B"),
    ("r16_all", {}, _retensor(lambda t: t.update({"base_model.model.lm_head.lora_A.weight":
                                                  t[Q0A].clone()})), "lm_head"),
    ("truncated", {}, None, "truncated"),
    ("pickle", {}, None, "pickle"),
]


@pytest.mark.parametrize("name,changes,retensor,match", ADAPTER_ERRORS)
def test_adapter_validation_errors(fx, name, changes, retensor, match):
    cfg, data = read_adapter(fx, name)
    config = ModelConfig.from_pretrained(fx["model_dir"])
    with pytest.raises(LoraplexError, match=match):
        parse_peft_adapter(json.dumps({**json.loads(cfg), **changes}),
                           retensor(data) if retensor else data, config, max_rank=MAX_RANK)


@pytest.mark.parametrize("changes", [
    {"init_lora_weights": True}, {"init_lora_weights": "gaussian"},
    {"init_lora_weights": "eva"}, {"init_lora_weights": "orthogonal"},
    {"layers_to_transform": [0, 1, 2, 3]}, {"layers_to_transform": [3, 2, 1, 0, 7]},
    {"exclude_modules": ["fc1", "lm_head"]}, {"exclude_modules": r".*\.no_such_proj"},
    # entries with no tensors adapt nothing, as PEFT reads them (a list written for several
    # families: Phi-3's fused names, a vision tower's)
    {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj", "qkv_proj", "gate_up_proj", "fc1", "out_proj"]}])
def test_configs_peft_serves_as_plain_lora_load_the_same_modules(fx, changes):
    cfg, data = read_adapter(fx, "r16_all")
    config = ModelConfig.from_pretrained(fx["model_dir"])
    plain = parse_peft_adapter(cfg, data, config).modules
    changed = parse_peft_adapter(json.dumps({**json.loads(cfg), **changes}), data, config).modules
    assert changed.keys() == plain.keys()
    assert all(torch.equal(changed[k].b, plain[k].b) and changed[k].scale == plain[k].scale
               for k in plain)


def test_a_rank_pattern_that_matches_no_module_does_not_count_against_max_rank(fx):
    cfg, data = read_adapter(fx, "r16_all")
    config = ModelConfig.from_pretrained(fx["model_dir"])
    changed = json.dumps({**json.loads(cfg), "rank_pattern": {"no_such_proj": 4 * MAX_RANK}})
    assert parse_peft_adapter(changed, data, config, max_rank=MAX_RANK).modules


def test_adapter_base_mismatch_scales_and_infix(fx):
    config = ModelConfig.from_pretrained(fx["model_dir"])
    with pytest.raises(FailedPrecondition, match="other-org/other-base-model"):
        parse_peft_adapter(*read_adapter(fx, "other_base"), config)
    cfg, data = read_adapter(fx, "r8_patterns")
    assert plan_adapter(parse_config(cfg), parse_header(data)).rank == 16
    mods = parse_peft_adapter(cfg, data, config).modules
    assert mods[(0, "q_proj")].scale == 1.0 and mods[(0, "q_proj")].a.shape == (16, 256)
    assert mods[(0, "v_proj")].scale == 0.5 and mods[(2, "o_proj")].scale == 8.0
    assert mods[(1, "down_proj")].scale == 4.0 and mods[(0, "down_proj")].scale == 2.0
    rs = parse_peft_adapter(*read_adapter(fx, "r8_rslora"), config).modules[(3, "up_proj")]
    assert rs.scale == pytest.approx(8 / math.sqrt(8))
    # PEFT saves without the adapter-name infix; the store refuses it, so executors do too.
    infix = save_st({k.replace(".weight", ".default.weight"): v for k, v in load_st(data).items()})
    with pytest.raises(InvalidArgument, match="is not a LoRA weight"):
        parse_peft_adapter(cfg, infix, config)
    # What PEFT's bias="lora_only" / "all" and trainable_token_indices save is named as such
    tensors = load_st(data)
    some = next(iter(tensors.values())).clone()
    for extra, why in (("base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias",
                        "bias='none'"),
                       ("base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta",
                        "trainable_token_indices")):
        with pytest.raises(InvalidArgument, match=why):
            parse_peft_adapter(cfg, save_st({**tensors, extra: some.clone()}), config)


@pytest.mark.parametrize("params,match", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"), ({"top_k": -1}, "top_k"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"seed": -1}, "seed")])
def test_sampling_validation(params, match):
    with pytest.raises(InvalidArgument, match=match):
        SamplingParams(**{"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": None,
                          **params}).validate()


def test_top_k_top_p_restrict_support():
    logits = torch.randn(1024, generator=torch.Generator().manual_seed(0)) * 3
    top_k = filtered_probs(logits[None], [SamplingParams(1.0, 5, 1.0)])[0]
    assert set(top_k.nonzero().flatten().tolist()) == set(torch.topk(logits, 5).indices.tolist())
    kept = filtered_probs(logits[None], [SamplingParams(1.0, 0, 0.6)])[0].nonzero().flatten()
    probs = torch.softmax(logits, -1)
    assert probs[kept].sum() >= 0.6 and probs[kept].sum() - probs[kept].min() < 0.6


def test_seeded_sampling_is_reproducible_and_batch_independent(fx):
    runner = make_runner(fx, num_slots=2)
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=7)
    ps = prompts(6, seed=2)
    alone = run(runner, {0: (ps[0], 1, params)}, 12)[0][0]
    others = {i: (ps[i], i % 3 - 1, SamplingParams(temperature=0.8, seed=i)) for i in range(1, 6)}
    batched = run(runner, {0: (ps[0], 1, params), **others}, 12, chunk=4)[0][0]
    reseeded = run(runner, {0: (ps[0], 1, SamplingParams(1.0, 50, 0.9, 8))}, 12)[0][0]
    assert alone == batched and alone != reseeded
    top1 = run(runner, {0: (ps[0], 1, SamplingParams(temperature=1.0, top_k=1, seed=3))}, 8)[0]
    greedy = run(runner, {0: (ps[0], 1, SamplingParams())}, 8)[0]
    assert top1[0] == greedy[0]
    runner.add_sequence(9, ps[1], SamplingParams(), -1)
    sampled, logits = runner.step_with_logits([Row(9, len(ps[1]), tuple(range(6)))])
    assert sampled[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1).max()))


def test_runner_validation_errors():
    config = ModelConfig.named("tiny").replace(max_position_embeddings=16)
    runner = ModelRunner.random(config, num_kv_blocks=8, block_size=BLOCK, num_slots=2, max_rank=8)
    runner.add_sequence(1, list(range(2, 18)), SamplingParams(), -1)
    for args, match in [((1, [3], SamplingParams(), -1), "already exists"),
                        ((2, [5000], SamplingParams(), -1), "token id 5000"),
                        ((2, [3], SamplingParams(), 2), "slot 2 out of range"),
                        ((2, [3], SamplingParams(top_p=0.0), -1), "top_p")]:
        with pytest.raises(ValueError, match=match):
            runner.add_sequence(*args)
    runner.add_sequence(2, [3, 4], SamplingParams(), 1)
    for rows, match in [([Row(99, 1)], "unknown sequence id 99"),
                        ([Row(1, 0)], "num_tokens 0 out of range"),
                        ([Row(1, 17, (0, 1, 2, 3, 4))], "num_tokens 17"),
                        ([Row(1, 4, (8,))], "block id 8 out of range"),
                        ([Row(1, 5, (0,))], "cannot hold"),
                        ([Row(1, 4, (0,)), Row(1, 4)], "more than one row"),
                        ([Row(2, 2, (5,))], "slot 1 holds no adapter")]:
        with pytest.raises(ValueError, match=match):
            runner.step(rows)
    sampled = runner.step([Row(1, 16, (0, 1, 2, 3))])  # the failed steps changed nothing
    assert [s.seq_id for s in sampled] == [1]
    with pytest.raises(ValueError, match="position 16 is beyond max_position_embeddings 16"):
        runner.step([Row(1, 1, (4,))])
    runner.free_sequence(1)
    runner.free_sequence(1)


def test_lora_segments_and_memory_budget(fx):
    meta = LoraSegments.from_row_slots(torch.tensor([3, 3, -1, 0, 0, 0]))
    assert meta.segments == ((0, 2, 3), (3, 6, 0)) and meta.max_seg_len == 3
    runner = make_runner(fx, num_slots=3)
    kw = {"num_kv_blocks": 2048, "block_size": BLOCK, "num_slots": 3, "max_rank": MAX_RANK}
    assert runner.memory_budget() == MemoryBudget.estimate(runner.config, **kw)
    big = MemoryBudget.estimate(ModelConfig.named("llama-3-8b"), **kw, dtype=torch.bfloat16)
    assert 16.0e9 < big.weights_bytes < 16.1e9


def test_a_row_without_a_distribution_takes_its_argmax_and_fails_no_other_row():
    """An adapter with huge (finite) weights overflows its rows' logits to inf or NaN: sampling
    them raised, which failed the step, and the Step stream, of every sequence on the executor."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    logits[1] = math.nan
    logits[2, 7] = math.inf
    params = [SamplingParams(temperature=0.8, seed=3)] * 4

    def streams():
        return [DrawStream(3, 0, "cpu") for _ in params]

    tokens = sample(logits, params, streams()).tolist()
    assert tokens[2] == 7 and 0 <= tokens[1] < 50
    alone = sample(logits[[0, 3]], [params[0], params[3]], streams()[:2]).tolist()
    assert [tokens[0], tokens[3]] == alone  # the others drew as they would have
