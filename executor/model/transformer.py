"""A readable decoder forward over a flattened step batch with a paged KV cache: the LLaMA layout
(Llama, Mistral, Qwen2, Qwen3) and its relatives, each family's quirks read from ModelConfig
(executor/model/family_quirks.py reads them from config.json; executor/model/layer_ops.py holds the
pieces: the RMSNorm variants, the activation, soft-capping; executor/model/rope.py the rotary
variants).

A step is T rows: prefill chunks and decode rows of many sequences, each sequence's rows
contiguous. Running example, block_size 4:

    rows    : seq 5 prefill chunk (positions 0..5) | seq 9 decode (position 12) | seq 2 decode (7)
    tokens  : [T=8]            positions: [0 1 2 3 4 5 12 7]
    slots   : where each row's k/v is written (from the mirrored block tables)

Every projection is one dense matmul over all T rows (q/k/v fused, gate/up fused; a quantized
base's through executor/model/quant.py's `project`, which is F.linear for a dense weight; on CPU
gate|up may run as its two halves where that is faster, executor/model/split_matmul.py), then the
LoRA backend adds the adapters of its segments with one call per fused output. Attention reads each
sequence's context back through its block table (executor/model/attention.py): on CUDA one Triton
kernel reads K/V in place for every row group; on CPU decode rows are batched in a few SDPA
calls by context length and prefill chunks get one SDPA call each. A layer with a sliding window
reads the step's metadata for its window; global layers read the whole context. Where sliding
layers keep KV of their own (window blocks, common/kv_layout.py), each kind's column of blocks
has tables of its own: a layer writes and reads its K/V at its slot of its column's blocks.

Per layer (Gemma's extra norms in brackets):

    h += [norm](attention(norm(h)))          h += [norm](down(act(gate(x)) * up(x))), x = norm(h)

On a rank of a tensor-parallel executor, `config` is the rank's part (executor/tp/shards.py: its
heads, KV heads and intermediate size) and `tp` its group: the embedding and lm_head hold its
vocabulary rows, and the outputs of o and down (row-parallel: partial sums, each with its LoRA
delta) are all-reduced, before Gemma's norms on them: the model's only collectives
(executor/tp/collectives.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.kv_layout import KVLayout, single_layout
from executor.lora.backend import LoraBackend, LoraBatchMeta
from executor.model.attention import AttentionMeta, attend, build_attention_meta
from executor.model.config import ModelConfig
from executor.model.kv_cache import PagedKVCache
from executor.model.layer_ops import activation, rms_norm, soft_cap
from executor.model.moe import grouped_matmul_for, moe_mlp
from executor.model.quant import project
from executor.model.rope import apply_rope, rope_cos_sin
from executor.model.split_matmul import faster_in_halves, in_halves
from executor.model.weights import ModelWeights
from executor.tp.collectives import SINGLE, TensorParallel


@dataclass(frozen=True)
class RowSpec:
    """One row group of a step: `num_tokens` queries of a sequence starting at `start_pos`."""

    start_pos: int
    num_tokens: int
    # its block table of each column of each kind (KVLayout, kinds in order, then columns): one
    # table but with window blocks
    tables: tuple[list[int], ...]
    is_long: bool = False  # its sequence computes with longrope's long factors (rope.py)


@dataclass(frozen=True)
class StepMetadata:
    """Built once per step, read by every layer."""

    positions: torch.Tensor  # [T]
    # [T] where each row's k/v goes, per table column (RowSpec.tables)
    write_slots: tuple[torch.Tensor, ...]
    # [T] 1 where a row's RoPE takes longrope's long factors, 0 the short ones; None: no row does
    long_rows: torch.Tensor | None
    # the attention path's own metadata (executor/model/attention.py), per (table column, sliding
    # window (None: the whole context)) among the model's layers
    attention: Mapping[tuple[int, int | None], AttentionMeta]
    lora: LoraBatchMeta
    sample_rows: torch.Tensor  # [S] rows whose logits are returned
    # [T] long, host: each row's adapter slot (-1: none), for the experts' LoRA (moe.py)
    row_slots: torch.Tensor | None = None

    @classmethod
    def build(cls, groups: list[RowSpec], *, kv: PagedKVCache,
              windows: Mapping[int, set[int | None]], lora: LoraBatchMeta,
              sample_rows: list[int], device: str | torch.device, attention: str = "auto",
              row_slots: torch.Tensor | None = None) -> StepMetadata:
        """windows: each table column's layers' sliding windows (Transformer.windows);
        attention: the attention backend (executor/model/attention.py), 'auto' by device."""
        positions, starts = [], []
        write_slots: list[list[int]] = [[] for _ in windows]
        row = 0
        for g in groups:  # plain ints: no small tensors per row (a decode step is many rows)
            end_pos = g.start_pos + g.num_tokens
            positions.extend(range(g.start_pos, end_pos))
            for column, table in zip(write_slots, g.tables):
                column.extend(kv.slots(table, g.start_pos, end_pos))
            starts.append(row)
            row += g.num_tokens
        long_rows = None
        if any(g.is_long for g in groups):  # (longrope past its switch: rope.py)
            long_rows = torch.tensor([int(g.is_long) for g in groups for _ in range(g.num_tokens)],
                                     dtype=torch.long, device=device)  # [T]
        context_lens = [g.start_pos + g.num_tokens for g in groups]
        query_lens = [g.num_tokens for g in groups]
        attention_meta = {}
        for column, column_windows in windows.items():
            metas = build_attention_meta(
                [g.tables[column] for g in groups], context_lens, starts, query_lens,
                block_size=kv.block_size, windows=column_windows, backend=attention,
                device=device)
            attention_meta.update({(column, w): meta for w, meta in metas.items()})
        return cls(
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            write_slots=tuple(torch.tensor(slots, dtype=torch.long, device=device)
                              for slots in write_slots),
            long_rows=long_rows, attention=attention_meta, lora=lora,
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=device),
            row_slots=row_slots)


class Transformer:
    def __init__(self, config: ModelConfig, weights: ModelWeights, lora: LoraBackend,
                 tp: TensorParallel = SINGLE, kv_layout: KVLayout | None = None) -> None:
        """kv_layout: where each layer's K and V lie (None: every layer in every block)."""
        self.config, self.weights, self.lora, self.tp = config, weights, lora, tp
        layout = kv_layout or single_layout(config.num_hidden_layers)
        # each layer's (table column, slot): columns numbered over the kinds in order
        first = [sum(kind.columns for kind in layout.kinds[:k]) for k in range(len(layout.kinds))]
        self.kv_places = []
        for layer in range(config.num_hidden_layers):
            kind, column, slot = layout.place(layer)
            self.kv_places.append((first[kind] + column, slot))
        device = weights.embed.device
        # the experts' grouped matmul (executor/model/moe.py): one Triton launch on CUDA
        self.moe_matmul = grouped_matmul_for(device) if config.num_experts else None
        # On CPU, gate|up as two matmuls where that is faster here (split_matmul.py)
        dense = [w.w_gate_up for w in weights.layers if isinstance(w.w_gate_up, torch.Tensor)]
        self.gate_up_in_halves = bool(dense) and device.type == "cpu" and \
            faster_in_halves(dense[0])
        # [2, D / 2] fp32 inverse frequencies of each rope the layers use (Gemma 3: local,
        # global), short then long (the same twice but for longrope)
        self.inv_freqs = {rope: torch.stack([rope.inv_freq(config.head_dim, long=False),
                                             rope.inv_freq(config.head_dim, long=True)]).to(device)
                          for rope in map(config.layer_rope, range(config.num_hidden_layers))}

    @property
    def windows(self) -> dict[int, set[int | None]]:
        """Each table column's layers' sliding windows (None: a global layer)."""
        out: dict[int, set[int | None]] = {}
        for layer, (column, _) in enumerate(self.kv_places):
            out.setdefault(column, set()).add(self.config.layer_window(layer))
        return dict(sorted(out.items()))

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        c = self.config
        return rms_norm(x, weight, c.rms_norm_eps, c.norm_unit_offset, c.norm_fp32_weight)

    def forward(self, tokens: torch.Tensor, meta: StepMetadata,
                kv: PagedKVCache) -> torch.Tensor | None:
        """tokens [T] -> logits [S, vocab] of meta.sample_rows (fp32); None on a rank but the
        first of a tensor-parallel group (rank 0 gathers them)."""
        return self.logits(self.hidden_states(tokens, meta, kv).index_select(0, meta.sample_rows))

    def logits(self, h: torch.Tensor) -> torch.Tensor | None:
        """Final hidden states [N, hidden] (hidden_states' rows) -> logits [N, vocab] (fp32);
        None on a rank but the first of a tensor-parallel group (a collective: every rank of
        the group calls it alike)."""
        logits = F.linear(self._norm(h, self.weights.norm), self.weights.lm_head)  # [N, rows]
        logits = soft_cap(logits, self.config.final_logit_softcap).float()  # (elementwise)
        return self.tp.gather_vocab(logits, self.config.vocab_size)  # [N, vocab]

    def hidden_states(self, tokens: torch.Tensor, meta: StepMetadata,
                      kv: PagedKVCache) -> torch.Tensor:
        """tokens [T] -> the last layer's output [T, hidden], before the final norm; writes the
        rows' K/V to the cache."""
        c, dtype = self.config, self.weights.embed.dtype
        rotary = {rope: rope_cos_sin(  # cos, sin [T, D]
                      rope, inv_freqs[0] if meta.long_rows is None else inv_freqs[meta.long_rows],
                      meta.positions, dtype)  # ([D / 2], or each row's [T, D / 2])
                  for rope, inv_freqs in self.inv_freqs.items()}
        h = self.tp.embed(self.weights.embed, tokens, self.weights.vocab_start)  # [T, hidden]
        if c.scale_embeddings:  # (Gemma: sqrt(hidden) rounded to the weights' dtype first)
            h = h * torch.tensor(c.hidden_size ** 0.5).to(dtype)
        for i, layer in enumerate(self.weights.layers):
            x = self._norm(h, layer.input_norm)
            out = self._attention(i, x, *rotary[c.layer_rope(i)], meta, kv)
            h = h + (self._norm(out, layer.attn_out_norm) if c.sandwich_norms else out)
            x = self._norm(h, layer.post_attention_norm)
            out = self._moe(i, x, meta) if c.is_moe_layer(i) else self._mlp(i, x, meta.lora)
            h = h + (self._norm(out, layer.mlp_out_norm) if c.sandwich_norms else out)
        return h

    def _attention(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   meta: StepMetadata, kv: PagedKVCache) -> torch.Tensor:
        c, w = self.config, self.weights.layers[i]
        qkv = project(x, w.wqkv, w.bqkv)  # [T, q_size + 2 * kv_size]
        self.lora.apply(i, "qkv", x, qkv, meta.lora)
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        t = x.shape[0]
        q = q.reshape(t, c.num_attention_heads, c.head_dim)  # [T, H, D]
        k = k.reshape(t, c.num_key_value_heads, c.head_dim)  # [T, Hkv, D]
        if c.qk_norm:  # (Qwen3, Gemma 3: each head normalised over head_dim, before RoPE)
            q, k = self._norm(q, w.q_norm), self._norm(k, w.k_norm)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        column, slot = self.kv_places[i]
        kv.write(slot, meta.write_slots[column], k, v.reshape(t, c.num_key_value_heads, c.head_dim))

        attn = attend(q, kv, slot, meta.attention[column, c.layer_window(i)],
                      scale=c.attention_scale, softcap=c.attn_logit_softcap,
                      sinks=w.sinks)  # [T, H, D]
        attn = attn.reshape(t, c.q_size)  # [T, H * D]
        out = project(attn, w.wo, w.bo, self.tp)  # [T, hidden] (bo: on one rank of a TP group)
        self.lora.apply(i, "o", attn, out, meta.lora)
        return self.tp.all_reduce(out)  # (row-parallel: the ranks' partial sums)

    def _moe(self, i: int, x: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        w = self.weights.layers[i]
        row_slots = meta.row_slots
        if row_slots is None:  # (no adapter on any row)
            row_slots = torch.full((x.shape[0],), -1, dtype=torch.long)
        out = moe_mlp(self.config, i, x, w, row_slots, self.lora, meta.lora, self.moe_matmul)
        return self.tp.all_reduce(out)  # (row-parallel inside each expert: partial sums)

    def _mlp(self, i: int, x: torch.Tensor, lora: LoraBatchMeta) -> torch.Tensor:
        w = self.weights.layers[i]
        gate_up = (in_halves(x, w.w_gate_up) if self.gate_up_in_halves
                   and isinstance(w.w_gate_up, torch.Tensor)
                   else project(x, w.w_gate_up))  # [T, 2 * intermediate]
        self.lora.apply(i, "gate_up", x, gate_up, lora)
        gate, up = gate_up.chunk(2, dim=-1)  # [T, intermediate] each
        hidden = activation(self.config.hidden_act)(gate) * up  # [T, intermediate]
        out = project(hidden, w.w_down, tp=self.tp)  # [T, hidden]
        self.lora.apply(i, "down", hidden, out, lora)
        return self.tp.all_reduce(out)  # (row-parallel: the ranks' partial sums)
