"""Fixtures of the store tests: started stores (on local files, or also on SeaweedFS S3) and a
tiny-model runner to load fetched adapters into. A module with a `store` of its own (holding its
adapters, or its own blob store) overrides the one here."""

import pytest

from executor.runner import ModelRunner
from tests.store.helpers import Store, backend_config, file_config


@pytest.fixture(params=["file", "s3"])
async def store(request, tmp_path):
    store = await Store(backend_config(request, tmp_path)).start()
    yield store
    await store.stop()


@pytest.fixture
async def file_store(tmp_path):
    store = await Store(file_config(tmp_path)).start()
    yield store
    await store.stop()


@pytest.fixture(scope="module")
def runner(tiny):
    return ModelRunner.from_pretrained(tiny["model_dir"], num_kv_blocks=128, block_size=8,
                                       num_slots=2, max_rank=64)
