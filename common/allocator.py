"""glibc malloc settings for processes that stream adapter bytes (the store, the executor).

Every gRPC message, S3 body chunk and protobuf field is a fresh Python bytes object of up to a few
MiB. With glibc's defaults such a block is mmapped, or carved from the top of the heap and handed
back to the kernel when freed (the trim threshold follows the largest block freed), so each one
costs fresh page faults when it is written: measured here, 64 MiB streamed through protobuf in
1 MiB messages took 127 ms with the defaults and 6 ms once freed blocks stay with the process.
`keep_freed_memory` makes blocks below `mmap_threshold_bytes` come from the heap and keeps up to
`trim_threshold_bytes` of freed heap for reuse. Call it once at process start.
"""

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

MIB = 1024 * 1024
_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_MAX_MMAP_THRESHOLD = 32 * MIB  # glibc refuses more on 64-bit (HEAP_MAX_SIZE / 2)


def keep_freed_memory(mmap_threshold_bytes: int = _MAX_MMAP_THRESHOLD,
                      trim_threshold_bytes: int = 256 * MIB) -> bool:
    """Apply the settings; False (and nothing changed) where the C library is not glibc."""
    if not 0 < mmap_threshold_bytes <= _MAX_MMAP_THRESHOLD or trim_threshold_bytes < 0:
        raise ValueError(f"mmap threshold must be within (0, {_MAX_MMAP_THRESHOLD}] and the trim "
                         f"threshold >= 0, got {mmap_threshold_bytes} and {trim_threshold_bytes}")
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        log.info("malloc settings left as they are: %s has no mallopt", name or "no C library")
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    is_set = (mallopt(_M_MMAP_THRESHOLD, mmap_threshold_bytes) == 1
              and mallopt(_M_TRIM_THRESHOLD, trim_threshold_bytes) == 1)
    if not is_set:
        log.warning("mallopt refused the streaming settings; large messages will page-fault")
    return is_set
