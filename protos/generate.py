"""Regenerate the protobuf and gRPC modules beside their .proto files.

Run from anywhere: `python -m protos.generate`. Compiling with the repository root as the include
path makes generated imports read `from protos import common_pb2`, so they work inside the package.
"""

import pathlib
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_FILES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "protos").glob("*.proto"))


def generate(out_dir: pathlib.Path = ROOT) -> None:
    """Write *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every .proto under out_dir/protos."""
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *PROTO_FILES,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")


if __name__ == "__main__":
    generate(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
