"""Weights are content-addressed, so a push of bytes that a version being deleted has shares its
weights: a delete only unreferences them, and a sweep removes them once unreferenced for the
grace period (adapter_store/orphans.py). A delete racing a push of the same bytes, through the
real service on local files and on SeaweedFS S3."""

import asyncio
import dataclasses
import time

import pytest

from adapter_store.records import MANIFEST_FILENAME, version_prefix
from protos import adapter_store_pb2 as pb
from tests.store.helpers import Store, backend_config, in_session_loop, make_adapter, weights_key


@in_session_loop
async def test_a_delete_racing_a_push_of_the_same_bytes_leaves_the_new_version_intact(store):
    config_json, data = make_adapter()
    await store.push("bot", config_json, data)
    # v2, the same bytes: uploaded, its weights written, held before it claims its version.
    registered = store.blobs.pause("put", version_prefix("bot", 2) + MANIFEST_FILENAME)
    push = asyncio.ensure_future(store.push("bot", config_json, data))
    await asyncio.wait_for(registered.reached.wait(), 30)
    deleted = await store.stub.DeleteAdapter(pb.DeleteAdapterRequest(name="bot", version=1))
    assert list(deleted.versions) == [1]
    registered.release()
    assert (await push).version == 2
    info, fetched = await store.fetch("bot", 2)
    assert fetched == data and info.version == 2


@pytest.fixture(params=["file", "s3"])
async def quick_store(request, tmp_path):
    """A store whose pushes are bounded to ~3 s in all, so its grace can be 4 s (a sweep every
    second)."""
    config = dataclasses.replace(backend_config(request, tmp_path), **QUICK)
    store = await Store(config).start()
    yield store
    await store.stop()


QUICK = dict(push_idle_s=1.0, push_min_bytes_per_s=1e8, max_adapter_bytes=1 << 20,
             push_register_s=2.0, blob_grace_s=4.0)


@in_session_loop
async def test_unreferenced_weights_stay_through_the_grace_then_go(quick_store):
    store = quick_store
    config_json, data = make_adapter()
    _, kept = make_adapter(seed=1)
    await store.push("bot", config_json, data)
    await store.push("bot", config_json, kept)
    gone, stays = weights_key("bot", data), weights_key("bot", kept)
    await store.stub.DeleteAdapter(pb.DeleteAdapterRequest(name="bot", version=1))
    deleted_at = time.monotonic()
    assert gone in await store.blobs.list_objects(gone), "a delete only unreferences weights"
    grace = QUICK["blob_grace_s"]
    while gone in await store.blobs.list_objects(gone):
        assert time.monotonic() - deleted_at < 3 * grace, "still there after three graces"
        await asyncio.sleep(0.1)
    assert time.monotonic() - deleted_at > grace - 0.2  # (the sweep marks by the wall clock)
    assert stays in await store.blobs.list_objects(stays)
    assert (await store.fetch("bot", 2))[1] == kept
    assert not await store.blobs.list_objects("orphans/"), "no marks left behind"
