"""Attention of a step's rows over the paged KV cache: which path runs, and the per-step metadata
each path reads (built once per step, read by every layer).

Each row group of a step is one sequence: n queries at positions start_pos..start_pos+n-1 (rows
of the step), attending to its keys at positions 0..start_pos+n-1 through its block table.
kernels/attention_work.py turns the groups into tables from plain ints, in one pass.

  triton (CUDA): kernels/paged_attention.py, one launch per layer over every group, K/V read
      in place through the block tables; a sequence costs its own context only.
  torch (CPU):
    - decode rows (one query each) are put in buckets by number of keys (<= 32, 33..64,
      65..128, ...) and each bucket is one SDPA over keys gathered and padded to the bucket's
      longest: a row is padded to at most twice its keys, so a step costs about the sum of its
      contexts, not rows x longest context (one long sequence no longer slows every row), in a
      handful of calls; a bucket whose rows all have the same length needs no mask;
    - prefill chunks (many queries) get one SDPA each over their gathered context.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from executor.kv_cache import PagedKVCache
from kernels.attention_work import PagedAttentionWork, visible_keys

ATTENTION_BACKENDS = ("torch", "triton")
MIN_BUCKET_KEYS = 32  # decode rows with at most this many keys share one bucket


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
    ctx_slots: torch.Tensor  # [C] flat KV slots of positions 0..C-1
    mask: torch.Tensor  # [n, C] bool, True = may attend


@dataclass(frozen=True)
class TorchAttentionMeta:
    decode: tuple[DecodeBucket, ...]
    prefills: tuple[PrefillChunk, ...]

    @classmethod
    def build(cls, work: PagedAttentionWork, *, block_size: int, sliding_window: int | None,
              device: str | torch.device) -> TorchAttentionMeta:
        """work: on the host."""
        tables = work.block_tables.long()  # [S, W]
        ctx, starts = work.context_lens.long(), work.query_starts.long()  # [S] each
        is_decode = work.query_lens == 1
        buckets = decode_buckets(tables[is_decode], ctx[is_decode], starts[is_decode],
                                 block_size, sliding_window, device)
        prefills = []
        for s in (~is_decode).nonzero()[:, 0].tolist():  # few chunks per step
            c, start, n = int(ctx[s]), int(starts[s]), int(work.query_lens[s])
            k_pos = torch.arange(c)  # [C]
            prefills.append(PrefillChunk(
                start=start, end=start + n,
                ctx_slots=(tables[s, k_pos // block_size] * block_size
                           + k_pos % block_size).to(device),
                mask=visible_keys(torch.arange(c - n, c)[:, None], k_pos[None, :],
                                  sliding_window).to(device)))
        return cls(buckets, tuple(prefills))


def decode_buckets(tables: torch.Tensor, ctx: torch.Tensor, rows: torch.Tensor, block_size: int,
                   sliding_window: int | None, device: str | torch.device,
                   ) -> tuple[DecodeBucket, ...]:
    """Buckets of decode rows by number of visible keys. tables [Sd, W], ctx [Sd] (the query
    is at position ctx - 1), rows [Sd] step rows; all int64 on the host.

    Example, block_size 4, no window: ctx [3, 40, 5] -> bucket <= 32 keys: rows 0, 2 with slots
    of positions [0 1 2 0 0] and [0 1 2 3 4] (mask [1 1 1 0 0], [1 1 1 1 1]); bucket 33..64:
    row 1, positions 0..39, no mask."""
    num_keys = ctx if sliding_window is None else ctx.clamp(max=sliding_window)  # [Sd]
    first = ctx - num_keys  # [Sd] position of each row's first visible key
    bucket = torch.ceil(torch.log2(num_keys.clamp(min=MIN_BUCKET_KEYS).double())).long()
    out = []
    for b in torch.unique(bucket).tolist():  # a handful: log2(longest / MIN_BUCKET_KEYS) + 1
        sel = (bucket == b).nonzero()[:, 0]  # [Sb]
        n = num_keys[sel]  # [Sb]
        j = torch.arange(int(n.max()))  # [Cb]
        is_key = j[None, :] < n[:, None]  # [Sb, Cb]
        k_pos = torch.where(is_key, first[sel, None] + j[None, :], 0)  # [Sb, Cb]
        slots = (tables[sel[:, None], k_pos // block_size] * block_size
                 + k_pos % block_size)  # [Sb, Cb]
        mask = None if bool(is_key.all()) else is_key[:, None, None, :].to(device)
        out.append(DecodeBucket(rows[sel].to(device), slots.to(device), mask))
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
                         sliding_window: int | None, backend: str,
                         device: str | torch.device) -> AttentionMeta:
    """One entry per row group: its block table, keys (start_pos + n), first row, n queries."""
    device = torch.device(device)
    if resolve_attention_backend(backend, device) == "triton":
        work = PagedAttentionWork.build(tables, context_lens, query_starts, query_lens,
                                        block_size=block_size, device=device)
        return TritonAttentionMeta.build(work, sliding_window=sliding_window, device=device)
    work = PagedAttentionWork.build(tables, context_lens, query_starts, query_lens,
                                    block_size=block_size)  # host
    return TorchAttentionMeta.build(work, block_size=block_size, sliding_window=sliding_window,
                                    device=device)


def attend(q: torch.Tensor, kv: PagedKVCache, layer: int, meta: AttentionMeta) -> torch.Tensor:
    """q [T, H, D] (after RoPE; this step's k/v already written) -> attention output [T, H, D]."""
    if isinstance(meta, TritonAttentionMeta):
        return meta.kernel(q, kv.k[layer], kv.v[layer], meta.work,
                           sliding_window=meta.sliding_window)
    attn = torch.empty_like(q)  # [T, H, D]
    for b in meta.decode:
        k, v = kv.gather(layer, b.slots)  # [Sb, Cb, Hkv, D]
        o = F.scaled_dot_product_attention(
            q[b.rows][:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=b.mask, enable_gqa=True)  # [Sb, H, 1, D]
        attn[b.rows] = o[:, :, 0, :]
    for p in meta.prefills:
        k, v = kv.gather(layer, p.ctx_slots)  # [C, Hkv, D]
        o = F.scaled_dot_product_attention(
            q[p.start:p.end].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=p.mask, enable_gqa=True)  # [H, n, D]
        attn[p.start:p.end] = o.transpose(0, 1)
    return attn
