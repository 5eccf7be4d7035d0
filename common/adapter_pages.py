"""Adapter pages: where an adapter's LoRA weights sit in an executor's memory, which it shares with
the KV cache. Defined once: executors place weights with it, schedulers count pages with it.

The unit is the KV block. A block holds, in every layer, a K region and a V region of
`region_elems` elements each (block_size x kv heads x head_dim); the KV cache is one tensor
[2 (K, V), layers, blocks, region], so a region's element offset is

    ((half * num_layers + layer) * num_blocks + block) * region_elems

A block the scheduler gives to an adapter is one of its pages: in every layer, its two regions
hold that layer's rank rows. Each rank row is a row of A (in_features elements) or of B^T (a
column of B: out_features elements) of one module, cut into chunks of at most `chunk_elems` (the
largest power of two that fits a region: kernel tiles never straddle a chunk). Chunks are packed
into regions first-fit decreasing, the same way in every layer, so one layout (and one table of
offsets per adapter) serves all layers; a layer whose rank is below the module's largest (a
rank_pattern naming layers) leaves its rows unread.

So an adapter takes pages in proportion to the rank rows it really has, module by module: a
rank-8 adapter about an eighth of a rank-64 one, nothing padded to a maximum rank.

Where sliding-window layers keep KV of their own (common/kv_layout.py), a block holds fewer layers
than the model has (`num_layers` is then the block's layer slots): an adapter takes its layout's
pages once per group of that many layers (`layer_groups`), layer l in group l // num_layers, at
slot l % num_layers; PageLayout.num_pages counts them all.

Running example: regions of 2048 elements (chunks 2048), q_proj 256 -> 256 at rank 2: four rows
of 256 (A0, A1, B0, B1) fill 1024 elements of region 0 (page 0, K half); 1 page.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

from common.peft.config import LoraConfig
from common.peft.modules import TEXT_LAYERS, module_path


@dataclasses.dataclass(frozen=True)
class PageGeometry:
    """An executor's memory as adapters see it (its InfoResponse carries it)."""

    num_layers: int  # layer slots of a block (the model's layers, but for window blocks)
    region_elems: int  # elements of one layer's K (or V) region of one block
    # module -> (in_features, out_features), in the model's order (common.peft.modules: the
    # LLaMA layout's LORA_MODULES or the fused layout's FUSED_MODULES)
    module_shapes: Mapping[str, tuple[int, int]]
    layer_groups: int = 1  # groups of num_layers layers the model's layers make

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.region_elems < 1 or self.layer_groups < 1:
            raise ValueError(f"page geometry needs layers >= 1, region_elems >= 1 and "
                             f"layer_groups >= 1, got {self.num_layers}, {self.region_elems} "
                             f"and {self.layer_groups}")

    @property
    def chunk_elems(self) -> int:
        """The longest piece of a rank row kept contiguous: a power of two, at most a region."""
        return 1 << (self.region_elems.bit_length() - 1)

    @property
    def page_elems(self) -> int:
        """Elements of one page (one KV block): two regions in every layer."""
        return 2 * self.num_layers * self.region_elems


@dataclasses.dataclass(frozen=True)
class Place:
    """Where one chunk of a rank row sits within an adapter's pages, in every layer."""

    page: int  # index into a group's pages (the scheduler gives it a block id per page)
    half: int  # 0: the K region, 1: the V region
    offset: int  # elements into the region


@dataclasses.dataclass(frozen=True)
class ModulePlaces:
    """A module's rank rows: a[r] / b[r] the chunks of A's row r / of B's column r, in order."""

    rank: int
    a: tuple[tuple[Place, ...], ...]  # [rank][chunks of in_features]
    b: tuple[tuple[Place, ...], ...]  # [rank][chunks of out_features]


@dataclasses.dataclass(frozen=True)
class PageLayout:
    num_pages: int  # pages the adapter takes: pages_per_group in each layer group
    modules: Mapping[str, ModulePlaces]  # targeted modules only
    used_elems: int  # elements of rank rows (per layer); the rest of its pages is slack
    pages_per_group: int = -1  # (-1: num_pages, one group)

    def __post_init__(self) -> None:
        if self.pages_per_group < 0:
            object.__setattr__(self, "pages_per_group", self.num_pages)

    def fill(self, geometry: PageGeometry) -> float:
        """The share of its pages' elements its rows use (1.0: no slack)."""
        if not self.num_pages:
            return 1.0
        return self.used_elems * geometry.num_layers / (self.pages_per_group
                                                        * geometry.page_elems)

    def group_pages(self, pages: tuple[int, ...], group: int) -> tuple[int, ...]:
        """The blocks of layer group `group` among the adapter's `pages` (group-major)."""
        return pages[group * self.pages_per_group:(group + 1) * self.pages_per_group]


NO_PAGES = PageLayout(0, MappingProxyType({}), 0)


def plan_pages(module_ranks: Mapping[str, int], geometry: PageGeometry) -> PageLayout:
    """The layout of an adapter whose largest rank over layers is module_ranks[m] for each
    module it targets (0 or absent: not targeted)."""
    chunk, region = geometry.chunk_elems, geometry.region_elems
    missing = [m for m, r in module_ranks.items() if r > 0 and m not in geometry.module_shapes]
    if missing:
        raise ValueError(f"the model has no {missing[0]} to adapt (its projections: "
                         f"{', '.join(geometry.module_shapes)})")
    items = []  # (size, order, module, kind, rank row, chunk index)
    for m in geometry.module_shapes:  # (the model's order: executor and scheduler agree)
        rank = module_ranks.get(m, 0)
        if rank <= 0:
            continue
        in_f, out_f = geometry.module_shapes[m]
        for kind, length in (("a", in_f), ("b", out_f)):
            for r in range(rank):
                for c, start in enumerate(range(0, length, chunk)):
                    items.append((min(chunk, length - start), len(items), m, kind, r, c))
    # First fit, decreasing: items of one size go, in order, into the first regions with room
    # (few sizes: each pass looks at every region once).
    by_size: dict[int, list] = {}
    for item in items:
        by_size.setdefault(item[0], []).append(item)
    free: list[int] = []  # per region (page * 2 + half): elements left
    placed: dict[tuple[str, str, int, int], Place] = {}
    for size in sorted(by_size, reverse=True):
        pending = iter(by_size[size])
        item = next(pending, None)
        at = 0
        while item is not None:
            if at == len(free):
                free.append(region)
            while item is not None and free[at] >= size:
                _, _, m, kind, r, c = item
                placed[m, kind, r, c] = Place(at // 2, at % 2, region - free[at])
                free[at] -= size
                item = next(pending, None)
            at += 1
    modules = {}
    for m in geometry.module_shapes:
        rank = module_ranks.get(m, 0)
        if rank <= 0:
            continue
        in_f, out_f = geometry.module_shapes[m]
        rows = {kind: tuple(tuple(placed[m, kind, r, c] for c in range(-(-length // chunk)))
                            for r in range(rank))
                for kind, length in (("a", in_f), ("b", out_f))}
        modules[m] = ModulePlaces(rank, rows["a"], rows["b"])
    used = sum(size for size, *_ in items)
    per_group = -(-len(free) // 2)
    return PageLayout(per_group * geometry.layer_groups, MappingProxyType(modules), used,
                      per_group)


def module_ranks(config: LoraConfig, target_modules: tuple[str, ...] | list[str],
                 num_layers: int, layers: str = "") -> dict[str, int]:
    """Each targeted module's largest rank over the model's layers, by the adapter's config
    (what its tensors hold: the store checks them against it at push), its patterns matched
    under `layers`, where its tensors put the decoder layers (AdapterInfo.layers_path; "": a
    text model's)."""
    out = {}
    for m in target_modules:
        paths = [module_path(layer, m, layers or TEXT_LAYERS) for layer in range(num_layers)]
        hit = config.targets(paths)
        ranks = [rank for (rank, _), is_hit in zip(config.ranks_and_alphas(paths), hit)
                 if is_hit]
        if ranks:
            out[m] = max(ranks)
    return out


def padded_pages(max_rank: int, geometry: PageGeometry) -> int:
    """Pages a slot sized for `max_rank` on every module would take (what a pool that pads to
    the maximum rank spends on every adapter): for comparison."""
    return plan_pages(dict.fromkeys(geometry.module_shapes, max_rank), geometry).num_pages
