"""An executor's page geometry (common/adapter_pages.py) and KV layout (common/kv_layout.py) on
the wire: its InfoResponse carries them to the scheduler. Apart from adapter_pages.py: the GPU
check imports the pool without protobuf."""

from __future__ import annotations

from types import MappingProxyType

from common.adapter_pages import PageGeometry
from common.kv_layout import KVKind, KVLayout, single_layout
from protos import executor_pb2


def geometry_to_pb(geometry: PageGeometry, page_bytes: int) -> executor_pb2.PageGeometry:
    return executor_pb2.PageGeometry(
        num_layers=geometry.num_layers, region_elements=geometry.region_elems,
        page_bytes=page_bytes, layer_groups=geometry.layer_groups,
        modules=[executor_pb2.ModuleShape(module=m, in_features=i, out_features=o)
                 for m, (i, o) in geometry.module_shapes.items()])


def geometry_from_pb(info: executor_pb2.InfoResponse) -> PageGeometry | None:
    """An executor's page geometry; None when it keeps adapters in fixed slots."""
    if not info.HasField("page_geometry"):
        return None
    pb = info.page_geometry
    return PageGeometry(pb.num_layers, pb.region_elements, MappingProxyType(
        {m.module: (m.in_features, m.out_features) for m in pb.modules}), pb.layer_groups or 1)


def kinds_to_pb(layout: KVLayout) -> list[executor_pb2.KVKind]:
    """InfoResponse.kv_kinds: empty for one kind that keeps the whole context."""
    if layout.is_single:
        return []
    return [executor_pb2.KVKind(window=kind.window or 0, layers=kind.layers, columns=kind.columns)
            for kind in layout.kinds]


def layout_from_pb(info: executor_pb2.InfoResponse) -> KVLayout:
    """An executor's KV layout (one kind that keeps the whole context when it names none)."""
    if not info.kv_kinds:
        return single_layout(max(1, info.page_geometry.num_layers))
    kinds = tuple(KVKind(k.window or None, tuple(k.layers), k.columns) for k in info.kv_kinds)
    per_block = info.page_geometry.num_layers if info.HasField("page_geometry") else 0
    if per_block <= 0 or any(k.columns < 1 or k.columns * per_block < len(k.layers)
                             for k in kinds):
        raise ValueError(f"kv_kinds {[(k.window, len(k.layers), k.columns) for k in kinds]} do "
                         f"not fit blocks of {per_block} layers")
    return KVLayout(kinds, per_block)
