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
