"""Which part of the model one rank of a tensor-parallel executor holds (Megatron-style), defined
once: the weight loader reads only that part of the checkpoint, adapters are cut to it before they
reach the rank's pages, and merging folds each rank's part into its own weights.

    column-parallel  q, k, v, gate, up   the rows of W (its outputs) split; x whole on every rank
    row-parallel     o, down             the columns of W (its inputs) split; each rank's output
                                         is a partial sum, all-reduced (executor/tp/collectives.py)
    vocab-parallel   embed, lm_head      the vocabulary's rows split (padded to equal parts)
    replicated       the norms (and q_norm / k_norm, per head)

Heads go whole to a rank: rank r of N holds q heads [r H/N, (r+1) H/N) and the KV heads they
read: its KV_heads/N when KV_heads >= N, else the one KV head of its query heads, replicated
(N/KV_heads ranks hold each). So a rank's attention is the model's over its heads, and its KV
cache holds only its KV heads.

LoRA follows the base (S-LoRA's scheme): for a column-parallel projection A [r, in] is whole on
every rank and B [out, r] split by its rows as W is; for a row-parallel one A split by its columns
as W is, B whole. The rank's partial shrink x_r A_r^T, expanded by B, is a partial sum like its
base output: the LoRA delta is added before the base's all-reduce, and one all-reduce serves both.
A rank's part has the shapes of `Shard.config`'s projections: the LoRA backends, the slot pool and
its pages see nothing but a smaller model.

A mixture of experts' experts split as the dense MLP does, inside each expert: each rank holds
its rows of every expert's gate and up (of moe_intermediate_size) and those columns of its down,
so its experts' output is a partial sum, all-reduced with the rest; the router is replicated
(every rank routes its tokens alike). An expert's fused gate_up (and its LoRA's B) is cut like
Phi-3's gate_up_proj below; gpt-oss's, whose gate and up interleave, is one run of rows (its
units [a, b) are rows [2a, 2b)). A bias of a row-parallel output (gpt-oss's o_proj and experts'
down) is added once: rank 0 holds it, the others zeros. Attention sinks go with their heads.

A quantized projection (executor/model/quant.py) is cut the same way, its scales, zeros and g_idx
with it: by rows freely, by input columns only where no group or scale block is split (an
act-order g_idx keeps every group's scales and takes its columns' entries); otherwise loading
refuses, naming the layer (executor/model/quant_load.py).

Fused projections (Phi-3's qkv_proj = q | k | v side by side, gate_up_proj = gate | up) take each
part's rows in turn: rank r's rows of qkv_proj are its q rows, then q_size + its k rows, then
q_size + kv_size + its v rows. A fused B is cut the same way.

Running example, the tiny model (hidden 256, 4 heads and 2 KV heads of 64, intermediate 688,
vocab 1024) at N = 4: rank 3 holds q rows [192, 256), KV head 1 (rows [64, 128) of k and of v,
shared with rank 2), gate/up rows [516, 688), o and down columns of the same, vocab rows
[768, 1024).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType

import torch

from common.peft.modules import parse_expert_module, projection_shapes
from executor.lora.slot_pool import LoraModuleWeights, LoraWeights
from executor.model.config import ModelConfig
from executor.model.quant import join

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "qkv_proj",
                   "gate_up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
# A fused projection -> its parts, in the order of its output's rows.
FUSED_PARTS = MappingProxyType({"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                                "gate_up_proj": ("gate_proj", "up_proj")})

Ranges = tuple[tuple[int, int], ...]  # (start, end) runs along one dim, in order


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `world`'s part of a model of `full` config (world 1: all of it)."""

    full: ModelConfig
    rank: int = 0
    world: int = 1

    def __post_init__(self) -> None:
        c, n = self.full, self.world
        if not 0 <= self.rank < n:
            raise ValueError(f"tensor parallel: rank {self.rank} out of range [0, {n})")
        problems = []
        if c.num_attention_heads % n:
            problems.append(f"num_attention_heads {c.num_attention_heads}")
        if c.intermediate_size % n:
            problems.append(f"intermediate_size {c.intermediate_size}")
        if c.moe_intermediate_size % n:
            problems.append(f"moe_intermediate_size {c.moe_intermediate_size}")
        kv = c.num_key_value_heads
        if (kv % n) if kv >= n else (n % kv):
            problems.append(f"num_key_value_heads {kv} (nor does {n} split into it)")
        if problems:
            raise ValueError(f"tensor parallel {n}: does not divide the model's "
                             f"{', '.join(problems)}")

    @property
    def config(self) -> ModelConfig:
        """The rank's part as a model of its own: its heads, KV heads and intermediate size
        (hidden size, vocabulary and the rest unchanged)."""
        c, n = self.full, self.world
        return c.replace(num_attention_heads=c.num_attention_heads // n,
                         num_key_value_heads=max(1, c.num_key_value_heads // n),
                         intermediate_size=c.intermediate_size // n,
                         moe_intermediate_size=c.moe_intermediate_size // n)

    @property
    def vocab_rows(self) -> int:
        """Rows of the rank's embedding and lm_head part: the vocabulary / N, rounded up (the
        last rank's part padded with zero rows)."""
        return -(-self.full.vocab_size // self.world)

    @property
    def vocab_start(self) -> int:
        """The first token id of the rank's vocabulary rows."""
        return self.rank * self.vocab_rows

    # ----- what part of each projection -----

    def _heads(self, num_heads: int, q_heads: int) -> tuple[int, int]:
        """The rank's [first, last) heads of a projection of `num_heads` heads."""
        n = self.world
        if num_heads >= n:
            per = num_heads // n
            return self.rank * per, (self.rank + 1) * per
        first_q = self.rank * (q_heads // n)  # its query heads' KV head, whole
        kv = first_q // (q_heads // num_heads)
        return kv, kv + 1

    def ranges(self, module: str) -> Ranges:
        """The rank's runs of the split dim of `module`: of its outputs (column-parallel), of its
        inputs (row-parallel)."""
        c = self.full
        expert = parse_expert_module(module)
        if expert is not None:  # (inside each expert, as the dense MLP's)
            per = c.moe_intermediate_size // self.world
            own = (self.rank * per, (self.rank + 1) * per)
            if expert[1] == "down_proj":
                return (own,)
            if c.gate_up_interleaved:
                return ((2 * own[0], 2 * own[1]),)
            return (own, (c.moe_intermediate_size + own[0], c.moe_intermediate_size + own[1]))
        if module in FUSED_PARTS:  # (its parts' shapes: those of the unfused layout)
            parts = projection_shapes(c.hidden_size, c.intermediate_size, c.num_attention_heads,
                                      c.num_key_value_heads, c.head_dim)
            out, at = [], 0
            for part in FUSED_PARTS[module]:
                out += [(at + a, at + b) for a, b in self.ranges(part)]
                at += parts[part][1]
            return tuple(out)
        d, heads = c.head_dim, c.num_attention_heads
        if module in ("q_proj", "o_proj"):
            first, last = self._heads(heads, heads)
        elif module in ("k_proj", "v_proj"):
            first, last = self._heads(c.num_key_value_heads, heads)
        elif module in ("gate_proj", "up_proj", "down_proj"):
            per = c.intermediate_size // self.world
            return ((self.rank * per, (self.rank + 1) * per),)
        else:
            raise ValueError(f"tensor parallel: no split defined for {module!r}")
        return ((first * d, last * d),)

    # ----- cutting tensors -----

    def take(self, name: str, read: Callable[[int, int, int], torch.Tensor],
             full: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The rank's part of the base tensor `name` (an HF checkpoint name): `read(dim, start,
        end)` gives one run of the whole tensor, `full()` all of it (a replicated tensor)."""
        module, kind = name.split(".")[-2:]
        if self.world == 1:
            return full()
        per = self.full.moe_intermediate_size // self.world
        a, b = self.rank * per, (self.rank + 1) * per
        if module == "experts":  # gpt-oss's fused experts, [E, in, out] (gate_up interleaved)
            if kind == "down_proj_bias":
                return full() if self.rank == 0 else torch.zeros_like(full())
            return {"gate_up_proj": lambda: read(2, 2 * a, 2 * b),
                    "gate_up_proj_bias": lambda: read(1, 2 * a, 2 * b),
                    "down_proj": lambda: read(1, a, b)}[kind]()
        if ".mlp.experts." in name:  # an expert's gate_proj / up_proj / down_proj weight
            return read(1 if module == "down_proj" else 0, a, b)
        if kind == "sinks":  # (one per query head)
            first, last = self._heads(self.full.num_attention_heads,
                                      self.full.num_attention_heads)
            return read(0, first, last)
        if module in ("embed_tokens", "lm_head"):
            end = min(self.vocab_start + self.vocab_rows, self.full.vocab_size)
            rows = read(0, self.vocab_start, end)  # [rows, hidden]
            pad = self.vocab_rows - rows.shape[0]
            return torch.cat([rows, rows.new_zeros(pad, rows.shape[1])]) if pad else rows
        if module in COLUMN_PARALLEL:  # weight [out, in] and bias [out]: rows
            dim = 0
        elif module in ROW_PARALLEL and kind == "weight":  # weight [out, in]: columns
            dim = 1
        elif module in ROW_PARALLEL:  # its bias: added once, by rank 0
            return full() if self.rank == 0 else torch.zeros_like(full())
        else:
            return full()
        pieces = [read(dim, a, b) for a, b in self.ranges(module)]
        return join(pieces, dim)  # (a quantized weight's runs too: executor/model/quant.py)

    def lora(self, weights: LoraWeights) -> LoraWeights:
        """The rank's part of an adapter: B's rows of a column-parallel projection, A's columns
        of a row-parallel one (views where one run; world 1: `weights` itself)."""
        if self.world == 1:
            return weights
        out = {}
        for key, w in weights.modules.items():
            module = key[1]
            expert = parse_expert_module(module)
            if module in ROW_PARALLEL or (expert is not None and expert[1] == "down_proj"):
                out[key] = LoraModuleWeights(a=_runs(w.a, 1, self.ranges(module)), b=w.b,
                                             scale=w.scale)
            else:
                out[key] = LoraModuleWeights(a=w.a, b=_runs(w.b, 0, self.ranges(module)),
                                             scale=w.scale)
        return LoraWeights(modules=MappingProxyType(out))


def _runs(t: torch.Tensor, dim: int, ranges: Ranges) -> torch.Tensor:
    pieces = [t.narrow(dim, a, b - a) for a, b in ranges]
    return torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0]
