"""An executor's page geometry (common/adapter_pages.py) on the wire: its InfoResponse carries it
to the scheduler. Apart from adapter_pages.py: the GPU check imports the pool without protobuf."""

from __future__ import annotations

from types import MappingProxyType

from common.adapter_pages import PageGeometry
from protos import executor_pb2


def geometry_to_pb(geometry: PageGeometry, page_bytes: int) -> executor_pb2.PageGeometry:
    return executor_pb2.PageGeometry(
        num_layers=geometry.num_layers, region_elements=geometry.region_elems,
        page_bytes=page_bytes,
        modules=[executor_pb2.ModuleShape(module=m, in_features=i, out_features=o)
                 for m, (i, o) in geometry.module_shapes.items()])


def geometry_from_pb(info: executor_pb2.InfoResponse) -> PageGeometry | None:
    """An executor's page geometry; None when it keeps adapters in fixed slots."""
    if not info.HasField("page_geometry"):
        return None
    pb = info.page_geometry
    return PageGeometry(pb.num_layers, pb.region_elements, MappingProxyType(
        {m.module: (m.in_features, m.out_features) for m in pb.modules}))
