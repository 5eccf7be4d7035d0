"""How the SGMV kernels (and their references) read an adapter's rank rows from the paged store.

A row (of A, or of B^T) of `length` elements is kept in chunks of `chunk` elements (a power of
two) that may lie anywhere in the flat storage; a table gives each chunk's element offset
(executor/lora/page_tables.py builds the tables from an adapter's pages). Element c of a row whose
chunks start at o[0], o[1], ... is at o[c // chunk] + c % chunk. Pure torch.

Example: chunk 64, a row of 200 elements at offsets (672, 3552, 192, 736): its element 130
(chunk 2, 2 in) is at 194.
"""

from __future__ import annotations

import torch


def row_index(offsets: torch.Tensor, length: int, chunk: int) -> torch.Tensor:
    """Element indices [r, length] of r rows of `length` elements whose chunks start at
    offsets [r, NC] (int64): row i's element c at offsets[i, c // chunk] + c % chunk."""
    cols = torch.arange(length, device=offsets.device)  # [length]
    return offsets[:, cols // chunk] + cols % chunk
