"""`loraplex up`: every service on this machine, as separate processes, until Ctrl-C.

    loraplex up [--model DIR] [--model-id ID] [--state-dir DIR] [--executors N] [--stores N]
                [--executor-args "--max-rank 64 --adapter-slots 8"] [--scheduler-args "..."]
                [--store-args "..."] [--gateway-args "..."] [--no-gateway] [--http-port 8000]
                [--api-keys-file F --admin-keys-file F --service-key-file F]

Ports: the gateway's gRPC at base-port - 1 (50050) and its HTTP at --http-port (8000), the
scheduler at base-port (50051), stores and executors after it; all are checked free before
anything starts. The model (default: the tiny fixture model, made on first use), the store's files
and the logs live under the state directory: --state-dir, else $LORAPLEX_STATE_DIR, else
$XDG_STATE_HOME/loraplex (~/.local/state/loraplex), never in the checkout. Each run's logs start
fresh (the run before's are kept in logs/previous/). The model is registered in the store as a
base model (its id and fingerprint), so adapters made for it match it whatever they call it, and
the stores take the executors' --max-rank (a push above it is refused: no pool could serve it).
Each --*-args string is split like a shell line and handed to that kind of service (`loraplex
serve NAME --help` lists what each takes).

Ctrl-C, SIGTERM or SIGHUP (the terminal closed) stop every service, also while they start; a
service that exits stops the others; and the services end by themselves if `up` dies (SIGKILL).
"""

import argparse
import os
import pathlib
import shlex
import shutil
import signal
import sys

from common.credentials import add_key_arguments
from loraplex import up_checks

BASE_PORT = 50051
WATCH_S = 0.5  # how often `up` looks whether every service still runs


def default_state_dir() -> pathlib.Path:
    if os.environ.get("LORAPLEX_STATE_DIR"):
        return pathlib.Path(os.environ["LORAPLEX_STATE_DIR"])
    state = os.environ.get("XDG_STATE_HOME") or pathlib.Path.home() / ".local" / "state"
    return pathlib.Path(state) / "loraplex"


def add_parser(sub) -> None:
    up = sub.add_parser("up", help="run every service locally (embedded defaults)",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    up.add_argument("--model", default="", help="HF model dir (default: the tiny fixture model)")
    up.add_argument("--model-id", default="",
                    help="the base model's id (default: the model folder's name); adapters' "
                         "base_model_name_or_path must name it or the folder")
    up.add_argument("--store-url", default="", help="file:///dir or s3://bucket/prefix "
                                                    "(default: files under the state dir)")
    up.add_argument("--state-dir", type=pathlib.Path, default=None,
                    help="model, store files and logs (default: $LORAPLEX_STATE_DIR, else "
                         "$XDG_STATE_HOME/loraplex)")
    up.add_argument("--base-port", type=int, default=BASE_PORT,
                    help="scheduler port; stores and executors take the ports after it, the "
                         "gateway's gRPC the one before (default: %(default)s)")
    up.add_argument("--http-port", type=int, default=8000,
                    help="the gateway's OpenAI API (default: %(default)s)")
    up.add_argument("--no-gateway", action="store_true", help="no gateway in front")
    up.add_argument("--executors", type=int, default=1, help="default: %(default)s")
    up.add_argument("--stores", type=int, default=1, help="default: %(default)s")
    for kind in ("executor", "scheduler", "store", "gateway"):
        up.add_argument(f"--{kind}-args", default="", metavar="'FLAGS'",
                        help=f"more flags for every {kind}, as one quoted string (`loraplex "
                             f"serve {'adapter-store' if kind == 'store' else kind} --help`)")
    add_key_arguments(up)  # handed to every service; without them all run open


class _Stopped(BaseException):
    """A signal asked `up` to stop (not an Exception: no handler on the way may swallow it)."""


def run(args: argparse.Namespace) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    try:
        _run(args)
    except _Stopped:
        sys.exit(130)


def _run(args: argparse.Namespace) -> None:
    from loraplex.launch import Fleet, ServiceFailed

    state = (args.state_dir or default_state_dir()).resolve()
    try:
        state.mkdir(parents=True, exist_ok=True)
        checked = up_checks.check(args, state)
    except up_checks.UpError as err:
        sys.exit(f"error: {err}")
    model, model_id = checked.model_dir, checked.model_id
    store_url = args.store_url or (state / "store").as_uri()
    files = [("--api-keys-file", args.api_keys_file), ("--admin-keys-file", args.admin_keys_file),
             ("--service-key-file", args.service_key_file)]
    every = [f for flag, path in files if path for f in (flag, str(pathlib.Path(path).resolve()))]
    service = every[every.index("--service-key-file"):][:2] if args.service_key_file else []
    extra = {kind: shlex.split(getattr(args, f"{kind}_args"))
             for kind in ("executor", "scheduler", "store", "gateway")}
    logs = _fresh_logs(state / "logs")
    # The stores refuse a push above the executors' rank limit (no pool could serve it).
    extra["store"] = ["--max-rank", str(_executor_max_rank(extra["executor"])), *extra["store"]]
    fleet = Fleet(model=model, store_url=store_url, log_dir=logs, num_executors=args.executors,
                  num_stores=args.stores, base_port=args.base_port,
                  store_args=every + extra["store"], scheduler_args=every + extra["scheduler"],
                  executor_args=service + ["--model-id", model_id] + extra["executor"])
    status = 0
    try:
        _say(up_checks.register_base(store_url, extra["store"], checked))
        _say(f"starting the services (logs under {logs})")
        fleet.start()
        if not args.no_gateway:
            fleet.add_gateway({model_id: [fleet.scheduler]}, args=every + extra["gateway"],
                              grpc_address=f"127.0.0.1:{args.base_port - 1}",
                              http_address=f"127.0.0.1:{args.http_port}")
        for s in fleet.services:
            _say(f"{s.name:16s} {s.address:22s} log {s.log_path}")
        _say(f"state: {state} (model {model_id}, store {store_url})")
        if not args.model:
            _say(f"fixture adapters to push: {state / 'fixtures' / 'adapters'}/*")
        if not args.no_gateway:
            _say(f"OpenAI API: http://127.0.0.1:{args.http_port}/v1 (model: {model_id} or an "
                 "adapter's name)")
        _say("serving; Ctrl-C stops all services")
        ended = _watch(fleet)
        status = 1
        _say(f"error: {ended.name} exited with status {ended.process.returncode}: "
             f"{_last_line(ended.log_path)} (log: {ended.log_path}); stopping the others",
             err=True)
    except _Stopped as stopped:
        _say(f"\n{stopped}: stopping every service")
    except ServiceFailed as err:
        status = 1
        _say(f"error: {err.name} did not start: {err.reason} (log: {err.log_path})", err=True)
    except TimeoutError as err:
        status = 1
        _say(f"error: {err}", err=True)
    finally:
        _ignore_signals()
        fleet.stop()
    _say("stopped: every service `up` started has ended")
    sys.exit(status)


def _executor_max_rank(executor_args: list[str]) -> int:
    """The --max-rank the executors will have (theirs, else their default)."""
    from executor.config import ExecutorConfig

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--max-rank", type=int, default=ExecutorConfig.max_rank)
    return parser.parse_known_args(executor_args)[0].max_rank


def _watch(fleet):
    """Until a service exits (the one that did) or a signal comes (_Stopped)."""
    import time

    while True:
        for service in fleet.services:
            if service.process.poll() is not None:
                return service
        time.sleep(WATCH_S)


def _fresh_logs(logs: pathlib.Path) -> pathlib.Path:
    """The logs folder, this run's to write: the run before's logs moved to logs/previous/."""
    old = sorted(logs.glob("*.log")) if logs.is_dir() else []
    if old:
        previous = logs / "previous"
        shutil.rmtree(previous, ignore_errors=True)
        previous.mkdir(parents=True)
        for path in old:
            path.rename(previous / path.name)
    logs.mkdir(parents=True, exist_ok=True)
    return logs


def _last_line(path: pathlib.Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "its log cannot be read"
    return lines[-1].strip() if lines else "nothing logged"


def _say(text: str, err: bool = False) -> None:
    """A line for the person who started `up`; nothing when their terminal is gone (SIGHUP)."""
    try:
        print(text, file=sys.stderr if err else sys.stdout, flush=True)
    except OSError:
        pass


def _on_signal(sig: int, _frame) -> None:
    _ignore_signals()  # one is enough: the rest must not cut the services' stop short
    raise _Stopped(signal.Signals(sig).name)


def _ignore_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
