"""Qwen3 bases (issue 32, its first family): per-head RMSNorm of q and k before RoPE, a head_dim
that is not hidden / heads, tied or untied embeddings. A tiny random Qwen3 made with
transformers, PEFT adapters on it (every projection, MLP only, a rank_pattern, rsLoRA), served
alone and in one batch beside base rows: greedy tokens and logits equal HF + PEFT's. Without
the q/k norms the tokens differ, so the test can fail."""

import pytest

from executor.model.config import ModelConfig
from executor.runner import ModelRunner
from loraplex import fixtures
from tests.oracle import assert_matches_hf, hf_greedy, made_adapters
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


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def qwen3(request, tmp_path_factory):
    """A tiny Qwen3 (head_dim 48 against hidden 256 / 4 heads = 64), its adapters, and HF +
    PEFT with all of them loaded."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("qwen3")
    model_dir = fixtures.save_tiny_model(out / "model", "qwen3", seed=3, head_dim=48,
                                         tie_word_embeddings=request.param)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    return model_dir, out, made_adapters(base, out, ADAPTERS, seed=50)


def make_runner(model_dir, folder) -> ModelRunner:
    runner = ModelRunner.from_pretrained(model_dir, num_kv_blocks=1024, block_size=BLOCK,
                                         num_slots=len(ADAPTERS), max_rank=16,
                                         lora_backend="torch")
    return load_folders(runner, [folder / name for name in ADAPTERS])


def test_the_config_is_read_as_qwen3():
    config = {"model_type": "qwen3", "hidden_size": 256, "intermediate_size": 688,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 48, "vocab_size": 1024, "sliding_window": 16,
              "use_sliding_window": False}
    model = ModelConfig.from_hf_dict(config)
    assert model.qk_norm and model.head_dim == 48 and model.q_size == 192
    assert model.sliding_window is None and not model.attention_bias
    assert model.module_shape("q_proj") == (256, 192) and model.module_shape("o_proj") == (192, 256)
    # (with use_sliding_window, the layers from max_window_layers on slide, as transformers')
    sliding = ModelConfig.from_hf_dict({**config, "use_sliding_window": True,
                                        "max_window_layers": 1})
    assert [sliding.layer_window(i) for i in range(2)] == [None, 16]


def test_qwen3_adapters_alone_and_batched_match_hf_peft(qwen3):
    model_dir, folder, hf = qwen3
    runner = make_runner(model_dir, folder)
    assert runner.config.qk_norm and runner.config.head_dim == 48
    names = [*ADAPTERS, None, "all_r8"]
    slots = [list(ADAPTERS).index(n) if n else -1 for n in names]
    requests = {sid: (p, slot) for sid, (p, slot) in enumerate(zip(prompts(len(names), 3),
                                                                    slots))}
    batched = run(runner, requests, NUM_TOKENS, chunk=6, admit=len(names))
    assert_matches_hf(hf, requests, names, batched, NUM_TOKENS, atol=1e-4, adapter_matters=False)
    for sid in (0, 2):
        assert run(runner, {sid: requests[sid]}, NUM_TOKENS)[sid][0] == batched[sid][0]


def test_without_the_qk_norms_the_tokens_differ(qwen3):
    model_dir, folder, hf = qwen3
    runner = make_runner(model_dir, folder)
    runner.model.config = runner.config.replace(qk_norm=False)  # the oracle's feature off
    requests = {sid: (p, sid % 2 - 1) for sid, p in enumerate(prompts(4, 5))}
    got = run(runner, requests, NUM_TOKENS)
    assert any(got[sid][0] != hf_greedy(hf, req[0], NUM_TOKENS, None if req[1] < 0 else
                                        list(ADAPTERS)[req[1]])[0]
               for sid, req in requests.items())
