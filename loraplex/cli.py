"""`loraplex`: run the services, push adapters, generate, and the demo.

    loraplex up                        every service locally on embedded defaults (+ gateway)
    loraplex serve scheduler|executor|adapter-store|gateway [flags]   one service
    loraplex adapters push|register|list|show|alias|rm|base add|stats ...
    loraplex generate --adapter N "prompt" [--json]
    loraplex admin stats|prewarm|evict|drain|resume ...   the scheduler's operator RPCs
    loraplex simulate CONFIG           the scheduler policy against a simulated workload
    loraplex fit-cost TIMINGS...       the simulator's [cost] fitted to a scheduler's --timings-out
    loraplex budget [--model M ...]    an executor's GPU memory for a model and traffic mix
    loraplex demo                      the main job: services + a streaming multi-tenant workload
"""

import argparse
import asyncio
import os
import sys
from collections.abc import Awaitable, Callable

import grpc

from common.credentials import metadata
from common.help_format import HelpFormatter
from common.server import insecure_channel, run
from loraplex import adapters_cli, admin_cli, api_key, client, service_wait, up_cli

# `up`: gateway 50050 (HTTP 8000), scheduler 50051, adapter store(s) from 50052, executor(s) after
DEFAULT_SCHEDULER = f"127.0.0.1:{up_cli.BASE_PORT}"
DEFAULT_STORE = f"127.0.0.1:{up_cli.BASE_PORT + 1}"


# `loraplex serve NAME`: the service's module, and what it is (its own --help lists its flags).
SERVICES = {"scheduler": ("scheduler.service", "the brain of a pool: queues, residency, steps"),
            "executor": ("executor.service", "a base model, KV cache and adapter slots on one "
                                             "device (or --tensor-parallel N)"),
            "adapter-store": ("adapter_store.service", "the adapter registry and its bytes"),
            "gateway": ("gateway.service", "the OpenAI, TGI/LoRAX and gRPC front door of pools")}
SERVE_HELP = "run one service: " + " | ".join(SERVICES)
SERVE_USAGE = (f"usage: loraplex serve {{{','.join(SERVICES)}}} [flags]\n\n{SERVE_HELP}\n\n"
               + "".join(f"  {name:14s} {what}\n" for name, (_, what) in SERVICES.items())
               + "\n`loraplex serve NAME --help` lists the flags of each.")


def _serve(argv: list[str]) -> None:
    if argv and argv[0] in ("-h", "--help"):
        print(SERVE_USAGE)
        return
    if not argv or argv[0] not in SERVICES:
        sys.exit(SERVE_USAGE if not argv else
                 f"{SERVE_USAGE}\n\nerror: no service {argv[0]!r}")
    module = __import__(SERVICES[argv[0]][0], fromlist=["main"])
    module.main(argv[1:])


# A generate with no token this long says why it may wait (queued, or the executors drained).
FIRST_TOKEN_NOTICE_S = 5.0


async def _generate(args: argparse.Namespace) -> None:
    from protos import scheduler_pb2_grpc

    request = client.generate_request(args.adapter, args.prompt, args.max_new_tokens,
                                      args.temperature, args.top_k, args.top_p, args.seed,
                                      args.stop, args.ignore_eos)
    key = api_key.read(args)
    # (pinging: a scheduler that freezes mid-answer ends the call within ~15 s, not never)
    async with insecure_channel(args.scheduler, keepalive=True) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        first = asyncio.Event()
        notice = asyncio.create_task(_tell_while_waiting(stub, key, first))
        try:
            async for response in client.stream(stub, request, key):
                first.set()
                if args.json:
                    print(client.token_json(response), flush=True)
                else:
                    print(response.text, end="", flush=True)
        finally:
            notice.cancel()
    if not args.json:
        print()


async def _tell_while_waiting(stub, key: str, first: asyncio.Event) -> None:
    """One line on stderr when no token came within FIRST_TOKEN_NOTICE_S: why, when the
    scheduler's Stats shows it (every executor drained or down), else where to look."""
    from protos import scheduler_pb2

    try:
        await asyncio.wait_for(first.wait(), FIRST_TOKEN_NOTICE_S)
        return
    except TimeoutError:
        pass
    try:
        stats = await stub.Stats(scheduler_pb2.StatsRequest(), timeout=2.0,
                                 metadata=metadata(key))
    except grpc.aio.AioRpcError:
        stats = None
    executors = list(stats.executors) if stats is not None else []
    admitting = [e for e in executors if e.is_up and not (e.is_drained or e.is_draining)]
    if executors and not admitting:
        states = ", ".join(f"{e.address} {admin_cli.state_of(e)}" for e in executors)
        why = (f"no executor of this pool admits work ({states}): the request waits until one "
               "does (`loraplex admin resume HOST:PORT`)")
    else:
        why = ("the request is queued at the scheduler: its executors may be busy, drained or "
               "down (`loraplex admin stats` with an admin key shows which)")
    print(f"no token after {FIRST_TOKEN_NOTICE_S:g} s: {why}; Ctrl-C gives up",
          file=sys.stderr, flush=True)


def _call(action: Callable[[argparse.Namespace], Awaitable[None]],
          args: argparse.Namespace) -> None:
    """Run a command that calls the services, once the service it calls is serving (waiting up
    to --wait-s for it: a command right after `loraplex up &`, saying so after a moment). A
    service that does not come up, a refused call or an unreadable file (a key file, an adapter
    folder) ends it with one line on stderr and exit status 1, not a traceback."""
    if getattr(args, "store", None):
        address, wanted = args.store, service_wait.STORE
    else:
        address, wanted = getattr(args, "scheduler", None), service_wait.SCHEDULER

    async def when_serving() -> None:
        if address and args.wait_s > 0:
            why = await service_wait.wait_for_service(address, wanted, args.wait_s)
            if why is not None:
                sys.exit(f"error: {why}")
        await action(args)

    try:
        run(when_serving)
    except grpc.aio.AioRpcError as err:
        details = (err.details() or "").replace("\n", " ")
        if err.code() == grpc.StatusCode.UNAUTHENTICATED:
            details = _unauthenticated(args, details)
        sys.exit(f"error: {err.code().name}: {details}")
    except service_wait.NotAService as err:
        sys.exit(f"error: {err}")
    except BrokenPipeError:
        raise
    except OSError as err:
        sys.exit(f"error: {err}")


def _unauthenticated(args: argparse.Namespace, details: str) -> str:
    """A refused key, told to a CLI user: where the CLI takes its key from."""
    if args.api_key_file:
        return (f"the key in {args.api_key_file} (--api-key-file) is not one this service "
                "knows: check the file, or ask for a key")
    if os.environ.get(api_key.ENV_VAR, "").strip():
        return (f"the key in ${api_key.ENV_VAR} is not one this service knows: check it, or "
                "ask for a key")
    return (f"this service needs an API key and none was given: set {api_key.ENV_VAR}=<key> "
            "or pass --api-key-file FILE (a file holding it)")


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

    sub.add_parser("serve", help=SERVE_HELP, add_help=False)

    adapters_cli.add_parser(sub, default_store=DEFAULT_STORE)

    gen = sub.add_parser("generate", help="stream a completion from a scheduler")
    gen.add_argument("prompt", help="the prompt's text")
    gen.add_argument("--adapter", default="",
                     help="name, name@version or name@alias (default: none, the base model)")
    gen.add_argument("--scheduler", default=DEFAULT_SCHEDULER,
                     help="a scheduler's gRPC address, as `loraplex up` starts it")
    api_key.add_argument(gen)
    gen.add_argument("--max-new-tokens", type=int, default=32, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    gen.add_argument("--seed", type=int, default=None,
                     help="seed of a sampled request (default: none, a fresh draw)")
    gen.add_argument("--stop", action="append", default=[],
                     help="a string that ends the output (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="go on past end-of-sequence, to --max-new-tokens")
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
    demo.add_argument("--requests", type=int, default=96, help="requests in the workload")
    demo.add_argument("--concurrency", type=int, default=32, help="requests in flight at once")
    _format_every_help(p)
    return p


def _format_every_help(parser: argparse.ArgumentParser) -> None:
    """Every command's help with its descriptions as written and each option's default."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _format_every_help(child)


def main(argv: list[str] | None = None) -> None:
    """The command; its output piped into a reader that stops early (`| head`) ends it quietly,
    as cat and grep end."""
    try:
        _main(sys.argv[1:] if argv is None else argv)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)  # (the exit's own flush must not fail too)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(141)  # 128 + SIGPIPE: what a shell shows for a command a pipe closed on


def _main(argv: list[str]) -> None:
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
