"""The collectives a tensor-parallel forward pass needs, at the few points the model calls them
(executor/model/transformer.py): after the row-parallel projections (o, down: one all-reduce of the
base's partial sums with the LoRA delta already added), around the vocab-parallel embedding and
lm_head, and the sampled tokens, which rank 0 alone draws (it alone gathers whole logits).

    tp = TensorParallel(rank, world, group)   # group: a torch.distributed ProcessGroup
    h = tp.embed(table, tokens, first_row)    # [T, hidden] on every rank
    out = tp.all_reduce(out)                  # in place: the sum over ranks
    logits = tp.gather_vocab(logits, vocab)   # [S, vocab] on rank 0, None on the others
    tokens = tp.share_tokens(tokens, count)   # rank 0's sampled tokens, on every rank

World 1 (SINGLE) does no communication: each is the identity. Which part of the weights a rank
holds is executor/tp/shards.py's.

Every wait is bounded: the group's timeout (ExecutorConfig.rank_timeout_s) bounds each
collective (gloo's own timeout; NCCL's watchdog aborts the process). A collective that fails (a
rank died: its connections closed) or times out (a rank froze) calls `on_broken`: a rank process
exits, so its supervisor (executor/tp/rank_group.py) restarts the group as one; elsewhere (tests) it
raises GroupBroken. A group that lost a rank cannot go on: NCCL and gloo have no way back.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class GroupBroken(RuntimeError):
    """A collective of the rank group failed or timed out: a rank died or froze."""


def rank_device(device: str, rank: int, world: int) -> torch.device:
    """The device of rank `rank`: cuda -> cuda:rank in a group of more than one, else `device`."""
    return torch.device("cuda", rank) if world > 1 and device == "cuda" else torch.device(device)


def _raise(err: Exception) -> NoReturn:
    raise GroupBroken(f"the tensor-parallel group broke: {err}") from err


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    world: int = 1
    group: dist.ProcessGroup | None = None
    device: torch.device = torch.device("cpu")  # where the group's tensors are (NCCL: the GPU)
    on_broken: Callable[[Exception], NoReturn] = field(default=_raise, compare=False)

    def __post_init__(self) -> None:
        if self.world > 1 and self.group is None:
            raise ValueError("tensor parallel: a group of more than one rank needs its "
                             "process group")

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @classmethod
    def join(cls, rank: int, world: int, store_file: str, *, device: torch.device,
             timeout_s: float,
             on_broken: Callable[[Exception], NoReturn] = _raise) -> TensorParallel:
        """Join the group of `world` ranks meeting at `store_file` (a FileStore: no port to pick),
        NCCL on CUDA and gloo elsewhere, each collective bounded by `timeout_s`."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{store_file}", rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s),
                                **({"device_id": device} if backend == "nccl" else {}))
        return cls(rank, world, dist.group.WORLD, device if backend == "nccl" else
                   torch.device("cpu"), on_broken)

    def _wait(self, work: dist.Work) -> None:
        try:
            work.wait()
        except RuntimeError as err:  # (gloo: a closed connection, a timeout)
            log.error("rank %d of %d: a collective failed: %s", self.rank, self.world, err)
            self.on_broken(err)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x (contiguous), summed over the ranks in place; returned."""
        if self.world > 1:
            self._wait(self.group.allreduce([x]))
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """x (contiguous), its largest over the ranks, in place; returned (W8A8's per-token
        scales of a row-parallel input: executor/model/quant.py)."""
        if self.world > 1:
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.MAX
            self._wait(self.group.allreduce([x], opts))
        return x

    def embed(self, table: torch.Tensor, tokens: torch.Tensor, first_row: int) -> torch.Tensor:
        """Rows of `tokens` [T] from an embedding split by rows: table [rows, hidden] holds token
        ids [first_row, first_row + rows). Each rank looks up its own and zeroes the rest; the
        sum over ranks is the lookup (exact: one rank gives each row)."""
        if self.world == 1:
            return table[tokens]  # [T, hidden]
        local = tokens - first_row
        inside = (local >= 0) & (local < table.shape[0])  # [T]
        h = table[local.clamp(0, table.shape[0] - 1)]  # [T, hidden]
        return self.all_reduce(h.masked_fill_(~inside[:, None], 0))

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """logits [S, rows] of each rank's vocabulary rows -> [S, vocab_size] on rank 0 (the
        parts side by side, padding cut), None on the others."""
        if self.world == 1:
            return logits
        if not logits.shape[0]:  # (no row samples: the same on every rank)
            return logits.new_empty(0, vocab_size) if self.is_first else None
        parts = [[torch.empty_like(logits) for _ in range(self.world)]] if self.is_first else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self._wait(self.group.gather(parts, [logits.contiguous()], opts))
        return torch.cat(parts[0], dim=-1)[:, :vocab_size] if self.is_first else None

    def share_tokens(self, token_ids: list[int], count: int) -> list[int]:
        """Rank 0's `count` sampled tokens, on every rank (the others pass anything)."""
        if self.world == 1 or not count:
            return token_ids
        t = (torch.tensor(token_ids, dtype=torch.int64, device=self.device) if self.is_first
             else torch.empty(count, dtype=torch.int64, device=self.device))  # [S]
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._wait(self.group.broadcast([t], opts))
        return t.tolist()


SINGLE = TensorParallel()  # one rank: no communication
