"""The CLI where a newcomer trips (issue 46), against a keyed fleet of real services with a gateway:
pointed at the wrong port (the gateway's HTTP, another kind of service, nothing), no key, a rank
above the pool's, deleting a resident adapter, output piped into `head`, a folder that is not an
adapter, a new version pushed, an executor drained. Each failure is one `error:` line that says
what is there or what to do."""

import asyncio
import os
import re
import socket
import subprocess
import sys
import threading

import grpc
import pytest

from loraplex import client
from loraplex.launch import Fleet, FleetKeys, start_gateway
from protos import (
    adapter_store_pb2,
    adapter_store_pb2_grpc,
    executor_pb2,
    executor_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from tests.e2e.test_cli import ok, refused

TENANT_KEY = "cli-trips-tenant-key-0001"
KEYS = FleetKeys(tenants={TENANT_KEY: "acme"})
REPEATS = 40  # client-streaming refusals per kind (a race lost 3 times in 16 before the fix)


@pytest.fixture(scope="module")
def fleet(tiny, tmp_path_factory, log_dir):
    store = tmp_path_factory.mktemp("trips-store").as_uri()
    with Fleet(model=tiny["model_dir"], store_url=store, log_dir=log_dir / "cli-trips",
               executor_args=["--adapter-slots", "4", "--threads", "1"], keys=KEYS) as fleet:
        fleet.services.append(start_gateway({tiny["model_id"]: [fleet.scheduler]},
                                            fleet.stores, fleet.log_dir, KEYS))
        yield fleet


@pytest.fixture(scope="module")
def admin_key_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("trips-keys") / "admin-key"
    path.touch(mode=0o600)
    path.write_text(KEYS.admin + "\n")
    return str(path)


def loraplex(*args: str, key: str = "", timeout: float = 120,
             **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "LORAPLEX_API_KEY"}
    if key:
        env["LORAPLEX_API_KEY"] = key
    return subprocess.run([sys.executable, "-m", "loraplex.cli", *args], text=True, env=env,
                          timeout=timeout, **{"capture_output": True, **kwargs})


def address_of(fleet, name: str) -> str:
    return fleet.by_name(name)[0].address


def test_generate_at_the_gateways_http_port_says_so_at_once(fleet):
    """Trip 8: no silent wait of --wait-s: the HTTP server found is named (bounded by the
    subprocess's timeout, well under the 60 s it used to wait)."""
    http = fleet.by_name("gateway")[0].announced["gateway-http"]
    done = loraplex("generate", "hi", "--scheduler", http, key=TENANT_KEY, timeout=40)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"error: {http} answers HTTP/1, not gRPC"), done.stderr
    assert "--scheduler" in done.stderr


def test_a_wait_says_what_it_waits_for(fleet):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    done = loraplex("--wait-s", "4", "adapters", "list", "--store", address)
    waiting, error = done.stderr.splitlines()
    assert waiting.startswith(f"waiting for an adapter store to serve at {address}"), waiting
    assert error.startswith("error: UNAVAILABLE: nothing serving at"), error


def test_a_frozen_service_is_told_from_an_absent_one():
    """A process that takes connections and never answers (a service stopped with SIGSTOP: the
    kernel still accepts) is named as such after --wait-s, not taken for nothing running."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        address = f"127.0.0.1:{s.getsockname()[1]}"
        done = loraplex("--wait-s", "3", "adapters", "list", "--store", address)
    error = done.stderr.splitlines()[-1]
    assert done.returncode == 1 and error.startswith(
        f"error: DEADLINE_EXCEEDED: a process at {address} takes connections but did not "
        "answer within 3s"), error


def test_a_command_at_another_service_names_what_is_there(fleet, admin_key_file, tiny):
    """Trip 8: `Method not found!` becomes which service answered."""
    error = refused(loraplex("generate", "hi", "--scheduler", fleet.stores[0], key=TENANT_KEY),
                    "UNIMPLEMENTED")
    assert "this address serves an adapter store" in error, error
    error = refused(loraplex("adapters", "push", tiny["adapters"]["r4_attn"]["path"], "--name",
                             "x", "--store", fleet.scheduler, "--api-key-file", admin_key_file),
                    "UNIMPLEMENTED")
    assert "this address serves a scheduler" in error, error
    error = refused(loraplex("adapters", "list", "--store", address_of(fleet, "executor"),
                             "--api-key-file", admin_key_file), "UNIMPLEMENTED")
    assert "this address serves an executor" in error, error


def test_client_streaming_refusals_arrive_as_themselves(fleet, tiny):
    """Trip 8: a Push refused before the store reads it (no key; a scheduler's port) is that
    refusal every time, never INTERNAL "Internal error from Core" (grpc's Python client, when the
    call ended while its first message was being sent)."""
    folder = tiny["adapters"]["r4_attn"]["path"]
    header = adapter_store_pb2.PushHeader(
        name="race", config_json=open(f"{folder}/adapter_config.json").read(),
        weights_filename="adapter_model.safetensors", num_bytes=1 << 20)

    async def push_many(address: str) -> list[str]:
        codes = []
        async with grpc.aio.insecure_channel(address) as channel:
            stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
            for _ in range(REPEATS):
                try:
                    await client.push(stub, header, bytes(1 << 20))
                    codes.append("OK")
                except grpc.aio.AioRpcError as err:
                    codes.append(err.code().name)
        return codes

    assert set(asyncio.run(push_many(fleet.stores[0]))) == {"UNAUTHENTICATED"}
    assert set(asyncio.run(push_many(fleet.scheduler))) == {"UNIMPLEMENTED"}


def test_bidirectional_stream_refusals_arrive_as_themselves(fleet):
    """As the client-streaming ones: a scheduler's Stream and an executor's Step without a key,
    the first message sent (and the stream held open, or closed at once), are UNAUTHENTICATED
    every time, never INTERNAL."""
    async def open_many(address: str, stub_class, method: str, message) -> set[str]:
        codes = set()
        async with grpc.aio.insecure_channel(address) as channel:
            stub = stub_class(channel)
            for i in range(REPEATS):
                async def held_open():
                    yield message
                    await asyncio.sleep(0.5)

                try:
                    async for _ in getattr(stub, method)(held_open() if i % 2 else iter([message])):
                        pass
                    codes.add("OK")
                except grpc.aio.AioRpcError as err:
                    codes.add(err.code().name)
        return codes

    assert asyncio.run(open_many(fleet.scheduler, scheduler_pb2_grpc.SchedulerStub, "Stream",
                                 scheduler_pb2.StreamRequest())) == {"UNAUTHENTICATED"}
    assert asyncio.run(open_many(address_of(fleet, "executor"), executor_pb2_grpc.ExecutorStub,
                                 "Step", executor_pb2.StepRequest())) == {"UNAUTHENTICATED"}


def test_no_key_tells_a_cli_user_where_the_key_goes(fleet, tmp_path):
    """Trip 9: not "send 'authorization: Bearer <key>'", but the CLI's own ways."""
    error = refused(loraplex("adapters", "list", "--store", fleet.stores[0]), "UNAUTHENTICATED")
    assert "LORAPLEX_API_KEY" in error and "--api-key-file" in error and "Bearer" not in error
    error = refused(loraplex("adapters", "list", "--store", fleet.stores[0],
                             key="not-a-key-of-this-fleet-0001"), "UNAUTHENTICATED")
    assert "$LORAPLEX_API_KEY is not one this service knows" in error, error
    error = refused(loraplex("admin", "drain", "127.0.0.1:1", "--scheduler", fleet.scheduler,
                             key=TENANT_KEY), "PERMISSION_DENIED")
    assert "needs an admin key" in error and "is a tenant key" in error, error


@pytest.fixture(scope="module")
def served(fleet, tiny, admin_key_file):
    """r4_attn pushed (public) and served once, so it is resident."""
    ok(loraplex("adapters", "push", tiny["adapters"]["r4_attn"]["path"], "--name", "r4_attn",
                "--store", fleet.stores[0], "--api-key-file", admin_key_file))
    ok(loraplex("generate", "--adapter", "r4_attn", "hello", "--max-new-tokens", "2",
                "--scheduler", fleet.scheduler, key=TENANT_KEY))


def test_a_rank_above_the_pools_names_the_flag_that_raises_it(fleet, tiny, admin_key_file):
    """Trip 10 (this store takes rank 64, the pool's executors 32; under `loraplex up` the store
    refuses it at push: tests/e2e/test_up.py)."""
    ok(loraplex("adapters", "push", tiny["adapters"]["r64"]["path"], "--name", "r64",
                "--store", fleet.stores[0], "--api-key-file", admin_key_file))
    error = refused(loraplex("generate", "--adapter", "r64", "hi", "--scheduler",
                             fleet.scheduler, key=TENANT_KEY), "INVALID_ARGUMENT")
    assert "above this pool's maximum 32" in error and "--max-rank 64" in error, error


def test_deleting_a_resident_adapter_names_the_executor_and_the_evict(fleet, served,
                                                                     admin_key_file):
    """Trip 12: the executor's host:port, and the command that unloads it."""
    error = refused(loraplex("adapters", "rm", "r4_attn@1", "--store", fleet.stores[0],
                             "--api-key-file", admin_key_file), "FAILED_PRECONDITION")
    port = address_of(fleet, "executor").rsplit(":", 1)[1]
    assert f"resident on {socket.gethostname()}:{port} (executor host:port)" in error, error
    assert "loraplex admin evict r4_attn@1" in error, error


def test_piping_into_a_reader_that_stops_is_quiet(fleet, served, admin_key_file):
    """Trip 15: `loraplex ... | head -0` prints nothing on stderr ("[Errno 32] Broken pipe")."""
    read, write = os.pipe()
    os.close(read)  # (a reader that is already gone: every write is a broken pipe)
    with os.fdopen(write, "w") as closed:
        done = loraplex("adapters", "list", "--store", fleet.stores[0], "--api-key-file",
                        admin_key_file, stdout=closed, stderr=subprocess.PIPE,
                        capture_output=False)
    assert done.stderr == "" and done.returncode == 141, done.stderr


def test_pushing_a_folder_that_is_not_an_adapter_says_so(fleet, tmp_path, admin_key_file):
    """Trip 17: not a raw "[Errno 2] No such file or directory"."""
    (tmp_path / "notes.txt").write_text("not an adapter")
    for folder in (tmp_path, tmp_path / "missing"):
        done = loraplex("adapters", "push", str(folder), "--name", "x", "--store",
                        fleet.stores[0], "--api-key-file", admin_key_file)
        assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
        assert "Errno" not in done.stderr and ("PEFT adapter" in done.stderr), done.stderr


def test_a_new_version_pushed_says_when_a_name_serves_it(fleet, tiny, admin_key_file):
    """Trip 17: a name's resolution is reused ~1 s: the push says so, and how to have it now."""
    out = ok(loraplex("adapters", "push", tiny["adapters"]["r8_mlp"]["path"], "--name", "bot",
                      "--store", fleet.stores[0], "--api-key-file", admin_key_file))
    assert "note:" not in out, "a first version replaces nothing"
    out = ok(loraplex("adapters", "push", tiny["adapters"]["r4_attn"]["path"], "--name", "bot",
                      "--store", fleet.stores[0], "--api-key-file", admin_key_file))
    assert re.search(r"^note: requests naming bot get bot@2 within 1 s.*name bot@2", out, re.M)


def test_generate_says_why_it_waits_when_every_executor_is_drained(fleet, admin_key_file):
    """Trip 17: a word on stderr after a few seconds without a token; resumed, the request is
    served. (A tenant key sees no executors: the word says where to look. Open, as `loraplex up`
    runs, it names the drained executor: tests/e2e/test_up.py.)"""
    executor = address_of(fleet, "executor")
    admin = ["--scheduler", fleet.scheduler, "--api-key-file", admin_key_file]
    ok(loraplex("admin", "drain", executor, *admin))
    said = waited_for(["generate", "hello", "--max-new-tokens", "2", "--scheduler",
                       fleet.scheduler], {"LORAPLEX_API_KEY": TENANT_KEY},
                      then=lambda: ok(loraplex("admin", "resume", executor, *admin)))
    assert said.startswith("no token after ") and "queued at the scheduler" in said, said
    assert "loraplex admin stats" in said


def waited_for(args: list[str], env: dict[str, str], then) -> str:
    """The first stderr line of `loraplex ARGS` (waiting for it at most 60 s), after which `then()`
    runs; the command must then succeed."""
    waiting = subprocess.Popen([sys.executable, "-m", "loraplex.cli", *args],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **env})
    said = []
    reader = threading.Thread(target=lambda: said.append(waiting.stderr.readline()), daemon=True)
    reader.start()
    try:
        reader.join(60)  # (the notice comes after cli.FIRST_TOKEN_NOTICE_S)
    finally:
        then()
    out, _ = waiting.communicate(timeout=120)
    assert waiting.returncode == 0 and out.endswith("\n"), out
    assert said, "nothing said on stderr within 60 s"
    return said[0]


@pytest.mark.parametrize("args, words", [
    (("rm", "r4_attn@1", "--all-versions"), "--all-versions deletes every version of r4_attn"),
    (("alias", "r4_attn@1", "prod", "--remove"), "--remove takes the adapter's NAME alone")])
def test_a_version_with_a_flag_for_every_version_is_refused_not_half_done(fleet, served,
                                                                          admin_key_file, args,
                                                                          words):
    """`rm NAME@1 --all-versions` deleted version 1 alone; `alias NAME@V A --remove` ignored V."""
    done = loraplex("adapters", *args, "--store", fleet.stores[0], "--api-key-file",
                    admin_key_file)
    assert done.returncode != 0 and words in done.stderr, done.stderr
    listed = loraplex("adapters", "list", "--store", fleet.stores[0], "--api-key-file",
                      admin_key_file)
    assert "r4_attn" in listed.stdout, listed.stdout
