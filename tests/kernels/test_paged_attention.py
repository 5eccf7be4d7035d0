"""Paged attention through the Triton interpreter on CPU: the kernel against its torch reference,
the executor's old padded gather + SDPA decode path, and the executor's attention paths (CPU
length buckets, and the kernel as the executor calls it), on random caches with mixed context
lengths; and the executor's oracle with its attention on the kernel.

The same check at Llama-3-8B shapes on a GPU is section 6 of bench/gpu_check.sh.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit is defined

import functools  # noqa: E402
import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from executor import runner as runner_module  # noqa: E402
from executor.model.attention import (  # noqa: E402
    MIN_BUCKET_KEYS,
    TorchAttentionMeta,
    attend,
    build_attention_meta,
    decode_buckets,
    prefill_batch,
)
from executor.model.kv_cache import PagedKVCache  # noqa: E402
from kernels.attention_work import PagedAttentionWork  # noqa: E402
from kernels.paged_attention import paged_attention  # noqa: E402
from kernels.paged_attention_ref import (  # noqa: E402
    padded_decode_attention,
    paged_attention_ref,
)
from kernels.reference import TOLERANCES  # noqa: E402
from tests.oracle import hf_greedy  # noqa: E402
from tests.runner_driver import make_runner, prompts, run  # noqa: E402

PAGE, NUM_KV_HEADS = 8, 2
# Contexts: 1 key, exactly a block, a block + 1, short ones, and one much longer sequence.
DECODE_LENS = [1, PAGE, PAGE + 1, 3, 20, 150]
# Row groups (start_pos, num_tokens) of a mixed step: prefill chunks and decode rows. On CPU the
# chunks over at most 16 keys share one padded SDPA (prompts of 3, 5, 6 and 12 tokens and 7
# queries after 9 keys; under a window of 7 the three prompts within it).
MIXED_GROUPS = [(0, 5), (PAGE, 1), (9, 7), (0, 1), (40, 3), (100, 1), (0, 3), (0, 12), (0, 6)]


def assert_close(actual, expected, dtype, k=1.0):
    rtol, atol = TOLERANCES[dtype]
    scale = float(expected.float().abs().max())
    torch.testing.assert_close(actual.float(), expected.float(), rtol=k * rtol,
                               atol=k * atol * scale)


def random_cache(seed, groups, *, group, head_dim, dtype):
    """A one-layer PagedKVCache of random K/V (every block, used or not), q [T, H, D], and the
    step's tables as the executor passes them: each group on shuffled blocks, its table one
    block longer than it needs (ids past the context must not be read)."""
    g = torch.Generator().manual_seed(seed)
    needed = [-(-(s + n) // PAGE) + 1 for s, n in groups]
    blocks = list(range(sum(needed) + 3))
    random.Random(seed).shuffle(blocks)
    kv = PagedKVCache(num_layers=1, num_blocks=len(blocks), block_size=PAGE,
                      num_kv_heads=NUM_KV_HEADS, head_dim=head_dim, dtype=dtype)
    kv.k[0] = torch.randn(kv.k[0].shape, generator=g).to(dtype)
    kv.v[0] = torch.randn(kv.v[0].shape, generator=g).to(dtype)
    tables = [blocks[sum(needed[:i]): sum(needed[:i + 1])] for i in range(len(groups))]
    num_rows = sum(n for _, n in groups)
    q = torch.randn(num_rows, NUM_KV_HEADS * group, head_dim, generator=g).to(dtype)
    starts = [sum(n for _, n in groups[:i]) for i in range(len(groups))]
    return kv, q, tables, starts


def step_work(groups, tables, starts):
    return PagedAttentionWork.build(tables, [s + n for s, n in groups], starts,
                                    [n for _, n in groups], block_size=PAGE)


def executor_attention(q, kv, groups, tables, starts, window, backend, **scores):
    meta = build_attention_meta(tables, [s + n for s, n in groups], starts,
                                [n for _, n in groups], block_size=PAGE,
                                windows={None, window}, backend=backend, device="cpu")
    return attend(q, kv, 0, meta[window], **scores)


@pytest.mark.parametrize("window", [None, 7], ids=["causal", "window7"])
@pytest.mark.parametrize("group", [1, 4], ids=["mha", "gqa4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_decode_matches_reference_and_padded_sdpa(dtype, group, window):
    groups = [(n - 1, 1) for n in DECODE_LENS]
    kv, q, tables, starts = random_cache(len(DECODE_LENS) + group, groups, group=group,
                                         head_dim=32, dtype=dtype)
    work = PagedAttentionWork.decode(tables, DECODE_LENS, block_size=PAGE)
    expected = paged_attention_ref(q, kv.k[0], kv.v[0], work, sliding_window=window)
    got = paged_attention(q, kv.k[0], kv.v[0], work, sliding_window=window, block_n=16)
    assert_close(got, expected, dtype)
    padded = padded_decode_attention(q, kv.k[0], kv.v[0], work, sliding_window=window)
    assert_close(padded, expected, dtype, k=2)  # SDPA's own rounding order on CPU
    cpu_path = executor_attention(q, kv, groups, tables, starts, window, "torch")
    assert_close(cpu_path, expected, dtype, k=2)
    if dtype == torch.float32:  # the executor's CPU path stays within fp32 rounding of the old
        torch.testing.assert_close(cpu_path, padded, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", [None, 7], ids=["causal", "window7"])
@pytest.mark.parametrize("group", [1, 4], ids=["mha", "gqa4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mixed_prefill_and_decode_step(dtype, group, window):
    """Chunked prefill (n causal queries at start..start+n-1 over the paged context) and decode
    rows in one launch, as the executor makes it on CUDA; odd head_dim."""
    kv, q, tables, starts = random_cache(7 + group, MIXED_GROUPS, group=group, head_dim=24,
                                         dtype=dtype)
    work = step_work(MIXED_GROUPS, tables, starts)
    expected = paged_attention_ref(q, kv.k[0], kv.v[0], work, sliding_window=window)
    got = paged_attention(q, kv.k[0], kv.v[0], work, sliding_window=window, block_n=16)
    assert_close(got, expected, dtype)
    for backend in ("torch", "triton"):
        assert_close(executor_attention(q, kv, MIXED_GROUPS, tables, starts, window, backend),
                     expected, dtype, k=2)


@pytest.mark.parametrize("window", [None, 7], ids=["causal", "window7"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_score_scale_and_soft_cap(dtype, window):
    """Gemma's scores: q k^T times the model's scale (query_pre_attn_scalar), capped to
    cap * tanh(s / cap), in the kernel and both executor paths, mixed prefill and decode; the
    cap changes the output (so the test sees it applied)."""
    kv, q, tables, starts = random_cache(11, MIXED_GROUPS, group=4, head_dim=24, dtype=dtype)
    work = step_work(MIXED_GROUPS, tables, starts)
    scores = {"scale": 0.4, "softcap": 1.5}
    expected = paged_attention_ref(q, kv.k[0], kv.v[0], work, sliding_window=window, **scores)
    got = paged_attention(q, kv.k[0], kv.v[0], work, sliding_window=window, block_n=16, **scores)
    assert_close(got, expected, dtype)
    for backend in ("torch", "triton"):
        assert_close(executor_attention(q, kv, MIXED_GROUPS, tables, starts, window, backend,
                                        **scores), expected, dtype, k=2)
    uncapped = paged_attention_ref(q, kv.k[0], kv.v[0], work, sliding_window=window, scale=0.4)
    assert (uncapped.float() - expected.float()).abs().max() > 0.05
    with pytest.raises(ValueError, match="softcap must be > 0"):
        paged_attention(q, kv.k[0], kv.v[0], work, softcap=0.0)


@pytest.mark.parametrize("window", [None, 7], ids=["causal", "window7"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_attention_sinks(dtype, window):
    """gpt-oss's sinks: each head's logit a last softmax column with no value, in the kernel and
    both executor paths, mixed prefill and decode; the sinks change the output, and a sink far
    below every score changes nothing."""
    kv, q, tables, starts = random_cache(13, MIXED_GROUPS, group=4, head_dim=24, dtype=dtype)
    work = step_work(MIXED_GROUPS, tables, starts)
    sinks = torch.linspace(-2.0, 3.0, q.shape[1])  # [H] fp32, as gpt-oss keeps them
    expected = paged_attention_ref(q, kv.k[0], kv.v[0], work, sliding_window=window,
                                   sinks=sinks)
    got = paged_attention(q, kv.k[0], kv.v[0], work, sliding_window=window, block_n=16,
                          sinks=sinks)
    assert_close(got, expected, dtype)
    for backend in ("torch", "triton"):
        assert_close(executor_attention(q, kv, MIXED_GROUPS, tables, starts, window, backend,
                                        sinks=sinks), expected, dtype, k=2)
    plain = paged_attention_ref(q, kv.k[0], kv.v[0], work, sliding_window=window)
    assert (plain.float() - expected.float()).abs().max() > 0.05
    silent = paged_attention(q, kv.k[0], kv.v[0], work, sliding_window=window, block_n=16,
                             sinks=torch.full_like(sinks, -1e4))
    assert_close(silent, plain, dtype)


def test_rows_of_no_sequence_are_untouched_and_tiles_split_long_chunks():
    groups = [(3, 9), (0, 2)]  # 9 queries x 4 heads = 36 rows: three tiles of 16
    kv, q, tables, starts = random_cache(3, groups, group=4, head_dim=16, dtype=torch.float32)
    work = PagedAttentionWork.build(tables, [12, 2], [1, 10], [9, 2], block_size=PAGE)
    q = torch.cat([q, torch.randn(2, *q.shape[1:])])  # rows 0, 12 belong to no sequence
    out = torch.full_like(q, 7.0)
    paged_attention(q, kv.k[0], kv.v[0], work, out=out, block_m=16, block_n=16)
    expected = paged_attention_ref(q, kv.k[0], kv.v[0], work, out=torch.full_like(q, 7.0))
    assert torch.equal(out[[0, 12]], torch.full_like(out[[0, 12]], 7.0))
    assert_close(out, expected, torch.float32)


def test_work_running_example_and_bad_inputs():
    work = PagedAttentionWork.build([[7, 2, 9, 4, 11], [3, 5]], [13, 6], [6, 0], [1, 6],
                                    block_size=4)
    assert work.block_tables.tolist() == [[7, 2, 9, 4], [3, 5, 0, 0]]
    assert work.context_lens.tolist() == [13, 6] and work.query_starts.tolist() == [6, 0]
    assert work.query_lens.tolist() == [1, 6] and work.max_query_len == 6
    assert work.block_tables.dtype == torch.int32
    empty = PagedAttentionWork.build([], [], [], [], block_size=4)
    q, cache = torch.randn(0, 4, 16), torch.randn(8, 4, 2, 16)
    assert empty.num_seqs == 0 and paged_attention(q, cache, cache, empty).shape == (0, 4, 16)
    q = torch.randn(12, 4, 16)
    with pytest.raises(ValueError, match="head_dim must match"):
        paged_attention(q, torch.randn(8, 4, 3, 16), torch.randn(8, 4, 3, 16), work)
    with pytest.raises(ValueError, match="k_cache is torch.float16"):
        paged_attention(q, cache.half(), cache.half(), work)
    with pytest.raises(ValueError, match="must be contiguous int32"):
        paged_attention(q, cache, cache, PagedAttentionWork(
            work.block_tables.long(), work.context_lens, work.query_starts, work.query_lens, 6))
    with pytest.raises(ValueError, match="sliding_window must be > 0"):
        paged_attention(q, cache, cache, work, sliding_window=0)
    with pytest.raises(ValueError, match="decode work"):
        padded_decode_attention(q, cache, cache, work)


def test_decode_buckets_pad_each_row_to_at_most_twice_its_keys():
    tables = torch.arange(3 * 10).view(3, 10).tolist()
    example = decode_buckets(tables, [3, 40, 5], [0, 1, 2], 4, None, "cpu")
    assert [b.rows.tolist() for b in example] == [[0, 2], [1]]
    assert example[0].slots.tolist() == [[0, 1, 2, 0, 0], [80, 81, 82, 83, 84]]  # padding: key 0
    assert example[0].mask[:, 0, 0].tolist() == [[True] * 3 + [False] * 2, [True] * 5]
    assert example[1].mask is None and example[1].slots.shape == (1, 40)
    buckets = decode_buckets([[0] * 128] * 64, [32] * 63 + [2048],
                             list(range(64)), 16, None, "cpu")
    assert [b.slots.shape for b in buckets] == [(63, 32), (1, 2048)]  # not 64 x 2048
    assert all(b.mask is None for b in buckets)
    rng = random.Random(0)
    lens = [rng.randint(1, 3000) for _ in range(64)]
    for window in (None, 500):
        buckets = decode_buckets([[0] * 200] * 64, lens, list(range(64)),
                                 16, window, "cpu")
        keys = torch.tensor(lens).clamp(max=window or 3000)
        assert sorted(r for b in buckets for r in b.rows.tolist()) == list(range(64))
        for b in buckets:
            assert b.slots.shape[1] <= 2 * max(int(keys[b.rows].min()), MIN_BUCKET_KEYS)
    metas = build_attention_meta([[0, 1]] * 2, [5, 2], [0, 5], [5, 1], block_size=4,
                                 windows={None, 5, 3}, backend="auto", device="cpu")
    assert isinstance(metas[None], TorchAttentionMeta) and len(metas[None].prefills) == 1
    assert metas[5] is metas[None] and metas[3] is not metas[None]  # no context exceeds 5
    with pytest.raises(ValueError, match="unknown attention backend"):
        build_attention_meta([], [], [], [], block_size=4, windows={None}, backend="flash",
                             device="cpu")


def test_short_chunks_share_one_padded_sdpa():
    """On CPU, prefill chunks of up to 64 queries over up to 256 keys (all within the window)
    make one batch per bucket of key counts; a longer chunk, a chunk over more keys or a lone
    one is an SDPA of its own. (Their output: test_mixed_prefill_and_decode_step and the scores
    tests, whose groups hold such chunks, prompts and one past earlier context.)"""
    example = prefill_batch([[3, 5], [7]], [6, 3], [0, 2], [2, 3], 4, "cpu")
    assert example.rows.tolist() == [0, 1, 1, 2, 3, 4]
    assert example.slots.tolist() == [[12, 13, 14, 15, 20, 21], [28, 29, 30, 30, 30, 30]]
    assert example.real_rows.tolist() == list(range(5))
    assert example.mask[:, 0].tolist() == [  # chunk 0 at positions 4, 5; chunk 1 at 0, 1, 2
        [[True] * 5 + [False], [True] * 6, [True] * 6],
        [[True] + [False] * 5, [True] * 2 + [False] * 4, [True] * 3 + [False] * 3]]
    groups = [*MIXED_GROUPS, (0, 70), (0, 17), (0, 30), (200, 60)]
    starts = [sum(n for _, n in groups[:i]) for i in range(len(groups))]
    metas = build_attention_meta([list(range(40))] * len(groups), [s + n for s, n in groups],
                                 starts, [n for _, n in groups], block_size=PAGE,
                                 windows={None, 7}, backend="torch", device="cpu")
    # [chunks, keys] by key count: <= 16 (contexts 5, 16, 3, 12, 6), 17-32 (17, 30); 43 alone;
    # 70 queries, 260 keys: SDPAs of their own; under window 7 contexts 5, 3, 6
    assert {w: [tuple(b.slots.shape) for b in m.prefill_batches] for w, m in metas.items()} == {
        None: [(5, 16), (2, 30)], 7: [(3, 6)]}
    assert sorted(p.end - p.start for p in metas[None].prefills) == [3, 60, 70]
    assert sorted(p.end - p.start for p in metas[7].prefills) == [3, 7, 12, 17, 30, 60, 70]


def test_executor_oracle_with_triton_attention(tiny, hf_peft, monkeypatch):
    """The foundation's oracle (every fixture adapter and a base-only row, paged KV on shuffled
    blocks, chunked prefill then decode) with attention through the kernel, as on CUDA."""
    monkeypatch.setattr(runner_module.StepMetadata, "build", functools.partial(
        runner_module.StepMetadata.build, attention="triton"))
    runner = make_runner(tiny)
    names = [*tiny["valid"], None]
    slots = [tiny["valid"].index(n) if n else -1 for n in names]
    requests = {sid: (p, slot) for sid, (p, slot) in enumerate(zip(prompts(len(names)), slots))}
    num_tokens = 3  # steps with prefill chunks (some at start_pos > 0) beside decode rows
    got = run(runner, requests, num_tokens, chunk=12, admit=len(names))
    for sid, name in enumerate(names):
        ref_tokens, ref_logits = hf_greedy(hf_peft, requests[sid][0], num_tokens, name)
        assert got[sid][0] == ref_tokens, f"greedy tokens differ for adapter {name}"
        torch.testing.assert_close(got[sid][1], ref_logits, atol=1e-4, rtol=0)
