"""`loraplex`: run the services, push adapters, generate, and the demo.

    loraplex up                        all three services locally on embedded defaults
    loraplex serve scheduler|executor|adapter-store [flags]
    loraplex adapters push|register|list|show|alias|rm|base|stats ...
    loraplex generate --adapter N "prompt" [--json]
    loraplex simulate CONFIG           the scheduler policy against a simulated workload
    loraplex fit-cost TIMINGS...       the simulator's [cost] fitted to a scheduler's --timings-out
    loraplex budget [--model M ...]    an executor's GPU memory for a model and traffic mix
    loraplex demo                      the main job: services + a streaming multi-tenant workload
"""

import argparse
import os
import pathlib
import signal
import sys
import time

import grpc

from common.adapter_ref import AdapterQuery, AdapterRef
from common.credentials import add_key_arguments
from common.errors import InvalidArgument
from common.server import insecure_channel, run
from loraplex import client

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
    files = [("--api-keys-file", args.api_keys_file), ("--admin-keys-file", args.admin_keys_file),
             ("--service-key-file", args.service_key_file)]
    every = [f for flag, path in files if path for f in (flag, str(pathlib.Path(path).resolve()))]
    service = every[every.index("--service-key-file"):][:2] if args.service_key_file else []
    fleet = Fleet(model=model, store_url=store_url, log_dir=DEFAULT_WORKDIR / "logs",
                  num_executors=args.executors, num_stores=args.stores, base_port=args.base_port,
                  store_args=every, scheduler_args=every, executor_args=service)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # leave the `with` so children stop too
    with fleet:
        for s in fleet.services:
            print(f"{s.name:16s} {s.address:22s} log {s.log_path}")
        print("serving; Ctrl-C stops all services", flush=True)
        try:
            fleet.services[-1].process.wait()
        except KeyboardInterrupt:
            print("\nstopping")


def _progress(done: int, total: int) -> None:
    width = 30
    filled = width * done // max(total, 1)
    print(f"\r  uploading [{'#' * filled}{'.' * (width - filled)}] {done / 2**20:.1f}/"
          f"{total / 2**20:.1f} MiB", end="", file=sys.stderr, flush=True)


def _metadata(args: argparse.Namespace):
    scores = {}
    for item in args.eval:
        metric, _, value = item.partition("=")
        try:
            scores[metric] = float(value)
        except ValueError:
            sys.exit(f"error: --eval {item!r}: use METRIC=NUMBER")
    return client.version_metadata(args.dataset, scores, args.base_revision, args.alias)


def _describe(d) -> str:
    i = d.info
    aliases = f"  (aliases: {', '.join(d.aliases)})" if d.aliases else ""
    revision = f" @ {d.base_model_revision}" if d.base_model_revision else ""
    evals = ", ".join(f"{k}={v:g}" for k, v in sorted(d.eval_scores.items()))
    lines = [str(AdapterRef(i.name, i.version)) + aliases,
             f"  owner      {i.owner_tenant or 'public'}",
             f"  base       {i.base_model}{revision}",
             f"  rank       {i.rank} (alpha {i.alpha:g}{', rsLoRA' if i.use_rslora else ''})"
             + (f", patterns {dict(d.rank_pattern)}" if d.rank_pattern else ""),
             f"  targets    {' '.join(i.target_modules)}",
             f"  weights    {i.num_bytes / 2**20:.2f} MiB {d.dtype}, sha256 {i.sha256[:16]}...",
             f"  dataset    {d.training_dataset or '-'}",
             f"  evals      {evals or '-'}",
             f"  created    {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(i.created_unix))}"
             f"  from {d.source or '-'}"]
    return "\n".join(lines)


def _key_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-key-file", default="",
                        help="file holding your API key (default: $LORAPLEX_API_KEY); keys never "
                             "go on a command line")


def _key(args: argparse.Namespace) -> str:
    """The caller's key: --api-key-file, else $LORAPLEX_API_KEY, else none."""
    if args.api_key_file:
        return pathlib.Path(args.api_key_file).read_text().strip()
    return os.environ.get("LORAPLEX_API_KEY", "").strip()


def _query(ref: str) -> AdapterQuery:
    try:
        return AdapterQuery.parse(ref)
    except InvalidArgument as err:
        sys.exit(f"error: {err}")


async def _adapters(args: argparse.Namespace) -> None:
    from protos import adapter_store_pb2 as pb

    command = args.adapters_command

    async def call(method: str, request):
        return await client.store_call(args.store, method, request, key=_key(args))

    if command == "push":
        info = await client.push_adapter(args.store, args.dir, args.name, args.tenant, _progress,
                                         _metadata(args), key=_key(args))
        print(file=sys.stderr)
    elif command == "register":
        info = await call("Register", pb.RegisterRequest(
            name=args.name, owner_tenant=args.tenant, source_uri=args.uri,
            metadata=_metadata(args)))
    if command in ("push", "register"):
        print(f"registered {AdapterRef(info.name, info.version)} (rank {info.rank}, "
              f"{len(info.target_modules)} modules, {info.num_bytes / 2**20:.2f} MiB, "
              f"owner {info.owner_tenant or 'public'}, base {info.base_model})")
    elif command == "list":
        listed = await call("ListAdapters", pb.ListAdaptersRequest(
            tenant=args.tenant, name=args.name, all_versions=args.all_versions))
        print(f"{'ADAPTER':32s} {'OWNER':10s} {'RANK':>4s} {'MIB':>7s}  {'ALIASES':16s} BASE")
        for d in listed.adapters:
            i = d.info
            print(f"{str(AdapterRef(i.name, i.version)):32s} {i.owner_tenant or 'public':10s} "
                  f"{i.rank:4d} {i.num_bytes / 2**20:7.2f}  {','.join(d.aliases) or '-':16s} "
                  f"{i.base_model}")
    elif command == "show":
        query = _query(args.ref)
        print(_describe(await call("DescribeAdapter", pb.GetAdapterRequest(
            name=query.name, version=query.version, alias=query.alias, tenant=args.tenant))))
    elif command == "alias":
        query = _query(args.ref)
        name, version = query.name, query.version
        request = pb.SetAliasRequest(name=name, alias=args.alias, tenant=args.tenant,
                                     version=0 if args.remove else version)
        if not args.remove and not version:
            sys.exit("error: give the version to point at: NAME@VERSION (or --remove)")
        if args.expect is not None:
            request.expected_version = args.expect
        answer = await call("SetAlias", request)
        target = "removed" if args.remove else f"-> {AdapterRef(name, version)}"
        print(f"{AdapterQuery(name, alias=args.alias)} {target} "
              f"(was {answer.previous_version or 'unset'})")
    elif command == "rm":
        query = _query(args.ref)
        name, version = query.name, query.version
        if query.alias or (not version and not args.all_versions):
            sys.exit("error: name the version to delete (NAME@VERSION), or --all-versions")
        answer = await call("DeleteAdapter", pb.DeleteAdapterRequest(
            name=name, version=version, tenant=args.tenant))
        print(f"deleted {name} versions {', '.join(map(str, answer.versions))}")
    elif command == "base":
        folder = pathlib.Path(args.dir)
        base = await call("RegisterBaseModel", pb.RegisterBaseModelRequest(
            model_id=args.id, config_json=(folder / "config.json").read_text(),
            revision=args.revision))
        print(f"registered base model {base.model_id} ({base.num_layers} layers, revision "
              f"{base.revision or '-'}, config sha256 {base.config_sha256[:16]}...)")
    elif command == "stats":
        print(await call("Stats", pb.StoreStatsRequest()), end="")


async def _generate(args: argparse.Namespace) -> None:
    from protos import scheduler_pb2_grpc

    request = client.generate_request(args.adapter, args.prompt, args.max_new_tokens,
                                      args.temperature, args.top_k, args.top_p, args.seed,
                                      args.stop, args.ignore_eos)
    async with insecure_channel(args.scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        async for response in client.stream(stub, request, _key(args)):
            if args.json:
                print(client.token_json(response), flush=True)
            else:
                print(response.text, end="", flush=True)
    if not args.json:
        print()


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
    start = time.perf_counter()
    result = Simulator(config).run()
    print(format_report(config, result))
    print(f"(simulated in {time.perf_counter() - start:.0f}s of wall time)")


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
    add_key_arguments(up)  # handed to every service; without them all run open

    sub.add_parser("serve", help="run one service: scheduler | executor | adapter-store",
                   add_help=False)

    adapters = sub.add_parser("adapters", help="manage adapters in the store")
    asub = adapters.add_subparsers(dest="adapters_command", required=True)
    def store_command(name: str, help: str) -> argparse.ArgumentParser:
        command = asub.add_parser(name, help=help)
        command.add_argument("--store", default=DEFAULT_STORE)
        command.add_argument("--tenant", default="",
                             help="with an admin key: the tenant to act for / owner (default: "
                                  "public adapters)")
        _key_argument(command)
        return command

    def metadata_flags(command: argparse.ArgumentParser) -> None:
        command.add_argument("--dataset", default="", help="training data set version")
        command.add_argument("--eval", action="append", default=[], metavar="METRIC=SCORE")
        command.add_argument("--base-revision", default="", help="base model revision / hash")
        command.add_argument("--alias", action="append", default=[],
                             help="point this alias at the new version (repeatable)")

    push = store_command("push", "upload a PEFT adapter folder (progress bar)")
    push.add_argument("dir")
    push.add_argument("--name", required=True)
    metadata_flags(push)
    register = store_command("register", "register a PEFT folder already in S3 (s3://b/prefix)")
    register.add_argument("uri")
    register.add_argument("--name", required=True)
    metadata_flags(register)
    listing = store_command("list", "adapters visible to a tenant")
    listing.add_argument("--name", default="", help="only this adapter")
    listing.add_argument("--all-versions", action="store_true")
    show = store_command("show", "everything recorded about NAME[@VERSION|@ALIAS]")
    show.add_argument("ref")
    alias = store_command("alias", "point ALIAS at NAME@VERSION (atomic), or --remove it")
    alias.add_argument("ref", help="NAME@VERSION")
    alias.add_argument("alias")
    alias.add_argument("--remove", action="store_true")
    alias.add_argument("--expect", type=int, default=None,
                       help="only if the alias points at this version now (0 = unset)")
    rm = store_command("rm", "delete NAME@VERSION (refused while aliased or resident)")
    rm.add_argument("ref")
    rm.add_argument("--all-versions", action="store_true")
    base = store_command("base", "register a base model's config.json for shape checks")
    base.add_argument("dir", help="folder with the model's config.json")
    base.add_argument("--id", required=True, help="model id adapters name as their base")
    base.add_argument("--revision", default="")
    store_command("stats", "host tier and registry counters of a store")

    gen = sub.add_parser("generate", help="stream a completion")
    gen.add_argument("prompt")
    gen.add_argument("--adapter", default="", help="name, name@version; empty = base model")
    gen.add_argument("--scheduler", default=DEFAULT_SCHEDULER)
    _key_argument(gen)
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="one JSON object per token")

    sim = sub.add_parser("simulate", help="run the scheduler policy against a simulated workload")
    sim.add_argument("config", help="TOML workload (see bench/sim/zipf1000.toml)")
    sim.add_argument("--requests", type=int, default=0, help="override num_requests")

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
        _up(args)
    elif args.command in ("adapters", "generate"):
        action = _adapters if args.command == "adapters" else _generate
        try:
            run(lambda: action(args))
        except grpc.aio.AioRpcError as err:
            sys.exit(f"error: {err.code().name}: {err.details()}")
    elif args.command == "simulate":
        _simulate(args)
    elif args.command == "fit-cost":
        _fit_cost(args)
    elif args.command == "demo":
        from loraplex import demo

        demo.main(args)


if __name__ == "__main__":
    main()
