"""The adapter store's authorization matrix: every RPC x {no key, tenant A, tenant B, service,
admin}. The tenant comes from the key, never from a request field: a tenant sees, pushes, moves
and deletes its own adapters and reads public ones; services fetch, resolve, warm the host tier
and report residency; admins do everything, across tenants."""

import json

import grpc
import pytest

from adapter_store.service import start_store
from common.adapter_ref import AdapterRef
from common.credentials import KeyRing
from common.registry_client import RegistryClient
from common.server import insecure_channel
from loraplex import client
from protos import adapter_store_pb2 as pb
from protos import adapter_store_pb2_grpc, common_pb2
from tests.store.helpers import WEIGHTS, file_config, make_adapter

KEYS = {"none": "", "a": "key-of-tenant-acme-0001", "b": "key-of-tenant-globex-001",
        "service": "service-key-000000000001", "admin": "admin-key-00000000000001"}
OK = grpc.StatusCode.OK
UNAUTH = grpc.StatusCode.UNAUTHENTICATED
DENIED = grpc.StatusCode.PERMISSION_DENIED
NOT_FOUND = grpc.StatusCode.NOT_FOUND
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
CONFIG, DATA = make_adapter()
CALLERS = ("none", "a", "b", "service", "admin")
TINY_BASE = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
             "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4}


def ref(name: str, version: int) -> common_pb2.AdapterRef:
    return common_pb2.AdapterRef(name=name, version=version)


@pytest.fixture
async def world(tmp_path):
    """A store with keys; tenant acme owns 'a-bot' (v1, v2), 'pub' is public."""
    keys = KeyRing({KEYS["a"]: "acme", KEYS["b"]: "globex"}, [KEYS["admin"]], [KEYS["service"]])
    running = await start_store(file_config(tmp_path), keys=keys)
    channels = {who: insecure_channel(running.address, key) for who, key in KEYS.items()}
    stubs = {who: adapter_store_pb2_grpc.AdapterStoreStub(c) for who, c in channels.items()}
    for _ in range(2):
        await push(stubs["a"], "a-bot")
    await push(stubs["admin"], "pub")
    folder = running.config.file_root / "incoming"
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(CONFIG)
    (folder / WEIGHTS).write_bytes(DATA)
    yield stubs, folder.as_uri()
    for channel in channels.values():
        await channel.close()
    await running.stop(grace=1.0)


async def push(stub, name: str, owner: str = "") -> common_pb2.AdapterInfo:
    header = pb.PushHeader(name=name, owner_tenant=owner, config_json=CONFIG,
                           weights_filename=WEIGHTS, num_bytes=len(DATA))
    return await client.push(stub, header, DATA)


async def code_of(awaitable) -> grpc.StatusCode:
    try:
        result = await awaitable
        if isinstance(result, grpc.StatusCode):  # (first_answer's)
            return result
        if hasattr(result, "__aiter__"):
            [_ async for _ in result]
    except grpc.aio.AioRpcError as err:
        return err.code()
    return OK


async def first_answer(call) -> grpc.StatusCode:
    """The status of a GetAdapters call's first answer (an error of the call raises)."""
    code = (await call).answers[0].error_code
    return next(c for c in grpc.StatusCode if c.value[0] == code)


async def fetch(stub, name, version):
    return [m async for m in stub.Fetch(pb.FetchRequest(adapter=ref(name, version)))]


# rpc -> (call(stub, who, register source), expected code per caller in CALLERS order). Each
# call leaves the store as it found it (or changes only what the caller itself made), so rows
# are independent.
MATRIX = {
    "GetAdapter own": (lambda s, w, src: s.GetAdapter(pb.GetAdapterRequest(name="a-bot")),
                       (UNAUTH, OK, NOT_FOUND, OK, OK)),
    "GetAdapter public": (lambda s, w, src: s.GetAdapter(pb.GetAdapterRequest(name="pub")),
                          (UNAUTH, OK, OK, OK, OK)),
    "GetAdapter for acme": (lambda s, w, src: s.GetAdapter(pb.GetAdapterRequest(name="a-bot",
                                                                           tenant="acme")),
                            (UNAUTH, OK, DENIED, OK, OK)),
    "GetAdapters own": (lambda s, w, src: first_answer(s.GetAdapters(pb.GetAdaptersRequest(
        queries=[pb.GetAdapterRequest(name="a-bot")]))), (UNAUTH, OK, NOT_FOUND, OK, OK)),
    "GetAdapters for acme": (lambda s, w, src: first_answer(s.GetAdapters(pb.GetAdaptersRequest(
        queries=[pb.GetAdapterRequest(name="a-bot", tenant="acme")]))),
        (UNAUTH, OK, DENIED, OK, OK)),
    "DescribeAdapter": (lambda s, w, src: s.DescribeAdapter(pb.GetAdapterRequest(name="a-bot")),
                        (UNAUTH, OK, NOT_FOUND, OK, OK)),
    "ListAdapters": (lambda s, w, src: s.ListAdapters(pb.ListAdaptersRequest()),
                     (UNAUTH, OK, OK, OK, OK)),
    "Push": (lambda s, w, src: push(s, f"new-{w}"), (UNAUTH, OK, OK, DENIED, OK)),
    "Push as acme": (lambda s, w, src: push(s, f"for-acme-{w}", owner="acme"),
                     (UNAUTH, OK, DENIED, DENIED, OK)),
    "Register": (lambda s, w, src: s.Register(pb.RegisterRequest(name=f"reg-{w}", source_uri=src)),
                 (UNAUTH, DENIED, DENIED, DENIED, OK)),  # reads with the store's credentials
    "SetAlias own": (lambda s, w, src: s.SetAlias(pb.SetAliasRequest(name="a-bot", alias="prod",
                                                                version=2)),
                     (UNAUTH, OK, NOT_FOUND, DENIED, OK)),
    "SetAlias public": (lambda s, w, src: s.SetAlias(pb.SetAliasRequest(name="pub", alias="prod",
                                                                   version=1)),
                        (UNAUTH, PRECONDITION, PRECONDITION, DENIED, OK)),
    "DeleteAdapter own": (lambda s, w, src: s.DeleteAdapter(pb.DeleteAdapterRequest(name="a-bot",
                                                                                version=99)),
                          (UNAUTH, NOT_FOUND, NOT_FOUND, DENIED, NOT_FOUND)),
    "Fetch": (lambda s, w, src: fetch(s, "a-bot", 1), (UNAUTH, DENIED, DENIED, OK, OK)),
    # The host tier's RAM is shared by every tenant: services and operators decide what is in it.
    "Prewarm": (lambda s, w, src: s.Prewarm(pb.HostPrewarmRequest(name="a-bot", version=1)),
                (UNAUTH, DENIED, DENIED, OK, OK)),
    "Prewarm public": (lambda s, w, src: s.Prewarm(pb.HostPrewarmRequest(name="pub")),
                       (UNAUTH, DENIED, DENIED, OK, OK)),
    "Prewarm for acme": (lambda s, w, src: s.Prewarm(pb.HostPrewarmRequest(name="a-bot",
                                                                          tenant="acme")),
                         (UNAUTH, DENIED, DENIED, OK, OK)),
    "Stats": (lambda s, w, src: s.Stats(pb.StoreStatsRequest()), (UNAUTH, DENIED, DENIED, OK, OK)),
    "RegisterBaseModel": (lambda s, w, src: s.RegisterBaseModel(pb.RegisterBaseModelRequest(
        model_id="tiny-llama", config_json=json.dumps(TINY_BASE))),
        (UNAUTH, DENIED, DENIED, DENIED, OK)),
    "GetBaseModel": (lambda s, w, src: s.GetBaseModel(pb.GetBaseModelRequest(name="no-such-base")),
                     (UNAUTH, NOT_FOUND, NOT_FOUND, NOT_FOUND, NOT_FOUND)),
    "ListBaseModels": (lambda s, w, src: s.ListBaseModels(pb.ListBaseModelsRequest()),
                       (UNAUTH, OK, OK, OK, OK)),
    "ReportResidency": (lambda s, w, src: s.ReportResidency(pb.ResidencyReport(
        holder="exec-1", adapters=[ref("a-bot", 1)])), (UNAUTH, DENIED, DENIED, OK, OK)),
}


async def test_every_rpc_for_every_kind_of_caller(world):
    stubs, source = world
    wrong = []
    for rpc, (call, expected) in MATRIX.items():
        for who, want in zip(CALLERS, expected):
            got = await code_of(call(stubs[who], who, source))
            if got != want:
                wrong.append(f"{rpc} by {who}: {got.name}, expected {want.name}")
    assert not wrong, "\n".join(wrong)


async def test_the_schedulers_warm_with_its_service_key_fills_the_host_tier(tmp_path):
    """The scheduler warms a store's host tier through RegistryClient.warm, with its service key:
    that keeps working now that tenants may not Prewarm (a tenant's key warms nothing)."""
    keys = KeyRing({KEYS["a"]: "acme"}, [KEYS["admin"]], [KEYS["service"]])
    running = await start_store(file_config(tmp_path), keys=keys)
    try:
        async with insecure_channel(running.address, KEYS["a"]) as channel:
            stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
            info = await push(stub, "a-bot")
            assert (await code_of(stub.Prewarm(pb.HostPrewarmRequest(name="a-bot")))) == DENIED
        await RegistryClient((running.address,), KEYS["a"]).warm(AdapterRef("a-bot", 1))
        assert len(running.cache) == 0
        await RegistryClient((running.address,), KEYS["service"]).warm(AdapterRef("a-bot", 1))
        assert len(running.cache) == 1 and running.cache.num_bytes == info.num_bytes
    finally:
        await running.stop(grace=1.0)


async def test_tenants_see_their_own_and_public_adapters_only(world):
    stubs, _ = world
    names = {}
    for who in ("a", "b", "admin"):
        listed = await stubs[who].ListAdapters(pb.ListAdaptersRequest())
        names[who] = sorted(d.info.name for d in listed.adapters)
    assert names == {"a": ["a-bot", "pub"], "b": ["pub"], "admin": ["a-bot", "pub"]}
    # Tenant B naming tenant A in the request field gets nothing of A's.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stubs["b"].ListAdapters(pb.ListAdaptersRequest(tenant="acme"))
    assert err.value.code() == DENIED
    # Another tenant's adapter is NOT_FOUND with the very words of a missing one.
    texts = []
    for name in ("a-bot", "no-such-adapter"):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stubs["b"].GetAdapter(pb.GetAdapterRequest(name=name))
        texts.append(err.value.details().replace(name, "NAME"))
    assert texts[0] == texts[1]


async def test_a_push_is_owned_by_the_key_not_the_header(world):
    stubs, _ = world
    info = await push(stubs["b"], "globex-bot")
    assert (info.owner_tenant, info.is_public) == ("globex", False)
    admin_public = await push(stubs["admin"], "shared-bot")
    assert admin_public.is_public
    for_acme = await push(stubs["admin"], "made-for-acme", owner="acme")
    assert for_acme.owner_tenant == "acme"
    # A refused owner costs no upload: the header is refused before any chunk is sent.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await push(stubs["b"], "sneaky", owner="acme")
    assert err.value.code() == DENIED and "own tenant" in err.value.details()


async def test_a_wrong_key_is_unauthenticated_and_names_no_key(world, tmp_path):
    stubs, _ = world
    for bad in ("not-a-key", KEYS["a"] + "x"):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stubs["none"].GetAdapter(pb.GetAdapterRequest(name="pub"),
                                           metadata=(("authorization", f"Bearer {bad}"),))
        assert err.value.code() == UNAUTH and bad not in err.value.details()


async def test_tenants_are_not_shown_the_servers_model_paths(world):
    """A base model's names include the folder it was registered from (`loraplex up`'s, an
    operator's): a path on the servers' disks, which admins and services see and tenants not."""
    stubs, _ = world
    await stubs["admin"].RegisterBaseModel(pb.RegisterBaseModelRequest(
        model_id="org/tiny", config_json=json.dumps(TINY_BASE), fingerprint="1f" * 32,
        names=["/srv/models/tiny", "hf-org/tiny"]))
    for who, names in (("a", ["hf-org/tiny"]), ("service", ["/srv/models/tiny", "hf-org/tiny"]),
                       ("admin", ["/srv/models/tiny", "hf-org/tiny"])):
        (listed,) = (await stubs[who].ListBaseModels(pb.ListBaseModelsRequest())).base_models
        one = await stubs[who].GetBaseModel(pb.GetBaseModelRequest(name="org/tiny"))
        assert sorted(listed.names) == sorted(one.names) == names, who
