"""The tiny model and PEFT adapters the demo and tests use, made once per folder."""

import json
import pathlib


def ensure(folder: str | pathlib.Path) -> dict:
    """Make the fixtures under `folder` unless they are already there; returns the manifest."""
    from tests import fixtures_gen

    manifest = pathlib.Path(folder) / "manifest.json"
    if manifest.exists():
        return json.loads(manifest.read_text())
    return fixtures_gen.generate(folder)
