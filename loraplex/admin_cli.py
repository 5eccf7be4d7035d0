"""`loraplex admin`: the scheduler's operator RPCs (protos/scheduler.proto) from a shell.

    loraplex admin stats                 residency per executor, queues, tenant counters
    loraplex admin prewarm ADAPTER [--executors N] [--pin] [--wait]
    loraplex admin evict ADAPTER [--executor HOST:PORT]
    loraplex admin drain HOST:PORT       admit nothing new there; what runs finishes
    loraplex admin resume HOST:PORT      admit there again
    loraplex admin merge ADAPTER [--executors N]   merge it into N executors' weights
    loraplex admin unmerge [ADAPTER] [--executor HOST:PORT]

prewarm, evict, drain, resume, merge and unmerge need an admin key; stats takes any key (a
tenant key sees its own counters only). A refused call prints one line on stderr (error: CODE:
details) and exits with status 1.
"""

import argparse
from collections.abc import Awaitable, Callable

from common.server import insecure_channel
from loraplex import api_key, client
from protos import scheduler_pb2 as pb
from protos import scheduler_pb2_grpc

# Deadline of every admin call, unless --timeout-s says otherwise.
CALL_TIMEOUT_S = 60.0
# Deadline of `prewarm --wait`, which answers once the loads finish: each takes the adapter's bytes
# over the measured bandwidth (at least the scheduler's --load-floor-s, 30 s), retried on failure.
PREWARM_WAIT_TIMEOUT_S = 300.0

Stub = scheduler_pb2_grpc.SchedulerStub
# What each subcommand does: one call on the stub, within the deadline, answered as text.
Action = Callable[[Stub, argparse.Namespace, float], Awaitable[str]]


def add_parser(sub: argparse._SubParsersAction, default_scheduler: str) -> None:
    """The `admin` command and its subcommands, each with --scheduler, --timeout-s and the key."""
    admin = sub.add_parser("admin", help="the scheduler's operator RPCs: stats, prewarm, evict, "
                                         "drain, resume", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = admin.add_subparsers(dest="admin_command", required=True)

    def command(name: str, help: str, action: Action) -> argparse.ArgumentParser:
        parser = commands.add_parser(name, help=help)
        parser.add_argument("--scheduler", default=default_scheduler,
                            help="scheduler address (default: %(default)s, as `loraplex up` "
                                 "starts it)")
        parser.add_argument("--timeout-s", type=_positive(float), default=None,
                            help=f"deadline of the call (default: {CALL_TIMEOUT_S:g}; "
                                 f"prewarm --wait: {PREWARM_WAIT_TIMEOUT_S:g})")
        api_key.add_argument(parser)
        parser.set_defaults(admin_action=action)
        return parser

    command("stats", "residency per executor, queues and tenant counters (any key)", _stats)
    prewarm = command("prewarm", "load an adapter onto executors ahead of traffic", _prewarm)
    prewarm.add_argument("adapter", help="NAME or NAME@VERSION")
    prewarm.add_argument("--executors", type=_positive(int), default=1,
                         help="on how many executors it should be resident (default 1)")
    prewarm.add_argument("--pin", action="store_true",
                         help="keep it resident until evicted (LRU never takes its slots)")
    prewarm.add_argument("--wait", action="store_true", help="answer once the loads finished")
    evict = command("evict", "free the slots holding an adapter (refused while it runs)", _evict)
    evict.add_argument("adapter", help="NAME or NAME@VERSION")
    evict.add_argument("--executor", default="", help="only on this executor (default: all)")
    drain = command("drain", "admit nothing new on an executor; running work finishes there",
                    _drain)
    drain.add_argument("executor", help="HOST:PORT, as `loraplex admin stats` lists it")
    resume = command("resume", "admit on a drained executor again", _resume)
    resume.add_argument("executor", help="HOST:PORT, as `loraplex admin stats` lists it")
    merge = command("merge", "dedicate executors to an adapter, merged into their weights",
                    _merge)
    merge.add_argument("adapter", help="NAME or NAME@VERSION")
    merge.add_argument("--executors", type=_positive(int), default=1,
                       help="into how many executors (default 1; one must keep serving all)")
    unmerge = command("unmerge", "let merged executors serve every adapter again", _unmerge)
    unmerge.add_argument("adapter", nargs="?", default="",
                         help="NAME or NAME@VERSION (default: whatever is merged)")
    unmerge.add_argument("--executor", default="", help="only this executor (default: all)")


async def run(args: argparse.Namespace) -> None:
    """One admin call against args.scheduler, printed for a person to read."""
    timeout_s = args.timeout_s or (
        PREWARM_WAIT_TIMEOUT_S if getattr(args, "wait", False) else CALL_TIMEOUT_S)
    async with insecure_channel(args.scheduler, api_key.read(args)) as channel:
        print(await args.admin_action(Stub(channel), args, timeout_s))


async def _stats(stub: Stub, args: argparse.Namespace, timeout_s: float) -> str:
    return format_stats(await stub.Stats(pb.StatsRequest(), timeout=timeout_s))


async def _prewarm(stub: Stub, args: argparse.Namespace, timeout_s: float) -> str:
    answer = await stub.Prewarm(pb.PrewarmRequest(
        adapter=args.adapter, num_executors=args.executors, pin=args.pin, wait=args.wait),
        timeout=timeout_s)
    where = ", ".join(answer.executors)
    state = "ready" if args.wait else "resident or loading (--wait waits for the loads)"
    return f"{client.ref_text(answer.adapter)} {state} on {where}" + \
        (", pinned until evicted" if args.pin else "")


async def _merge(stub: Stub, args: argparse.Namespace, timeout_s: float) -> str:
    answer = await stub.Merge(pb.MergeRequest(adapter=args.adapter, num_executors=args.executors),
                              timeout=timeout_s)
    return (f"{client.ref_text(answer.adapter)} dedicated to {', '.join(answer.executors)}: "
            "each merges once its other work ends (`loraplex admin stats` shows when)")


async def _unmerge(stub: Stub, args: argparse.Namespace, timeout_s: float) -> str:
    answer = await stub.Unmerge(pb.UnmergeRequest(adapter=args.adapter, executor=args.executor),
                                timeout=timeout_s)
    if not answer.executors:
        return "nothing was merged there: nothing to do"
    return f"unmerged on {', '.join(answer.executors)}: they serve every adapter again"


async def _evict(stub: Stub, args: argparse.Namespace, timeout_s: float) -> str:
    answer = await stub.Evict(pb.EvictRequest(adapter=args.adapter, executor=args.executor),
                              timeout=timeout_s)
    where = f" on {args.executor}" if args.executor else ""
    if not answer.num_evicted:
        return f"{args.adapter} is not resident{where}: nothing evicted"
    return f"evicted {args.adapter}{where}: {_count(answer.num_evicted, 'slot')} freed"


async def _drain(stub: Stub, args: argparse.Namespace, timeout_s: float) -> str:
    answer = await stub.Drain(pb.DrainRequest(executor=args.executor), timeout=timeout_s)
    if not answer.running:
        return f"drained {args.executor}: admits nothing new, nothing runs there"
    return (f"draining {args.executor}: admits nothing new; {_count(answer.running, 'sequence')} "
            "running there finish first (see `loraplex admin stats`)")


async def _resume(stub: Stub, args: argparse.Namespace, timeout_s: float) -> str:
    answer = await stub.Resume(pb.ResumeRequest(executor=args.executor), timeout=timeout_s)
    return (f"resumed {args.executor}: admitting again, {_count(answer.queued, 'request')} "
            "queued on it")


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


def format_stats(stats: pb.StatsResponse) -> str:
    """Executors (with their occupied slots) and tenants, as two tables."""
    lines = []
    if stats.executors:
        lines.append(f"{'EXECUTOR':22s} {'STATE':9s} {'RUNNING':>7s} {'QUEUED':>6s} "
                     f"{'FREE KV':>13s} {'CACHED':>7s} {'STEPS':>8s} {'LOADS':>6s} {'HITS':>6s}")
        for ex in stats.executors:
            kv = f"{ex.free_kv_blocks}/{ex.num_kv_blocks}"
            lines.append(f"{ex.address:22s} {state_of(ex):9s} {ex.running:7d} {ex.queued:6d} "
                         f"{kv:>13s} {ex.cached_kv_blocks:7d} {ex.steps:8d} {ex.adapter_loads:6d} "
                         f"{ex.adapter_hits:6d}")
            used = [(i, s) for i, s in enumerate(ex.slots) if s.state != "empty"]
            if client.ref_text(ex.dedicated_to):
                state = "merged" if ex.is_merged else "merging once its other work ends"
                lines.append(f"  dedicated to {client.ref_text(ex.dedicated_to)} ({state})")
            pages = (f"; adapters' pages {ex.adapter_pages} blocks "
                     f"({ex.adapter_pages * ex.page_bytes / 2**20:.1f} MiB)"
                     if ex.page_bytes else "")
            evicted = (f"; {ex.adapter_evictions} adapters evicted for room, "
                       f"{ex.adapter_early_evictions} before they served anyone"
                       if ex.adapter_evictions else "")
            behind = (f"; {ex.kv_blocks_behind_windows} KV blocks not held behind sliding "
                      "windows" if ex.kv_blocks_behind_windows else "")
            preempted = (f"; preempted for KV: {ex.preemptions} sequences"
                         if ex.preemptions else "")
            lines.append(f"  {len(used)} of {len(ex.slots)} slots in use{pages}{evicted}{behind}"
                         f"{preempted}")
            if ex.quantization:
                lines.append(f"  quantized base ({ex.quantization}): "
                             f"{ex.quantized_freed_bytes / 1e9:.2f} GB freed against 16-bit "
                             f"weights = {ex.quantized_freed_kv_tokens:,} KV tokens, or "
                             f"{ex.quantized_freed_blocks:,} blocks of KV or adapters' pages")
            if ex.decode_graph_buckets:
                lines.append(f"  decode steps of up to {max(ex.decode_graph_buckets)} sequences "
                             "replay CUDA graphs (batch sizes "
                             f"{', '.join(map(str, ex.decode_graph_buckets))})")
            elif ex.decode_graphs_off:
                lines.append(f"  CUDA graphs off, every step eager: {ex.decode_graphs_off}")
            lines.extend(f"  slot {i:<3d} {_slot(s)}" for i, s in used)
    else:
        lines.append("EXECUTORS: none shown (a tenant key sees its own counters only)")
    lines.append("")
    lines.append(f"{'TENANT':20s} {'QUEUED':>6s} {'RUNNING':>7s} {'REQUESTS':>8s} "
                 f"{'PROMPT TOK':>10s} {'CACHED':>7s} {'OUTPUT TOK':>10s} {'LOADS':>6s} "
                 f"{'VIRTUAL':>10s}")
    lines.extend(f"{t.tenant or '-':20s} {t.queued:6d} {t.running:7d} {t.requests:8d} "
                 f"{t.prompt_tokens:10d} {_share(t.cached_prompt_tokens, t.prompt_tokens):>7s} "
                 f"{t.completion_tokens:10d} {t.adapter_loads_caused:6d} "
                 f"{t.virtual_counter:10.1f}" for t in stats.tenants)
    if not stats.tenants:
        lines.append("(no tenant seen yet)")
    return "\n".join(lines)


def state_of(ex: pb.ExecutorStats) -> str:
    """up, down, draining, drained, merging or merged."""
    if not ex.is_up:
        return "down"
    if ex.is_merged or client.ref_text(ex.dedicated_to):
        return "merged" if ex.is_merged else "merging"
    return "drained" if ex.is_drained else "draining" if ex.is_draining else "up"


def _slot(slot: pb.SlotStats) -> str:
    text = f"{client.ref_text(slot.adapter) or '-':24s} {slot.state:8s} pins {slot.pins}"
    if slot.num_pages:
        text += f", {slot.num_pages} pages"
    if slot.is_admin_pinned:
        text += ", pinned by an admin"
    if client.ref_text(slot.reserved_for):
        text += f", reserved for {client.ref_text(slot.reserved_for)}"
    return text


def _positive(kind):
    """An argparse type: a number of `kind` above 0."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r}: give a number above 0")
        return value

    return parse


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"
