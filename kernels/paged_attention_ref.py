"""Pure-torch references of paged attention (kernels/paged_attention.py), same signature:

  - paged_attention_ref: a loop over sequences, each one's keys gathered through its block
    table, softmax in fp32, the output rounded once to q's dtype: the kernel's tolerance target;
  - padded_decode_attention: the executor's decode path before the kernel (one SDPA over every
    sequence's keys padded to the longest context and masked), kept as the baseline the GPU check
    times the kernel against and the tests compare with. Decode only (one query per sequence).

For tests, benchmarks and the GPU check, not for serving (executor/model/attention.py serves on
CPU).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels.attention_work import PagedAttentionWork, visible_keys


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        work: PagedAttentionWork, *, sliding_window: int | None = None,
                        scale: float | None = None, softcap: float | None = None,
                        sinks: torch.Tensor | None = None, out: torch.Tensor | None = None,
                        **_tuning) -> torch.Tensor:
    out = torch.empty_like(q) if out is None else out
    scale = 1 / math.sqrt(q.shape[2]) if scale is None else scale
    page, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    per_seq = torch.stack([work.context_lens, work.query_starts, work.query_lens]).tolist()
    for s, (ctx, start, n) in enumerate(zip(*per_seq)):
        k_pos = torch.arange(ctx, device=q.device)  # [C]
        slots = work.block_tables[s].long()[k_pos // page] * page + k_pos % page  # [C]
        k = k_cache.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)  # [C, H, D]
        v = v_cache.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)  # [C, H, D]
        qs = q[start: start + n].float()  # [n, H, D]
        scores = torch.einsum("nhd,chd->hnc", qs, k) * scale  # [H, n, C]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(ctx - n, ctx, device=q.device)  # [n]
        seen = visible_keys(q_pos[:, None], k_pos[None, :], sliding_window)  # [n, C]
        scores = scores.masked_fill(~seen, float("-inf"))
        if sinks is not None:  # (a last column with no value, dropped after the softmax)
            sink = sinks.float()[:, None, None].expand(-1, n, 1)
            scores = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :ctx]  # [H, n, C]
        out[start: start + n] = torch.einsum("hnc,chd->nhd", probs, v).to(out.dtype)
    return out


def padded_decode_slots(work: PagedAttentionWork, page: int,
                        sliding_window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The old executor's per-step metadata: (flat KV slots [S, Cmax] padded with slot 0 up to
    the longest context, visibility mask [S, 1, 1, Cmax])."""
    ctx = work.context_lens.long()  # [S]
    c_max = int(ctx.max()) if ctx.numel() else 1
    k_pos = torch.arange(c_max, device=ctx.device)  # [Cmax]
    slots = work.block_tables.long()[:, k_pos // page] * page + k_pos % page  # [S, Cmax]
    mask = (k_pos[None, :] < ctx[:, None]) & visible_keys(
        (ctx - 1)[:, None], k_pos[None, :], sliding_window)  # [S, Cmax]
    return slots, mask[:, None, None, :]


def padded_decode_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [S, H, D]: gather every sequence's keys padded to Cmax, one masked SDPA -> [S, H, D]."""
    k = k_cache.flatten(0, 1)[slots]  # [S, Cmax, Hkv, D]
    v = v_cache.flatten(0, 1)[slots]
    o = F.scaled_dot_product_attention(q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask, enable_gqa=True)  # [S, H, 1, D]
    return o[:, :, 0, :]


def padded_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            work: PagedAttentionWork, *, sliding_window: int | None = None,
                            out: torch.Tensor | None = None, **_tuning) -> torch.Tensor:
    if work.max_query_len > 1 or not torch.equal(
            work.query_starts.cpu(), torch.arange(work.num_seqs, dtype=torch.int32)):
        raise ValueError("padded_decode_attention takes decode work: sequence s at row s")
    out = torch.empty_like(q) if out is None else out
    if work.num_seqs:
        slots, mask = padded_decode_slots(work, k_cache.shape[1], sliding_window)
        out[: work.num_seqs] = padded_decode_sdpa(q[: work.num_seqs], k_cache, v_cache, slots,
                                                  mask)
    return out
