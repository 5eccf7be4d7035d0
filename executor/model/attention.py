"""Attention of a step's rows over the paged KV cache: which path runs, and the per-step metadata
each path reads (built once per step from plain ints, read by every layer).

Each row group of a step is one sequence: n queries at positions start_pos..start_pos+n-1 (rows
of the step), attending to its keys at positions 0..start_pos+n-1 (the last `sliding_window` of
them, on a layer with a window) through its block table. A step builds one metadata per window
among the model's layers (Gemma: the sliding layers' and the global layers' whole context); every
path takes the model's score scale and soft cap (Gemma 2: scores -> cap * tanh(scores / cap)).

  triton (CUDA): kernels/paged_attention.py, one launch per layer over every group, K/V read
      in place through the block tables (kernels/attention_work.py: the tables, one transfer);
      a sequence costs its own context only.
  torch (CPU):
    - decode rows (one query each) are put in buckets by number of visible keys (<= 32, 33..64,
      65..128, ...); each bucket is one SDPA over keys gathered and padded to the bucket's
      longest. A row is padded to at most twice its keys, so a step costs about the sum of its
      contexts, not rows x longest context (one long sequence no longer slows every row), in a
      handful of calls; a bucket whose rows all have the same length needs no mask. (Measured
      on 64-row batches: a flat per-key segment softmax, exact too, was 2-9x slower.)
    - short prefill chunks (up to PREFILL_BATCH_MAX_ROWS queries over up to
      PREFILL_BATCH_MAX_KEYS keys, all within the window on a layer with one: a prompt, or its
      part past a cached prefix) are put in buckets by number of keys like decode rows; a bucket
      of two or more is one SDPA over them, queries and keys padded to the bucket's longest, a
      [B, Lq, C] mask letting each query see its own sequence's keys up to its position. 64
      prompts of 8-24 tokens: 1.7 ms a layer against 4.5-6.7 ms for an SDPA each.
    - other prefill chunks get one SDPA each over their gathered context (from the first
      query's window on, on a layer with a window).
    With a soft cap the SDPA is written out as HF's eager attention computes it (SDPA has no cap).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from executor.model.kv_cache import PagedKVCache
from executor.model.layer_ops import soft_cap
from kernels.attention_work import PagedAttentionWork, visible_keys

ATTENTION_BACKENDS = ("torch", "triton")
MIN_BUCKET_KEYS = 32  # decode rows with at most this many keys share one bucket
# Longer chunks, or over more keys, get an SDPA each (its call costs little beside them)
PREFILL_BATCH_MAX_ROWS = 64
PREFILL_BATCH_MAX_KEYS = 256
MIN_PREFILL_BUCKET = 16  # chunks over at most this many keys share one bucket


def resolve_attention_backend(name: str, device: str | torch.device) -> str:
    """'auto' -> 'triton' on CUDA, 'torch' elsewhere; other names are checked and pass through."""
    if name == "auto":
        return "triton" if torch.device(device).type == "cuda" else "torch"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} "
                         f"(known: auto, {', '.join(ATTENTION_BACKENDS)})")
    return name


@dataclass(frozen=True)
class DecodeBucket:
    rows: torch.Tensor  # [Sb] step rows of the bucket's decode queries
    slots: torch.Tensor  # [Sb, Cb] flat KV slots of each row's visible keys, padded
    mask: torch.Tensor | None  # [Sb, 1, 1, Cb] bool, True = a real key; None: no padding


@dataclass(frozen=True)
class PrefillChunk:
    start: int  # first row in the step
    end: int
    ctx_slots: torch.Tensor  # [C] flat KV slots of the keys its first query's window starts at
    mask: torch.Tensor  # [n, C] bool, True = may attend


@dataclass(frozen=True)
class PrefillBatch:
    """Short chunks over similar numbers of keys, one SDPA over all of them: chunk b's queries
    padded to the longest chunk (Lq; padding repeats its last query), its keys to the most keys
    (C; padding repeats its last key, which no real query sees)."""

    rows: torch.Tensor  # [B * Lq] step rows of the queries
    slots: torch.Tensor  # [B, C] flat KV slots of the keys
    real: torch.Tensor  # [N] the positions of `rows` that are not padding
    real_rows: torch.Tensor  # [N] rows[real]: the step rows it writes
    mask: torch.Tensor  # [B, 1, Lq, C] bool: True = may attend


@dataclass(frozen=True)
class TorchAttentionMeta:
    decode: tuple[DecodeBucket, ...]
    prefills: tuple[PrefillChunk, ...]
    prefill_batches: tuple[PrefillBatch, ...] = ()

    @classmethod
    def build(cls, tables: list[list[int]], context_lens: list[int], query_starts: list[int],
              query_lens: list[int], *, block_size: int, sliding_window: int | None,
              device: str | torch.device) -> TorchAttentionMeta:
        """One entry per row group (see build_attention_meta)."""
        decode = [s for s, n in enumerate(query_lens) if n == 1]
        buckets = decode_buckets([tables[s] for s in decode], [context_lens[s] for s in decode],
                                 [query_starts[s] for s in decode], block_size, sliding_window,
                                 device)
        short: dict[int, list[int]] = {}  # short chunks by number of keys
        for s, n in enumerate(query_lens):
            c = context_lens[s]
            if 1 < n <= PREFILL_BATCH_MAX_ROWS and c <= min(PREFILL_BATCH_MAX_KEYS,
                                                            sliding_window or c):
                short.setdefault((max(c, MIN_PREFILL_BUCKET) - 1).bit_length(), []).append(s)
        batched = [sel for sel in short.values() if len(sel) > 1]
        in_batches = {s for sel in batched for s in sel}
        prefills = []
        for s in (s for s, n in enumerate(query_lens) if n > 1 and s not in in_batches):
            c, start, n = context_lens[s], query_starts[s], query_lens[s]
            # keys from the first query's window on (the blocks before it may hold another
            # sequence's KV by now: window blocks, common/kv_layout.py)
            first = 0 if sliding_window is None else max(0, c - n - sliding_window + 1)
            table = torch.tensor(tables[s][first // block_size: -(-c // block_size)])
            k_pos = torch.arange(first, c)  # [C]
            k_blocks = k_pos // block_size - first // block_size
            prefills.append(PrefillChunk(
                start=start, end=start + n,
                ctx_slots=(table[k_blocks] * block_size + k_pos % block_size).to(device),
                mask=visible_keys(torch.arange(c - n, c)[:, None], k_pos[None, :],
                                  sliding_window).to(device)))
        return cls(buckets, tuple(prefills), tuple(
            prefill_batch([tables[s] for s in sel], [context_lens[s] for s in sel],
                          [query_starts[s] for s in sel], [query_lens[s] for s in sel],
                          block_size, device) for sel in batched))


def prefill_batch(tables: list[list[int]], context_lens: list[int], starts: list[int],
                  lens: list[int], block_size: int, device: str | torch.device) -> PrefillBatch:
    """Chunks of whole context: chunk b has lens[b] queries at step rows starts[b]..., at the
    last positions of its context_lens[b] keys, through block table tables[b].

    Example, block_size 4: tables [[3, 5], [7]], contexts [6, 3], starts [0, 2], lens [2, 3] ->
    rows [0 1 1 2 3 4], slots [[12 13 14 15 20 21], [28 29 30 30 30 30]], real rows 0-4; chunk
    0's queries (positions 4, 5) see keys 0-4 and 0-5, chunk 1's (0, 1, 2) keys 0, 0-1, 0-2."""
    n, c = torch.tensor(lens), torch.tensor(context_lens)
    width, num_keys = max(lens), max(context_lens)
    j = torch.arange(width)
    query = torch.minimum(j[None, :], (n - 1)[:, None])  # [B, Lq]: its query of each column
    k_pos = torch.minimum(torch.arange(num_keys)[None, :], (c - 1)[:, None])  # [B, C]
    blocks = -(-num_keys // block_size)
    table = torch.tensor([t[:blocks] + [0] * (blocks - len(t[:blocks])) for t in tables])
    slots = table.gather(1, k_pos // block_size) * block_size + k_pos % block_size
    rows = (torch.tensor(starts)[:, None] + query).flatten()
    real = (j[None, :] < n[:, None]).flatten().nonzero().flatten()
    q_pos = (c - n)[:, None] + query  # [B, Lq]
    mask = visible_keys(q_pos[:, :, None], torch.arange(num_keys)[None, None, :],
                        None)  # [B, Lq, C] (every key within the window: no clipping)
    return PrefillBatch(rows.to(device), slots.to(device), real.to(device),
                        rows[real].to(device), mask[:, None].to(device))


def decode_buckets(tables: list[list[int]], ctx: list[int], rows: list[int], block_size: int,
                   sliding_window: int | None, device: str | torch.device,
                   ) -> tuple[DecodeBucket, ...]:
    """Buckets of decode rows by number of visible keys: row i has block table tables[i], keys
    at positions < ctx[i] (its query at ctx[i] - 1), and is step row rows[i]. Rows are grouped
    in plain ints; a bucket is one tensor of just the blocks its rows see, and a few vectorised
    ops: the work is proportional to the keys, padding to at most twice a row's own.

    Example, block_size 4, no window, tables [[0..9], [10..19], [20..29]]: ctx [3, 40, 5] ->
    bucket <= 32 keys: rows 0, 2 with slots [0 1 2 0 0] and [80 81 82 83 84], mask
    [1 1 1 0 0], [1 1 1 1 1]; bucket 33..64: row 1, slots of positions 0..39, no mask."""
    num_keys = ctx if sliding_window is None else [min(c, sliding_window) for c in ctx]
    members: dict[int, list[int]] = {}  # ceil(log2(keys)) -> rows; <= 32 keys share one
    for i, n in enumerate(num_keys):
        members.setdefault((max(n, MIN_BUCKET_KEYS) - 1).bit_length(), []).append(i)
    out = []
    for sel in (members[b] for b in sorted(members)):  # a handful: log2(longest / 32) + 1
        n = [num_keys[i] for i in sel]
        first_block = [(ctx[i] - k) // block_size for i, k in zip(sel, n)]
        seen = [tables[i][f: -(-ctx[i] // block_size)] for i, f in zip(sel, first_block)]
        width = max(map(len, seen))
        table = torch.tensor([t + [0] * (width - len(t)) for t in seen])  # [Sb, blocks seen]
        # Key j of a row is at position first + j: offset (first % block_size) + j in `table`.
        offset, step_rows, n_t = torch.tensor(
            [[ctx[i] - k - f * block_size for i, k, f in zip(sel, n, first_block)],
             [rows[i] for i in sel], n])  # [3, Sb]
        j = torch.arange(max(n))  # [Cb]
        k_off = offset[:, None] + j[None, :]  # [Sb, Cb]
        mask = None
        if min(n) < max(n):  # padded: point padding at the row's first key, mask it off
            is_key = j[None, :] < n_t[:, None]  # [Sb, Cb]
            k_off = torch.where(is_key, k_off, offset[:, None])
            mask = is_key[:, None, None, :].to(device)
        slots = (table.gather(1, k_off // block_size) * block_size
                 + k_off % block_size)  # [Sb, Cb]
        out.append(DecodeBucket(step_rows.to(device), slots.to(device), mask))
    return tuple(out)


@dataclass(frozen=True)
class TritonAttentionMeta:
    work: PagedAttentionWork  # on the device
    sliding_window: int | None
    kernel: Callable[..., torch.Tensor]  # kernels.paged_attention.paged_attention

    @classmethod
    def build(cls, work: PagedAttentionWork, *, sliding_window: int | None,
              device: torch.device) -> TritonAttentionMeta:
        from kernels.paged_attention import paged_attention  # imports triton
        from kernels.sgmv_tiles import is_interpreted

        if device.type != "cuda" and not is_interpreted():
            raise ValueError("the triton attention backend needs a CUDA device, or the Triton "
                             "interpreter on CPU (TRITON_INTERPRET=1 before triton is imported)")
        return cls(work, sliding_window, paged_attention)


AttentionMeta = TorchAttentionMeta | TritonAttentionMeta


def build_attention_meta(tables: list[list[int]], context_lens: list[int],
                         query_starts: list[int], query_lens: list[int], *, block_size: int,
                         windows: set[int | None], backend: str,
                         device: str | torch.device) -> dict[int | None, AttentionMeta]:
    """One entry per row group: its block table, keys (start_pos + n), first row, n queries.
    Returns the metadata of each window (None: the whole context); a window no context of the
    step exceeds shares the whole context's."""
    device = torch.device(device)
    if resolve_attention_backend(backend, device) == "triton":
        work = PagedAttentionWork.build(tables, context_lens, query_starts, query_lens,
                                        block_size=block_size, device=device)
        return {w: TritonAttentionMeta.build(work, sliding_window=w, device=device)
                for w in windows}
    out: dict[int | None, AttentionMeta] = {}
    longest = max(context_lens, default=0)
    for w in sorted(windows, key=lambda w: (w is not None, w)):  # None first
        if w is not None and w >= longest and None in out:
            out[w] = out[None]
        else:
            out[w] = TorchAttentionMeta.build(tables, context_lens, query_starts, query_lens,
                                              block_size=block_size, sliding_window=w,
                                              device=device)
    return out


def attend(q: torch.Tensor, kv: PagedKVCache, layer: int, meta: AttentionMeta, *,
           scale: float | None = None, softcap: float | None = None,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D] (after RoPE; this step's k/v already written) -> attention output [T, H, D]
    of softmax(cap(q k^T * scale)) v; scale None: 1 / sqrt(D); softcap None: no cap; sinks [H]:
    each head's sink logit, a softmax column with no value (gpt-oss), or None."""
    if isinstance(meta, TritonAttentionMeta):
        return meta.kernel(q, kv.k[layer], kv.v[layer], meta.work,
                           sliding_window=meta.sliding_window, scale=scale, softcap=softcap,
                           sinks=sinks)
    attn = torch.empty_like(q)  # [T, H, D]
    for b in meta.decode:
        k, v = kv.gather(layer, b.slots)  # [Sb, Cb, Hkv, D]
        o = sdpa(q.index_select(0, b.rows)[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
                 b.mask, scale, softcap, sinks)  # [Sb, H, 1, D]
        attn.index_copy_(0, b.rows, o[:, :, 0, :])
    for b in meta.prefill_batches:
        k, v = kv.gather(layer, b.slots)  # [B, C, Hkv, D]
        num, width = b.mask.shape[0], b.mask.shape[2]
        qb = q.index_select(0, b.rows).view(num, width, *q.shape[1:])  # [B, Lq, H, D]
        o = sdpa(qb.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), b.mask, scale,
                 softcap, sinks)  # [B, H, Lq, D]
        attn.index_copy_(0, b.real_rows,
                         o.transpose(1, 2).reshape(num * width, *q.shape[1:])[b.real])
    for p in meta.prefills:
        k, v = kv.gather(layer, p.ctx_slots)  # [C, Hkv, D]
        o = sdpa(q[p.start:p.end].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                 p.mask, scale, softcap, sinks)  # [H, n, D]
        attn[p.start:p.end] = o.transpose(0, 1)
    return attn


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
         scale: float | None, softcap: float | None,
         sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [..., H, n, D], k and v [..., Hkv, C, D], mask broadcast to [..., H, n, C] (True: may
    attend) -> [..., H, n, D]. With a soft cap, HF's eager attention step by step: scores in
    q's dtype, capped, masked, softmax in fp32 cast back, times v. With sinks [H] (gpt-oss),
    its eager attention: each head's sink logit a last column of the scores, the max taken out,
    softmax in the scores' dtype, the sink's column dropped."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=True)
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = soft_cap(scores, softcap)  # [..., H, n, C]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return probs @ v
    sink = sinks.to(scores.dtype)[:, None, None].expand(*scores.shape[:-1], 1)  # [..., H, n, 1]
    scores = torch.cat([scores, sink], dim=-1)
    scores = scores - scores.max(dim=-1, keepdim=True).values
    probs = torch.softmax(scores, dim=-1, dtype=scores.dtype)[..., :-1]
    return probs.to(v.dtype) @ v
