"""The generated protobuf code must match the .proto files (run `make protos` when this fails)."""

import pathlib

from protos import generate


def test_generated_code_is_fresh(tmp_path: pathlib.Path):
    (tmp_path / "protos").mkdir()
    generate.generate(tmp_path)
    generated = sorted((generate.ROOT / "protos").glob("*_pb2*.py*"))
    assert generated, "no generated code found; run `make protos`"
    for path in generated:
        fresh = (tmp_path / "protos" / path.name).read_text()
        assert path.read_text() == fresh, f"{path.name} is stale: run `make protos`"
    expected = {p.name for p in (tmp_path / "protos").iterdir()}
    assert {p.name for p in generated} == expected


def test_every_field_is_documented():
    """The proto is the contract: every message field carries a comment (STYLE.md habit 1)."""
    undocumented = []
    for proto in sorted((generate.ROOT / "protos").glob("*.proto")):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            s = line.strip()
            is_field = s.endswith(";") and "=" in s and not s.startswith(("option", "syntax", "//"))
            if not is_field:
                continue
            prev = lines[i - 1].strip()
            # Consecutive fields may share one comment block (e.g. a pair of related counters).
            j = i - 1
            while j >= 0 and lines[j].strip().endswith(";") and "=" in lines[j]:
                j -= 1
            if not (prev.startswith("//") or lines[j].strip().startswith("//")):
                undocumented.append(f"{proto.name}:{i + 1}: {s}")
    assert not undocumented, "fields without a comment:\n" + "\n".join(undocumented)
