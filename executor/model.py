"""A readable LLaMA-family forward over a flattened step batch with a paged KV cache.

A step is T rows: prefill chunks and decode rows of many sequences, each sequence's rows
contiguous. Running example, block_size 4:

    rows    : seq 5 prefill chunk (positions 0..5) | seq 9 decode (position 12) | seq 2 decode (7)
    tokens  : [T=8]            positions: [0 1 2 3 4 5 12 7]
    slots   : where each row's k/v is written (from the mirrored block tables)

Every projection is one dense matmul over all T rows (q/k/v fused, gate/up fused), then the LoRA
backend adds the adapters of its segments with one call per fused output. Attention reads each
sequence's context back through its block table:
  - decode rows (one query each) are batched into one SDPA call, keys padded to the longest
    context and masked: a decode step is many short rows, so one call beats a Python loop, and
    padding costs little because decode attention is cheap next to the projections;
  - prefill chunks (many queries) get one SDPA call each: padding them together would waste up
    to (num_seqs x longest chunk) query rows, and there are few chunks per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from executor.kv_cache import PagedKVCache
from executor.lora import LoraBackend, LoraBatchMeta
from executor.model_config import ModelConfig
from executor.weights import ModelWeights


@dataclass(frozen=True)
class RowSpec:
    """One row group of a step: `num_tokens` queries of a sequence starting at `start_pos`."""

    start_pos: int
    num_tokens: int
    block_table: list[int]


@dataclass(frozen=True)
class PrefillChunk:
    start: int  # first row in the step
    end: int
    ctx_slots: torch.Tensor  # [C] flat KV slots of positions 0..C-1
    mask: torch.Tensor  # [n, C] bool, True = may attend


@dataclass(frozen=True)
class StepMetadata:
    """Built once per step, read by every layer."""

    positions: torch.Tensor  # [T]
    write_slots: torch.Tensor  # [T] where each row's k/v goes
    decode_rows: torch.Tensor  # [Sd] rows of single-token groups
    decode_ctx_slots: torch.Tensor  # [Sd, Cmax] padded with slot 0
    decode_mask: torch.Tensor  # [Sd, 1, 1, Cmax] bool
    prefills: tuple[PrefillChunk, ...]
    lora: LoraBatchMeta
    sample_rows: torch.Tensor  # [S] rows whose logits are returned

    @classmethod
    def build(cls, groups: list[RowSpec], *, kv: PagedKVCache, sliding_window: int | None,
              lora: LoraBatchMeta, sample_rows: list[int],
              device: str | torch.device) -> StepMetadata:
        bs = kv.block_size
        positions, write_slots, prefills = [], [], []
        decode_rows, decode_groups = [], []
        row = 0
        for g in groups:  # plain ints: no small tensors per row (a decode step is many rows)
            end_pos = g.start_pos + g.num_tokens
            positions.extend(range(g.start_pos, end_pos))
            write_slots.extend(kv.slots(g.block_table, g.start_pos, end_pos))
            if g.num_tokens == 1:
                decode_rows.append(row)
                decode_groups.append(g)
            else:
                q_pos = torch.arange(g.start_pos, end_pos)[:, None]  # [n, 1]
                k_pos = torch.arange(end_pos)[None, :]  # [1, C]
                prefills.append(PrefillChunk(
                    start=row, end=row + g.num_tokens,
                    ctx_slots=torch.tensor(kv.slots(g.block_table, 0, end_pos),
                                           dtype=torch.long, device=device),
                    mask=_visible(q_pos, k_pos, sliding_window).to(device)))
            row += g.num_tokens
        ctx_lens = torch.tensor([g.start_pos + 1 for g in decode_groups], dtype=torch.long)
        c_max = int(ctx_lens.max()) if decode_groups else 1
        n_blocks = (c_max + bs - 1) // bs
        used = [g.block_table[: g.start_pos // bs + 1] for g in decode_groups]
        tables = torch.tensor([u + [0] * (n_blocks - len(u)) for u in used],
                              dtype=torch.long).view(len(used), n_blocks)  # [Sd, blocks]
        k_pos = torch.arange(c_max)  # [Cmax]
        ctx_slots = tables[:, k_pos // bs] * bs + k_pos % bs  # [Sd, Cmax]
        mask = (k_pos[None, :] < ctx_lens[:, None]) & _visible(
            (ctx_lens - 1)[:, None], k_pos[None, :], sliding_window)  # [Sd, Cmax]
        return cls(
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            write_slots=torch.tensor(write_slots, dtype=torch.long, device=device),
            decode_rows=torch.tensor(decode_rows, dtype=torch.long, device=device),
            decode_ctx_slots=ctx_slots.to(device),
            decode_mask=mask[:, None, None, :].to(device),
            prefills=tuple(prefills), lora=lora,
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=device))


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) visibility of keys at k_pos from queries at q_pos."""
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies, with Llama 3.1 scaling when configured."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos, sin [T, D] (HF rotate-half layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, hidden]; normalised in fp32 like HF, then scaled by weight [hidden]."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class Transformer:
    def __init__(self, config: ModelConfig, weights: ModelWeights, lora: LoraBackend) -> None:
        self.config, self.weights, self.lora = config, weights, lora
        self.inv_freq = rope_inv_freq(config).to(weights.embed.device)  # [D / 2] fp32

    def forward(self, tokens: torch.Tensor, meta: StepMetadata, kv: PagedKVCache) -> torch.Tensor:
        """tokens [T] -> logits [S, vocab] of meta.sample_rows (fp32)."""
        freqs = meta.positions[:, None].float() * self.inv_freq[None, :]  # [T, D / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        dtype = self.weights.embed.dtype
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        h = self.weights.embed[tokens]  # [T, hidden]
        for i, layer in enumerate(self.weights.layers):
            x = rms_norm(h, layer.input_norm, self.config.rms_norm_eps)
            h = h + self._attention(i, x, cos, sin, meta, kv)
            x = rms_norm(h, layer.post_attention_norm, self.config.rms_norm_eps)
            h = h + self._mlp(i, x, meta.lora)
        last = rms_norm(h[meta.sample_rows], self.weights.norm, self.config.rms_norm_eps)
        return F.linear(last, self.weights.lm_head).float()  # [S, vocab]

    def _attention(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   meta: StepMetadata, kv: PagedKVCache) -> torch.Tensor:
        c, w = self.config, self.weights.layers[i]
        qkv = F.linear(x, w.wqkv, w.bqkv)  # [T, q_size + 2 * kv_size]
        self.lora.apply(i, "qkv", x, qkv, meta.lora)
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        t = x.shape[0]
        q = apply_rope(q.reshape(t, c.num_attention_heads, c.head_dim), cos, sin)  # [T, H, D]
        k = apply_rope(k.reshape(t, c.num_key_value_heads, c.head_dim), cos, sin)  # [T, Hkv, D]
        kv.write(i, meta.write_slots, k, v.reshape(t, c.num_key_value_heads, c.head_dim))

        attn = torch.empty_like(q)  # [T, H, D]
        if meta.decode_rows.numel():
            k_ctx, v_ctx = kv.gather(i, meta.decode_ctx_slots)  # [Sd, Cmax, Hkv, D]
            q_d = q[meta.decode_rows][:, :, None, :]  # [Sd, H, 1, D]
            o = F.scaled_dot_product_attention(
                q_d, k_ctx.transpose(1, 2), v_ctx.transpose(1, 2),
                attn_mask=meta.decode_mask, enable_gqa=True)  # [Sd, H, 1, D]
            attn[meta.decode_rows] = o[:, :, 0, :]
        for p in meta.prefills:
            k_ctx, v_ctx = kv.gather(i, p.ctx_slots)  # [C, Hkv, D]
            q_p = q[p.start:p.end].transpose(0, 1)  # [H, n, D]
            o = F.scaled_dot_product_attention(
                q_p, k_ctx.transpose(0, 1), v_ctx.transpose(0, 1),
                attn_mask=p.mask, enable_gqa=True)  # [H, n, D]
            attn[p.start:p.end] = o.transpose(0, 1)
        attn = attn.reshape(t, c.q_size)  # [T, H * D]
        out = F.linear(attn, w.wo)  # [T, hidden]
        self.lora.apply(i, "o", attn, out, meta.lora)
        return out

    def _mlp(self, i: int, x: torch.Tensor, lora: LoraBatchMeta) -> torch.Tensor:
        w = self.weights.layers[i]
        gate_up = F.linear(x, w.w_gate_up)  # [T, 2 * intermediate]
        self.lora.apply(i, "gate_up", x, gate_up, lora)
        gate, up = gate_up.chunk(2, dim=-1)  # [T, intermediate] each
        hidden = F.silu(gate) * up  # [T, intermediate]
        out = F.linear(hidden, w.w_down)  # [T, hidden]
        self.lora.apply(i, "down", hidden, out, lora)
        return out
