"""Bad input on the adapter store's RPCs that the other store tests do not cover: names with a
trailing newline, JSON nested or numbered past what the parser takes, regexes that backtrack for
ever, malformed residency reports, oversized or unreadable Register sources, and edge values
(version 2^32-1, NaN ttl, odd shapes) that already come back with the right status."""

import asyncio
import dataclasses
import json
import math
import os
import uuid

import grpc
import pytest
import safetensors.torch

from adapter_store.config import StoreConfig
from common.peft import patterns as module_patterns
from protos import adapter_store_pb2 as pb
from protos import common_pb2
from tests.store.helpers import (
    WEIGHTS,
    Store,
    call_rpc,
    expect_error,
    file_config,
    in_session_loop,
    lora_config,
    lora_tensors,
    make_adapter,
)

INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
CONFIG_JSON, DATA = make_adapter()
MAX_U32 = 2**32 - 1
DEEP_JSON = "[" * 100_000 + "]" * 100_000
TINY_BASE = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
             "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}


@pytest.fixture
async def store(tmp_path):
    """A file store holding "bot" (public) and "secret" (tenant acme's, alias prod)."""
    store = await Store(file_config(tmp_path)).start()
    await store.push("bot", CONFIG_JSON, DATA)
    await store.push("secret", CONFIG_JSON, DATA, owner="acme")
    await store.stub.SetAlias(pb.SetAliasRequest(name="secret", alias="prod", version=1,
                                                 tenant="acme"))
    yield store
    await store.stop()


def _safetensors(header: dict, data_section: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data_section


def _base(model_id: str = "m", **fields) -> pb.RegisterBaseModelRequest:
    return pb.RegisterBaseModelRequest(model_id=model_id,
                                       config_json=json.dumps({**TINY_BASE, **fields}))


def _residency(*adapters: str, holder: str = "exec-1", ttl: float = 0.0) -> pb.ResidencyReport:
    """A report of "name@version" entries, split at the last "@" (no check: bad ones are sent)."""
    refs = [common_pb2.AdapterRef(name=a.rpartition("@")[0], version=int(a.rpartition("@")[2]))
            for a in adapters]
    return pb.ResidencyReport(holder=holder, adapters=refs, ttl_seconds=ttl)


# Inputs refused with INVALID_ARGUMENT: (rpc, request, words the message must contain).
BAD_RPCS = {
    # A trailing newline passed the name/alias/holder/model-id patterns ("$" matches before it):
    # it made adapters/bot\n/ a second adapter that lists as "bot", and leases/exec-1\n.json.
    "name-newline": ("GetAdapter", pb.GetAdapterRequest(name="bot\n"), ["adapter name 'bot\\n'"]),
    "alias-newline": ("SetAlias", pb.SetAliasRequest(name="bot", alias="prod\n", version=1),
                      ["alias 'prod\\n' is invalid"]),
    "get-alias-newline": ("GetAdapter", pb.GetAdapterRequest(name="bot", alias="prod\n"),
                          ["alias 'prod\\n' is invalid"]),
    "holder-newline": ("ReportResidency", _residency("bot@1", holder="exec-1\n"),
                       ["holder 'exec-1\\n'"]),
    "base-id-newline": ("RegisterBaseModel", _base("org/m\n"), ["base model id 'org/m\\n'"]),
    # Residency entries were stored unchecked: a malformed one pinned nothing, silently.
    "residency-version-0": ("ReportResidency", _residency("bot@1", "bot@0"),
                            ["adapters[1]", "version 0"]),
    "residency-bad-name": ("ReportResidency", _residency("a/b@1"), ["adapters[0]", "'a/b'"]),
    "residency-empty-entry": ("ReportResidency", _residency("@0"), ["adapters[0]"]),
    "residency-newline": ("ReportResidency", _residency("bot\n@1"), ["'bot\\n'"]),
    # JSON the parser gives up on: RecursionError (INTERNAL) or a message naming no field.
    "base-deep-json": ("RegisterBaseModel", pb.RegisterBaseModelRequest(
        model_id="m", config_json=DEEP_JSON), ["config.json", "nested too deeply"]),
    "base-huge-int": ("RegisterBaseModel", pb.RegisterBaseModelRequest(
        model_id="m", config_json='{"hidden_size": 1' + "0" * 5000 + "}"),
        ["config.json", "not valid JSON", "digits"]),
    "base-kv-heads-bool": ("RegisterBaseModel", _base(num_key_value_heads=True),
                           ["num_key_value_heads"]),
    # Already refused as they should be.
    "base-not-object": ("RegisterBaseModel", pb.RegisterBaseModelRequest(
        model_id="m", config_json="[1]"), ["must be a JSON object"]),
    "base-nan": ("RegisterBaseModel", pb.RegisterBaseModelRequest(
        model_id="m", config_json=json.dumps({**TINY_BASE, "hidden_size": math.nan})),
        ["hidden_size"]),
    "base-missing-field": ("RegisterBaseModel", pb.RegisterBaseModelRequest(
        model_id="m", config_json=json.dumps({"model_type": "llama"})), ["hidden_size"]),
    "base-float-heads": ("RegisterBaseModel", _base(num_key_value_heads=1.5),
                         ["num_key_value_heads"]),
    "holder-empty": ("ReportResidency", _residency("bot@1", holder=""), ["holder ''"]),
    "holder-long": ("ReportResidency", _residency("bot@1", holder="h" * 201), ["holder"]),
    "ttl-nan": ("ReportResidency", _residency("bot@1", ttl=math.nan), ["ttl_seconds"]),
    "ttl-inf": ("ReportResidency", _residency("bot@1", ttl=math.inf), ["ttl_seconds"]),
    "ttl-huge": ("ReportResidency", _residency("bot@1", ttl=1e300), ["ttl_seconds"]),
    "register-no-bucket": ("Register", pb.RegisterRequest(name="bot", source_uri="s3://"),
                           ["file:// URIs under"]),
    "register-outside-root": ("Register", pb.RegisterRequest(name="bot",
                                                             source_uri="file:///etc"),
                              ["file:// URIs under"]),
    "fetch-bad-name": ("Fetch", pb.FetchRequest(adapter=common_pb2.AdapterRef(
        name="../x", version=1)), ["adapter name"]),
}


@pytest.mark.parametrize("case", BAD_RPCS)
@in_session_loop
async def test_bad_input_is_invalid_argument_naming_the_field(store, case):
    method, request, words = BAD_RPCS[case]
    details = await expect_error(INVALID, call_rpc(store.stub, method, request, timeout=20))
    for word in words:
        assert word in details, details


V_A0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
# Pushes refused with INVALID_ARGUMENT: (config_json, weights, words the message must contain).
BAD_PUSHES = {
    # Deep but under the config's size bound (a bigger one is refused for its size).
    "config-deep-json": ("[" * 30_000 + "]" * 30_000, DATA,
                         ["adapter_config.json", "nested too deeply"]),
    "config-too-large": ('{"r": 8, "notes": "' + "x" * 70_000 + '"}', DATA,
                         ["adapter_config.json", "over 65536 bytes"]),
    "config-huge-int": ('{"r": 1' + "0" * 5000 + "}", DATA, ["adapter_config.json", "digits"]),
    "header-deep-json": (CONFIG_JSON, len(DEEP_JSON).to_bytes(8, "little") + DEEP_JSON.encode(),
                         ["adapter_model.safetensors", "nested too deeply"]),
    # Catastrophic backtracking: these ran for ever with the GIL held, freezing the whole store.
    "target-modules-redos": (lora_config(targets=(), target_modules="(.*.*)*x"), DATA,
                             ["target_modules regex"]),
    "rank-pattern-redos": (lora_config(rank_pattern={"(.*.*)*y": 4}), DATA,
                           ["rank_pattern keys"]),
    "alpha-pattern-redos": (lora_config(alpha_pattern={"(.|.)*y": 4}), DATA,
                            ["alpha_pattern keys"]),
    "alpha-pattern-not-a-regex": (lora_config(alpha_pattern={"(": 4}), DATA,
                                  ["alpha_pattern key '('", "not a valid regex"]),
    "target-modules-huge-repeat": (lora_config(targets=(), target_modules="a{99999999999}"),
                                   DATA, ["target_modules regex", "not a valid regex"]),
    # Compiles alone, not as PEFT matches it ("(.*\.)?(KEY)$"): was INTERNAL from the child.
    "rank-pattern-inline-flag": (lora_config(rank_pattern={"(?i)v_proj": 4}), DATA,
                                 ["rank_pattern keys '(?i)v_proj', matched as",
                                  "not a valid regex"]),
    # Already refused as they should be.
    "header-length-2^64-1": (CONFIG_JSON, (2**64 - 1).to_bytes(8, "little") + DATA[8:],
                             ["header length"]),
    "negative-dim": (CONFIG_JSON, _safetensors(
        {V_A0: {"dtype": "F32", "shape": [-1, 4], "data_offsets": [0, 16]}}, bytes(16)),
        ["invalid shape"]),
    "huge-dims": (CONFIG_JSON, _safetensors(
        {V_A0: {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 16]}}, bytes(16)),
        ["longer than the file"]),
    "offsets-past-the-end": (CONFIG_JSON, _safetensors(
        {V_A0: {"dtype": "F32", "shape": [4], "data_offsets": [2**64 - 16, 2**64]}}, bytes(16)),
        ["outside"]),
    "offsets-reversed": (CONFIG_JSON, _safetensors(
        {V_A0: {"dtype": "F32", "shape": [0], "data_offsets": [16, 0]}}, bytes(16)),
        ["outside"]),
    "dtype-not-a-string": (CONFIG_JSON, _safetensors(
        {V_A0: {"dtype": ["F32"], "shape": [4], "data_offsets": [0, 16]}}, bytes(16)),
        ["unknown dtype"]),
    "integer-dtype": (CONFIG_JSON, _safetensors(
        {V_A0: {"dtype": "I32", "shape": [4], "data_offsets": [0, 16]}}, bytes(16)),
        ["dtype I32"]),
}


@pytest.mark.parametrize("case", BAD_PUSHES)
@in_session_loop
async def test_bad_push_is_invalid_argument_naming_the_field(store, case, monkeypatch):
    monkeypatch.setattr(module_patterns, "TIMEOUT_S", 0.5)  # the catastrophic ones wait it out
    config_json, data = BAD_PUSHES[case][:2]
    details = await expect_error(INVALID, asyncio.wait_for(
        store.push("pushed", config_json, data), timeout=20))
    for word in BAD_PUSHES[case][2]:
        assert word in details, details


@in_session_loop
async def test_a_trailing_newline_cannot_shadow_another_tenants_name(store):
    await expect_error(INVALID, store.push("secret\n", CONFIG_JSON, DATA, owner="globex"))
    listed = await store.stub.ListAdapters(pb.ListAdaptersRequest())
    assert [a.info.name for a in listed.adapters] == ["bot", "secret"]


@in_session_loop
async def test_residency_report_of_many_and_duplicate_entries_pins_them(store):
    refs = [f"bot@{v}" for v in range(1, 3001)] + ["bot@1", "secret@1"]
    ack = await store.stub.ReportResidency(_residency(*refs, ttl=60))
    assert ack.ttl_seconds == 60
    details = await expect_error(grpc.StatusCode.FAILED_PRECONDITION, store.stub.DeleteAdapter(
        pb.DeleteAdapterRequest(name="bot", version=1)))
    assert "exec-1" in details
    await store.stub.ReportResidency(_residency())  # releases all
    await store.stub.DeleteAdapter(pb.DeleteAdapterRequest(name="bot", version=1))


@in_session_loop
async def test_register_refuses_an_oversized_or_unreadable_file(tmp_path):
    """The source was read whole, however large (a 100 GB object filled the store's RAM), and a
    file the store may not read was INTERNAL."""
    config = dataclasses.replace(file_config(tmp_path), max_adapter_bytes=len(DATA) - 1)
    store = await Store(config).start()
    try:
        folder = config.file_root / "incoming" / "big"
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text(CONFIG_JSON)
        (folder / WEIGHTS).write_bytes(DATA)
        details = await expect_error(INVALID, store.stub.Register(pb.RegisterRequest(
            name="big", source_uri=folder.as_uri())))
        assert WEIGHTS in details and f"{len(DATA) - 1}-byte limit" in details, details
        details = await expect_error(INVALID, store.push("big", CONFIG_JSON, DATA))
        assert f"{len(DATA) - 1}-byte push limit" in details, details
        missing = await expect_error(NOT_FOUND, store.stub.Register(pb.RegisterRequest(
            name="big", source_uri=folder.as_uri() + "-nothing")))
        assert "adapter_config.json" in missing
        if os.geteuid() != 0:  # root reads anything
            (folder / WEIGHTS).write_bytes(DATA[:100])
            (folder / WEIGHTS).chmod(0)
            details = await expect_error(grpc.StatusCode.PERMISSION_DENIED, store.stub.Register(
                pb.RegisterRequest(name="big", source_uri=folder.as_uri())))
            assert WEIGHTS in details, details
    finally:
        await store.stop()


@in_session_loop
async def test_register_from_a_missing_bucket_or_an_oversized_s3_object(seaweedfs_s3):
    config = StoreConfig(url=f"s3://{seaweedfs_s3.bucket}/{uuid.uuid4().hex}",
                         s3_endpoint_url=seaweedfs_s3.endpoint_url,
                         max_adapter_bytes=len(DATA) - 1)
    store = await Store(config).start()
    try:
        bucket = f"no-such-bucket-{uuid.uuid4().hex[:8]}"
        details = await expect_error(NOT_FOUND, store.stub.Register(pb.RegisterRequest(
            name="reg", source_uri=f"s3://{bucket}/folder")))
        assert bucket in details, details
        prefix = f"incoming/{uuid.uuid4().hex}"
        s3 = seaweedfs_s3.client()
        s3.put_object(Bucket=seaweedfs_s3.bucket, Key=f"{prefix}/adapter_config.json",
                      Body=CONFIG_JSON.encode())
        s3.put_object(Bucket=seaweedfs_s3.bucket, Key=f"{prefix}/{WEIGHTS}", Body=DATA)
        details = await expect_error(INVALID, store.stub.Register(pb.RegisterRequest(
            name="reg", source_uri=f"s3://{seaweedfs_s3.bucket}/{prefix}")))
        assert WEIGHTS in details and f"{len(DATA) - 1}-byte limit" in details, details
    finally:
        await store.stop()


@in_session_loop
async def test_edge_versions_and_other_tenants_names_are_not_found_alike(store):
    """Version 2^32-1 and names another tenant owns: NOT_FOUND, in the same words as a name that
    does not exist (no hint that a private adapter is there)."""
    get = store.stub.GetAdapter
    assert "no version 4294967295" in await expect_error(NOT_FOUND, get(
        pb.GetAdapterRequest(name="bot", version=MAX_U32)))
    for method, request in [
            ("GetAdapter", pb.GetAdapterRequest(name="{}", version=MAX_U32, tenant="globex")),
            ("GetAdapter", pb.GetAdapterRequest(name="{}", alias="prod", tenant="globex")),
            ("GetAdapter", pb.GetAdapterRequest(name="{}", alias="nope", tenant="globex")),
            ("DescribeAdapter", pb.GetAdapterRequest(name="{}", tenant="globex")),
            ("Prewarm", pb.HostPrewarmRequest(name="{}", version=MAX_U32, tenant="globex")),
            ("SetAlias", pb.SetAliasRequest(name="{}", alias="prod", version=0,
                                            tenant="globex")),
            ("SetAlias", pb.SetAliasRequest(name="{}", alias="prod", version=1, tenant="globex",
                                            expected_version=1)),
            ("DeleteAdapter", pb.DeleteAdapterRequest(name="{}", version=MAX_U32,
                                                      tenant="globex")),
            ("DeleteAdapter", pb.DeleteAdapterRequest(name="{}", tenant="globex"))]:
        answers = []
        for name in ("secret", "nothing"):
            request.name = name
            answers.append((await expect_error(NOT_FOUND, getattr(store.stub, method)(
                request))).replace(name, "NAME"))
        assert answers[0] == answers[1], (method, answers)
    listed = await store.stub.ListAdapters(pb.ListAdaptersRequest(tenant="globex",
                                                                  name="secret"))
    assert not listed.adapters
    assert (await get(pb.GetAdapterRequest(name="secret", alias="prod"))).version == 1


@in_session_loop
async def test_lookups_of_unknown_names_leave_no_state_behind(store):
    registry = store.running.registry
    before = len(registry._indexes)
    for i in range(200):
        await expect_error(NOT_FOUND, store.stub.GetAdapter(pb.GetAdapterRequest(
            name=f"unknown-{i}", alias="prod", tenant="globex")))
    assert len(registry._indexes) == before


@in_session_loop
async def test_two_tenants_pushing_one_new_name_at_once(store):
    results = await asyncio.gather(
        *(store.push("contested", CONFIG_JSON, DATA, owner=tenant)
          for tenant in ("acme", "globex", "acme", "globex")), return_exceptions=True)
    owners = {r.owner_tenant for r in results if not isinstance(r, Exception)}
    errors = [r for r in results if isinstance(r, Exception)]
    assert len(owners) == 1 and len(errors) == 2, results
    assert all(e.code() == grpc.StatusCode.ALREADY_EXISTS for e in errors)
    (winner,) = owners
    loser = ({"acme", "globex"} - owners).pop()
    listed = await store.stub.ListAdapters(pb.ListAdaptersRequest(tenant=loser,
                                                                  name="contested"))
    assert not listed.adapters
    versions = await store.stub.ListAdapters(pb.ListAdaptersRequest(
        tenant=winner, name="contested", all_versions=True))
    assert [a.info.version for a in versions.adapters] == [1, 2]


@in_session_loop
async def test_patterns_still_match_after_the_regex_guard(store):
    tensors = lora_tensors(targets=("q_proj", "v_proj"), ranks={"layers.1.v_proj": 4})
    config_json = lora_config(targets=(), target_modules=r".*\.(q_proj|v_proj)",
                              rank_pattern={r"layers\.1\.self_attn\.v_proj": 4})
    info = await store.push("patterned", config_json, safetensors.torch.save(tensors))
    assert list(info.target_modules) == ["q_proj", "v_proj"]
