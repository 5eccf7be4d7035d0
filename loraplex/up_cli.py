"""`loraplex up`: every service on this machine, as separate processes, until Ctrl-C.

    loraplex up [--model DIR] [--model-id ID] [--state-dir DIR] [--executors N] [--stores N]
                [--executor-args "--max-rank 64 --adapter-slots 8"] [--scheduler-args "..."]
                [--store-args "..."] [--gateway-args "..."] [--no-gateway] [--http-port 8000]
                [--api-keys-file F --admin-keys-file F --service-key-file F]

Ports: the gateway's gRPC at base-port - 1 (50050) and its HTTP at --http-port (8000), the
scheduler at base-port (50051), stores and executors after it. The model (default: the tiny
fixture model, made on first use), the store's files and the logs live under the state directory:
--state-dir, else $LORAPLEX_STATE_DIR, else $XDG_STATE_HOME/loraplex (~/.local/state/loraplex),
never in the checkout. Each --*-args string is split like a shell line and handed to that kind of
service (`python -m scheduler.service --help` and the others list what they take).
"""

import argparse
import os
import pathlib
import shlex
import signal
import sys

from common.credentials import add_key_arguments

BASE_PORT = 50051


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
                         "base_model_name_or_path must name it")
    up.add_argument("--store-url", default="", help="file:///dir or s3://bucket/prefix "
                                                    "(default: files under the state dir)")
    up.add_argument("--state-dir", type=pathlib.Path, default=None,
                    help="model, store files and logs (default: $LORAPLEX_STATE_DIR, else "
                         "$XDG_STATE_HOME/loraplex)")
    up.add_argument("--base-port", type=int, default=BASE_PORT,
                    help="scheduler port; stores and executors take the ports after it, the "
                         "gateway's gRPC the one before")
    up.add_argument("--http-port", type=int, default=8000, help="the gateway's OpenAI API")
    up.add_argument("--no-gateway", action="store_true", help="no gateway in front")
    up.add_argument("--executors", type=int, default=1)
    up.add_argument("--stores", type=int, default=1)
    for kind in ("executor", "scheduler", "store", "gateway"):
        up.add_argument(f"--{kind}-args", default="", metavar="'FLAGS'",
                        help=f"more flags for every {kind}, as one quoted string")
    add_key_arguments(up)  # handed to every service; without them all run open


def run(args: argparse.Namespace) -> None:
    from loraplex import fixtures
    from loraplex.launch import Fleet, start_gateway

    state = (args.state_dir or default_state_dir()).resolve()
    state.mkdir(parents=True, exist_ok=True)
    model = args.model or str(fixtures.ensure(state / "fixtures")["model_dir"])
    model_id = args.model_id or pathlib.Path(model).resolve().name
    store_url = args.store_url or (state / "store").as_uri()
    files = [("--api-keys-file", args.api_keys_file), ("--admin-keys-file", args.admin_keys_file),
             ("--service-key-file", args.service_key_file)]
    every = [f for flag, path in files if path for f in (flag, str(pathlib.Path(path).resolve()))]
    service = every[every.index("--service-key-file"):][:2] if args.service_key_file else []
    extra = {kind: shlex.split(getattr(args, f"{kind}_args"))
             for kind in ("executor", "scheduler", "store", "gateway")}
    logs = state / "logs"
    fleet = Fleet(model=model, store_url=store_url, log_dir=logs, num_executors=args.executors,
                  num_stores=args.stores, base_port=args.base_port,
                  store_args=every + extra["store"], scheduler_args=every + extra["scheduler"],
                  executor_args=service + ["--model-id", model_id] + extra["executor"])
    signal.signal(signal.SIGTERM, _stop)  # leave the `with` so the services stop too
    with fleet:
        if not args.no_gateway:
            fleet.services.append(start_gateway(
                {model_id: [fleet.scheduler]}, fleet.stores, logs, args=every + extra["gateway"],
                grpc_address=f"127.0.0.1:{args.base_port - 1}",
                http_address=f"127.0.0.1:{args.http_port}"))
        for s in fleet.services:
            print(f"{s.name:16s} {s.address:22s} log {s.log_path}")
        print(f"state: {state} (model {model_id}, store {store_url})")
        if not args.model:
            print(f"fixture adapters to push: {state / 'fixtures' / 'adapters'}/*")
        if not args.no_gateway:
            print(f"OpenAI API: http://127.0.0.1:{args.http_port}/v1 (model: {model_id} or an "
                  "adapter's name)")
        print("serving; Ctrl-C stops all services", flush=True)
        try:
            fleet.by_name("scheduler")[0].process.wait()
        except KeyboardInterrupt:
            _ignore_signals()
            print("\nstopping")


def _ignore_signals() -> None:
    """While the services stop, another Ctrl-C or SIGTERM must not cut that short (it would
    leave the rest running)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def _stop(*_) -> None:
    _ignore_signals()
    sys.exit(0)
