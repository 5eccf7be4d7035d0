"""Section 5 of the GPU check: the paged-attention kernel (kernels/paged_attention.py) at the
model's attention shapes (Llama-3-8B: 32 query heads, 8 KV heads, head_dim 128; block size 16).
Checked against its torch reference on decode batches of 64 mixed context lengths up to 4k
(sliding window off and on) and on a step of prefill chunks beside decode rows (also with a
score scale and soft cap, as Gemma 2 computes them), bf16 and fp16;
then timed, bf16, against the executor's old decode path: every row's keys gathered and padded
to the longest context, one masked SDPA (its slots and mask prebuilt, as the old step metadata
did once per step).
"""

from __future__ import annotations

import random

from gpu_harness import CFG, DEVICE, OPTS, REPORT, bench_ms, section, table  # first

import torch
from kernels.attention_work import PagedAttentionWork
from kernels.paged_attention import paged_attention
from kernels.paged_attention_ref import (
    padded_decode_attention,
    padded_decode_sdpa,
    padded_decode_slots,
    paged_attention_ref,
)
from kernels.reference import TOLERANCES

PAGE = 16
WINDOW = 1024 if not OPTS.smoke else 24


def decode_lengths() -> dict[str, list[int]]:
    """Scenario -> context length of each of the batch's decode rows."""
    if OPTS.smoke:
        return {"mixed": [1, 16, 17, 40], "short + 1 long": [32, 32, 32, 100]}
    rng = random.Random(0)
    return {"64 mixed <= 4096": [1, 16, 17] + [rng.randint(1, 1024) for _ in range(60)] + [4096],
            "63 x 32 + 1 x 4096": [32] * 63 + [4096],
            "64 x 1024": [1024] * 64,
            "64 x 4096": [4096] * 64}


def make_step(groups: list[tuple[int, int]], dtype, seed: int):
    """A one-layer paged cache of random K/V on shuffled blocks, q [T, H, D], and the work of a
    step of row groups (start_pos, num_tokens)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    needed = [-(-(s + n) // PAGE) for s, n in groups]
    blocks = list(range(sum(needed) + 1))
    random.Random(seed).shuffle(blocks)
    shape = (len(blocks), PAGE, CFG.num_key_value_heads, CFG.head_dim)
    k = torch.randn(shape, generator=g, device=DEVICE).to(dtype)
    v = torch.randn(shape, generator=g, device=DEVICE).to(dtype)
    tables = [blocks[sum(needed[:i]): sum(needed[:i + 1])] for i in range(len(groups))]
    starts = [sum(n for _, n in groups[:i]) for i in range(len(groups))]
    work = PagedAttentionWork.build(tables, [s + n for s, n in groups], starts,
                                    [n for _, n in groups], block_size=PAGE, device=DEVICE)
    q = torch.randn(sum(n for _, n in groups), CFG.num_attention_heads, CFG.head_dim,
                    generator=g, device=DEVICE).to(dtype)
    return q, k, v, work


def err(a, b, dtype) -> float:
    """max |a - b| / (tolerance): <= 1 passes (TOLERANCES of kernels/reference.py)."""
    rtol, atol = TOLERANCES[dtype]
    bound = atol * float(b.float().abs().max()) + rtol * b.float().abs()
    return float(((a.float() - b.float()).abs() / bound).max())


def correctness_rows() -> list[list]:
    lengths = next(iter(decode_lengths().values()))
    prefill = [(0, 37), (200, 64)] if OPTS.smoke else [(0, 300), (700, 200), (3000, 96)]
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        cases = [(f"paged decode {len(lengths)} mixed <= {max(lengths)}", None, {}),
                 (f"paged decode {len(lengths)} mixed <= {max(lengths)}", WINDOW, {}),
                 ("paged prefill chunks + decode rows", WINDOW, {}),
                 ("paged prefill chunks + decode rows, scale 1/16, soft cap 2 (Gemma 2's "
                  "kind)", WINDOW, {"scale": 1 / 16, "softcap": 2.0})]
        for name, window, scores in cases:
            decode = [(n - 1, 1) for n in lengths]
            is_prefill = name.startswith("paged prefill")
            q, k, v, work = make_step(prefill + decode if is_prefill else decode, dtype,
                                      len(rows))
            got = paged_attention(q, k, v, work, sliding_window=window, **scores)
            ref = paged_attention_ref(q, k, v, work, sliding_window=window, **scores)
            e_old = (float("nan") if is_prefill else
                     err(padded_decode_attention(q, k, v, work, sliding_window=window), ref,
                         dtype))
            e = err(got, ref, dtype)
            rows.append([name, str(dtype)[6:], window or "none", e, e_old,
                         "yes" if e <= 1 else "**NO**"])
    return rows


def time_decode(name: str, lengths: list[int], copy_gbs: float) -> list:
    """One row of the timing table: a decode batch of these context lengths, bf16."""
    q, k, v, work = make_step([(n - 1, 1) for n in lengths], torch.bfloat16, 7)
    out = torch.empty_like(q)
    kernel_ms = bench_ms(lambda: paged_attention(q, k, v, work, out=out))
    slots, mask = padded_decode_slots(work, PAGE, None)
    padded_ms = bench_ms(lambda: padded_decode_sdpa(q, k, v, slots, mask))
    moved = 2 * (2 * sum(lengths) * CFG.kv_size + 2 * q.numel())  # bf16: K, V once; q, out
    gbs = moved / kernel_ms / 1e6
    return [name, sum(lengths), max(lengths), kernel_ms * 1e3, padded_ms * 1e3,
            padded_ms / kernel_ms, gbs, gbs / copy_gbs]


def timing_rows(copy_gbs: float) -> list[list]:
    rows = []
    for name, lengths in decode_lengths().items():
        rows.append(time_decode(name, lengths, copy_gbs))
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return rows


@section("5. Paged attention kernel vs torch reference and the padded gather + SDPA path")
def paged_attention_check(copy_gbs: float) -> None:
    rows = correctness_rows()
    REPORT.append(f"{CFG.num_attention_heads} query heads, {CFG.num_key_value_heads} KV heads, "
                  f"head_dim {CFG.head_dim}, block size {PAGE}; each row's KV on shuffled "
                  "blocks. err = max |kernel - reference| / (tolerance); pass when <= 1. "
                  "'err old path' = the padded gather + SDPA decode path against the same "
                  "reference (for scale).\n\n")
    header = ["case", "dtype", "window", "err vs ref", "err old path", "pass"]
    REPORT.append(table(header, rows))
    print(table(header, rows))
    timings = timing_rows(copy_gbs)
    REPORT.append("\nDecode, bf16, one layer: us = GPU time (do_bench median, L2 flushed). "
                  "The padded path is the executor's before this kernel (gather to the longest "
                  "context + masked SDPA, metadata prebuilt). GB/s on the bytes the kernel must "
                  "move (each row's K and V once, q and out).\n\n")
    header = ["decode rows (context lengths)", "sum of contexts", "longest", "kernel us",
              "padded gather+SDPA us", "speed-up", "kernel GB/s", "of copy"]
    REPORT.append(table(header, timings))
    print(table(header, timings))
