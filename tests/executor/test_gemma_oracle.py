"""Gemma 2 and Gemma 3 (text) bases (issue 32): tiny random models made with transformers, PEFT
adapters on them (every projection, MLP only, a rank_pattern, rsLoRA), served alone and in one
batch beside base rows, prompts longer than the sliding window: greedy tokens and logits equal
HF + PEFT's. Each distinguishing feature, turned off in our runner, moves the tokens (or, for the
final soft cap, which keeps the argmax, the logits) off HF's: the tests can fail.

The tiny models make every feature bite: a window of 6 keys, a score cap of 1 (Gemma 2), a
query_pre_attn_scalar of 32 against head_dim 96 / 48, Gemma 3's sliding layers on a RoPE base of
100 and its global ones on linear scaling.
"""

import functools

import pytest
import torch

from executor import runner as runner_module
from executor.model.config import FULL, SLIDING, ModelConfig
from executor.model.rope import LinearRopeScaling, Rope
from executor.runner import ModelRunner
from loraplex import fixtures
from tests.oracle import assert_matches_hf, hf_greedy, tiny_family
from tests.runner_driver import BLOCK, load_folders, prompts, run

ALL = fixtures.ATTN + fixtures.MLP
ADAPTERS = {
    "all_r8": {"r": 8, "lora_alpha": 16, "target_modules": ALL},
    "mlp_r4": {"r": 4, "lora_alpha": 8, "target_modules": fixtures.MLP},
    "pattern": {"r": 8, "lora_alpha": 16, "target_modules": ALL,
                "rank_pattern": {"q_proj": 16, "layers.1.mlp.down_proj": 2}},
    "rslora": {"r": 16, "lora_alpha": 8, "target_modules": ALL, "use_rslora": True},
}
NUM_TOKENS = 12
WINDOW = 6
FAMILIES = {  # (head_dim x heads above and below hidden 256, as Gemma 2 9B's and 3 1B's are)
    "gemma2": {"sliding_window": WINDOW, "query_pre_attn_scalar": 32, "head_dim": 96,
               "attn_logit_softcapping": 1.0, "final_logit_softcapping": 3.0},
    "gemma3_text": {"sliding_window": WINDOW, "query_pre_attn_scalar": 32, "head_dim": 48,
                    "sliding_window_pattern": 2, "rope_local_base_freq": 100.0,
                    "rope_theta": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0},
                    "final_logit_softcapping": 3.0},
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def gemma(request, tmp_path_factory):
    """A tiny Gemma of the family, its adapters, and HF + PEFT with all of them loaded."""
    out = tmp_path_factory.mktemp(request.param)
    model_dir, hf = tiny_family(out, request.param, FAMILIES[request.param], 5, ADAPTERS, 60)
    return request.param, model_dir, out, hf


def make_runner(model_dir, folder) -> ModelRunner:
    runner = ModelRunner.from_pretrained(model_dir, num_kv_blocks=1024, block_size=BLOCK,
                                         num_slots=len(ADAPTERS), max_rank=16,
                                         lora_backend="torch")
    return load_folders(runner, [folder / name for name in ADAPTERS])


def long_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts of 3..21 tokens and one of 25, all but the shortest longer than the window."""
    return [*prompts(n - 1, seed), prompts(1, seed + 1)[0] * 3 + [7] * 25][:n]


def test_the_configs_are_read_as_transformers_reads_them():
    shape = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 6,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024}
    g2 = ModelConfig.from_hf_dict({**shape, "model_type": "gemma2"})  # defaults, tf4 style
    assert g2.head_dim == 256 and g2.tie_word_embeddings and g2.hidden_act == "gelu_pytorch_tanh"
    assert (g2.attn_logit_softcap, g2.final_logit_softcap, g2.attention_scale) == (50, 30, 1 / 16)
    assert [g2.layer_window(i) for i in range(6)] == [4096, None] * 3
    assert g2.norm_unit_offset and g2.sandwich_norms and g2.scale_embeddings
    g3 = ModelConfig.from_hf_dict({**shape, "model_type": "gemma3_text", "rope_theta": 1e6,
                                   "rope_local_base_freq": 1e4, "sliding_window": 512,
                                   "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                                   "attn_logit_softcapping": 50.0, "head_dim": 64})
    assert [g3.is_sliding(i) for i in range(6)] == [True] * 5 + [False]  # every 6th is global
    assert g3.layer_rope(0) == Rope(1e4) and g3.layer_rope(5) == Rope(1e6, LinearRopeScaling(8))
    assert g3.qk_norm and g3.attn_logit_softcap is None  # (transformers ignores it on Gemma 3)
    tf5 = {**shape, "model_type": "gemma3_text", "head_dim": 64, "sliding_window": 512,
           "layer_types": [SLIDING] * 5 + [FULL],
           "rope_parameters": {FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                               SLIDING: {"rope_type": "default", "rope_theta": 1e4}}}
    assert ModelConfig.from_hf_dict(tf5) == g3
    for bad, match in [({"model_type": "gemma3_text", "use_bidirectional_attention": True},
                        "use_bidirectional_attention"),
                       ({"model_type": "gemma2", "layer_types": ["chunked_attention"] * 6},
                        "chunked_attention"),
                       ({"model_type": "gemma2", "hidden_activation": "quick_gelu"}, "quick_gelu")]:
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf_dict({**shape, **bad})


def test_adapters_alone_and_batched_match_hf_peft(gemma):
    family, model_dir, folder, hf = gemma
    runner = make_runner(model_dir, folder)
    assert runner.config.sandwich_norms and runner.config.sliding_window == WINDOW
    names = [*ADAPTERS, None, "all_r8"]
    slots = [list(ADAPTERS).index(n) if n else -1 for n in names]
    requests = {sid: (p, slot) for sid, (p, slot) in enumerate(zip(long_prompts(len(names), 3),
                                                                    slots))}
    batched = run(runner, requests, NUM_TOKENS, chunk=6, admit=len(names))
    assert_matches_hf(hf, requests, names, batched, NUM_TOKENS, atol=1e-4, adapter_matters=False)
    for sid in (0, len(names) - 2):
        assert run(runner, {sid: requests[sid]}, NUM_TOKENS)[sid][0] == batched[sid][0]


# feature -> (families it belongs to, the ModelConfig change that turns it off)
FEATURES = {
    "unit_offset_norm": (FAMILIES, {"norm_unit_offset": False}),
    "window": (FAMILIES, {"layer_types": (), "sliding_window": None}),
    "attention_scale": (FAMILIES, {"query_pre_attn_scalar": None}),
    "embedding_scale": (FAMILIES, {"scale_embeddings": False}),
    "sandwich_norms": (FAMILIES, {"sandwich_norms": False}),
    "gelu_tanh": (FAMILIES, {"hidden_act": "silu"}),
    "attention_soft_cap": (("gemma2",), {"attn_logit_softcap": None}),
    "qk_norm": (("gemma3_text",), {"qk_norm": False}),
    "local_rope": (("gemma3_text",), {"local_rope_theta": None}),
    "global_rope_scaling": (("gemma3_text",), {"rope_scaling": None}),
}


@pytest.mark.parametrize("feature", list(FEATURES) + ["final_soft_cap"])
def test_each_feature_matters(gemma, feature):
    family, model_dir, folder, hf = gemma
    if feature != "final_soft_cap" and family not in FEATURES[feature][0]:
        pytest.skip(f"{family} has no {feature}")
    runner = make_runner(model_dir, folder)
    off = FEATURES[feature][1] if feature in FEATURES else {"final_logit_softcap": None}
    runner.model = runner_module.Transformer(runner.config.replace(**off), runner.weights,
                                             runner.lora)  # the oracle's feature off
    requests = {sid: (p, sid % 2 - 1) for sid, p in enumerate(long_prompts(4, 5))}
    got = run(runner, requests, NUM_TOKENS)
    refs = {sid: hf_greedy(hf, req[0], NUM_TOKENS, None if req[1] < 0 else
                           list(ADAPTERS)[req[1]]) for sid, req in requests.items()}
    if feature == "final_soft_cap":  # tanh keeps the argmax: the logits tell
        assert any((got[sid][1][0] - refs[sid][1][0]).abs().max() > 1e-2 for sid in requests)
    else:
        assert any(got[sid][0] != refs[sid][0] for sid in requests)


def test_triton_attention_matches_hf_peft(gemma, monkeypatch):
    """Windows, the score scale and (Gemma 2) the cap through the paged-attention kernel, as on
    CUDA (the Triton interpreter here)."""
    pytest.importorskip("triton")
    from kernels.sgmv_tiles import is_interpreted

    if not is_interpreted():
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported")
    family, model_dir, folder, hf = gemma
    monkeypatch.setattr(runner_module.StepMetadata, "build", functools.partial(
        runner_module.StepMetadata.build, attention="triton"))
    runner = make_runner(model_dir, folder)
    names = ["all_r8", None, "rslora"]
    slots = [list(ADAPTERS).index(n) if n else -1 for n in names]
    requests = {sid: (p, slot) for sid, (p, slot) in enumerate(zip(long_prompts(3, 9), slots))}
    got = run(runner, requests, 4, chunk=8, admit=3)
    assert_matches_hf(hf, requests, names, got, 4, atol=1e-4, adapter_matters=False)
    assert torch.isfinite(got[0][1]).all()
