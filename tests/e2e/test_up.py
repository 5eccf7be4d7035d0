"""`loraplex up` as a newcomer meets it (issue 46): a model folder named `base` whose adapters name
it by path, a second `up` on the same ports, start-up errors, signals while it starts and once it
serves (SIGINT, SIGTERM, SIGHUP, SIGKILL), logs of one run at a time, the first fixture build.
Every check is on what the person sees (its output, exit status) and on what is left running."""

import json
import pathlib
import shutil
import signal
import subprocess
import time

import pytest

from loraplex.launch import ServiceFailed, start_service
from tests.e2e.local_up import (
    BIN,
    ROOT,
    free_base_port,
    kill_leftovers,
    processes_mentioning,
    read_until,
    start_up,
    stop,
    wait_gone,
    wait_serving,
)

DEMO = ROOT / "loraplex" / "demo_assets"


def loraplex(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "loraplex"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def adapter_for(folder: pathlib.Path, base_model: str) -> pathlib.Path:
    """The demo's reverse-words adapter, saying it was made for `base_model`."""
    shutil.copytree(DEMO / "adapters" / "reverse-words", folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(
        {**config, "base_model_name_or_path": base_model}))
    return folder


@pytest.fixture(scope="module")
def model_named_base(tmp_path_factory) -> pathlib.Path:
    """The demo model in a folder named `base`, as a fine-tuning script might save it."""
    folder = tmp_path_factory.mktemp("models") / "base"
    shutil.copytree(DEMO / "loraplex-demo-tiny", folder)
    return folder


@pytest.fixture(scope="module")
def served(model_named_base, tmp_path_factory):
    """`loraplex up --model .../base`: (its process, base port, state folder)."""
    state = tmp_path_factory.mktemp("up-state")
    base = free_base_port()
    server = start_up("--model", str(model_named_base), "--executor-args", "--threads 1",
                      state=state, base=base, http=base + 3)
    try:
        wait_serving(server)
        yield server, base, state
    finally:
        stop(server)
        kill_leftovers(str(state), f"127.0.0.1:{base}")


def one_error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode not in (0, None), done.stdout
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: "), done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    return errors[0]


def test_adapters_made_for_the_model_folder_serve(served, model_named_base, tmp_path):
    """Trip 3: `up` registers the model it serves, so an adapter whose base_model_name_or_path is
    the folder matches it (no "not a registered base model"), and serves; one made for another
    model is refused naming the pool's model and --model-id."""
    _, base, _ = served
    store, scheduler = f"127.0.0.1:{base + 1}", f"127.0.0.1:{base}"
    by_path = adapter_for(tmp_path / "by-path", str(model_named_base))
    pushed = loraplex("adapters", "push", str(by_path), "--name", "by-path", "--store", store)
    assert pushed.returncode == 0, pushed.stderr
    assert "matched by fingerprint" in pushed.stdout and "not a registered" not in pushed.stdout
    done = loraplex("generate", "--adapter", "by-path", "quiet river stone",
                    "--scheduler", scheduler)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "stone river quiet"

    other = adapter_for(tmp_path / "other", "acme/other-model")
    assert loraplex("adapters", "push", str(other), "--name", "other",
                    "--store", store).returncode == 0
    error = one_error_line(loraplex("generate", "--adapter", "other", "x",
                                    "--scheduler", scheduler))
    assert error.startswith("error: FAILED_PRECONDITION: ") and "serves 'base'" in error
    assert "--model-id acme/other-model" in error and "adapters base add" in error


def test_a_base_model_not_served_here_names_the_one_served(served):
    """Trip 13: a request for a base model the pool does not serve is not only "adapter ... not
    found; push it first": it names the base model served, at the scheduler and the gateway."""
    import urllib.error
    import urllib.request

    _, base, _ = served
    error = one_error_line(loraplex("generate", "--adapter", "llama-3-8b", "x",
                                    "--scheduler", f"127.0.0.1:{base}"))
    assert error.startswith("error: NOT_FOUND: ") and "serves base model 'base'" in error
    request = urllib.request.Request(
        f"http://127.0.0.1:{base + 3}/v1/completions", method="POST",
        data=json.dumps({"model": "llama-3-8b", "prompt": "x"}).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer sk-local"})
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(request, timeout=60)
    assert answer.value.code == 404
    message = json.loads(answer.value.read())["error"]["message"]
    assert "not a base model served here either (served: base)" in message, message


def test_generate_names_the_drained_executor_it_waits_for(served):
    """Trip 17: open, as `up` runs, the word after a few seconds without a token names the
    drained executor and the command that admits there again."""
    from tests.e2e.test_cli_trips import waited_for

    _, base, _ = served
    scheduler, executor = f"127.0.0.1:{base}", f"127.0.0.1:{base + 2}"
    assert loraplex("admin", "drain", executor, "--scheduler", scheduler).returncode == 0
    said = waited_for(["generate", "quiet river", "--scheduler", scheduler], {},
                      then=lambda: loraplex("admin", "resume", executor, "--scheduler", scheduler))
    assert said.startswith("no token after ") and f"{executor} drained" in said, said
    assert "loraplex admin resume HOST:PORT" in said


def test_a_rank_no_pool_serves_is_refused_at_push(served, tmp_path):
    """Trip 10: `up` gives its stores its executors' --max-rank, so a rank-64 adapter is
    refused when pushed (not on every request after), naming the flag that raises both."""
    import torch
    from safetensors.torch import load_file, save_file

    _, base, _ = served
    folder = adapter_for(tmp_path / "r64", "loraplex-demo-tiny")
    tensors = load_file(folder / "adapter_model.safetensors")
    padded = {name: torch.cat([t, torch.zeros(64 - t.shape[0], t.shape[1])]) if "lora_A" in name
              else torch.cat([t, torch.zeros(t.shape[0], 64 - t.shape[1])], dim=1)
              for name, t in tensors.items()}
    save_file(padded, folder / "adapter_model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "r": 64}))
    error = one_error_line(loraplex("adapters", "push", str(folder), "--name", "r64",
                                    "--store", f"127.0.0.1:{base + 1}"))
    assert error.startswith("error: INVALID_ARGUMENT: ") and "maximum 32" in error, error
    assert "--executor-args '--max-rank 64'" in error, error


def test_a_second_up_on_the_same_ports_is_one_error_line(served, model_named_base, tmp_path):
    """Trip 4: nothing of the second starts; the first goes on serving."""
    _, base, state = served
    second = tmp_path / "second-state"
    done = loraplex("up", "--model", str(model_named_base), "--state-dir", str(second),
                    "--base-port", str(base), "--http-port", str(base + 3))
    error = one_error_line(done)
    assert f"{base} (the scheduler)" in error and "--base-port" in error
    assert not processes_mentioning(str(second))
    answer = loraplex("generate", "quiet river", "--scheduler", f"127.0.0.1:{base}")
    assert answer.returncode == 0 and answer.stdout.strip() == "quiet river", answer.stderr


def test_a_service_cannot_listen_on_a_port_in_use(served, tmp_path):
    """Trip 4, in every server: gRPC's port sharing (SO_REUSEPORT) is off, so a second store on
    the first one's port ends at once, saying why."""
    _, base, _ = served
    try:
        second = start_service("second-store", "adapter_store.service",
                               ["--url", tmp_path.as_uri(), "--address", f"127.0.0.1:{base + 1}"],
                               tmp_path / "logs", timeout=60)
    except ServiceFailed as failed:
        assert "cannot listen on 127.0.0.1:" in failed.reason, failed.tail
    else:
        second.stop()
        pytest.fail("a second store listened on a port in use")


@pytest.mark.parametrize("trip", ["short key", "no config.json", "unsupported family",
                                  "no weights", "bad model id"])
def test_start_up_errors_are_one_line_before_anything_starts(trip, model_named_base, tmp_path):
    """Trip 6: what `up` can check itself is checked first, as one `error:` line."""
    model = tmp_path / "model"
    args = ["--model", str(model)]
    if trip == "short key":
        (tmp_path / "keys").write_text("short-key=acme\n")
        args = ["--model", str(model_named_base), "--api-keys-file", str(tmp_path / "keys")]
    elif trip == "no config.json":
        model.mkdir()
    elif trip in ("unsupported family", "no weights"):
        shutil.copytree(model_named_base, model)
        if trip == "no weights":
            (model / "model.safetensors").unlink()
        else:
            (model / "config.json").write_text(json.dumps({"model_type": "bert"}))
    else:
        args = ["--model", str(model_named_base), "--model-id", "a model id"]
    done = loraplex("up", *args, "--state-dir", str(tmp_path / "state"),
                    "--base-port", str(free_base_port()), "--http-port", str(free_base_port()))
    error = one_error_line(done)
    expected = {"short key": "shorter than 16 characters", "no config.json": "no config.json",
                "unsupported family": "model_type 'bert' is not supported",
                "no weights": "no safetensors weights", "bad model id": "base model id"}[trip]
    assert expected in error
    assert "starting the services" not in done.stdout and not processes_mentioning(str(tmp_path))


def test_a_service_that_fails_to_start_says_why_from_this_run_only(model_named_base, tmp_path):
    """Trips 6 and 7: an executor that exits at start is one `error:` line, taken from this run's
    log (the run before's error is not repeated; its logs are kept in logs/previous/); what had
    started is stopped."""
    logs = tmp_path / "state" / "logs"
    logs.mkdir(parents=True)
    (logs / "executor-0.log").write_text("Traceback\nOldRunError: the run before's failure\n")
    base = free_base_port()
    done = loraplex("up", "--model", str(model_named_base), "--state-dir", str(tmp_path / "state"),
                    "--executor-args=--no-such-flag", "--base-port", str(base),
                    "--http-port", str(base + 3))
    error = one_error_line(done)
    assert error.startswith("error: executor-0 did not start: ") and "--no-such-flag" in error
    assert "OldRunError" not in done.stdout + done.stderr
    assert "OldRunError" in (logs / "previous" / "executor-0.log").read_text()
    assert "OldRunError" not in (logs / "executor-0.log").read_text()
    assert "stopped:" in done.stdout and not wait_gone(str(tmp_path))


def starting(server: subprocess.Popen, base: int) -> list[str]:
    """`up`'s lines until it starts the services, once the store and the executor run."""
    lines = read_until(server, "starting the services")
    assert lines and lines[-1].startswith("starting the services"), lines
    deadline = time.monotonic() + 60
    while not all(processes_mentioning(f"--address 127.0.0.1:{base + i}") for i in (1, 2)):
        assert time.monotonic() < deadline and server.poll() is None, "".join(lines)
        time.sleep(0.05)
    return lines


def test_the_first_fixture_build_says_so_and_sigterm_while_starting_stops_all(tmp_path):
    """Trips 17 and 5: `up` without --model on a fresh state folder says it builds the fixture
    model, with no blank lines or library warnings; SIGTERM while the services start stops the
    half-started ones, with no traceback."""
    state, base = tmp_path / "state", free_base_port()
    server = start_up(state=state, base=base, http=base + 3)
    try:
        lines = starting(server, base)
        assert lines[0].startswith("building the fixture model and adapters under "), lines
        assert all(line.strip() and "Warning" not in line for line in lines), lines
        out = stop(server, signal.SIGTERM)
    finally:
        kill_leftovers(str(state), f"127.0.0.1:{base}")
    assert "SIGTERM: stopping every service" in out and "stopped:" in out
    assert "Traceback" not in out
    assert not wait_gone(str(state), f"127.0.0.1:{base}"), "services left running"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_a_signal_while_starting_leaves_nothing_running(sig, model_named_base, tmp_path):
    """Trips 5 and 17: Ctrl-C while the services start stops them, no traceback; SIGKILL (no
    chance to stop anything) ends them too: each dies with its parent."""
    state, base = tmp_path / "state", free_base_port()
    server = start_up("--model", str(model_named_base), state=state, base=base, http=base + 3)
    try:
        starting(server, base)
        out = stop(server, sig)
    finally:
        kill_leftovers(str(state), f"127.0.0.1:{base}")
    if sig == signal.SIGINT:
        assert "SIGINT: stopping every service" in out and "Traceback" not in out
    assert not wait_gone(str(state), f"127.0.0.1:{base}"), "services left running"


def test_fixture_adapters_to_push_are_all_valid(tiny):
    """Trip 11: the folder `up` offers (fixtures/adapters/*) holds only adapters that push and
    serve; the deliberately broken ones live apart."""
    folder = pathlib.Path(tiny["model_dir"]).parent / "adapters"
    assert sorted(p.name for p in folder.iterdir()) == sorted(tiny["valid"])
    assert all(folder not in pathlib.Path(tiny["adapters"][name]["path"]).parents
               for name in tiny["invalid"])


def test_sighup_stops_every_service(served):
    """Trip 5: closing the terminal (SIGHUP) stops `up` and every service it started."""
    server, base, state = served
    out = stop(server, signal.SIGHUP)
    assert "SIGHUP: stopping every service" in out and "stopped:" in out
    assert not wait_gone(str(state), f"127.0.0.1:{base}"), "services left running"
