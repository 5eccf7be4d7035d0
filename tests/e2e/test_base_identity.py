"""Base models identified by fingerprint, end to end (issue 14: an adapter trained against a local
copy of the very model a pool serves was refused as "trained for another base").

Real processes with keys: a store; the fixture model registered from its folder under an id of its
own (`loraplex adapters base add`); a copy of the model in another folder under another name. An
adapter whose adapter_config.json names the copy's local path is pushed with the CLI, matched by
fingerprint (push and `adapters show` say so), and served by a pool whose two executors were
started from the original folder and from the copy, with no --model-id: each asked the store for
the id of its folder's fingerprint. An executor that could not ask keeps its folder's name and
still loads the adapter, by fingerprint. An adapter naming an unknown base, or a changed copy of
the model, is refused as before."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import grpc
import pytest

from common.adapter_pages import module_ranks, plan_pages
from common.base_fingerprint import base_fingerprint
from common.credentials import metadata
from common.page_geometry_pb import geometry_from_pb
from common.peft.config import parse_config
from common.peft.modules import LORA_MODULES
from common.server import insecure_channel
from loraplex import client
from loraplex.launch import FleetKeys, start_service
from protos import common_pb2, executor_pb2, executor_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

TENANT_KEY = "base-identity-tenant-key-0001"
KEYS = FleetKeys(tenants={TENANT_KEY: "acme"})
BASE_ID = "org/tiny-llama"
PROMPT = [5, 17, 42, 7]


def copy_model(src: str, dst) -> str:
    """A copy of the model folder, its config.json re-saved as another transformers would (no
    _name_or_path: the executor's own id for it is the folder's name)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.pop("_name_or_path", None)
    (dst / "config.json").write_text(json.dumps({**config, "transformers_version": "9.9.9"},
                                                indent=1))
    return str(dst)


def adapter_naming(src: str, dst, base: str) -> str:
    """A copy of a PEFT adapter folder whose base_model_name_or_path is `base`."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps(
        {**config, "base_model_name_or_path": base}, indent=1))
    return str(dst)


def loraplex(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "loraplex.cli", *args], capture_output=True,
                          text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "LORAPLEX_API_KEY"})
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def world(tiny, tmp_path_factory, log_dir):
    """Folders, a store with the base registered and the adapters pushed, and a pool of two
    executors (original folder, copy) behind a scheduler, plus a lone executor that never asked
    the store (--resolve-base-s 0)."""
    tmp = tmp_path_factory.mktemp("base-identity")
    logs = log_dir / "base_identity"
    flags = KEYS.write(logs / "keys")
    admin_key = logs / "keys" / "admin-key"
    admin_key.write_text(KEYS.admin + "\n")
    models = {"original": tiny["model_dir"],
              "copy": copy_model(tiny["model_dir"], tmp / "models" / "My-Local-Copy"),
              "changed": copy_model(tiny["model_dir"], tmp / "models" / "changed")}
    weights = tmp / "models" / "changed" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[8 + int.from_bytes(raw[:8], "little")] ^= 0x01  # the first weight byte of the first tensor
    weights.write_bytes(bytes(raw))
    r4 = tiny["adapters"]["r4_attn"]["path"]
    adapters = {"as-named": r4,  # names the fixture id, registered as a --name
                "via-copy": adapter_naming(r4, tmp / "adapters" / "via-copy", models["copy"]),
                "via-changed": adapter_naming(r4, tmp / "adapters" / "via-changed",
                                              models["changed"]),
                "other-base": tiny["adapters"]["other_base"]["path"]}
    services = []

    def start(name, module, args):
        services.append(start_service(name, module, args, logs))
        return services[-1]

    try:
        store = start("adapter_store", "adapter_store.service", [
            "--url", (tmp / "store").as_uri(), "--address", "127.0.0.1:0", *flags["store"]]).address
        as_admin = ["--store", store, "--api-key-file", str(admin_key)]
        registered = loraplex("adapters", "base", "add", models["original"], "--id", BASE_ID,
                              "--name", tiny["model_id"], *as_admin)
        pushed = {name: loraplex("adapters", "push", path, "--name", name, *as_admin)
                  for name, path in adapters.items()}
        shown = loraplex("adapters", "show", "via-copy", *as_admin)

        def executor(name, model, *extra):
            return start(name, "executor.service", [
                "--model", model, "--store", store, "--address", "127.0.0.1:0", "--threads", "1",
                "--adapter-slots", "2", *flags["executor"], *extra])

        pool = [executor("executor-original", models["original"]),
                executor("executor-copy", models["copy"])]
        lone = executor("executor-lone", models["copy"], "--resolve-base-s", "0")
        scheduler = start("scheduler", "scheduler.service", [
            "--address", "127.0.0.1:0", "--store", store, *flags["scheduler"],
            *(f for e in pool for f in ("--executor", e.address))]).address
        yield dict(models=models, adapters=adapters, store=store, registered=registered,
                   pushed=pushed,
                   shown=shown, pool=pool, lone=lone, scheduler=scheduler)
    finally:
        for service in reversed(services):
            service.stop()


async def executor_info(address: str) -> executor_pb2.InfoResponse:
    async with insecure_channel(address, KEYS.service) as channel:
        return await executor_pb2_grpc.ExecutorStub(channel).Info(executor_pb2.InfoRequest())


def test_registration_and_push_say_which_base_and_how(world, tiny):
    fingerprint = base_fingerprint(world["models"]["original"])
    assert base_fingerprint(world["models"]["copy"]) == fingerprint
    assert base_fingerprint(world["models"]["changed"]) != fingerprint
    assert world["registered"].startswith(f"registered base model {BASE_ID} (4 layers, ")
    assert f"fingerprint {fingerprint[:16]}..., names {tiny['model_id']})" in world["registered"]
    pushed, copy = world["pushed"], world["models"]["copy"]
    assert pushed["via-copy"].startswith("registered via-copy@1 ")
    assert (f"base {BASE_ID}: matched by fingerprint {fingerprint[:16]}... of the folder "
            f"{copy!r})") in pushed["via-copy"]
    assert f"base {BASE_ID}: matched by name {tiny['model_id']!r})" in pushed["as-named"]
    changed = world["models"]["changed"]
    assert f"base {changed}: not a registered base model)" in pushed["via-changed"]
    assert f"base {fingerprint[:4]}" not in pushed["via-changed"]
    base_line = next(line for line in world["shown"].splitlines() if "base " in line)
    assert base_line == (f"  base       {BASE_ID} (matched by fingerprint {fingerprint[:16]}... "
                         f"of the folder {copy!r})")


async def test_executors_from_either_folder_take_the_registered_id(world):
    fingerprint = base_fingerprint(world["models"]["original"])
    for service in world["pool"]:
        info = await executor_info(service.address)
        assert (info.model_id, info.base_fingerprint) == (BASE_ID, fingerprint)
        log = service.log_path.read_text()
        assert f"model id '{BASE_ID}', from the base model registered at " in log, log[-2000:]


async def test_the_pool_serves_the_adapter_from_both_folders(world):
    async with insecure_channel(world["scheduler"]) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        warmed = await stub.Prewarm(scheduler_pb2.PrewarmRequest(
            adapter="via-copy", num_executors=2, wait=True), metadata=metadata(KEYS.admin))
        assert sorted(warmed.executors) == sorted(e.address for e in world["pool"])
        answers = [await client.generate(stub, client.generate_request(
            name, PROMPT, max_new_tokens=8, ignore_eos=True), TENANT_KEY)
            for name in ("via-copy", "as-named", "")]
    via_copy, as_named, base = (a.token_ids for a in answers)
    assert len(via_copy) == 8 and via_copy == as_named != base  # the same weights, applied
    for service in world["pool"]:
        slots = (await executor_info(service.address)).slot_adapters
        assert common_pb2.AdapterRef(name="via-copy", version=1) in slots, service.name


@pytest.mark.parametrize("adapter, words", [
    ("other-base", "trained for base model 'other-org/other-base-model'"),
    ("via-changed", "trained for base model '{changed}'"),
])
async def test_unknown_or_changed_bases_are_refused_as_before(world, adapter, words):
    async with insecure_channel(world["scheduler"]) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.generate(stub, client.generate_request(adapter, PROMPT), TENANT_KEY)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert words.format(changed=world["models"]["changed"]) in err.value.details()
    assert f"this pool serves '{BASE_ID}'" in err.value.details()


def pages_for(info: executor_pb2.InfoResponse, folder: str) -> list[int]:
    """KV blocks for the weights of the adapter in `folder`, as a scheduler would give them (the
    highest: the executor holds no sequences)."""
    geometry = geometry_from_pb(info)
    config = parse_config((pathlib.Path(folder) / "adapter_config.json").read_text())
    needed = plan_pages(module_ranks(config, LORA_MODULES, geometry.num_layers),
                        geometry).num_pages
    return list(range(info.num_kv_blocks - needed, info.num_kv_blocks))


async def test_an_executor_that_never_asked_loads_it_by_fingerprint(world):
    lone = world["lone"]
    info = await executor_info(lone.address)
    fingerprint = base_fingerprint(world["models"]["copy"])
    assert (info.model_id, info.base_fingerprint) == ("My-Local-Copy", fingerprint)
    assert "model id 'My-Local-Copy', from the model folder (" in lone.log_path.read_text()
    async with insecure_channel(lone.address, KEYS.service) as channel:
        stub = executor_pb2_grpc.ExecutorStub(channel)
        loaded = await stub.LoadAdapter(executor_pb2.LoadAdapterRequest(
            adapter=common_pb2.AdapterRef(name="via-copy", version=1), slot=0,
            pages=pages_for(info, world["adapters"]["via-copy"])))
        assert loaded.num_bytes > 0
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.LoadAdapter(executor_pb2.LoadAdapterRequest(
                adapter=common_pb2.AdapterRef(name="via-changed", version=1), slot=1))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "this pool serves 'My-Local-Copy'" in err.value.details()
