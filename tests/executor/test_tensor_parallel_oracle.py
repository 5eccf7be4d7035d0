"""Tensor parallelism on the fixture model (hidden 256, 4 heads, 2 KV heads, intermediate 688):
2 and 4 ranks (KV heads split, then replicated) in gloo groups, each rank a runner of its own
part, give HF + PEFT's greedy tokens and TP=1's logits within TP_ATOL, for every fixture adapter
(all projections, MLP only, rank patterns, rsLoRA, layers_to_transform) mixed in one batch beside
base-model rows; with a cached prefix; merged; and with the Triton LoRA backend (interpreter).
A Qwen-shaped model (biases, head norms) with tied embeddings and an uneven vocabulary too.

TP_ATOL: a rank's row-parallel outputs are partial sums added by the all-reduce, so the float32
sums run in another order than TP=1's one matmul: the logits differ by ~5e-6 (measured), against
TP_ATOL = 5e-5."""

import os
import threading

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit is defined

import pytest  # noqa: E402
import torch  # noqa: E402

from common.sampling import SamplingParams  # noqa: E402
from executor.lora.peft_adapter import parse_peft_adapter  # noqa: E402
from executor.model.config import ModelConfig  # noqa: E402
from executor.runner import ModelRunner, Row  # noqa: E402
from executor.tp.collectives import TensorParallel  # noqa: E402
from tests.executor.test_merge import weights_digest  # noqa: E402
from tests.executor.test_prefix_reuse import decode  # noqa: E402
from tests.oracle import assert_matches_hf  # noqa: E402
from tests.random_adapters import random_adapter  # noqa: E402
from tests.rank_threads import RankThreads  # noqa: E402
from tests.runner_driver import BLOCK, MAX_RANK, make_runner, prompts, read_adapter, run  # noqa: E402

TP_ATOL = 5e-5
NUM_TOKENS = 8


def tp_runners(tiny, world: int, backend: str = "torch") -> RankThreads:
    """`world` ranks of the fixture model, every valid fixture adapter in slots 0, 1, ..."""
    def make(tp: TensorParallel) -> ModelRunner:
        return ModelRunner.from_pretrained(tiny["model_dir"], num_kv_blocks=2048,
                                           block_size=BLOCK, num_slots=len(tiny["valid"]),
                                           max_rank=MAX_RANK, lora_backend=backend, tp=tp)

    ranks = RankThreads(world, make)
    if backend == "triton":  # the interpreter is one per process: its launches one at a time
        lock = threading.Lock()
        for rank in ranks.ranks:
            for name in ("_shrink", "_expand", "_fused"):
                setattr(rank.lora, name, _locked(lock, getattr(rank.lora, name)))
    for slot, name in enumerate(tiny["valid"]):
        ranks.load_adapter(slot, parse_peft_adapter(*read_adapter(tiny, name), ranks.config))
    return ranks


def _locked(lock: threading.Lock, kernel):
    def call(*args, **kw):
        with lock:
            return kernel(*args, **kw)
    return call


@pytest.fixture(scope="module")
def one(tiny):
    return make_runner(tiny)


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request, tiny):
    ranks = tp_runners(tiny, request.param)
    yield ranks
    ranks.close()


def mixed_batch(tiny) -> tuple[dict, list]:
    """Every fixture adapter once, base-model rows among them, two adapters twice."""
    names = [*tiny["valid"], None, "r8_patterns", None, "r16_all"]
    slots = [tiny["valid"].index(n) if n else -1 for n in names]
    return {sid: (p, s) for sid, (p, s) in enumerate(zip(prompts(len(names), 5), slots))}, names


def test_each_rank_holds_its_part(tiny, ranks):
    world = len(ranks.ranks)
    local = ranks.ranks[0].pool.config
    assert local.num_attention_heads == 4 // world and local.num_key_value_heads == max(1, 2 //
                                                                                       world)
    sizes = ranks.each(lambda r: r.memory_budget())
    assert len({s.weights_bytes for s in sizes}) == 1  # equal parts
    whole = make_runner(tiny).memory_budget()
    assert sizes[0].weights_bytes < whole.weights_bytes / world * 1.1
    assert sizes[0].kv_cache_bytes == whole.kv_cache_bytes // min(world, 2)  # KV heads split


def test_mixed_adapters_in_one_batch_match_hf_peft_and_tp1(tiny, hf_peft, one, ranks):
    requests, names = mixed_batch(tiny)
    got = run(ranks, requests, NUM_TOKENS, chunk=8, admit=len(names))
    assert_matches_hf(hf_peft, requests, names, got, NUM_TOKENS, atol=2e-4,
                      what=f"TP={len(ranks.ranks)}: ")
    want = run(one, requests, NUM_TOKENS, chunk=8, admit=len(names))
    for sid in requests:
        assert got[sid][0] == want[sid][0]
        torch.testing.assert_close(got[sid][1], want[sid][1], atol=TP_ATOL, rtol=0)


def test_a_cached_prefix_gives_the_tokens_and_logits_of_computing_it(tiny, one, ranks):
    slot = tiny["valid"].index("r8_patterns")
    shared = prompts(1, seed=11)[0][:3] * 4  # 12 tokens: 3 full blocks of 4
    free = ranks.free_blocks()
    blocks = free[:24]
    ranks.add_sequence(1, shared + [5, 6], SamplingParams(), slot)
    ranks.step([Row(1, 14, tuple(blocks[:4]))])  # computes the 3 shared blocks (and one more)
    prompt = shared + [7, 8, 9]
    ranks.add_sequence(2, prompt, SamplingParams(), slot, num_cached=12)
    cached = decode(ranks, 2, Row(2, 3, (*blocks[:3], blocks[10])), blocks[11:15], steps=6)
    for sid in (1, 2):
        ranks.free_sequence(sid)
    one.add_sequence(3, prompt, SamplingParams(), slot)
    fresh = decode(one, 3, Row(3, 15, tuple(blocks[16:20])), blocks[20:24], steps=6)
    one.free_sequence(3)
    assert cached[0] == fresh[0]
    torch.testing.assert_close(cached[1], fresh[1], atol=TP_ATOL, rtol=0)


def test_merge_works_per_shard_and_unmerge_restores_every_rank(tiny, hf_peft, ranks):
    slot = tiny["valid"].index("r16_all")
    before = ranks.each(weights_digest)
    ranks.merge(slot)
    assert all(a != b for a, b in zip(ranks.each(weights_digest), before))
    requests = {sid: (p, slot) for sid, p in enumerate(prompts(2, seed=4))}
    got = run(ranks, requests, NUM_TOKENS, chunk=5)
    assert_matches_hf(hf_peft, requests, ["r16_all"] * 2, got, NUM_TOKENS, atol=2e-4,
                      what="merged: ")
    ranks.unmerge()
    assert ranks.each(weights_digest) == before


def test_the_triton_backend_gives_the_torch_backends_tokens(tiny, one):
    """(Interpreter: two tokens, the prefill chunks and a decode step.)"""
    ranks = tp_runners(tiny, 2, backend="triton")
    names = ["r16_all", None, "r8_patterns", "r1_down", "r16_all"]
    slots = [tiny["valid"].index(n) if n else -1 for n in names]
    requests = {sid: (p, s) for sid, (p, s) in enumerate(zip(prompts(len(names), 9), slots))}
    got = run(ranks, requests, 2, chunk=8, admit=len(names))
    ranks.close()
    want = run(one, requests, 2, chunk=8, admit=len(names))
    for sid in requests:
        assert got[sid][0] == want[sid][0]
        torch.testing.assert_close(got[sid][1], want[sid][1], atol=TP_ATOL, rtol=0)


def test_without_the_row_parallel_all_reduce_the_logits_are_wrong(tiny, one, monkeypatch):
    """The test above can fail: each rank's o and down outputs left as its partial sums."""
    class WithoutRowReduce:  # (the embedding and the logits as before)
        def __init__(self, tp):
            self.tp = tp

        def all_reduce(self, x):
            return x

        def __getattr__(self, name):
            return getattr(self.tp, name)

    ranks = tp_runners(tiny, 2)
    for rank in ranks.ranks:
        monkeypatch.setattr(rank.model, "tp", WithoutRowReduce(rank.tp))
    requests = {0: (prompts(1, seed=2)[0], tiny["valid"].index("r16_all"))}
    got = run(ranks, requests, 1)
    ranks.close()
    want = run(one, requests, 1)
    assert (got[0][1] - want[0][1]).abs().max() > 1e-2


def test_biases_head_norms_tied_embeddings_and_an_uneven_vocabulary():
    """Qwen-shaped (q/k/v biases split with their rows, q/k norms per head whole on each rank),
    tied embeddings, a vocabulary of 1001 split 501 + 500 (the last part padded): random weights,
    the same model whole and cut in two, with an adapter of ranks 8..2 on every projection."""
    config = ModelConfig.named("tiny").replace(attention_bias=True, qk_norm=True,
                                               tie_word_embeddings=True, vocab_size=1001)
    kw = dict(num_kv_blocks=1024, block_size=BLOCK, num_slots=1, max_rank=8, seed=3)
    one = ModelRunner.random(config, **kw)
    ranks = RankThreads(2, lambda tp: ModelRunner.random(config, tp=tp, **kw))
    adapter = random_adapter(config, 8, seed=5)
    one.load_adapter(0, adapter)
    ranks.load_adapter(0, adapter)
    requests = {sid: ([t % 1001 for t in p], sid % 2 - 1)
                for sid, p in enumerate(prompts(4, seed=6))}
    got, want = run(ranks, requests, 4, admit=4), run(one, requests, 4, admit=4)
    ranks.close()
    for sid in requests:
        assert got[sid][0] == want[sid][0]
        torch.testing.assert_close(got[sid][1], want[sid][1], atol=TP_ATOL, rtol=0)
    assert got[0][1].shape[-1] == 1001  # (the padding row cut)
