"""Base models by fingerprint and names (adapter_store/base_models.py): a push is matched to a
registered base by the fingerprint of the folder its base_model_name_or_path names, then by id,
then by name; its base_model becomes the base's id and it says how it was matched. A real store
on local files; fingerprints stand in for folders here (tests/e2e/test_base_identity.py computes
them from real ones)."""

import dataclasses
import json

import grpc
import pytest
import safetensors.torch

from adapter_store.messages import record_to_pb
from adapter_store.records import AdapterRecord
from loraplex import client
from protos import adapter_store_pb2 as pb
from protos import common_pb2
from tests.store.helpers import HIDDEN, Store, expect_error, file_config, lora_config, lora_tensors

TINY_BASE = {"model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": 512,
             "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
FP, OTHER_FP = "1f" * 32, "2e" * 32
DATA = safetensors.torch.save(lora_tensors())
FAILED, INVALID, EXISTS, NOT_FOUND = (
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.NOT_FOUND)


def register(store, model_id="org/tiny", fingerprint=FP, names=("/models/tiny",), **config):
    return store.stub.RegisterBaseModel(pb.RegisterBaseModelRequest(
        model_id=model_id, config_json=json.dumps({**TINY_BASE, **config}),
        fingerprint=fingerprint, names=names))


def push(store, name, base_text, fingerprint="", data=DATA):
    return client.push(store.stub, pb.PushHeader(
        name=name, config_json=lora_config(base_model_name_or_path=base_text),
        weights_filename="adapter_model.safetensors", num_bytes=len(data),
        base_fingerprint=fingerprint), data)


@pytest.fixture
async def store(tmp_path):
    store = await Store(file_config(tmp_path)).start()
    await register(store)
    yield store
    await store.stop()


async def test_a_push_is_matched_by_fingerprint_then_id_then_name(store):
    cases = {  # adapter name: (base_model_name_or_path, pushed fingerprint, expected match)
        "by-fingerprint": ("/home/me/copy-of-tiny", FP, common_pb2.BASE_MATCH_FINGERPRINT),
        "by-id": ("org/tiny", "", common_pb2.BASE_MATCH_ID),
        "by-name": ("/models/tiny/", "", common_pb2.BASE_MATCH_NAME),
        "id-and-fingerprint": ("org/tiny", FP, common_pb2.BASE_MATCH_FINGERPRINT),
    }
    for name, (text, fingerprint, how) in cases.items():
        info = await push(store, name, text, fingerprint)
        assert (info.base_model, info.base_model_name_or_path, info.base_match,
                info.base_fingerprint) == ("org/tiny", text, how, FP), name
        described = await store.stub.DescribeAdapter(pb.GetAdapterRequest(name=name))
        assert described.info == info
        assert described.base_config_sha256  # checked against the registered config
    # Matched by fingerprint, it is still checked against the base's shapes.
    deep = safetensors.torch.save(lora_tensors(num_layers=3))
    details = await expect_error(FAILED, push(store, "deep", "/elsewhere", FP, data=deep))
    assert "layer 2 does not exist" in details


async def test_unregistered_bases_keep_their_text(store):
    for name, text, fingerprint in (("hub", "meta-llama/Llama-3.1-8B", ""),
                                    ("other-folder", "/home/me/other-model", OTHER_FP)):
        info = await push(store, name, text, fingerprint)
        assert (info.base_model, info.base_model_name_or_path, info.base_match,
                info.base_fingerprint) == (text, text, common_pb2.BASE_MATCH_UNREGISTERED, "")


async def test_a_registered_name_whose_folder_holds_another_model_is_refused(store):
    details = await expect_error(FAILED, push(store, "changed", "/models/tiny", OTHER_FP))
    assert "'/models/tiny' names base model 'org/tiny'" in details
    assert "holds another model" in details
    bad = await expect_error(INVALID, push(store, "bad", "org/tiny", "not-hex"))
    assert "base_fingerprint must be 64 lowercase hex digits" in bad


async def test_lookup_by_id_name_or_fingerprint(store):
    for request in (pb.GetBaseModelRequest(name="org/tiny"),
                    pb.GetBaseModelRequest(name="/models/tiny/"),
                    pb.GetBaseModelRequest(fingerprint=FP)):
        base = await store.stub.GetBaseModel(request)
        assert (base.model_id, base.fingerprint, list(base.names), base.num_layers) == (
            "org/tiny", FP, ["/models/tiny"], 2)
    missing = await expect_error(NOT_FOUND, store.stub.GetBaseModel(pb.GetBaseModelRequest(
        fingerprint=OTHER_FP)))
    assert "no registered base model has fingerprint" in missing
    await expect_error(INVALID, store.stub.GetBaseModel(pb.GetBaseModelRequest()))
    await expect_error(INVALID, store.stub.GetBaseModel(pb.GetBaseModelRequest(fingerprint="x")))
    listed = await store.stub.ListBaseModels(pb.ListBaseModelsRequest())
    assert [b.model_id for b in listed.base_models] == ["org/tiny"]


async def test_one_model_one_base_and_a_name_maps_to_one_base(store):
    same_model = await expect_error(EXISTS, register(store, "org/tiny-again", names=()))
    assert "registered as 'org/tiny'" in same_model
    await register(store, names=("/models/tiny", "hf/tiny"))
    for model_id, names in (("org/other", ("/models/tiny",)),  # another base's name
                            ("org/other", ("org/tiny",)),  # another base's id
                            ("hf/tiny", ())):  # an id that is another base's name
        taken = await expect_error(EXISTS, register(store, model_id, OTHER_FP, names))
        assert "is taken by base model 'org/tiny'" in taken, taken
    # Registering the same id again replaces it: new names, the old ones gone.
    base = await register(store, names=("hf/tiny", "hf/tiny/", "org/tiny"))
    assert list(base.names) == ["hf/tiny"]
    assert (await push(store, "renamed", "hf/tiny")).base_match == common_pb2.BASE_MATCH_NAME
    old = await push(store, "old-name", "/models/tiny")
    assert old.base_match == common_pb2.BASE_MATCH_UNREGISTERED
    bad = await expect_error(INVALID, register(store, "org/x", OTHER_FP, names=("a\nb",)))
    assert "printable" in bad


async def test_bases_survive_a_restart_and_require_base_model_uses_the_match(tmp_path):
    config = file_config(tmp_path)
    store = await Store(config).start()
    try:
        await register(store)
        await store.restart()
        assert (await store.stub.GetBaseModel(pb.GetBaseModelRequest(fingerprint=FP))).model_id \
            == "org/tiny"
    finally:
        await store.stop()
    strict = await Store(dataclasses.replace(config, require_base_model=True)).start()
    try:
        assert (await push(strict, "fits", "/any/copy", FP)).base_model == "org/tiny"
        details = await expect_error(FAILED, push(strict, "unknown", "/any/other", OTHER_FP))
        assert "'/any/other' is not registered" in details
    finally:
        await strict.stop()


def test_versions_pushed_before_matching_read_as_unspecified():
    old = {"name": "bot", "version": 1, "owner_tenant": "", "is_public": True,
           "base_model": "org/tiny", "rank": 8, "alpha": 16.0, "use_rslora": False,
           "target_modules": ["q_proj"], "num_bytes": 1, "sha256": "0" * 64,
           "created_unix": 0.0, "config_json": "{}"}
    info = record_to_pb(AdapterRecord.from_json(json.dumps(old)))
    assert (info.base_model, info.base_model_name_or_path, info.base_match,
            info.base_fingerprint) == ("org/tiny", "org/tiny", common_pb2.BASE_MATCH_UNSPECIFIED,
                                       "")

