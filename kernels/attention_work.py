"""Per-step work for paged attention: each sequence's block table, context length and query rows,
built once per step on the host (from plain ints) and copied to the device in one transfer.
Pure torch (no triton): the executor's CPU path reads it too.

A sequence's keys are its positions 0..context_len-1; its queries are the last query_len of
them, rows query_start.. of the step. Running example, block_size 4:

    seq 0: decode at position 12 (row 6), table [7, 2, 9, 4]  -> context 13, 1 query
    seq 1: prefill chunk of positions 0..5 (rows 0..5), table [3, 5]  -> context 6, 6 queries

    block_tables [[7, 2, 9, 4], [3, 5, 0, 0]]  (padded with block 0, never read)
    context_lens [13, 6]   query_starts [6, 0]   query_lens [1, 6]   max_query_len 6

Key position p of sequence s is read from block block_tables[s, p // 4] at offset p % 4.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch


def visible_keys(q_pos: torch.Tensor, k_pos: torch.Tensor,
                 sliding_window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) visibility of keys at k_pos from queries at q_pos
    (broadcast): a query sees the keys at positions p with q_pos - window < p <= q_pos."""
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


@dataclass(frozen=True)
class PagedAttentionWork:
    block_tables: torch.Tensor  # [S, max_blocks] int32
    context_lens: torch.Tensor  # [S] int32: keys at positions 0..context_len-1
    query_starts: torch.Tensor  # [S] int32: the row in q of each sequence's first query
    query_lens: torch.Tensor  # [S] int32: queries at the last query_len positions
    max_query_len: int  # host int: sizes the grid without reading the device

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @classmethod
    def build(cls, tables: list[list[int]], context_lens: list[int], query_starts: list[int],
              query_lens: list[int], *, block_size: int,
              device: str | torch.device = "cpu") -> PagedAttentionWork:
        """tables: each sequence's block ids (at least cdiv(context_len, block_size) of them;
        ids past those are not copied); the other lists: one int per sequence."""
        widths = [-(-c // block_size) for c in context_lens]
        if any(len(t) < w for t, w in zip(tables, widths)):
            raise ValueError("a block table is shorter than its context needs")
        width = max(widths, default=0)
        # One tensor from one flat list of plain ints, one host-to-device copy: the tables
        # (padded with block 0), then context_lens, query_starts, query_lens.
        flat = torch.tensor([*chain.from_iterable(t[:w] + [0] * (width - w)
                                                  for t, w in zip(tables, widths)),
                             *context_lens, *query_starts, *query_lens],
                            dtype=torch.int32).to(device)
        n, num_seqs = len(tables) * width, len(context_lens)
        ctx, starts, lens = flat[n:].view(3, num_seqs)
        return cls(block_tables=flat[:n].view(num_seqs, width), context_lens=ctx,
                   query_starts=starts, query_lens=lens,
                   max_query_len=max(query_lens, default=0))

    @classmethod
    def decode(cls, tables: list[list[int]], context_lens: list[int], *, block_size: int,
               device: str | torch.device = "cpu") -> PagedAttentionWork:
        """One query per sequence, sequence s at row s (q [S, H, D])."""
        return cls.build(tables, context_lens, list(range(len(context_lens))),
                         [1] * len(context_lens), block_size=block_size, device=device)
