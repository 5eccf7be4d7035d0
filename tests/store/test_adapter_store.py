"""The adapter store through its real gRPC service, on local files and on SeaweedFS S3."""

import asyncio
import dataclasses
import hashlib
import signal
import subprocess
import sys
import zlib

import grpc
import pytest
import safetensors.torch

from adapter_store.blob_backends import open_blob_store
from adapter_store.config import StoreConfig, parse_args
from common.errors import InvalidArgument, Unavailable
from common.server import insecure_channel
from executor.lora.peft_adapter import parse_peft_adapter
from executor.model.config import ModelConfig
from protos import adapter_store_pb2 as pb
from protos import adapter_store_pb2_grpc
from tests.store.helpers import (
    Store,
    expect_error,
    file_config,
    in_session_loop,
    lora_config,
    lora_tensors,
    make_adapter,
    weights_key,
)


@in_session_loop
async def test_push_fetch_round_trip_and_versions(store):
    config_json, data = make_adapter()
    info = await store.push("support-bot", config_json, data, owner="acme")
    assert (info.name, info.version, info.owner_tenant) == ("support-bot", 1, "acme")
    assert not info.is_public
    assert (info.rank, info.alpha, info.base_model) == (8, 16.0, "tiny-llama")
    assert list(info.target_modules) == ["q_proj", "v_proj"]
    assert info.num_bytes == len(data) and info.config_json == config_json
    fetched_info, fetched = await store.fetch("support-bot", 1)
    assert fetched == data and fetched_info.sha256 == info.sha256
    assert hashlib.sha256(fetched).hexdigest() == info.sha256
    assert fetched_info.HasField("crc32") and fetched_info.crc32 == zlib.crc32(data)

    _, data2 = make_adapter(seed=1)
    assert (await store.push("support-bot", config_json, data2, owner="acme")).version == 2
    latest = await store.stub.GetAdapter(pb.GetAdapterRequest(name="support-bot"))
    assert latest.version == 2
    assert (await store.fetch("support-bot", 1))[1] == data
    assert (await store.fetch("support-bot", 2))[1] == data2
    details = await expect_error(grpc.StatusCode.NOT_FOUND, store.stub.GetAdapter(
        pb.GetAdapterRequest(name="support-bot", version=3)))
    assert "no version 3" in details


@in_session_loop
async def test_restart_keeps_registry(store):
    config_json, data = make_adapter()
    await store.push("kept", config_json, data, owner="acme")
    await store.push("kept", config_json, make_adapter(seed=2)[1], owner="acme")
    await store.push("public-one", config_json, data)
    await store.restart()
    listed = await store.stub.ListAdapters(pb.ListAdaptersRequest())
    assert [(a.info.name, a.info.version) for a in listed.adapters] == [("kept", 2),
                                                                          ("public-one", 1)]
    info, fetched = await store.fetch("kept", 1)
    assert fetched == data and info.owner_tenant == "acme"
    assert (await store.push("kept", config_json, data, owner="acme")).version == 3


@in_session_loop
async def test_single_flight_of_cold_adapter(store):
    config_json, data = make_adapter(num_layers=4)
    await store.push("hot", config_json, data)
    key = weights_key("hot", data)
    store.blobs.get_delay_s = 0.3  # a slow backend: all 100 requests arrive during the one read
    results = await asyncio.gather(*(store.fetch("hot", 1) for _ in range(100)))
    assert all(fetched == data for _, fetched in results)
    assert store.blobs.num_gets[key] == 1
    await store.fetch("hot", 1)
    assert store.blobs.num_gets[key] == 1  # served from the host tier


@in_session_loop
async def test_corrupted_object_is_data_loss(store, request):
    config_json, data = make_adapter()
    await store.push("fragile", config_json, data)
    corrupted = bytearray(data)
    corrupted[-1] ^= 0xFF
    if store.config.is_s3:  # overwrite the object directly in the bucket
        s3 = request.getfixturevalue("seaweedfs_s3")
        key = store.config.s3_prefix + weights_key("fragile", data)
        s3.client().put_object(Bucket=s3.bucket, Key=key, Body=bytes(corrupted))
    else:
        (store.config.file_root / weights_key("fragile", data)).write_bytes(corrupted)
    for _ in range(2):  # never cached: the second read fails the same way
        details = await expect_error(grpc.StatusCode.DATA_LOSS, store.fetch("fragile", 1))
        assert "fragile" in details and "sha256" in details


@in_session_loop
async def test_replicas_share_one_blob_store(store):
    other = await Store(store.config).start()
    try:
        config_json, data = make_adapter()
        await store.push("shared-bot", config_json, data)
        assert (await other.fetch("shared-bot", 1))[1] == data  # unknown name: re-read at once
        _, data2 = make_adapter(seed=3)
        assert (await other.push("shared-bot", config_json, data2)).version == 2
        assert (await store.fetch("shared-bot", 2))[1] == data2  # unknown version: re-read
    finally:
        await other.stop()


@in_session_loop
async def test_missing_weights_is_data_loss(file_store):
    config_json, data = make_adapter()
    await file_store.push("gone", config_json, data)
    (file_store.config.file_root / weights_key("gone", data)).unlink()
    details = await expect_error(grpc.StatusCode.DATA_LOSS, file_store.fetch("gone", 1))
    assert "missing" in details


@in_session_loop
async def test_missing_bucket_is_unavailable(seaweedfs_s3):
    config = StoreConfig(url="s3://no-such-bucket/x", s3_endpoint_url=seaweedfs_s3.endpoint_url)
    with pytest.raises(Unavailable, match="no-such-bucket"):
        await open_blob_store(config)


@in_session_loop
async def test_tenants_see_own_and_public(file_store):
    config_json, data = make_adapter()
    await file_store.push("alice-bot", config_json, data, owner="alice")
    await file_store.push("bob-bot", config_json, data, owner="bob")
    await file_store.push("shared", config_json, data)

    async def names(tenant):
        listed = await file_store.stub.ListAdapters(pb.ListAdaptersRequest(tenant=tenant))
        return [a.info.name for a in listed.adapters]

    assert await names("alice") == ["alice-bot", "shared"]
    assert await names("bob") == ["bob-bot", "shared"]
    assert await names("") == ["alice-bot", "bob-bot", "shared"]

    get = file_store.stub.GetAdapter
    assert (await get(pb.GetAdapterRequest(name="alice-bot", tenant="alice"))).version == 1
    assert (await get(pb.GetAdapterRequest(name="shared", tenant="bob"))).is_public
    hidden = await expect_error(grpc.StatusCode.NOT_FOUND, get(
        pb.GetAdapterRequest(name="alice-bot", tenant="bob")))
    hidden_v1 = await expect_error(grpc.StatusCode.NOT_FOUND, get(
        pb.GetAdapterRequest(name="alice-bot", version=1, tenant="bob")))
    missing = await expect_error(grpc.StatusCode.NOT_FOUND, get(
        pb.GetAdapterRequest(name="nobody-bot", tenant="bob")))
    assert hidden == hidden_v1 == missing.replace("nobody-bot", "alice-bot")
    # A name belongs to its first owner.
    await expect_error(grpc.StatusCode.ALREADY_EXISTS,
                       file_store.push("alice-bot", config_json, data, owner="bob"))


@in_session_loop
async def test_target_modules_string_and_rank_pattern(file_store):
    tensors = lora_tensors(targets=("q_proj", "v_proj", "down_proj"), rank=8,
                           ranks={"layers.0.v_proj": 4, "layers.1.v_proj": 4,
                                  "layers.1.q_proj": 16})
    config_json = lora_config(targets=(), rank=8, use_rslora=True,
                              target_modules=r".*\.(q_proj|v_proj|down_proj)",
                              rank_pattern={"v_proj": 4, "layers.1.self_attn.q_proj": 16})
    info = await file_store.push("patterned", config_json, safetensors.torch.save(tensors))
    assert info.rank == 16 and info.use_rslora
    assert list(info.target_modules) == ["down_proj", "q_proj", "v_proj"]


@in_session_loop
async def test_rank_pattern_takes_the_first_matching_key_as_peft_and_executors_do(file_store):
    """PEFT gives a module the rank of the first rank_pattern key that matches it, even when a
    later key names it exactly: with {"q_proj": 4, "model.layers.1.self_attn.q_proj": 16} every
    q_proj has rank 4. The store must check the same ranks the executor's parse computes."""
    config_json = lora_config(targets=("q_proj",), rank=8, rank_pattern={
        "q_proj": 4, "model.layers.1.self_attn.q_proj": 16})
    as_peft = lora_tensors(targets=("q_proj",), ranks={"layers.0.q_proj": 4, "layers.1.q_proj": 4})
    info = await file_store.push("first-key", config_json, safetensors.torch.save(as_peft))
    assert info.version == 1
    weights = parse_peft_adapter(config_json, safetensors.torch.save(as_peft),
                                 ModelConfig.named("tiny"), check_base_model=False)
    assert {w.a.shape[0] for w in weights.modules.values()} == {4}
    exact_wins = lora_tensors(targets=("q_proj",), ranks={"layers.0.q_proj": 4,
                                                          "layers.1.q_proj": 16})
    details = await expect_error(grpc.StatusCode.INVALID_ARGUMENT, file_store.push(
        "first-key", config_json, safetensors.torch.save(exact_wins)))
    assert "rank 16 differs from 4" in details


@in_session_loop
async def test_a_rank_pattern_naming_no_module_of_the_adapter_counts_for_neither_store_nor_executor(
        tmp_path):
    """An adapter's rank is the largest its tensors use (AdapterLayout.rank), for the store and
    executors alike: r 8 with rank_pattern {"nonexistent_proj": 64} is rank 8, accepted and
    recorded as 8 by a store of max rank 8 and loaded by an executor of max rank 8 (the store
    recorded 64 and refused it before). A module whose tensors do use 16 is over both limits."""
    store = await Store(dataclasses.replace(file_config(tmp_path), max_rank=8)).start()
    try:
        config_json = lora_config(rank=8, rank_pattern={"nonexistent_proj": 64})
        data = safetensors.torch.save(lora_tensors(rank=8))
        assert (await store.push("unmatched", config_json, data)).rank == 8
        assert parse_peft_adapter(config_json, data, ModelConfig.named("tiny"), max_rank=8,
                                  check_base_model=False).modules
        over_json = lora_config(rank=8, rank_pattern={"v_proj": 16})
        over = safetensors.torch.save(lora_tensors(rank=8, ranks={"layers.0.v_proj": 16,
                                                                  "layers.1.v_proj": 16}))
        details = await expect_error(grpc.StatusCode.INVALID_ARGUMENT,
                                     store.push("over", over_json, over))
        assert "rank 16 (the largest its tensors use) exceeds this store's maximum 8" in details
        with pytest.raises(InvalidArgument, match="rank 16 exceeds the executor's max rank 8"):
            parse_peft_adapter(over_json, over, ModelConfig.named("tiny"), max_rank=8,
                               check_base_model=False)
    finally:
        await store.stop()


def test_config_validation():
    with pytest.raises(ValueError, match="file:///absolute/dir"):
        StoreConfig(url="file://relative/dir")
    with pytest.raises(ValueError, match="bucket"):
        StoreConfig(url="s3://B_ad/x")
    env = {"LORAPLEX_STORE_URL": "s3://bucket/pre/fix", "LORAPLEX_HOST_CACHE_MB": "2"}
    config = StoreConfig.from_env(env, address="0.0.0.0:9000")
    assert (config.s3_bucket, config.s3_prefix) == ("bucket", "pre/fix/")
    assert config.host_cache_bytes == 2 * 1024 * 1024 and config.address == "0.0.0.0:9000"
    with pytest.raises(ValueError, match="LORAPLEX_HOST_CACHE_MB"):
        StoreConfig.from_env({"LORAPLEX_HOST_CACHE_MB": "lots"})
    assert StoreConfig.from_env({"LORAPLEX_MAX_ADAPTER_MB": "3"}).max_adapter_bytes == 3 * 2**20
    assert parse_args(["--max-adapter-mb", "5"], environ={
        "LORAPLEX_MAX_ADAPTER_MB": "3"}).max_adapter_bytes == 5 * 2**20  # the flag wins


@in_session_loop
async def test_subprocess_entry_point_and_sigterm(tmp_path):
    url = (tmp_path / "store").as_uri()
    process = subprocess.Popen(
        [sys.executable, "-m", "adapter_store.service", "--url", url, "--port", "0",
         "--host-cache-mb", "16"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(process.stdout.readline), 30)
        assert line.startswith("adapter_store listening on 127.0.0.1:"), line
        address = line.split()[-1]
        async with insecure_channel(address) as channel:
            stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
            listed = await stub.ListAdapters(pb.ListAdaptersRequest())
            assert not listed.adapters
        process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(process.wait, 15) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
