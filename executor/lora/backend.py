"""The LoRA backends' contract and how one is chosen. A backend adds the adapter contributions of
a step to the base model's projections; the adapters sit in the slot pool.

Rows of a step come sorted by slot, so each adapter's rows form a segment
(executor/lora/segments.py). For every projection (the model's 7, or 4 fused) the dense base matmul
runs over all rows first; then, per segment s with slot j:

    out[rows_s] += scale_j * (x[rows_s] @ A_j^T) @ B_j^T      (shrink to rank r, expand back)

Rows with slot -1 ("base model only") cost nothing. Projections that share an input form a group
(LORA_GROUPS: q/k/v, gate/up) and are applied by one backend call on the group's fused base
output, so a kernel reads x once for all of the group's slices. In a fused layout (FUSED_GROUPS:
Phi-3's qkv_proj, gate_up_proj) the fused module is the group's one slice.

Where each part lives:
    executor/lora/slot_pool.py       the pool (adapter storage) and what each slot holds
    executor/lora/segments.py        a step's segments, from its row slots (shared by the backends)
    executor/lora/torch_backend.py   TorchLoraBackend, TorchBatchMeta (pure torch: CPU, reference)
    executor/lora/triton_backend.py  TritonLoraBackend, TritonBatchMeta (SGMV kernels: CUDA)
Each backend's `prepare` builds its own per-step metadata once; every layer's `apply` reads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Protocol, TypeVar

import torch

from executor.lora.slot_pool import LoraSlotPool
from executor.lora.torch_backend import TorchBatchMeta, TorchLoraBackend
from executor.lora.triton_backend import TritonBatchMeta, TritonLoraBackend

Meta = TypeVar("Meta")

# One backend's per-step metadata, as the model passes it from `prepare` to `apply`.
LoraBatchMeta = TorchBatchMeta | TritonBatchMeta


class LoraBackend(Protocol[Meta]):
    def __init__(self, pool: LoraSlotPool) -> None: ...

    def prepare(self, row_slots: torch.Tensor) -> Meta:
        """Build the step's metadata from host row_slots [T] (once per step)."""
        ...

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor,
              meta: Meta) -> None:
        """out [T, sum of the group's out_features] += the adapter contributions of the group's
        projections (LORA_GROUPS[group], side by side in out's columns) to x [T, in], in place."""
        ...


LORA_BACKENDS: Mapping[str, type[LoraBackend]] = MappingProxyType(
    {"torch": TorchLoraBackend, "triton": TritonLoraBackend})


def resolve_lora_backend(name: str, device: str | torch.device) -> str:
    """'auto' -> 'triton' on CUDA, 'torch' elsewhere; other names pass through."""
    if name == "auto":
        return "triton" if torch.device(device).type == "cuda" else "torch"
    return name


def make_lora_backend(name: str, pool: LoraSlotPool) -> LoraBackend:
    name = resolve_lora_backend(name, pool.device)
    if name not in LORA_BACKENDS:
        raise ValueError(f"unknown LoRA backend {name!r} "
                         f"(known: auto, {', '.join(LORA_BACKENDS)})")
    return LORA_BACKENDS[name](pool)
