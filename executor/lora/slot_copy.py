"""The last hop of an adapter load: host staging buffers, and the copy from one into a pool slot.

On CUDA the staging buffers are pinned and the copy runs on a side stream of its own, its transfers
queued without a wait each (the staging buffer is not reused before the copy ends) and one wait at
the end, in the loading thread: the step loop, on its own thread and the default stream, never
waits on it. Unloads clear the slot's record after the copies on that stream have passed (its pages
go back to the scheduler for KV). The weights are copied as the file stores them (views into
staging); the pool converts to its dtype on the GPU. On CPU it is a plain copy. The copier only
writes the pool: the slot counts as loaded once the AdapterLoader marks it so
(LoraSlotPool.mark_loaded). No gRPC here: bench/gpu_check.py runs this path on a GPU machine that
has only torch and triton.
"""

import torch

from executor.lora.slot_pool import LoraSlotPool, LoraWeights

_MAX_FREE_STAGING = 2  # staging buffers kept for reuse between loads


class StagingBuffers:
    """Host buffers that fetched adapters land in, reused between loads: a fresh 64 MiB buffer
    costs its page faults on every load (CPU), or a pinned allocation (CUDA)."""

    def __init__(self, pin_memory: bool):
        self._pin_memory = pin_memory
        self._free: list[torch.Tensor] = []

    def take(self, num_bytes: int) -> torch.Tensor:
        """A uint8 buffer of at least `num_bytes`; give it back with `release` once unused."""
        fitting = [i for i, b in enumerate(self._free) if b.numel() >= num_bytes]
        if fitting:  # (list.remove would compare tensors by value)
            return self._free.pop(min(fitting, key=lambda i: self._free[i].numel()))
        return torch.empty(max(num_bytes, 1), dtype=torch.uint8, pin_memory=self._pin_memory)

    def release(self, buffer: torch.Tensor) -> None:
        self._free.append(buffer)
        self._free.sort(key=torch.Tensor.numel, reverse=True)
        del self._free[_MAX_FREE_STAGING:]  # keep the largest


class SlotCopier:
    """Copies parsed adapters into `pool`; call `copy` from a worker thread."""

    def __init__(self, pool: LoraSlotPool):
        self._pool = pool
        is_cuda = pool.device.type == "cuda"
        self._stream = torch.cuda.Stream(pool.device) if is_cuda else None

    def copy(self, slot: int, weights: LoraWeights, pages: tuple[int, ...]) -> None:
        """Returns once the slot holds `weights`, in `pages` (their source may be reused after),
        or once nothing queued reads them any more when the copy failed."""
        self._on_side_stream(self._pool.load, slot, weights, pages)

    def clear(self, slot: int) -> None:
        """Empty `slot` once every copy queued on the side stream has passed: its pages, the
        scheduler's again, are written by nothing of it any more when this returns."""
        self._on_side_stream(self._pool.clear, slot)

    def _on_side_stream(self, write, slot: int, *args) -> None:
        """`write(slot, *args)`, then, once done (the side stream passed it), the pool told so:
        a step that copied the slot meanwhile copies it again."""
        try:
            if self._stream is None:
                write(slot, *args)
                return
            try:
                with torch.cuda.stream(self._stream):
                    write(slot, *args)
            finally:
                self._stream.synchronize()  # this thread waits; the step loop's stream does not
        finally:
            self._pool.finish_write(slot)
