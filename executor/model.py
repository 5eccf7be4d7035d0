"""A readable LLaMA-family forward (Llama, Mistral, Qwen2, Qwen3) over a flattened step batch
with a paged KV cache.

A step is T rows: prefill chunks and decode rows of many sequences, each sequence's rows
contiguous. Running example, block_size 4:

    rows    : seq 5 prefill chunk (positions 0..5) | seq 9 decode (position 12) | seq 2 decode (7)
    tokens  : [T=8]            positions: [0 1 2 3 4 5 12 7]
    slots   : where each row's k/v is written (from the mirrored block tables)

Every projection is one dense matmul over all T rows (q/k/v fused, gate/up fused), then the LoRA
backend adds the adapters of its segments with one call per fused output. Attention reads each
sequence's context back through its block table (executor/attention.py): on CUDA one Triton
kernel reads K/V in place for every row group; on CPU decode rows are batched in a few SDPA
calls by context length and prefill chunks get one SDPA call each.

On a rank of a tensor-parallel executor, `config` is the rank's part (executor/shards.py: its
heads, KV heads and intermediate size) and `tp` its group: the embedding and lm_head hold its
vocabulary rows, and the outputs of o and down (row-parallel: partial sums, each with its LoRA
delta) are all-reduced: the model's only collectives (executor/tensor_parallel.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from executor.attention import AttentionMeta, attend, build_attention_meta
from executor.kv_cache import PagedKVCache
from executor.lora import LoraBackend, LoraBatchMeta
from executor.model_config import ModelConfig
from executor.tensor_parallel import SINGLE, TensorParallel
from executor.weights import ModelWeights


@dataclass(frozen=True)
class RowSpec:
    """One row group of a step: `num_tokens` queries of a sequence starting at `start_pos`."""

    start_pos: int
    num_tokens: int
    block_table: list[int]


@dataclass(frozen=True)
class StepMetadata:
    """Built once per step, read by every layer."""

    positions: torch.Tensor  # [T]
    write_slots: torch.Tensor  # [T] where each row's k/v goes
    attention: AttentionMeta  # the attention path's own metadata (executor/attention.py)
    lora: LoraBatchMeta
    sample_rows: torch.Tensor  # [S] rows whose logits are returned

    @classmethod
    def build(cls, groups: list[RowSpec], *, kv: PagedKVCache, sliding_window: int | None,
              lora: LoraBatchMeta, sample_rows: list[int], device: str | torch.device,
              attention: str = "auto") -> StepMetadata:
        """attention: the attention backend (executor/attention.py), 'auto' by device."""
        positions, write_slots, starts = [], [], []
        row = 0
        for g in groups:  # plain ints: no small tensors per row (a decode step is many rows)
            end_pos = g.start_pos + g.num_tokens
            positions.extend(range(g.start_pos, end_pos))
            write_slots.extend(kv.slots(g.block_table, g.start_pos, end_pos))
            starts.append(row)
            row += g.num_tokens
        attention_meta = build_attention_meta(
            [g.block_table for g in groups], [g.start_pos + g.num_tokens for g in groups], starts,
            [g.num_tokens for g in groups], block_size=kv.block_size,
            sliding_window=sliding_window, backend=attention, device=device)
        return cls(
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            write_slots=torch.tensor(write_slots, dtype=torch.long, device=device),
            attention=attention_meta, lora=lora,
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=device))


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
    """x [..., n]; normalised over its last dim in fp32 like HF, then scaled by weight [n]."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class Transformer:
    def __init__(self, config: ModelConfig, weights: ModelWeights, lora: LoraBackend,
                 tp: TensorParallel = SINGLE) -> None:
        self.config, self.weights, self.lora, self.tp = config, weights, lora, tp
        self.inv_freq = rope_inv_freq(config).to(weights.embed.device)  # [D / 2] fp32

    def forward(self, tokens: torch.Tensor, meta: StepMetadata,
                kv: PagedKVCache) -> torch.Tensor | None:
        """tokens [T] -> logits [S, vocab] of meta.sample_rows (fp32); None on a rank but the
        first of a tensor-parallel group (rank 0 gathers them)."""
        freqs = meta.positions[:, None].float() * self.inv_freq[None, :]  # [T, D / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        dtype = self.weights.embed.dtype
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        h = self.tp.embed(self.weights.embed, tokens, self.weights.vocab_start)  # [T, hidden]
        for i, layer in enumerate(self.weights.layers):
            x = rms_norm(h, layer.input_norm, self.config.rms_norm_eps)
            h = h + self._attention(i, x, cos, sin, meta, kv)
            x = rms_norm(h, layer.post_attention_norm, self.config.rms_norm_eps)
            h = h + self._mlp(i, x, meta.lora)
        last = rms_norm(h.index_select(0, meta.sample_rows), self.weights.norm,
                        self.config.rms_norm_eps)
        logits = F.linear(last, self.weights.lm_head).float()  # [S, the rank's vocab rows]
        return self.tp.gather_vocab(logits, self.config.vocab_size)  # [S, vocab]

    def _attention(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   meta: StepMetadata, kv: PagedKVCache) -> torch.Tensor:
        c, w = self.config, self.weights.layers[i]
        qkv = F.linear(x, w.wqkv, w.bqkv)  # [T, q_size + 2 * kv_size]
        self.lora.apply(i, "qkv", x, qkv, meta.lora)
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        t = x.shape[0]
        q = q.reshape(t, c.num_attention_heads, c.head_dim)  # [T, H, D]
        k = k.reshape(t, c.num_key_value_heads, c.head_dim)  # [T, Hkv, D]
        if c.qk_norm:  # (Qwen3: each head normalised over head_dim, before RoPE)
            q, k = rms_norm(q, w.q_norm, c.rms_norm_eps), rms_norm(k, w.k_norm, c.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kv.write(i, meta.write_slots, k, v.reshape(t, c.num_key_value_heads, c.head_dim))

        attn = attend(q, kv, i, meta.attention)  # [T, H, D]
        attn = attn.reshape(t, c.q_size)  # [T, H * D]
        out = F.linear(attn, w.wo)  # [T, hidden]
        self.lora.apply(i, "o", attn, out, meta.lora)
        return self.tp.all_reduce(out)  # (row-parallel: the ranks' partial sums)

    def _mlp(self, i: int, x: torch.Tensor, lora: LoraBatchMeta) -> torch.Tensor:
        w = self.weights.layers[i]
        gate_up = F.linear(x, w.w_gate_up)  # [T, 2 * intermediate]
        self.lora.apply(i, "gate_up", x, gate_up, lora)
        gate, up = gate_up.chunk(2, dim=-1)  # [T, intermediate] each
        hidden = F.silu(gate) * up  # [T, intermediate]
        out = F.linear(hidden, w.w_down)  # [T, hidden]
        self.lora.apply(i, "down", hidden, out, lora)
        return self.tp.all_reduce(out)  # (row-parallel: the ranks' partial sums)
