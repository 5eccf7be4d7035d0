"""Every value of an adapter's weights finite, checked on the file's bytes with numpy: the adapter
store validates every push without loading torch (a store starts in under a second, not four).

A float of any format safetensors holds here is NaN or infinite exactly when its exponent bits are
all ones, so one mask test per value decides, read as unsigned integers of the float's width:

    F16 0x7C00   BF16 0x7F80   F32 0x7F800000   F64 0x7FF0000000000000

One pass covers the whole data section when every tensor has one dtype (they tile it); tensor by
tensor otherwise, or to name the culprit.
"""

import numpy as np

from common.errors import InvalidArgument
from common.peft.layout import AdapterLayout
from common.peft.safetensors_header import data_start

_EXPONENT_BITS = {"F16": (np.uint16, 0x7C00), "BF16": (np.uint16, 0x7F80),
                  "F32": (np.uint32, 0x7F800000), "F64": (np.uint64, 0x7FF0000000000000)}
_CHUNK = 1 << 18  # values per numpy call: the temporaries stay in cache


def check_finite(data, layout: AdapterLayout) -> None:
    """INVALID_ARGUMENT naming a tensor with a NaN or infinite value. `data`: the file's bytes
    (anything with the buffer protocol: bytes, a uint8 numpy array), its header already parsed
    into `layout`."""
    start = data_start(data)
    dtypes = layout.file_dtypes  # (the tensors tile the data section, unserved ones among them)
    if len(dtypes) == 1 and not _count_non_finite(data, start, len(data) - start, *dtypes):
        return
    for entry in layout.entries():
        count = _count_non_finite(data, start + entry.begin, entry.end - entry.begin,
                                  entry.dtype)
        if count:
            raise InvalidArgument(f"tensor {entry.name!r} has {count} NaN or infinite values")


def _count_non_finite(data, offset: int, num_bytes: int, dtype: str) -> int:
    uint, mask = _EXPONENT_BITS[dtype]
    values = np.frombuffer(data, dtype=uint, count=num_bytes // np.dtype(uint).itemsize,
                           offset=offset)
    scratch = np.empty(min(_CHUNK, len(values)), dtype=uint)
    bad = 0
    for i in range(0, len(values), _CHUNK):
        chunk = values[i:i + _CHUNK]
        exponent = np.bitwise_and(chunk, mask, out=scratch[:len(chunk)])
        bad += int(np.count_nonzero(exponent == mask))
    return bad
