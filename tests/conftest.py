"""Session fixtures: the tiny model and adapters, a real S3 server, and a fleet of real services."""

import os
import pathlib

import grpc
import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run through its interpreter on CPU. The switch must be set before triton is
    # first imported by anything (transformers may import it), so here, before any test module.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from loraplex import fixtures
from tests.s3server import seaweedfs_s3  # noqa: F401  (re-exported fixture)

# Tenant keys of the keyed test fleets (key -> tenant), and each tenant's key.
API_KEYS = {f"test-key-of-{t}-0123456789": t for t in ("acme", "globex", "initech", "limited")}
KEY_OF = {tenant: key for key, tenant in API_KEYS.items()}


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """In-process models here are tiny and overhead-bound: a second intra-op thread only adds
    OpenMP barriers, and while the services' processes share the 2 cores those spin-waits made the
    oracle tests ~20x slower (measured: 180 s vs 9 s)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
async def grpc_aio_held():
    """One idle grpc.aio channel for the whole session. grpc.aio stops its completion poller when
    its last channel closes and starts a new one with the next; a test that opened and closed a
    channel per call (`async with insecure_channel(...)`) after other modules had closed theirs
    once waited forever for an answer the scheduler had sent (its poller thread restarted). Held
    open, the poller starts once. The channel never connects (channels connect on first call)."""
    channel = grpc.aio.insecure_channel("127.0.0.1:9")
    yield
    await channel.close()


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
