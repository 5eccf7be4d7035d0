"""Session fixtures: the tiny model and adapters, a real S3 server, and a fleet of real services."""

import pathlib

import pytest

from loraplex import fixtures
from tests.s3server import seaweedfs_s3  # noqa: F401  (re-exported fixture)

API_KEYS = {"key-acme": "acme", "key-globex": "globex", "key-initech": "initech"}


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> dict:
    """Manifest of the deterministic tiny model + PEFT adapters (see loraplex/fixtures.py)."""
    return fixtures.ensure(tmp_path_factory.mktemp("fixtures"))


@pytest.fixture(scope="session")
def hf_peft(tiny):
    """HF transformers + PEFT with every valid fixture adapter loaded (see tests/oracle.py)."""
    from tests.oracle import load_hf_peft

    return load_hf_peft(tiny)


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("logs")
