"""The row tables the SGMV kernels read (kernels/sgmv_*.py): where each chunk of each rank row of
an adapter sits in the KV storage, from its page layout (common/adapter_pages.py). How a kernel
reads a row through them is kernels/page_rows.py.

The storage is one tensor [2 (K, V), layers, blocks, region_elems], read flat. A chunk's Place
(page, half, offset) of an adapter whose pages are the blocks `pages` is, in layer 0, at

    (half * num_layers * num_blocks + pages[page]) * region_elems + offset

and in layer l at that plus l * num_blocks * region_elems (`layer_base`): one table serves every
layer. Element c of a row whose chunks start at o[0], o[1], ... is at o[c // chunk] + c % chunk.
Where a block holds fewer layer slots than the model has layers (window blocks: the geometry's
layer_groups > 1), layer l lies at slot l % num_layers of its group l // num_layers's pages: one
table per group, and layer_base counts the slot.

Running example: regions of 96 elements (chunk 64), 3 layers, 10 blocks, an adapter in blocks
(7, 2): a row of A of 200 elements in chunks (page 0, K, 0), (page 0, V, 0), (page 1, K, 0),
(page 0, K, 64) has offsets (672, 3552, 192, 736) in layer 0; its element 130 (chunk 2, 2 in)
in layer 1 is at 960 + 192 + 2 = 1154.
"""

from __future__ import annotations

import torch

from common.adapter_pages import PageGeometry, PageLayout, Place


def layer_base(layer: int, num_blocks: int, geometry: PageGeometry) -> int:
    """Elements from slot 0's copy of a place in `layer`'s group to `layer`'s."""
    return layer % geometry.num_layers * num_blocks * geometry.region_elems


def place_offset(place: Place, pages: tuple[int, ...], num_blocks: int,
                 geometry: PageGeometry) -> int:
    """A chunk's element offset in the flat storage, in layer 0."""
    region = place.half * geometry.num_layers * num_blocks + pages[place.page]
    return region * geometry.region_elems + place.offset


def slot_tables(layout: PageLayout, pages: tuple[int, ...], num_blocks: int,
                geometry: PageGeometry, *, max_rank: int,
                num_chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One slot's rows of the offset tables the kernels read (executor/lora/slot_pool.py keeps them
    for every slot): a, b int64 [layer groups, the model's modules (geometry.module_shapes),
    max_rank, num_chunks], the slot-0 offset in each group of chunk c of row r of A, and of B^T
    (B's column r), of each module; 0 where the adapter has no such row or chunk."""
    if len(pages) != layout.num_pages:
        raise ValueError(f"the layout takes {layout.num_pages} pages, {len(pages)} given")
    order = list(geometry.module_shapes)
    shape = (geometry.layer_groups, len(order), max_rank, num_chunks)
    a, b = torch.zeros(shape, dtype=torch.int64), torch.zeros(shape, dtype=torch.int64)
    for group in range(geometry.layer_groups):
        group_pages = layout.group_pages(pages, group)
        for module, places in layout.modules.items():
            m = order.index(module)
            if places.rank > max_rank:
                raise ValueError(f"{module} has rank {places.rank} > max_rank {max_rank}")
            for table, rows in ((a, places.a), (b, places.b)):
                if len(rows[0]) > num_chunks:
                    raise ValueError(f"{module}'s rows take {len(rows[0])} chunks > "
                                     f"{num_chunks}")
                table[group, m, :places.rank, :len(rows[0])] = torch.tensor(
                    [[place_offset(p, group_pages, num_blocks, geometry) for p in chunks]
                     for chunks in rows])
    return a, b
