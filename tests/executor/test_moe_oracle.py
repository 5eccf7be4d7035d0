"""Mixture-of-experts bases (issue 41): a tiny Qwen3-MoE (a dense layer among MoE ones, q/k
norms, renormalised top-k) and a tiny Mixtral (sliding window, fp32 routing weights), made with
transformers, with PEFT adapters on attention only, on the experts only (both weights, or
gate_up alone), on both with a rank_pattern, rsLoRA, with bare weight names as PEFT converts
them; the experts' LoRA in PEFT's target_parameters layout and rewritten as per-expert modules
(Qwen's and Mixtral's transformers 4 names). Served alone and batched beside base rows and each
other: greedy tokens equal HF + PEFT's, logits within 1e-4. A wrong router, a transposed expert
B or a dropped expert each fail."""

import pytest
import torch

from executor.lora import experts as lora_experts
from executor.lora.experts import ExpertRuns
from executor.runner import ModelRunner
from loraplex import fixtures
from tests.executor.moe_oracle import Oracles, as_per_expert
from tests.runner_driver import BLOCK, load_folders, prompts, run

ATTN = ["q_proj", "v_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ADAPTERS = {
    "attn_r8": {"r": 8, "lora_alpha": 16, "target_modules": ATTN},
    "experts_r4": {"r": 4, "lora_alpha": 8, "target_modules": [],
                   "target_parameters": EXPERTS},
    "gate_up_r2": {"r": 2, "lora_alpha": 8, "target_modules": [],
                   "target_parameters": EXPERTS[:1]},
    "both_pattern": {"r": 4, "lora_alpha": 16, "target_modules": ATTN + ["o_proj"],
                     "target_parameters": EXPERTS,
                     "rank_pattern": {"layers.0.mlp.experts.down_proj": 2, "q_proj": 6}},
    "rslora": {"r": 8, "lora_alpha": 4, "use_rslora": True, "target_modules": ATTN,
               "target_parameters": EXPERTS},
    # as PEFT writes an adapter whose target_modules name the experts' own projections
    # (gate_proj, up_proj, down_proj; w1, w3, w2): bare weight names, gate_up's rank doubled
    "bare_names": {"r": 3, "lora_alpha": 5, "target_modules": ATTN,
                   "target_parameters": ["gate_up_proj", "down_proj"],
                   "rank_pattern": {r".*\.gate_up_proj": 6},
                   "alpha_pattern": {r".*\.gate_up_proj": 10}},
}
REWRITTEN = "experts_r4"  # also served as per-expert modules
NUM_TOKENS = 8
SHAPE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "num_hidden_layers": 3}
FAMILIES = {
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "intermediate_size": 48, "norm_topk_prob": True, "mlp_only_layers": [1]},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
                "sliding_window": 6},
    # sinks, biases everywhere, sliding layers between full ones, YaRN, clamped SwiGLU
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
                "sliding_window": 6, "max_position_embeddings": 256, "swiglu_limit": 1.5},
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def moe(request, tmp_path_factory):
    """(family, model dir, adapter folders by name, HF + PEFT with the adapters loaded)."""
    from transformers import AutoModelForCausalLM

    family = request.param
    out = tmp_path_factory.mktemp(family)
    model_dir = fixtures.save_tiny_model(out / "model", family, seed=5,
                                         **SHAPE, **FAMILIES[family])
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    for i, (name, args) in enumerate(ADAPTERS.items()):
        fixtures._save_adapter(base, out / name, 70 + i, args)
    folders = {name: out / name for name in ADAPTERS}
    hf = Oracles(base, folders)
    if family != "gpt_oss":
        folders["per_expert"] = as_per_expert(out / REWRITTEN, out / "per_expert",
                                              mixtral=family == "mixtral")
    return family, model_dir, folders, hf


def served_names(family: str) -> list[str]:
    """Every adapter, and the per-expert rewrite but on gpt-oss (whose gate and up interleave:
    a per-expert gate / up pair is refused there, as no such adapters exist)."""
    return [*ADAPTERS] + ([] if family == "gpt_oss" else ["per_expert"])


def make_runner(model_dir, folders, names) -> ModelRunner:
    runner = ModelRunner.from_pretrained(model_dir, num_kv_blocks=1024, block_size=BLOCK,
                                         num_slots=len(names), max_rank=16, lora_backend="torch")
    return load_folders(runner, [folders[n] for n in names])


def check(hf, requests, names, got, what=""):
    for sid, name in enumerate(names):
        ref = REWRITTEN if name == "per_expert" else name
        tokens, logits = hf.greedy(requests[sid][0], NUM_TOKENS, ref)
        assert got[sid][0] == tokens, f"{what}greedy tokens differ for {name}"
        torch.testing.assert_close(got[sid][1], logits, atol=1e-4, rtol=0)


def test_the_configs_are_read_as_mixtures_of_experts(moe):
    family, model_dir, _, _ = moe
    runner = make_runner(model_dir, {}, [])
    c = runner.config
    assert c.num_experts == (8 if family == "qwen3_moe" else 4) and c.num_experts_per_tok == 2
    assert c.moe_layers == ((0, 2) if family == "qwen3_moe" else (0, 1, 2))
    assert c.routing_in_fp32 == (family == "mixtral")
    assert c.sliding_window == (None if family == "qwen3_moe" else 6)
    assert (c.routing == "topk_softmax") == c.attention_sinks == (family == "gpt_oss")
    if family == "gpt_oss":
        assert c.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
        assert c.swiglu_limit == 1.5 and c.rope.scaling.factor == 32.0
        assert runner.weights.layers[0].experts_down_bias.abs().sum() > 0
    assert runner.weights.layers[0].w_gate_up is None
    assert (runner.weights.layers[1].w_gate_up is None) == (family != "qwen3_moe")


@pytest.mark.parametrize("batched_rows", [8, 0], ids=["short-runs-batched", "each-run-alone"])
def test_every_adapter_alone_and_batched_matches_hf_peft(moe, monkeypatch, batched_rows):
    family, model_dir, folders, hf = moe
    monkeypatch.setattr(lora_experts, "BATCH_MAX_ROWS", batched_rows)
    names = served_names(moe[0])
    runner = make_runner(model_dir, folders, names)
    order = [*names, None, "experts_r4", None]
    slots = [names.index(n) if n else -1 for n in order]
    requests = {sid: (p, slot) for sid, (p, slot) in
                enumerate(zip([[t % 1024 for t in p] for p in prompts(len(order), 4)], slots))}
    batched = run(runner, requests, NUM_TOKENS, chunk=5, admit=len(order))
    check(hf, requests, order, batched)
    for sid in (1, 5):  # alone: the same tokens as in the batch
        assert run(runner, {sid: requests[sid]}, NUM_TOKENS)[sid][0] == batched[sid][0]
    base = hf.greedy(requests[1][0], 1, None)[1][0]
    assert (batched[1][1][0] - base).abs().max() > 1e-2, "the expert adapter matters"


def test_neighbours_never_change_a_requests_logits(moe):
    """A base request and one on an attention adapter get bit-identical logits whether an
    expert adapter is loaded or not (no stale expert delta reaches them); beside that adapter's
    own requests in one batch, the same tokens."""
    _, model_dir, folders, _ = moe
    requests = {sid: (p, slot) for sid, (p, slot) in enumerate(zip(prompts(2, 9), (-1, 0)))}
    without = run(make_runner(model_dir, folders, ["attn_r8"]), requests, NUM_TOKENS)
    runner = make_runner(model_dir, folders, ["attn_r8", "experts_r4"])
    loaded = run(runner, requests, NUM_TOKENS)
    for sid in requests:
        assert without[sid][0] == loaded[sid][0]
        assert torch.equal(without[sid][1], loaded[sid][1])
    crowd = {**requests, 2: (requests[0][0], 1), 3: (requests[1][0], 1)}
    beside = run(runner, crowd, NUM_TOKENS, admit=4)
    for sid in requests:
        assert beside[sid][0] == without[sid][0]
        torch.testing.assert_close(beside[sid][1], without[sid][1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("breakage", ["router not renormalised", "expert B transposed",
                                      "an expert dropped"])
def test_each_piece_matters(moe, monkeypatch, breakage):
    family, model_dir, folders, hf = moe
    if breakage == "router not renormalised" and family != "qwen3_moe":
        pytest.skip("(the qwen3_moe case covers a renormalising router)")
    runner = make_runner(model_dir, folders, ["experts_r4"])
    if breakage == "router not renormalised":
        runner.model.config = runner.config.replace(norm_topk_prob=False)
    elif breakage == "expert B transposed":
        from common.peft import experts

        made = experts.ExpertPart

        def expert_major(a, b, a_rows, b_cols, *rest):  # B read as [out, E * r], not [out, r * E]
            e, stop, num = b_cols
            rank = stop // num
            return made(a, b, a_rows, (e * rank, (e + 1) * rank, 1), *rest)

        monkeypatch.setattr(experts, "ExpertPart", expert_major)
        runner = make_runner(model_dir, folders, ["experts_r4"])
    else:
        build = ExpertRuns.build
        monkeypatch.setattr(ExpertRuns, "build", classmethod(lambda cls, slots, runs: build(
            slots, tuple(r for r in runs if r[2] != 1))))
    requests = {sid: (p, 0) for sid, p in enumerate(prompts(3, 11))}
    got = run(runner, requests, NUM_TOKENS)
    assert any(got[sid][0] != hf.greedy(req[0], NUM_TOKENS, "experts_r4")[0] or not torch.allclose(
        got[sid][1], hf.greedy(req[0], NUM_TOKENS, "experts_r4")[1], atol=1e-4)
               for sid, req in requests.items()), f"{breakage}: still equal to HF"


def test_a_merged_expert_adapter_gives_hf_peft_tokens_and_unmerges_bit_for_bit(moe):
    """Merged (each expert's B @ A into its expert's weight, attention's into theirs), the
    adapter's requests run with no LoRA work and give HF + PEFT's tokens; unmerged, every expert
    weight is back bit for bit."""
    _, model_dir, folders, hf = moe
    runner = make_runner(model_dir, folders, ["both_pattern"])
    layer = runner.config.moe_layers[0]
    before = runner.weights.layers[layer].experts_down.clone()
    runner.merge(0)
    assert not torch.equal(runner.weights.layers[layer].experts_down, before)
    requests = {sid: (p, 0) for sid, p in enumerate(prompts(2, 13))}
    got = run(runner, requests, NUM_TOKENS)
    for sid, (prompt, _) in requests.items():
        tokens, logits = hf.greedy(prompt, NUM_TOKENS, "both_pattern")
        assert got[sid][0] == tokens
        torch.testing.assert_close(got[sid][1], logits, atol=1e-4, rtol=0)
    runner.unmerge()
    assert torch.equal(runner.weights.layers[layer].experts_down, before)


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_ranks_give_tp1s_tokens(moe, world):
    """2 and 4 ranks in gloo groups, each expert's gate / up rows and down columns split as the
    dense MLP's (and its LoRA's B / A with them), the router replicated: every adapter mixed
    with base rows gives TP=1's greedy tokens, logits within 5e-5 (the partial sums' order)."""
    from executor.tp.collectives import TensorParallel
    from tests.rank_threads import RankThreads

    _, model_dir, folders, _ = moe
    names = served_names(moe[0])

    def make(tp: TensorParallel) -> ModelRunner:
        return ModelRunner.from_pretrained(model_dir, num_kv_blocks=1024, block_size=BLOCK,
                                           num_slots=len(names), max_rank=16,
                                           lora_backend="torch", tp=tp)

    ranks = RankThreads(world, make)
    try:
        full, local = ranks.ranks[0].config, ranks.ranks[0].pool.config
        assert local.moe_intermediate_size * world == full.moe_intermediate_size
        load_folders(ranks, [folders[n] for n in names])
        order = [*names, None, None]
        slots = [names.index(n) if n else -1 for n in order]
        requests = {sid: (p, slot) for sid, (p, slot) in enumerate(zip(prompts(len(order), 8),
                                                                       slots))}
        got = run(ranks, requests, NUM_TOKENS, chunk=6, admit=len(order))
        want = run(make_runner(model_dir, folders, names), requests, NUM_TOKENS, chunk=6,
                   admit=len(order))
        for sid in requests:
            assert got[sid][0] == want[sid][0]
            torch.testing.assert_close(got[sid][1], want[sid][1], atol=5e-5, rtol=0)
    finally:
        ranks.close()
