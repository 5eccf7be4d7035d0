"""`loraplex`: run the services, push adapters, generate, and the demo.

    loraplex up                        every service locally on embedded defaults (+ gateway)
    loraplex serve scheduler|executor|adapter-store|gateway [flags]
    loraplex adapters push|register|list|show|alias|rm|base add|stats ...
    loraplex generate --adapter N "prompt" [--json]
    loraplex admin stats|prewarm|evict|drain|resume ...   the scheduler's operator RPCs
    loraplex simulate CONFIG           the scheduler policy against a simulated workload
    loraplex fit-cost TIMINGS...       the simulator's [cost] fitted to a scheduler's --timings-out
    loraplex budget [--model M ...]    an executor's GPU memory for a model and traffic mix
    loraplex demo                      the main job: services + a streaming multi-tenant workload
"""

import argparse
import sys
from collections.abc import Awaitable, Callable

import grpc

from common.server import insecure_channel, run
from loraplex import adapters_cli, admin_cli, api_key, client, up_cli

# `up`: gateway 50050 (HTTP 8000), scheduler 50051, adapter store(s) from 50052, executor(s) after
DEFAULT_SCHEDULER = f"127.0.0.1:{up_cli.BASE_PORT}"
DEFAULT_STORE = f"127.0.0.1:{up_cli.BASE_PORT + 1}"


def _serve(argv: list[str]) -> None:
    services = {"scheduler": "scheduler.service", "executor": "executor.service",
                "adapter-store": "adapter_store.service", "gateway": "gateway.service"}
    if not argv or argv[0] not in services:
        sys.exit(f"usage: loraplex serve {{{'|'.join(services)}}} [flags]  (--help after the name)")
    module = __import__(services[argv[0]], fromlist=["main"])
    module.main(argv[1:])


async def _generate(args: argparse.Namespace) -> None:
    from protos import scheduler_pb2_grpc

    request = client.generate_request(args.adapter, args.prompt, args.max_new_tokens,
                                      args.temperature, args.top_k, args.top_p, args.seed,
                                      args.stop, args.ignore_eos)
    async with insecure_channel(args.scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        async for response in client.stream(stub, request, api_key.read(args)):
            if args.json:
                print(client.token_json(response), flush=True)
            else:
                print(response.text, end="", flush=True)
    if not args.json:
        print()


def _call(action: Callable[[argparse.Namespace], Awaitable[None]],
          args: argparse.Namespace) -> None:
    """Run a command that calls the services, once the service it calls is serving (waiting up
    to --wait-s for it: a command right after `loraplex up &`). A service that does not come up,
    a refused call or an unreadable file (a key file, an adapter folder) ends it with one line on
    stderr and exit status 1, not a traceback."""
    address = getattr(args, "store", None) or getattr(args, "scheduler", None)

    async def when_serving() -> None:
        if address and args.wait_s > 0 and not await client.wait_until_serving(address,
                                                                              args.wait_s):
            sys.exit(f"error: UNAVAILABLE: nothing serving at {address} within {args.wait_s:g}s "
                     "(--wait-s): "
                     "is `loraplex up` running? (its services log under its state directory)")
        await action(args)

    try:
        run(when_serving)
    except grpc.aio.AioRpcError as err:
        details = (err.details() or "").replace("\n", " ")
        sys.exit(f"error: {err.code().name}: {details}")
    except OSError as err:
        sys.exit(f"error: {err}")


def _fit_cost(args: argparse.Namespace) -> None:
    import itertools

    from scheduler.sim.cost_fit import fit_cost, format_fit

    files = [open(path) for path in args.timings]
    try:
        fit = fit_cost(itertools.chain.from_iterable(files))
    except ValueError as err:
        sys.exit(f"error: {err}")
    finally:
        for f in files:
            f.close()
    print(format_fit(fit, args.timings))


def _simulate(args: argparse.Namespace) -> None:
    import dataclasses
    import time

    from scheduler.sim.config import SimConfig
    from scheduler.sim.simulator import Simulator, format_report

    config = SimConfig.load(args.config)
    if args.requests:
        config = dataclasses.replace(config, num_requests=args.requests)
    variants = [("", config)]
    if args.compare_merge:
        off = dataclasses.replace(config, limits=dataclasses.replace(config.limits, merge_share=0))
        variants = [("with merging (its [limits])", config), ("without merging", off)]
    if args.compare_memory:
        variants = [(f"adapter memory: {memory}", dataclasses.replace(
            config, executors=dataclasses.replace(config.executors, memory=memory)))
            for memory in ("pages", "padded")]
    for title, variant in variants:
        start = time.perf_counter()
        result = Simulator(variant).run()
        if title:
            print(f"== {title}")
        print(format_report(variant, result))
        print(f"(simulated in {time.perf_counter() - start:.0f}s of wall time)\n")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loraplex", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--wait-s", type=float, default=60.0,
                   help="how long a command waits for the service it calls to come up "
                        "(default 60; 0: not at all)")
    sub = p.add_subparsers(dest="command", required=True)

    up_cli.add_parser(sub)

    sub.add_parser("serve", help="run one service: scheduler | executor | adapter-store",
                   add_help=False)

    adapters_cli.add_parser(sub, default_store=DEFAULT_STORE)

    gen = sub.add_parser("generate", help="stream a completion")
    gen.add_argument("prompt")
    gen.add_argument("--adapter", default="", help="name, name@version; empty = base model")
    gen.add_argument("--scheduler", default=DEFAULT_SCHEDULER)
    api_key.add_argument(gen)
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="one JSON object per token")

    admin_cli.add_parser(sub, default_scheduler=DEFAULT_SCHEDULER)

    sim = sub.add_parser("simulate", help="run the scheduler policy against a simulated workload")
    sim.add_argument("config", help="TOML workload (see bench/sim/zipf1000.toml)")
    sim.add_argument("--requests", type=int, default=0, help="override num_requests")
    sim.add_argument("--compare-merge", action="store_true",
                     help="run it twice: as configured, and with merging off")
    sim.add_argument("--compare-memory", action="store_true",
                     help="run it twice at the same blocks: adapters in pages by their ranks, "
                          "and padded to the largest rank")

    fit = sub.add_parser("fit-cost",
                         help="fit the simulator's cost model to measured step and load times")
    fit.add_argument("timings", nargs="+", help="files a scheduler wrote with --timings-out")

    sub.add_parser("budget", add_help=False,
                   help="an executor's GPU memory for a model and traffic mix (no GPU needed)")

    demo = sub.add_parser("demo", help="the main job: services + a streaming multi-tenant workload")
    demo.add_argument("--requests", type=int, default=96)
    demo.add_argument("--concurrency", type=int, default=32)
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "serve":
        return _serve(argv[1:])
    if argv and argv[0] == "budget":
        from loraplex import budget

        return budget.main(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "up":
        up_cli.run(args)
    elif args.command in ("adapters", "generate", "admin"):
        action = {"adapters": adapters_cli.run, "generate": _generate, "admin": admin_cli.run}
        _call(action[args.command], args)
    elif args.command == "simulate":
        _simulate(args)
    elif args.command == "fit-cost":
        _fit_cost(args)
    elif args.command == "demo":
        from loraplex import demo

        demo.main(args)


if __name__ == "__main__":
    main()
