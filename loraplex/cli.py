"""`loraplex`: run the services, push adapters, generate, and the demo.

    loraplex up                        all three services locally on embedded defaults
    loraplex serve scheduler|executor|adapter-store [flags]
    loraplex adapters push DIR --name N [--tenant T]
    loraplex generate --adapter N "prompt" [--json]
    loraplex demo                      the main job: services + a streaming multi-tenant workload
"""

import argparse
import asyncio
import pathlib
import signal
import sys

import grpc

from loraplex import client
from loraplex.server import insecure_channel, run

REPO = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_WORKDIR = REPO / ".fixtures"
BASE_PORT = 50051  # `up`: scheduler 50051, adapter store(s) from 50052, then executor(s)
DEFAULT_SCHEDULER = f"127.0.0.1:{BASE_PORT}"
DEFAULT_STORE = f"127.0.0.1:{BASE_PORT + 1}"


def _serve(argv: list[str]) -> None:
    services = {"scheduler": "scheduler.service", "executor": "executor.service",
                "adapter-store": "adapter_store.service"}
    if not argv or argv[0] not in services:
        sys.exit(f"usage: loraplex serve {{{'|'.join(services)}}} [flags]  (--help after the name)")
    module = __import__(services[argv[0]], fromlist=["main"])
    module.main(argv[1:])


def _up(args: argparse.Namespace) -> None:
    from loraplex import fixtures
    from loraplex.launch import Fleet

    model = args.model or str(fixtures.ensure(DEFAULT_WORKDIR)["model_dir"])
    store_url = args.store_url or (DEFAULT_WORKDIR / "store").resolve().as_uri()
    fleet = Fleet(model=model, store_url=store_url, log_dir=DEFAULT_WORKDIR / "logs",
                  num_executors=args.executors, num_stores=args.stores, base_port=args.base_port)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # leave the `with` so children stop too
    with fleet:
        for s in fleet.services:
            print(f"{s.name:16s} {s.address:22s} log {s.log_path}")
        print("serving; Ctrl-C stops all services", flush=True)
        try:
            fleet.services[-1].process.wait()
        except KeyboardInterrupt:
            print("\nstopping")


async def _push(args: argparse.Namespace) -> None:
    def progress(done: int, total: int) -> None:
        width = 30
        filled = width * done // max(total, 1)
        print(f"\r  uploading [{'#' * filled}{'.' * (width - filled)}] {done / 2**20:.1f}/"
              f"{total / 2**20:.1f} MiB", end="", file=sys.stderr, flush=True)

    info = await client.push_adapter(args.store, args.dir, args.name, args.tenant, progress)
    print(file=sys.stderr)
    owner = info.owner_tenant or "public"
    print(f"pushed {info.name}@{info.version} (rank {info.rank}, {len(info.target_modules)} modules, "
          f"{info.num_bytes / 2**20:.2f} MiB, owner {owner}, base {info.base_model})")


async def _generate(args: argparse.Namespace) -> None:
    from protos import scheduler_pb2_grpc

    request = client.generate_request(args.adapter, args.prompt, args.max_new_tokens, args.temperature,
                                      args.top_k, args.top_p, args.seed, args.stop, args.ignore_eos)
    async with insecure_channel(args.scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        async for response in client.stream(stub, request, args.api_key):
            if args.json:
                print(client.token_json(response), flush=True)
            else:
                print(response.text, end="", flush=True)
    if not args.json:
        print()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loraplex", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run all services locally (embedded defaults)")
    up.add_argument("--model", default="", help="HF model dir (default: the tiny fixture model)")
    up.add_argument("--store-url", default="", help="file:///dir or s3://bucket/prefix")
    up.add_argument("--base-port", type=int, default=BASE_PORT,
                    help="scheduler port; stores and executors take the ports after it")
    up.add_argument("--executors", type=int, default=1)
    up.add_argument("--stores", type=int, default=1)

    sub.add_parser("serve", help="run one service: scheduler | executor | adapter-store", add_help=False)

    adapters = sub.add_parser("adapters", help="manage adapters in the store")
    asub = adapters.add_subparsers(dest="adapters_command", required=True)
    push = asub.add_parser("push", help="upload a PEFT adapter folder")
    push.add_argument("dir")
    push.add_argument("--name", required=True)
    push.add_argument("--tenant", default="", help="owner tenant (default: public)")
    push.add_argument("--store", default=DEFAULT_STORE)

    gen = sub.add_parser("generate", help="stream a completion")
    gen.add_argument("prompt")
    gen.add_argument("--adapter", default="", help="name, name@version; empty = base model")
    gen.add_argument("--scheduler", default=DEFAULT_SCHEDULER)
    gen.add_argument("--api-key", default="")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="one JSON object per token")

    demo = sub.add_parser("demo", help="the main job: services + a streaming multi-tenant workload")
    demo.add_argument("--requests", type=int, default=96)
    demo.add_argument("--concurrency", type=int, default=32)
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "serve":
        return _serve(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "up":
        _up(args)
    elif args.command in ("adapters", "generate"):
        action = _push if args.command == "adapters" else _generate
        try:
            run(lambda: action(args))
        except grpc.aio.AioRpcError as err:
            sys.exit(f"error: {err.code().name}: {err.details()}")
    elif args.command == "demo":
        from loraplex import demo

        demo.main(args, DEFAULT_WORKDIR)


if __name__ == "__main__":
    main()
