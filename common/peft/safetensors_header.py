"""A hand-written, bounds-checked reader of a safetensors header: nothing is allocated from
untrusted sizes until they are checked against the bytes we actually hold.

Layout: 8-byte little-endian header length N, N bytes of UTF-8 JSON
{"name": {"dtype": "F32", "shape": [r, in], "data_offsets": [begin, end]}, "__metadata__": {...}},
then the data section; offsets are relative to its start, tensors tile it without gaps or overlaps.
"""

import dataclasses
import json
import math

from common.errors import InvalidArgument

# A header is a few KB per tensor; 100 MB is the limit the safetensors library itself enforces.
MAX_HEADER_BYTES = 100_000_000
MAX_DIMS = 8  # a LoRA tensor has 2; no safetensors dtype needs more than a few
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}
WEIGHTS_FILE = "adapter_model.safetensors"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    # Byte range inside the data section.
    begin: int
    end: int


def data_start(data) -> int:
    """Where the data section starts in a file whose header `parse_header` accepted: tensor
    offsets count from here."""
    return 8 + int.from_bytes(bytes(data[:8]), "little")


def _invalid(message: str) -> InvalidArgument:
    return InvalidArgument(f"{WEIGHTS_FILE}: {message}")


def parse_header(data: bytes) -> dict[str, TensorEntry]:
    """The tensors a safetensors file declares, checked against the file's real size. `data` is
    any bytes-like object (bytes, memoryview, a uint8 numpy array)."""
    if len(data) < 8:
        raise _invalid(f"the file is {len(data)} bytes, too short for the 8-byte header length "
                       "(truncated upload?)")
    header_len = int.from_bytes(bytes(data[:8]), "little")
    if header_len > MAX_HEADER_BYTES:
        raise _invalid(f"header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit "
                       "(not a safetensors file?)")
    if header_len > len(data) - 8:
        raise _invalid(f"header length {header_len} exceeds the {len(data) - 8} bytes after it "
                       "(truncated or not a safetensors file)")
    try:
        header = json.loads(bytes(data[8:8 + header_len]).decode("utf-8"))
    except RecursionError:
        raise _invalid("header JSON is nested too deeply") from None
    except ValueError as exc:  # not UTF-8, not JSON, or an integer of more than 4300 digits
        raise _invalid(f"header is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(header, dict):
        raise _invalid("header JSON must be an object of tensor entries")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise _invalid("__metadata__ must map strings to strings")

    data_len = len(data) - 8 - header_len
    entries = {name: _parse_entry(name, raw, data_len) for name, raw in header.items()}
    _check_tiling(sorted(entries.values(), key=lambda e: (e.begin, e.end)), data_len)
    return entries


def _parse_entry(name: str, raw: object, data_len: int) -> TensorEntry:
    if not isinstance(raw, dict):
        raise _invalid(f"entry of tensor {name!r} must be an object")
    dtype, shape, offsets = raw.get("dtype"), raw.get("shape"), raw.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:  # a list is unhashable
        raise _invalid(f"tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise _invalid(f"tensor {name!r} has invalid shape {str(shape)[:100]}")
    if len(shape) > MAX_DIMS or any(d > data_len for d in shape):
        # (refused before their product: thousands of huge dimensions multiply for minutes)
        raise _invalid(f"tensor {name!r} has a shape of {len(shape)} dimensions, up to "
                       f"{max(shape)}: more than {MAX_DIMS}, or longer than the file's {data_len} "
                       "data bytes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise _invalid(f"tensor {name!r} has invalid data_offsets {offsets!r}")
    begin, end = offsets
    if not begin <= end <= data_len:
        raise _invalid(f"tensor {name!r} has data_offsets [{begin}, {end}] outside the {data_len} "
                       "data bytes of the file (truncated upload?)")
    expected = math.prod(shape) * DTYPE_BYTES[dtype]
    if end - begin != expected:
        raise _invalid(f"tensor {name!r} holds {end - begin} bytes but its shape {shape} of "
                       f"{dtype} needs {expected}")
    return TensorEntry(name, dtype, tuple(shape), begin, end)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_tiling(entries: list[TensorEntry], data_len: int) -> None:
    """Tensors must cover the data section exactly once, in some order."""
    position, previous = 0, None
    for entry in entries:
        if entry.begin < position:
            raise _invalid(f"tensor {entry.name!r} overlaps tensor {previous!r}")
        if entry.begin > position:
            raise _invalid(f"{entry.begin - position} unused bytes before tensor {entry.name!r}")
        position, previous = entry.end, entry.name
    if position != data_len:
        raise _invalid(f"{data_len - position} bytes after the last tensor are not part of any "
                       "tensor")


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
