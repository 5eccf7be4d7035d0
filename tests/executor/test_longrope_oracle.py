"""Phi-3's longrope (Phi-3-128k, Phi-3.5) served past its original context, as transformers'
generate() serves it: a sequence of up to original_max_position_embeddings tokens (the switch)
with the short factors, a longer one with the long factors at every position, its KV computed
again whole when it outgrows the switch (executor/model/rope.py, scheduler/steps/longrope.py).

A tiny random Phi-3 (switch 32, context 256, distinct short and long factors) with a PEFT adapter
on qkv_proj and o_proj: greedy tokens and logits equal HF + PEFT generate()'s for a prompt past
the switch and for one whose generation crosses it, alone and batched with a base-model row, in
prefill chunks (two tensor-parallel ranks give one rank's); through the scheduler's core too (its
plans as step messages, run by the executor's step code), which recomputes a crossing sequence
and gives prefix-cached blocks only to runs of their own kind. Served with the short factors
alone, the tokens leave HF's; and generate()'s recompute shows in HF's own logits (stepping its
rotary module call by call, as the KV cache alone would, gives others)."""

import math

import pytest
import torch

from common.detokenizer import OutputProcessor
from common.sampling import SamplingParams
from executor.model.config import ModelConfig
from executor.model.rope import LongRopeScaling
from executor.runner import ModelRunner
from executor.step_request import run_step, step_rows
from loraplex import fixtures
from scheduler.executor_link import step_request
from scheduler.limits import Limits
from scheduler.request import Ask, Request, TokenEvent
from scheduler.sim.invariants import check_invariants
from scheduler.steps.sequence import Sample, Samples
from tests.executor.test_tensor_parallel_oracle import TP_ATOL
from tests.oracle import hf_generate, hf_greedy, made_adapters
from tests.rank_threads import RankThreads
from tests.runner_driver import BLOCK, load_folders, run
from tests.scheduler.sched_world import World, ref

SWITCH, CONTEXT = 32, 256
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(32)],
            "long_factor": [2.0 + 0.5 * i for i in range(32)]}
ADAPTERS = {"attn": {"r": 8, "lora_alpha": 16, "target_modules": ["qkv_proj", "o_proj"]}}
NUM_TOKENS = 20
PAST = [(7 * i + 3) % 1000 + 2 for i in range(40)]  # 40 tokens: past the switch
ACROSS = [(11 * i + 5) % 1000 + 2 for i in range(20)]  # 20: its 14th sample is past it
BASE = [(13 * i + 1) % 1000 + 2 for i in range(27)]  # 27: the base model's, crossing at its 6th


@pytest.fixture(scope="module")
def longrope(tmp_path_factory):
    """The model's folder, the adapters' folder, and HF + PEFT with the adapter loaded."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("longrope")
    model_dir = fixtures.save_tiny_model(out / "model", "phi3", seed=9,
                                         max_position_embeddings=CONTEXT, rope_scaling=LONGROPE,
                                         original_max_position_embeddings=SWITCH)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    return model_dir, out, made_adapters(base, out, ADAPTERS, seed=31)


def make_runner(model_dir, folder) -> ModelRunner:
    runner = ModelRunner.from_pretrained(model_dir, num_kv_blocks=256, block_size=BLOCK,
                                         num_slots=1, max_rank=8)
    return load_folders(runner, [folder / name for name in ADAPTERS])


def assert_hf(hf, prompt, adapter, got, what=""):
    tokens, logits = hf_generate(hf, prompt, len(got[0]), adapter)
    assert got[0] == tokens, f"{what}greedy tokens differ from HF generate()'s"
    torch.testing.assert_close(got[1], logits, atol=1e-4, rtol=0)


def test_the_config_reads_the_switch_and_serves_the_whole_context():
    """Phi-3-mini-128k's tf4 layout: "su" (and Phi-3's "yarn") are longrope; the attention
    factor from the context's growth (131072 / 4096), one for both factors; the context is
    max_position_embeddings."""
    shape = {"model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192,
             "num_hidden_layers": 2, "num_attention_heads": 32, "vocab_size": 32064,
             "max_position_embeddings": 131072, "original_max_position_embeddings": 4096}
    factors = {"short_factor": [1.0] * 48, "long_factor": [4.0] * 48}
    for name in ("su", "yarn", "longrope"):
        c = ModelConfig.from_hf_dict({**shape, "rope_scaling": {"type": name, **factors}})
        assert c.max_position_embeddings == 131072 and c.rope_switch_len == 4096
        assert c.rope.attention_factor == pytest.approx(
            math.sqrt(1 + math.log(32) / math.log(4096)))
        assert torch.equal(c.rope.inv_freq(96, long=True) * 4, c.rope.inv_freq(96))
    for bad, match in [({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic'"),
                       ({"rope_scaling": {"type": "su", "short_factor": [1.0]}}, "48 positive"),
                       ({"rope_scaling": {"type": "su", "short_factor": [1.0] * 48}},
                        "missing 'long_factor'"),
                       ({"partial_rotary_factor": 0.75}, "partial_rotary_factor")]:
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf_dict({**shape, **bad})
    assert ModelConfig.named("phi-3-mini").rope_switch_len == 0  # (the 4k model: no switch)


def test_past_and_across_the_switch_the_tokens_and_logits_are_hf_generates(longrope):
    """A prompt past the switch (adapter), one whose generation crosses it (adapter) and a
    base-model row that crosses it early, batched in prefill chunks of 7; the first two alone
    too, each prompt in one chunk."""
    model_dir, folder, hf = longrope
    runner = make_runner(model_dir, folder)
    c = runner.config
    assert isinstance(c.rope_scaling, LongRopeScaling) and c.max_position_embeddings == CONTEXT
    assert runner.rope_switch_len == SWITCH
    # (no factor given: the context's growth, 256 / 32)
    assert c.rope.attention_factor == pytest.approx(math.sqrt(1 + math.log(8) / math.log(32)))
    requests = {0: (PAST, 0), 1: (ACROSS, 0), 2: (BASE, -1)}
    names = ["attn", "attn", None]
    batched = run(runner, requests, NUM_TOKENS, chunk=7)
    for sid, name in enumerate(names):
        assert_hf(hf, requests[sid][0], name, batched[sid], f"batched row {sid}: ")
    for sid in (0, 1):
        alone = run(runner, {sid: requests[sid]}, NUM_TOKENS, chunk=64)[sid]
        assert alone[0] == batched[sid][0]
        torch.testing.assert_close(alone[1], batched[sid][1], atol=1e-5, rtol=0)


def test_two_tensor_parallel_ranks_give_one_ranks_tokens_and_logits(longrope):
    """Each rank rotates its own heads by the same rule: the rows above at TP=2 (gloo, threads)."""
    model_dir, folder, _ = longrope
    requests = {0: (PAST, 0), 1: (ACROSS, 0), 2: (BASE, -1)}
    want = run(make_runner(model_dir, folder), requests, 16, chunk=7)
    ranks = RankThreads(2, lambda tp: ModelRunner.from_pretrained(
        model_dir, num_kv_blocks=256, block_size=BLOCK, num_slots=1, max_rank=8, tp=tp))
    got = run(load_folders(ranks, [folder / name for name in ADAPTERS]), requests, 16, chunk=7)
    ranks.close()
    for sid in requests:
        assert got[sid][0] == want[sid][0]
        torch.testing.assert_close(got[sid][1], want[sid][1], atol=TP_ATOL, rtol=0)


def test_the_oracle_sees_the_long_factors_and_the_recompute(longrope):
    model_dir, folder, hf = longrope
    runner = make_runner(model_dir, folder)
    (inv_freqs,) = runner.model.inv_freqs.values()  # [2, D / 2]: short, long
    inv_freqs[1] = inv_freqs[0]  # the short factors alone
    tokens, logits = run(runner, {0: (PAST, 0)}, NUM_TOKENS)[0]
    ref_tokens, ref_logits = hf_generate(hf, PAST, NUM_TOKENS, "attn")
    assert tokens != ref_tokens and (logits - ref_logits).abs().max() > 0.1
    # HF's rotary module stepped call by call keeps the short KV below the switch: not generate()
    stepped, generated = (hf_greedy(hf, ACROSS, NUM_TOKENS, "attn")[1],
                          hf_generate(hf, ACROSS, NUM_TOKENS, "attn")[1])
    torch.testing.assert_close(stepped[:13], generated[:13], atol=1e-4, rtol=0)  # (from 32)
    assert (stepped[13:] - generated[13:]).abs().amax(-1).min() > 0.1  # each one past it


def _submit(w: World, prompt: list[int], adapter: str, max_new: int) -> Request:
    rid = next(w._ids)
    w.events[rid] = []
    ask = Ask("t", ref(adapter) if adapter else None, 2**20, tuple(prompt), SamplingParams(),
              adapter_ranks={"qkv_proj": 8, "o_proj": 8})
    req = Request(rid, ask, OutputProcessor(None, max_new_tokens=max_new), w.events[rid].append)
    w.core.submit(req)
    w.requests.append(req)
    return req


def _serve(w: World, runner: ModelRunner, folder) -> None:
    """Step the core's plans through the executor's step code until the work is done."""
    ex = w.executors[0]
    loaded = lambda slot, adapter: load_folders(runner, [folder / adapter.name])  # noqa: E731
    for _ in range(300):
        w.complete_loads(loaded=loaded)
        plan = w.core.schedule(ex)
        message = step_request(plan)
        sampled = run_step(runner, message, step_rows(message))
        w.core.on_step_done(ex, plan, Samples.of(
            Sample(s.seq_id, s.token_id, s.logprob) for s in sampled))
        check_invariants(w.core, w.requests)
        if not w.core.has_work(ex) and not w.loads:
            return
    raise AssertionError("work did not drain")


def _tokens(w: World, req: Request) -> list[int]:
    return [e.token_id for e in w.events[req.serial] if isinstance(e, TokenEvent)]


def test_through_the_scheduler_a_crossing_run_is_recomputed_and_kinds_share_no_blocks(longrope):
    """The core learns the switch (ExecutorState.rope_switch_len, from Info) and plans in chunks
    of 16 tokens: a crossing request (adapter) and a long base-model one give HF generate()'s
    tokens. Then the crossing request's prompt again (short) reuses its short run's cached
    blocks, and a long prompt that starts with its first 36 tokens reuses its long run's: both
    still HF's, which KV of the other kind would not give."""
    model_dir, folder, hf = longrope
    runner = make_runner(model_dir, folder)
    w = World(num_blocks=160, block_size=BLOCK, num_slots=1,  # (the adapter's pages above)
              limits=Limits(max_batched_tokens=16), rope_switch_len=runner.rope_switch_len)
    across = _submit(w, ACROSS, "attn@1", NUM_TOKENS)
    base = _submit(w, PAST, "", 8)
    _serve(w, runner, folder)
    generated = hf_generate(hf, ACROSS, NUM_TOKENS, "attn")[0]
    assert _tokens(w, across) == generated
    assert _tokens(w, base) == hf_generate(hf, PAST, 8)[0]
    assert across.runs_long and base.runs_long
    again = _submit(w, ACROSS, "attn@1", 6)  # short: within the switch all along
    longer = _submit(w, ACROSS + generated[:16], "attn@1", 6)  # 36 tokens: long
    _serve(w, runner, folder)
    assert again.charges.cached_prompt_tokens == 16 and not again.runs_long
    assert longer.charges.cached_prompt_tokens == 32 and longer.runs_long
    assert _tokens(w, again) == generated[:6]
    assert _tokens(w, longer) == hf_generate(hf, ACROSS + generated[:16], 6, "attn")[0]
