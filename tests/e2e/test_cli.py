"""The `loraplex` command as an operator types it (a subprocess, keys from a file or
$LORAPLEX_API_KEY) against a keyed fleet of real services: `admin stats|prewarm|evict|drain|resume`,
`adapters push|stats|base add`, `generate`. What is checked is what a person reads: answers in
plain lines ending in a newline, and every failure as one `error: CODE: ...` line on stderr with
a nonzero exit status, never a traceback."""

import os
import re
import socket
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.launch import Fleet, FleetKeys, start_service
from protos import adapter_store_pb2, scheduler_pb2

TENANT_KEY = "cli-test-tenant-key-0001"
KEYS = FleetKeys(tenants={TENANT_KEY: "acme"})
ERROR_LINE = re.compile(r"^error: [A-Z_]+: .+\n$")  # all of stderr: one line


@pytest.fixture(scope="module")
def fleet(tiny, tmp_path_factory, log_dir):
    store = tmp_path_factory.mktemp("store").as_uri()
    with Fleet(model=tiny["model_dir"], store_url=store, log_dir=log_dir / "cli",
               executor_args=["--adapter-slots", "4", "--threads", "1"], keys=KEYS) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def admin_key_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("cli-keys") / "admin-key"
    path.touch(mode=0o600)
    path.write_text(KEYS.admin + "\n")
    return str(path)


def loraplex(*args: str, key: str = "") -> subprocess.CompletedProcess:
    """Run the CLI; `key` goes in $LORAPLEX_API_KEY (the other way: --api-key-file in args)."""
    env = {k: v for k, v in os.environ.items() if k != "LORAPLEX_API_KEY"}
    if key:
        env["LORAPLEX_API_KEY"] = key
    return subprocess.run([sys.executable, "-m", "loraplex.cli", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def ok(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("\n") and "Traceback" not in done.stderr
    return done.stdout


def refused(done: subprocess.CompletedProcess, code: str) -> str:
    """The one error line of a failed command, checked to carry `code`."""
    assert done.returncode != 0, done.stdout
    assert ERROR_LINE.match(done.stderr), done.stderr
    assert done.stderr.startswith(f"error: {code}: "), done.stderr
    return done.stderr


@pytest.fixture(scope="module")
def pushed(fleet, tiny, admin_key_file) -> None:
    """r4_attn serves requests; r8_mlp only ever gets pre-warmed (its load is the prewarm's)."""
    for name in ("r4_attn", "r8_mlp"):
        out = ok(loraplex("adapters", "push", tiny["adapters"][name]["path"], "--name", name,
                          "--store", fleet.stores[0], "--api-key-file", admin_key_file))
        assert out.startswith(f"registered {name}@1 ")


def protobuf_text(out: str, *messages) -> list[str]:
    """The fields of `messages` that `out` shows in protobuf text format ("name: 1", "name {")."""
    names = {f.name for m in messages for f in m.DESCRIPTOR.fields}
    return [n for n in names if re.search(rf"\b{n}(: | {{)", out)]


def executor(fleet) -> str:
    return fleet.by_name("executor")[0].address


def admin(fleet, admin_key_file, *args: str) -> subprocess.CompletedProcess:
    return loraplex("admin", *args, "--scheduler", fleet.scheduler,
                    "--api-key-file", admin_key_file)


def slot_lines(stats: str, adapter: str) -> list[str]:
    return [line for line in stats.splitlines() if line.lstrip().startswith("slot ")
            and f" {adapter} " in line]


def test_admin_stats_shows_executors_and_tenants(fleet, pushed, admin_key_file):
    ok(loraplex("generate", "--adapter", "r4_attn", "hello there", "--max-new-tokens", "3",
                "--scheduler", fleet.scheduler, key=TENANT_KEY))
    stats = ok(admin(fleet, admin_key_file, "stats"))
    assert re.search(rf"^{re.escape(executor(fleet))} +up +", stats, re.M), stats
    assert re.search(r"^acme +0 +0 +1 ", stats, re.M), "acme: nothing queued or running, 1 request"
    assert not protobuf_text(stats, scheduler_pb2.StatsResponse, scheduler_pb2.ExecutorStats,
                             scheduler_pb2.SlotStats, scheduler_pb2.TenantStats)

    as_tenant = ok(loraplex("admin", "stats", "--scheduler", fleet.scheduler, key=TENANT_KEY))
    assert "acme" in as_tenant and executor(fleet) not in as_tenant, "a tenant sees its own only"


def test_prewarm_wait_then_evict(fleet, pushed, admin_key_file):
    assert not slot_lines(ok(admin(fleet, admin_key_file, "stats")), "r8_mlp@1")
    out = ok(admin(fleet, admin_key_file, "prewarm", "r8_mlp", "--pin", "--wait"))
    assert out == f"r8_mlp@1 ready on {executor(fleet)}, pinned until evicted\n"
    (slot,) = slot_lines(ok(admin(fleet, admin_key_file, "stats")), "r8_mlp@1")
    assert " ready " in slot and "pinned by an admin" in slot

    out = ok(admin(fleet, admin_key_file, "evict", "r8_mlp"))
    assert out == "evicted r8_mlp: 1 slot freed\n"
    assert not slot_lines(ok(admin(fleet, admin_key_file, "stats")), "r8_mlp@1")
    out = ok(admin(fleet, admin_key_file, "evict", "r8_mlp", "--executor", executor(fleet)))
    assert out == f"r8_mlp is not resident on {executor(fleet)}: nothing evicted\n"


@pytest.mark.parametrize("command", [["prewarm", "r4_attn"], ["evict", "r4_attn"],
                                     ["drain", "127.0.0.1:1"], ["resume", "127.0.0.1:1"]])
def test_admin_commands_refuse_a_tenant_key(fleet, pushed, command):
    done = loraplex("admin", *command, "--scheduler", fleet.scheduler, key=TENANT_KEY)
    assert "admin" in refused(done, "PERMISSION_DENIED")
    assert not done.stdout


def test_admin_commands_without_a_key_are_unauthenticated(fleet):
    refused(loraplex("admin", "stats", "--scheduler", fleet.scheduler), "UNAUTHENTICATED")


def test_drain_then_resume(fleet, pushed, admin_key_file):
    address = executor(fleet)
    out = ok(admin(fleet, admin_key_file, "drain", address))
    assert out == f"drained {address}: admits nothing new, nothing runs there\n"
    stats = ok(admin(fleet, admin_key_file, "stats"))
    assert re.search(rf"^{re.escape(address)} +(draining|drained) ", stats, re.M), stats

    assert ok(admin(fleet, admin_key_file, "resume", address)).startswith(f"resumed {address}: ")
    stats = ok(admin(fleet, admin_key_file, "stats"))
    assert re.search(rf"^{re.escape(address)} +up ", stats, re.M), stats
    assert address in refused(admin(fleet, admin_key_file, "drain", "127.0.0.1:1"), "NOT_FOUND")


def test_unreachable_scheduler_and_unreadable_key_file_are_one_line(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    refused(loraplex("--wait-s", "1", "admin", "stats", "--scheduler", f"127.0.0.1:{port}",
                     key=TENANT_KEY), "UNAVAILABLE")
    refused(loraplex("--wait-s", "0", "admin", "stats", "--scheduler", f"127.0.0.1:{port}",
                     key=TENANT_KEY), "UNAVAILABLE")  # (the call itself, not waited for)
    done = loraplex("--wait-s", "0", "admin", "stats", "--api-key-file", str(tmp_path / "missing"))
    assert done.returncode != 0 and done.stderr.startswith("error: ") and \
        done.stderr.count("\n") == 1 and "missing" in done.stderr, done.stderr


def test_adapters_stats_reads_as_lines(fleet, pushed, admin_key_file):
    out = ok(loraplex("adapters", "stats", "--store", fleet.stores[0],
                      "--api-key-file", admin_key_file))
    assert out.startswith("blob store       file://")
    assert re.search(r"^registry +names 2, versions 2$", out, re.M), out
    assert not protobuf_text(out, adapter_store_pb2.StoreStatsResponse)


def test_push_error_starts_on_its_own_line(fleet, tiny, admin_key_file, tmp_path):
    """The store refuses non-finite weights once they are uploaded: after the progress bar."""
    folder = tmp_path / "nan_adapter"
    folder.mkdir()
    source = tiny["adapters"]["r8_mlp"]["path"]
    (folder / "adapter_config.json").write_text(open(f"{source}/adapter_config.json").read())
    tensors = load_file(f"{source}/adapter_model.safetensors")
    first = sorted(tensors)[0]
    tensors[first] = tensors[first].clone()
    tensors[first].view(-1)[0] = torch.nan
    save_file(tensors, folder / "adapter_model.safetensors", metadata={"format": "pt"})

    done = loraplex("adapters", "push", str(folder), "--name", "nan_adapter",
                    "--store", fleet.stores[0], "--api-key-file", admin_key_file)
    assert done.returncode != 0
    progress, error = done.stderr.rsplit("\n", 2)[:2]
    assert "uploading [" in progress and progress.endswith(" MiB"), done.stderr
    assert ERROR_LINE.match(error + "\n") and error.startswith("error: INVALID_ARGUMENT: "), \
        done.stderr


def test_base_add_registers_a_base_model(fleet, tiny, admin_key_file):
    out = ok(loraplex("adapters", "base", "add", tiny["model_dir"], "--id", tiny["model_id"],
                      "--store", fleet.stores[0], "--api-key-file", admin_key_file))
    assert out.startswith(f"registered base model {tiny['model_id']} (4 layers, ")


def test_a_command_right_after_up_waits_for_the_service_to_come_up(tiny, tmp_path, log_dir):
    """`loraplex up &` then at once `loraplex adapters push ...`: the command waits (--wait-s)
    for the store to report SERVING, then pushes; with nothing coming up it ends UNAVAILABLE
    once --wait-s has passed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    waiting = subprocess.Popen(
        [sys.executable, "-m", "loraplex.cli", "--wait-s", "120", "adapters", "push",
         tiny["adapters"]["r4_attn"]["path"], "--name", "early", "--store", address],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        store = start_service("adapter_store-early", "adapter_store.service",
                              ["--url", tmp_path.as_uri(), "--address", address],
                              log_dir / "cli-wait")
        try:
            out, err = waiting.communicate(timeout=120)
            assert waiting.returncode == 0, err
            assert "early@1" in out
        finally:
            store.stop()
    finally:
        waiting.kill()
    started = time.monotonic()
    done = loraplex("--wait-s", "1", "adapters", "list", "--store", address)
    refused(done, "UNAVAILABLE")
    assert "nothing serving" in done.stderr and time.monotonic() - started < 30
