"""An adapter's weights as tensors: views into the bytes of its safetensors file (no copy, never
unpickled). Executors read them so; the checks on the bytes themselves (safetensors, not pickle;
finite values) need no torch: common.peft.safetensors_header and common.peft.finite."""

import warnings

import torch

from common.peft.layout import AdapterLayout
from common.peft.safetensors_header import TensorEntry, data_start

_TORCH_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
                 "F64": torch.float64}


def as_uint8(data: bytes | bytearray | memoryview | torch.Tensor) -> torch.Tensor:
    """The file's bytes as a 1-D uint8 tensor sharing memory with `data`, to be read only (torch
    warns that immutable bytes are not writable; nothing here writes)."""
    if isinstance(data, torch.Tensor):
        return data
    if not len(data):
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)


def tensor_views(raw: torch.Tensor, layout: AdapterLayout
                 ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(A [r, in], B [out, r]) of every module, as views into `raw` [num_bytes] uint8 (a copy
    only for a tensor misaligned for its dtype). The header was checked against len(raw)."""
    start = data_start(raw.numpy())

    def view(entry: TensorEntry) -> torch.Tensor:
        dtype = _TORCH_DTYPES[entry.dtype]
        span = raw[start + entry.begin:start + entry.end]
        if (start + entry.begin) % dtype.itemsize:
            span = span.clone()
        return span.view(dtype).view(entry.shape)

    return {key: (view(m.a), view(m.b)) for key, m in layout.modules.items()}


def expert_tensors(raw: torch.Tensor, layout: AdapterLayout
                   ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]:
    """(A [r, in], B [out, r], scale) of every expert module (common.peft.experts): views into
    `raw` for a single part (a fused weight's expert: rows of A, every E-th column of B), built
    for an expert's own gate and up (A stacked, B block-diagonal, each part's scale folded in
    where the two differ)."""
    if not layout.experts:
        return {}
    start = data_start(raw.numpy())
    views: dict[str, torch.Tensor] = {}

    def view(entry: TensorEntry) -> torch.Tensor:
        if entry.name not in views:
            dtype = _TORCH_DTYPES[entry.dtype]
            span = raw[start + entry.begin:start + entry.end]
            if (start + entry.begin) % dtype.itemsize:
                span = span.clone()
            views[entry.name] = span.view(dtype).view(entry.shape)
        return views[entry.name]

    out = {}
    for key, e in layout.experts.items():
        pieces = [(view(p.a)[p.a_rows[0]:p.a_rows[1]], view(p.b)[:, slice(*p.b_cols)], p)
                  for p in e.parts]
        if len(pieces) == 1 and pieces[0][2].out_offset == 0 and \
                pieces[0][1].shape[0] == e.out_features:
            a, b, _ = pieces[0]
            out[key] = (a, b, e.scale)
            continue
        scale = e.scale
        a = torch.cat([a for a, _, _ in pieces])  # [r_gate + r_up, in]
        # [2 moe_intermediate, r_gate + r_up]; a scale folded in at fp32 at least (PEFT computes
        # a 16-bit adapter's LoRA in fp32: the product rounded to 16 bits lost ~4e-3 of logits)
        folds = any(part.scale != scale for _, _, part in pieces)
        b = torch.zeros(e.out_features, e.rank, dtype=torch.promote_types(
            a.dtype, torch.float32) if folds else a.dtype)
        col = 0
        for _, part_b, part in pieces:
            rows, rank = part_b.shape[0], part.rank
            block = part_b if part.scale == scale else part_b.to(b.dtype) * (part.scale / scale)
            b[part.out_offset:part.out_offset + rows, col:col + rank] = block
            col += rank
        out[key] = (a, b, scale)
    return out
