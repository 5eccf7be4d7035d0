"""`loraplex adapters`: the adapter store's registry (protos/adapter_store.proto) from a shell.

    loraplex adapters push DIR --name N      upload a PEFT folder (progress bar on stderr)
    loraplex adapters register s3://b/p --name N
    loraplex adapters list|show|alias|rm ...
    loraplex adapters base add MODEL_DIR --id ID [--name NAME ...]
    loraplex adapters base list
    loraplex adapters stats                  a store's registry and host-tier counters

A refused call prints one line on stderr (error: CODE: details) and exits with status 1.
"""

import argparse
import asyncio
import pathlib
import sys
import time

from common.adapter_ref import AdapterQuery, AdapterRef
from common.base_fingerprint import base_fingerprint
from common.errors import InvalidArgument
from common.registry_client import RESOLVE_TTL_S
from loraplex import api_key, client
from protos import adapter_store_pb2 as pb
from protos import common_pb2


def add_parser(sub: argparse._SubParsersAction, default_store: str) -> None:
    """The `adapters` command and its subcommands, each with --store, --tenant and the key."""
    adapters = sub.add_parser("adapters", help="manage adapters in the store")
    asub = adapters.add_subparsers(dest="adapters_command", required=True)

    def store_command(name: str, help: str, parent=asub) -> argparse.ArgumentParser:
        command = parent.add_parser(name, help=help)
        command.add_argument("--store", default=default_store,
                             help="an adapter store's address, as `loraplex up` starts it")
        command.add_argument("--tenant", default="",
                             help="with an admin key: the tenant to act for / owner (default: "
                                  "public adapters)")
        api_key.add_argument(command)
        return command

    def metadata_flags(command: argparse.ArgumentParser) -> None:
        command.add_argument("--dataset", default="", help="training data set version")
        command.add_argument("--eval", action="append", default=[], metavar="METRIC=SCORE",
                             help="an evaluation score to record (repeatable)")
        command.add_argument("--base-revision", default="", help="base model revision / hash")
        command.add_argument("--alias", action="append", default=[],
                             help="point this alias at the new version (repeatable)")

    push = store_command("push", "upload a PEFT adapter folder (progress bar)")
    push.add_argument("dir", help="the adapter's folder, as PEFT's save_pretrained wrote it")
    push.add_argument("--name", required=True,
                      help="its name in the store (each push makes a new version of it)")
    metadata_flags(push)
    register = store_command("register", "register a PEFT folder already in S3 (s3://b/prefix)")
    register.add_argument("uri", help="s3://bucket/prefix of the PEFT folder")
    register.add_argument("--name", required=True,
                          help="its name in the store (each registration makes a new version)")
    metadata_flags(register)
    listing = store_command("list", "adapters visible to a tenant")
    listing.add_argument("--name", default="", help="only this adapter")
    listing.add_argument("--all-versions", action="store_true",
                         help="every live version, not only the latest")
    show = store_command("show", "everything recorded about NAME[@VERSION|@ALIAS]")
    show.add_argument("ref", help="NAME, NAME@VERSION or NAME@ALIAS")
    alias = store_command("alias", "point ALIAS at NAME@VERSION (atomic), or --remove it")
    alias.add_argument("ref", help="NAME@VERSION")
    alias.add_argument("alias", help="the alias's name")
    alias.add_argument("--remove", action="store_true", help="remove the alias instead")
    alias.add_argument("--expect", type=int, default=None,
                       help="only if the alias points at this version now (0 = unset)")
    rm = store_command("rm", "delete NAME@VERSION (refused while aliased or resident)")
    rm.add_argument("ref", help="NAME@VERSION")
    rm.add_argument("--all-versions", action="store_true",
                    help="delete every version of NAME (give NAME alone)")
    bases = asub.add_parser("base", help="base models that pushes are checked against")
    bsub = bases.add_subparsers(dest="base_command", required=True)
    base = store_command("add", "register a base model: its config.json for shape checks and "
                                "its fingerprint, so adapters naming any copy of it match", bsub)
    base.add_argument("dir", help="the model's folder (config.json and safetensors weights)")
    base.add_argument("--id", required=True,
                      help="the base's canonical id: executors serving it should use it")
    base.add_argument("--name", action="append", default=[], dest="names",
                      help="another name adapters may give it, e.g. a hub id or a local path "
                           "(repeatable; replaces the names it had)")
    base.add_argument("--revision", default="", help="the base's revision or hash, recorded")
    store_command("list", "registered base models", bsub)
    store_command("stats", "host tier and registry counters of a store")


class _ProgressBar:
    """A push's progress, redrawn in place on one stderr line; `end` finishes that line, so what
    is printed next (the result, or an error) starts on a line of its own."""

    WIDTH = 30

    def __init__(self):
        self.is_drawn = False

    def __call__(self, done: int, total: int) -> None:
        filled = self.WIDTH * done // max(total, 1)
        print(f"\r  uploading [{'#' * filled}{'.' * (self.WIDTH - filled)}] {done / 2**20:.1f}/"
              f"{total / 2**20:.1f} MiB", end="", file=sys.stderr, flush=True)
        self.is_drawn = True

    def end(self) -> None:
        if self.is_drawn:
            print(file=sys.stderr, flush=True)
            self.is_drawn = False


def _metadata(args: argparse.Namespace) -> pb.VersionMetadata:
    scores = {}
    for item in args.eval:
        metric, _, value = item.partition("=")
        try:
            scores[metric] = float(value)
        except ValueError:
            sys.exit(f"error: --eval {item!r}: use METRIC=NUMBER")
    return client.version_metadata(args.dataset, scores, args.base_revision, args.alias)


def _base_match(info: common_pb2.AdapterInfo) -> str:
    """How the store matched the adapter's base_model_name_or_path to its base_model."""
    text = info.base_model_name_or_path
    if info.base_match == common_pb2.BASE_MATCH_FINGERPRINT:
        return (f"matched by fingerprint {info.base_fingerprint[:16]}... of the folder {text!r}")
    if info.base_match == common_pb2.BASE_MATCH_NAME:
        return f"matched by name {text!r}"
    if info.base_match == common_pb2.BASE_MATCH_ID:
        return "matched by id"
    if info.base_match == common_pb2.BASE_MATCH_UNREGISTERED:
        return "not a registered base model"
    return "pushed before bases were matched"


def _print_listed(d: pb.AdapterDetails) -> None:
    i = d.info
    print(f"{str(AdapterRef.of(i)):32s} {i.owner_tenant or 'public':10s} "
          f"{i.rank:4d} {i.num_bytes / 2**20:7.2f}  {','.join(d.aliases) or '-':16s} "
          f"{i.base_model}")


def _describe(d: pb.AdapterDetails) -> str:
    i = d.info
    aliases = f"  (aliases: {', '.join(d.aliases)})" if d.aliases else ""
    revision = f" @ {d.base_model_revision}" if d.base_model_revision else ""
    evals = ", ".join(f"{k}={v:g}" for k, v in sorted(d.eval_scores.items()))
    lines = [str(AdapterRef.of(i)) + aliases,
             f"  owner      {i.owner_tenant or 'public'}",
             f"  base       {i.base_model}{revision} ({_base_match(i)})",
             f"  rank       {i.rank} (alpha {i.alpha:g}{', rsLoRA' if i.use_rslora else ''})"
             + (f", patterns {dict(d.rank_pattern)}" if d.rank_pattern else ""),
             f"  targets    {' '.join(i.target_modules)}",
             *([f"  activated  from its invocation, token ids "
                f"{list(i.alora_invocation_tokens)} (an activated LoRA)"]
               if i.alora_invocation_tokens else []),
             f"  weights    {i.num_bytes / 2**20:.2f} MiB {d.dtype}, sha256 {i.sha256[:16]}...",
             f"  dataset    {d.training_dataset or '-'}",
             f"  evals      {evals or '-'}",
             f"  created    {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(i.created_unix))}"
             f"  from {d.source or '-'}"]
    return "\n".join(lines)


def _store_stats(s: pb.StoreStatsResponse) -> str:
    """A store's StoreStatsResponse, one counter per line."""
    lookups = s.host_hits + s.host_misses + s.host_joined
    hit_rate = f" ({s.host_hits / lookups:.0%} hits)" if lookups else ""
    return "\n".join([
        f"blob store       {s.blob_store}",
        f"registry         names {s.num_adapters}, versions {s.num_versions}",
        f"host tier        held {s.host_entries}, {s.host_bytes / 2**20:.1f} of "
        f"{s.host_capacity_bytes / 2**20:.1f} MiB, evicted {s.host_evictions}",
        f"host lookups     hits {s.host_hits}, misses {s.host_misses}, joined a read in flight "
        f"{s.host_joined}{hit_rate}",
        f"blob reads       {s.blob_reads} ({s.blob_bytes_read / 2**20:.1f} MiB), failed the "
        f"sha256 check {s.checksum_failures}",
        f"fetches served   {s.fetches}"])


def _query(ref: str) -> AdapterQuery:
    try:
        return AdapterQuery.parse(ref)
    except InvalidArgument as err:
        sys.exit(f"error: {err}")


async def run(args: argparse.Namespace) -> None:
    """One `adapters` subcommand against args.store, printed for a person to read."""
    command = args.adapters_command

    async def call(method: str, request):
        return await client.store_call(args.store, method, request, key=api_key.read(args))

    if command == "push":
        progress = _ProgressBar()
        try:
            info = await client.push_adapter(args.store, args.dir, args.name, args.tenant,
                                             progress, _metadata(args), key=api_key.read(args))
        except ValueError as err:  # the local base folder's checkpoint is unreadable
            sys.exit(f"error: {err}")
        finally:
            progress.end()
    elif command == "register":
        info = await call("Register", pb.RegisterRequest(
            name=args.name, owner_tenant=args.tenant, source_uri=args.uri,
            metadata=_metadata(args)))
    if command in ("push", "register"):
        ref = AdapterRef.of(info)
        print(f"registered {ref} (rank {info.rank}, "
              f"{len(info.target_modules)} modules, {info.num_bytes / 2**20:.2f} MiB, "
              f"owner {info.owner_tenant or 'public'}, base {info.base_model}: "
              f"{_base_match(info)})")
        if info.version > 1:
            print(f"note: requests naming {info.name} get {ref} within {RESOLVE_TTL_S:g} s "
                  f"(services reuse a name's resolution that long); name {ref} to have it at "
                  "once")
    elif command == "list":
        request = pb.ListAdaptersRequest(tenant=args.tenant, name=args.name,
                                         all_versions=args.all_versions)
        print(f"{'ADAPTER':32s} {'OWNER':10s} {'RANK':>4s} {'MIB':>7s}  {'ALIASES':16s} BASE")
        while True:  # page by page
            listed = await call("ListAdapters", request)
            for d in listed.adapters:
                _print_listed(d)
            if not listed.next_page_token:
                break
            request.page_token = listed.next_page_token
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
        if args.remove and (version or query.alias):
            sys.exit(f"error: --remove takes the adapter's NAME alone ({name}), not "
                     f"{args.ref}: the alias is removed whatever it points at")
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
        if version and args.all_versions:
            sys.exit(f"error: --all-versions deletes every version of {name}: give NAME alone, "
                     f"or NAME@VERSION without --all-versions")
        answer = await call("DeleteAdapter", pb.DeleteAdapterRequest(
            name=name, version=version, tenant=args.tenant))
        print(f"deleted {name} versions {', '.join(map(str, answer.versions))}")
    elif command == "base" and args.base_command == "list":
        listed = await call("ListBaseModels", pb.ListBaseModelsRequest())
        print(f"{'BASE MODEL':32s} {'LAYERS':>6s}  {'FINGERPRINT':19s} NAMES")
        for b in listed.base_models:
            fingerprint = f"{b.fingerprint[:16]}..." if b.fingerprint else "-"
            print(f"{b.model_id:32s} {b.num_layers:6d}  {fingerprint:19s} "
                  f"{', '.join(b.names) or '-'}")
    elif command == "base":
        folder = pathlib.Path(args.dir)
        config_json = (folder / "config.json").read_text()
        try:
            fingerprint = await asyncio.to_thread(base_fingerprint, folder)
        except ValueError as err:
            sys.exit(f"error: {err}")
        base = await call("RegisterBaseModel", pb.RegisterBaseModelRequest(
            model_id=args.id, config_json=config_json, revision=args.revision,
            fingerprint=fingerprint or "", names=args.names))
        print(f"registered base model {base.model_id} ({base.num_layers} layers, revision "
              f"{base.revision or '-'}, config sha256 {base.config_sha256[:16]}..., fingerprint "
              f"{base.fingerprint[:16] + '...' if base.fingerprint else '-'}, names "
              f"{', '.join(base.names) or '-'})")
        if fingerprint is None:
            print(f"note: {folder} holds no safetensors weights, so it was registered without a "
                  "fingerprint: adapters match it by --id and --name only")
    elif command == "stats":
        print(_store_stats(await call("Stats", pb.StoreStatsRequest())))
