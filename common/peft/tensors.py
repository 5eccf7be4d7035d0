"""An adapter's weights as tensors: views into the bytes of its safetensors file (no copy, never
unpickled), and the checks on the bytes themselves (safetensors, not pickle; finite values)."""

import warnings

import torch

from common.errors import InvalidArgument
from common.peft.layout import AdapterLayout
from common.peft.safetensors_header import WEIGHTS_FILE, TensorEntry

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_TORCH_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
                 "F64": torch.float64}


def check_weights_file(filename: str, head: bytes) -> None:
    """Only safetensors named adapter_model.safetensors is accepted: pickle is refused by its
    name and by its first bytes (`head`, at least 9 of them when there are that many)."""
    if filename.endswith(_PICKLE_SUFFIXES):
        raise InvalidArgument(f"weights file {filename!r} is a pickle checkpoint; only "
                              f"safetensors is accepted: save the adapter as {WEIGHTS_FILE}")
    if filename != WEIGHTS_FILE:
        raise InvalidArgument(f"weights file {filename!r} is not accepted; only safetensors is "
                              f"accepted, named {WEIGHTS_FILE}")
    # Pickle starts 0x80 <protocol>, torch's zip format "PK\3\4"; safetensors has '{' at byte 8.
    is_pickle = head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")
    if (is_pickle or head[:4] == b"PK\x03\x04") and head[8:9] != b"{":
        raise InvalidArgument(f"{WEIGHTS_FILE} holds a pickle/torch.save checkpoint; only "
                              "safetensors is accepted (use safetensors.torch.save_file)")


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
    start = 8 + int.from_bytes(raw[:8].numpy().tobytes(), "little")

    def view(entry: TensorEntry) -> torch.Tensor:
        dtype = _TORCH_DTYPES[entry.dtype]
        span = raw[start + entry.begin:start + entry.end]
        if (start + entry.begin) % dtype.itemsize:
            span = span.clone()
        return span.view(dtype).view(entry.shape)

    return {key: (view(m.a), view(m.b)) for key, m in layout.modules.items()}


def check_finite(raw: torch.Tensor, layout: AdapterLayout,
                 views: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> None:
    """INVALID_ARGUMENT naming a tensor with a NaN or infinite value. One reduction over the whole
    data section when every tensor has one dtype (they tile it); tensor by tensor otherwise, or
    to name the culprit."""
    start = 8 + int.from_bytes(raw[:8].numpy().tobytes(), "little")
    dtypes = layout.dtype.split(",")
    if len(dtypes) == 1:
        dtype = _TORCH_DTYPES[dtypes[0]]
        if start % dtype.itemsize == 0 and _is_finite(raw[start:].view(dtype)):
            return
    for key, (a, b) in views.items():
        for entry, tensor in ((layout.modules[key].a, a), (layout.modules[key].b, b)):
            if not _is_finite(tensor):
                count = int((~torch.isfinite(tensor)).sum())
                raise InvalidArgument(f"tensor {entry.name!r} has {count} NaN or infinite values")


def _is_finite(tensor: torch.Tensor) -> bool:
    """All values finite; min and max propagate NaN, so two reductions decide (no mask)."""
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) & torch.isfinite(high))
