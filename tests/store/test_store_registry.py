"""The registry against a real S3 server (SeaweedFS): metadata, versions under concurrent pushes
from two replicas, aliases (CAS, seen at once by every replica), deletion rules, tenant isolation
on every RPC, base-model checks, pre-warm and stats, and bad input through the real RPCs."""

import asyncio
import hashlib
import json
import math
import uuid

import grpc
import pytest
import safetensors.torch

from adapter_store.config import StoreConfig
from loraplex import client
from protos import adapter_store_pb2 as pb
from protos import common_pb2
from tests.store.helpers import (
    HIDDEN,
    Store,
    call_rpc,
    expect_error,
    in_session_loop,
    lora_config,
    lora_tensors,
    make_adapter,
)

TINY_BASE = {"model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": 512,
             "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
CONFIG_JSON, DATA = make_adapter()
NOT_FOUND, FAILED, INVALID = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
                              grpc.StatusCode.INVALID_ARGUMENT)


def s3_config(s3, **overrides) -> StoreConfig:
    return StoreConfig(url=f"s3://{s3.bucket}/{uuid.uuid4().hex}", chunk_bytes=64 * 1024,
                       s3_endpoint_url=s3.endpoint_url, **overrides)


@pytest.fixture
async def replicas(seaweedfs_s3):
    """Two store replicas sharing one S3 prefix."""
    config = s3_config(seaweedfs_s3)
    stores = [await Store(config).start(), await Store(config).start()]
    yield stores
    for store in stores:
        await store.stop()


def meta(**kw) -> pb.VersionMetadata:
    return pb.VersionMetadata(**kw)


async def push(store, name, owner="", data=DATA, config_json=CONFIG_JSON, **metadata):
    return await client.push(store.stub, pb.PushHeader(
        name=name, owner_tenant=owner, config_json=config_json,
        weights_filename="adapter_model.safetensors", num_bytes=len(data),
        metadata=meta(**metadata)), data)


@in_session_loop
async def test_metadata_round_trip_and_register_from_s3_prefix(replicas, seaweedfs_s3):
    a, b = replicas
    info = await push(a, "bot", "acme", training_dataset="tickets@2026-10-01",
                      eval_scores={"rougeL": 0.41, "exact": 0.5}, base_model_revision="abc123",
                      aliases=["staging"])
    details = await b.stub.DescribeAdapter(pb.GetAdapterRequest(name="bot", version=1))
    assert details.info == info
    assert (details.training_dataset, dict(details.eval_scores)) == (
        "tickets@2026-10-01", {"rougeL": 0.41, "exact": 0.5})
    assert (details.base_model_revision, details.dtype, details.source) == ("abc123", "F32",
                                                                             "upload")
    assert list(details.aliases) == ["staging"] and details.info.created_unix > 0
    fetched_info, fetched = await b.fetch("bot", 1)
    assert fetched == DATA and hashlib.sha256(fetched).hexdigest() == fetched_info.sha256

    # A PEFT folder written to S3 by a training job, registered in place.
    tensors = lora_tensors(rank=4, seed=5)
    config_json = lora_config(rank=4, rank_pattern={"v_proj": 4}, alpha_pattern={"q_proj": 8})
    prefix = f"incoming/{uuid.uuid4().hex}"
    s3 = seaweedfs_s3.client()
    s3.put_object(Bucket=seaweedfs_s3.bucket, Key=f"{prefix}/adapter_config.json",
                  Body=config_json.encode())
    weights = safetensors.torch.save(tensors)
    s3.put_object(Bucket=seaweedfs_s3.bucket, Key=f"{prefix}/adapter_model.safetensors",
                  Body=weights)
    uri = f"s3://{seaweedfs_s3.bucket}/{prefix}"
    registered = await a.stub.Register(pb.RegisterRequest(name="bot", owner_tenant="acme",
                                                          source_uri=uri))
    assert registered.version == 2 and registered.rank == 4
    details = await a.stub.DescribeAdapter(pb.GetAdapterRequest(name="bot", version=2))
    assert details.source == uri + "/" and dict(details.alpha_pattern) == {"q_proj": 8.0}
    assert (await b.fetch("bot", 2))[1] == weights
    missing = await expect_error(NOT_FOUND, a.stub.Register(pb.RegisterRequest(
        name="bot", owner_tenant="acme", source_uri=f"s3://{seaweedfs_s3.bucket}/nothing-here")))
    assert "nothing-here" in missing


@in_session_loop
async def test_concurrent_pushes_on_two_replicas_get_distinct_versions(replicas):
    adapters = [make_adapter(seed=i) for i in range(8)]
    infos = await asyncio.gather(*(push(replicas[i % 2], "race", "acme", data=data)
                                   for i, (_, data) in enumerate(adapters)))
    assert sorted(i.version for i in infos) == list(range(1, 9))
    for info, (_, data) in zip(infos, adapters):  # each version holds the bytes of its push
        assert (await replicas[(info.version + 1) % 2].fetch("race", info.version))[1] == data
    # Two tenants racing for a new name: exactly one owns it.
    results = await asyncio.gather(push(replicas[0], "contested", "acme"),
                                   push(replicas[1], "contested", "globex"),
                                   return_exceptions=True)
    errors = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(errors) == 1 and errors[0].code() == grpc.StatusCode.ALREADY_EXISTS


@in_session_loop
async def test_aliases_move_atomically_and_are_seen_at_once_by_every_replica(replicas):
    a, b = replicas
    for seed in range(3):
        await push(a, "svc", "acme", data=make_adapter(seed=seed)[1])

    def alias_req(version, **kw):
        return pb.SetAliasRequest(name="svc", alias="prod", version=version, tenant="acme", **kw)

    async def resolve(store):
        return (await store.stub.GetAdapter(pb.GetAdapterRequest(
            name="svc", alias="prod", tenant="acme"))).version

    assert (await a.stub.SetAlias(alias_req(1))).previous_version == 0
    assert await resolve(b) == 1
    assert (await b.stub.SetAlias(alias_req(2))).previous_version == 1
    assert await resolve(a) == 2  # no refresh window: read fresh on every alias lookup
    # Compare-and-set from both replicas at once: exactly one move wins.
    results = await asyncio.gather(
        *(replicas[i % 2].stub.SetAlias(alias_req(3 if i % 2 else 1, expected_version=2))
          for i in range(10)), return_exceptions=True)
    winners = [r for r in results if not isinstance(r, Exception)]
    assert len(winners) == 1 and winners[0].previous_version == 2
    assert all(r.code() == FAILED for r in results if isinstance(r, Exception))
    assert await resolve(a) == await resolve(b) in (1, 3)
    await a.stub.SetAlias(alias_req(0))  # remove
    details = await expect_error(NOT_FOUND, b.stub.GetAdapter(pb.GetAdapterRequest(
        name="svc", alias="prod")))
    assert "no alias 'prod'" in details


@in_session_loop
async def test_delete_is_refused_while_aliased_or_resident_and_never_reuses_versions(replicas):
    a, b = replicas
    await push(a, "old", "acme")
    await push(a, "old", "acme", data=make_adapter(seed=1)[1])
    await a.fetch("old", 1)  # (replica a knows it, and holds it in its RAM tier)
    await a.stub.SetAlias(pb.SetAliasRequest(name="old", alias="prod", version=1, tenant="acme"))
    delete = pb.DeleteAdapterRequest(name="old", version=1, tenant="acme")
    assert "alias(es) prod" in await expect_error(FAILED, b.stub.DeleteAdapter(delete))
    await a.stub.SetAlias(pb.SetAliasRequest(name="old", alias="prod", version=2, tenant="acme"))
    await a.stub.ReportResidency(pb.ResidencyReport(
        holder="gpu-7", adapters=[common_pb2.AdapterRef(name="old", version=1)]))
    assert "resident on gpu-7" in await expect_error(FAILED, b.stub.DeleteAdapter(delete))
    await b.stub.ReportResidency(pb.ResidencyReport(holder="gpu-7", adapters=[]))
    assert list((await b.stub.DeleteAdapter(delete)).versions) == [1]
    for _ in range(100):  # replica a learns of it within its refresh period
        try:
            await a.fetch("old", 1)
        except grpc.aio.AioRpcError as err:
            assert err.code() == NOT_FOUND and "was deleted" in err.details()
            break
        await asyncio.sleep(0.1)
    else:
        pytest.fail("a version deleted on one replica is still served by the other after 10 s")
    assert (await a.fetch("old", 2))[1] == make_adapter(seed=1)[1]
    assert (await push(b, "old", "acme")).version == 3  # v1 is never reused
    listed = await a.stub.ListAdapters(pb.ListAdaptersRequest(name="old", all_versions=True))
    assert [d.info.version for d in listed.adapters] == [2, 3]
    await expect_error(NOT_FOUND, a.stub.SetAlias(  # cannot point an alias at a deleted version
        pb.SetAliasRequest(name="old", alias="prod", version=1, tenant="acme")))


@in_session_loop
async def test_listing_comes_in_pages_bounded_in_versions_and_bytes(replicas, monkeypatch):
    """(a listing of every version in one answer failed past gRPC's 64 MiB: 1,150 versions of
    a 60 KB config)"""
    from adapter_store import messages

    a, _ = replicas
    for _ in range(5):
        await push(a, "paged", "acme")
    every = pb.ListAdaptersRequest(name="paged", all_versions=True)

    async def pages(request) -> list[list[int]]:
        out = []
        while True:
            page = await a.stub.ListAdapters(request)
            out.append([d.info.version for d in page.adapters])
            if not page.next_page_token:
                return out
            request.page_token = page.next_page_token

    assert await pages(every) == [[1, 2, 3, 4, 5]]
    every.page_size = 2
    assert await pages(every) == [[1, 2], [3, 4], [5]]
    one = (await a.stub.ListAdapters(pb.ListAdaptersRequest(name="paged"))).adapters[0]
    monkeypatch.setattr(messages, "LIST_PAGE_BYTES", int(2.5 * one.ByteSize()))
    every.page_size, every.page_token = 0, ""
    assert await pages(every) == [[1, 2], [3, 4], [5]]
    every.page_token = "not a token"
    assert "page_token" in await expect_error(INVALID, a.stub.ListAdapters(every))


@in_session_loop
async def test_stats_count_the_names_that_have_a_live_version(replicas):
    """A name whose every version was deleted is no adapter in Stats (it was counted)."""
    a, _ = replicas
    before = await a.stub.Stats(pb.StoreStatsRequest())
    await push(a, "short-lived", "acme")
    during = await a.stub.Stats(pb.StoreStatsRequest())
    assert (during.num_adapters, during.num_versions) == (before.num_adapters + 1,
                                                          before.num_versions + 1)
    await a.stub.DeleteAdapter(pb.DeleteAdapterRequest(name="short-lived", version=1,
                                                       tenant="acme"))
    after = await a.stub.Stats(pb.StoreStatsRequest())
    assert (after.num_adapters, after.num_versions) == (before.num_adapters,
                                                        before.num_versions)


@in_session_loop
async def test_another_tenants_adapter_is_not_found_on_every_rpc(replicas):
    a, _ = replicas
    await push(a, "secret", "acme")
    await a.stub.SetAlias(pb.SetAliasRequest(name="secret", alias="prod", version=1,
                                             tenant="acme"))
    calls = {
        "get": a.stub.GetAdapter(pb.GetAdapterRequest(name="secret", tenant="globex")),
        "get-version": a.stub.GetAdapter(pb.GetAdapterRequest(name="secret", version=1,
                                                              tenant="globex")),
        "get-alias": a.stub.GetAdapter(pb.GetAdapterRequest(name="secret", alias="prod",
                                                            tenant="globex")),
        "describe": a.stub.DescribeAdapter(pb.GetAdapterRequest(name="secret", tenant="globex")),
        "prewarm": a.stub.Prewarm(pb.HostPrewarmRequest(name="secret", tenant="globex")),
        "alias": a.stub.SetAlias(pb.SetAliasRequest(name="secret", alias="x", version=1,
                                                    tenant="globex")),
        "delete": a.stub.DeleteAdapter(pb.DeleteAdapterRequest(name="secret", version=1,
                                                               tenant="globex")),
    }
    missing = await expect_error(NOT_FOUND, a.stub.GetAdapter(pb.GetAdapterRequest(
        name="nothing", tenant="globex")))
    for case, call in calls.items():
        details = await expect_error(NOT_FOUND, call)
        assert details == missing.replace("nothing", "secret"), case
    listed = await a.stub.ListAdapters(pb.ListAdaptersRequest(tenant="globex", name="secret"))
    assert not listed.adapters
    await expect_error(grpc.StatusCode.ALREADY_EXISTS, push(a, "secret", "globex"))


@in_session_loop
async def test_base_model_shapes_and_revision_are_checked_at_push(seaweedfs_s3):
    store = await Store(s3_config(seaweedfs_s3, require_base_model=True)).start()
    try:
        unknown = await expect_error(FAILED, push(store, "early"))
        assert "'tiny-llama' is not registered" in unknown
        base = await store.stub.RegisterBaseModel(pb.RegisterBaseModelRequest(
            model_id="tiny-llama", config_json=json.dumps(TINY_BASE), revision="r1"))
        assert base.num_layers == 2
        assert (await push(store, "fits")).version == 1
        details = await store.stub.DescribeAdapter(pb.GetAdapterRequest(name="fits"))
        assert details.base_model_revision == "r1"
        assert details.base_config_sha256 == base.config_sha256
        wide = json.dumps({**TINY_BASE, "hidden_size": 512, "num_attention_heads": 8})
        await store.stub.RegisterBaseModel(pb.RegisterBaseModelRequest(
            model_id="wide-llama", config_json=wide))
        shape = await expect_error(FAILED, push(store, "misfit", config_json=lora_config(
            base_model_name_or_path="wide-llama")))
        assert "layers.0.self_attn.q_proj.lora_A.weight" in shape and "512" in shape
        deep = await expect_error(FAILED, push(store, "deep", data=safetensors.torch.save(
            lora_tensors(num_layers=3))))
        assert "layer 2 does not exist" in deep
        revision = await expect_error(FAILED, push(store, "stale", config_json=lora_config(
            revision="r0")))
        assert "revision 'r0'" in revision and "'r1'" in revision
        bad = await expect_error(INVALID, store.stub.RegisterBaseModel(pb.RegisterBaseModelRequest(
            model_id="gpt", config_json=json.dumps({"model_type": "gpt2"}))))
        assert "model_type 'gpt2' is not supported" in bad
    finally:
        await store.stop()


@in_session_loop
async def test_prewarm_and_stats(replicas):
    a, b = replicas
    await push(a, "warm", "acme", aliases=["prod"])
    first = await b.stub.Prewarm(pb.HostPrewarmRequest(name="warm", alias="prod", tenant="acme"))
    assert not first.was_cached and first.info.version == 1 and first.seconds > 0
    again = await b.stub.Prewarm(pb.HostPrewarmRequest(name="warm", tenant="acme"))
    assert again.was_cached and again.seconds == 0
    await b.fetch("warm", 1)
    stats = await b.stub.Stats(pb.StoreStatsRequest())
    assert (stats.host_entries, stats.host_bytes, stats.blob_reads) == (1, len(DATA), 1)
    assert (stats.host_hits, stats.host_misses, stats.fetches) == (2, 1, 1)
    assert stats.num_adapters >= 1 and stats.blob_store.startswith("s3://")


BAD_RPCS = {
    # case: (method, request, code, words)
    "alias-with-version": ("GetAdapter", pb.GetAdapterRequest(name="bot", version=1, alias="prod"),
                           INVALID, ["version or an alias"]),
    "alias-bad-name": ("SetAlias", pb.SetAliasRequest(name="bot", alias="9lives", version=1),
                       INVALID, ["alias '9lives' is invalid"]),
    "alias-latest": ("SetAlias", pb.SetAliasRequest(name="bot", alias="latest", version=1),
                     INVALID, ["not 'latest'"]),
    "alias-missing-version": ("SetAlias", pb.SetAliasRequest(name="bot", alias="prod", version=9),
                              NOT_FOUND, ["no version 9"]),
    "delete-missing-version": ("DeleteAdapter", pb.DeleteAdapterRequest(name="bot", version=9),
                               NOT_FOUND, ["no version 9"]),
    "fetch-version-0": ("Fetch", pb.FetchRequest(adapter=common_pb2.AdapterRef(name="bot")),
                        INVALID, ["exact version"]),
    "register-no-uri": ("Register", pb.RegisterRequest(name="bot"), INVALID, ["source_uri"]),
    "register-not-s3": ("Register", pb.RegisterRequest(name="bot", source_uri="http://x/y"),
                        INVALID, ["s3://bucket/key"]),
    "register-bad-name": ("Register", pb.RegisterRequest(name="a b", source_uri="s3://b/k"),
                          INVALID, ["adapter name 'a b' is invalid"]),
    "register-bad-alias": ("Register", pb.RegisterRequest(
        name="bot", source_uri="s3://b/k", metadata=meta(aliases=["-x"])), INVALID, ["'-x'"]),
    "holder-bad": ("ReportResidency", pb.ResidencyReport(
        holder="a/b", adapters=[common_pb2.AdapterRef(name="bot", version=1)]),
                   INVALID, ["holder 'a/b'"]),
    "ttl-bad": ("ReportResidency", pb.ResidencyReport(holder="h", ttl_seconds=-1), INVALID,
                ["ttl_seconds"]),
    "base-bad-id": ("RegisterBaseModel", pb.RegisterBaseModelRequest(model_id="../x",
                                                                    config_json="{}"),
                    INVALID, ["base model id '../x'"]),
    "base-bad-json": ("RegisterBaseModel", pb.RegisterBaseModelRequest(model_id="m",
                                                                      config_json="{"),
                      INVALID, ["not valid JSON"]),
    "base-no-layers": ("RegisterBaseModel", pb.RegisterBaseModelRequest(
        model_id="m", config_json=json.dumps({**TINY_BASE, "num_hidden_layers": 0})),
        INVALID, ["num_hidden_layers"]),
}


@pytest.mark.parametrize("case", BAD_RPCS)
@in_session_loop
async def test_bad_rpc_input(replicas, case):
    a, _ = replicas
    if not (await a.stub.ListAdapters(pb.ListAdaptersRequest(name="bot"))).adapters:
        await push(a, "bot")
    method, request, code, words = BAD_RPCS[case]
    details = await expect_error(code, call_rpc(a.stub, method, request))
    for word in words:
        assert word in details, details


@pytest.mark.parametrize("case, metadata, config_json, words", [
    ("eval-nan", meta(eval_scores={"acc": math.nan}), CONFIG_JSON, ["eval score 'acc'"]),
    ("dataset-too-long", meta(training_dataset="x" * 300), CONFIG_JSON, ["training_dataset"]),
    ("revision-too-long", meta(base_model_revision="r" * 300), CONFIG_JSON,
     ["base_model_revision"]),
    ("eval-name-too-long", meta(eval_scores={"m" * 300: 1.0}), CONFIG_JSON, ["eval_scores key"]),
    ("too-many-evals", meta(eval_scores={f"m{i}": 1.0 for i in range(65)}), CONFIG_JSON,
     ["eval_scores has 65 entries"]),
    ("too-many-aliases", meta(aliases=[f"a{i}" for i in range(17)]), CONFIG_JSON,
     ["aliases has 17 entries"]),
    ("rank-above-store-max", meta(), lora_config(rank=512, rank_pattern={"q_proj": 1024}),
     ["rank 512", "maximum 256"]),
])
@in_session_loop
async def test_bad_push_metadata(replicas, case, metadata, config_json, words):
    details = await expect_error(INVALID, client.push(replicas[0].stub, pb.PushHeader(
        name="meta", config_json=config_json, weights_filename="adapter_model.safetensors",
        num_bytes=len(DATA), metadata=metadata), DATA))
    for word in words:
        assert word in details, details


@pytest.mark.parametrize("metadata, words", [
    (meta(eval_scores={"acc": math.inf}), "eval score 'acc'=inf must be named and finite"),
    (meta(eval_scores={"": 0.5}), "eval score ''=0.5 must be named"),
    (meta(training_dataset="tickets\x1b[2J"), "metadata.training_dataset"),
    (meta(eval_scores={"acc\nowner      mallory": 0.5}), "control character"),
    (meta(base_model_revision="main\x00"), "metadata.base_model_revision")])
@in_session_loop
async def test_push_metadata_is_refused_at_the_header_before_any_upload(replicas, metadata,
                                                                        words):
    """(no weights follow the header: a check made after the upload would see a short file)"""
    details = await expect_error(INVALID, client.push(replicas[0].stub, pb.PushHeader(
        name="meta", config_json=CONFIG_JSON, weights_filename="adapter_model.safetensors",
        num_bytes=len(DATA), metadata=metadata), b""))
    assert words in details, details


def _not_utf8(message) -> bytes:
    """`message` serialized with its "n-a-m-e" string's bytes made invalid UTF-8."""
    data = message.SerializeToString()
    assert data.count(b"n-a-m-e") == 1
    return data.replace(b"n-a-m-e", b"n\xff\xfe\xfdm-e")


@in_session_loop
async def test_a_request_that_does_not_decode_is_invalid_argument_naming_the_method(replicas):
    """A string field that is not UTF-8 does not decode (proto3): INVALID_ARGUMENT, on a unary
    call and on a streamed one (grpc's own answers were UNKNOWN and INTERNAL "this is a bug")."""
    channel = replicas[0].channel
    get = channel.unary_unary("/loraplex.v1.AdapterStore/GetAdapter")
    details = await expect_error(INVALID, get(_not_utf8(pb.GetAdapterRequest(name="n-a-m-e"))))
    assert "GetAdapter: the request is not a valid message" in details, details
    push = channel.stream_unary("/loraplex.v1.AdapterStore/Push")
    header = pb.PushRequest(header=pb.PushHeader(name="n-a-m-e", config_json=CONFIG_JSON,
                                                 weights_filename="adapter_model.safetensors",
                                                 num_bytes=len(DATA)))

    async def requests():
        yield _not_utf8(header)

    details = await expect_error(INVALID, push(requests()))
    assert "Push: the request is not a valid message" in details, details
    assert (await replicas[0].stub.ListAdapters(pb.ListAdaptersRequest())).adapters == []
