"""GPU check of the SGMV LoRA kernels (issue 3). Run it with `bench/gpu_check.sh`.

Sections, each catching its own failure (printed; the script goes on), the markdown report
rewritten after each so a cut-off run still leaves one:
  1. device-to-device copy bandwidth (the roofline every number below is compared with);
  2. every kernel vs its torch reference, bf16 and fp16, at Llama-3-8B shapes;
  3. a whole executor decode step of a random-weight 8B model, 64 rows: base only, one rank-16
     adapter, 64 distinct rank-16 adapters, with the memory floor beside it;
  4. the last hop of an adapter load as the executor makes it (executor/slot_copy.py): views into
     a pinned staging buffer copied into a slot on a side stream, bf16 and fp32 files; checked
     bit for bit; its time against a plain pinned copy of the same bytes; decode steps timed
     while loads run beside them (the step loop must not wait on a load);
  5. kernel timings (triton.testing.do_bench, median) over tokens x adapters x ranks: GB/s vs the
     copy, LoRA time / base matmul time, speed-up over a torch gather+bmm baseline.
`--smoke` runs a tiny version on CPU through the Triton interpreter (checks the script itself).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (Triton interpreter)")
ARGS.add_argument("--budget-s", type=float, default=420.0, help="stop timing configs after this")
ARGS.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu-check.md"))
OPTS = ARGS.parse_args()
if OPTS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton defines any kernel
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

if "safetensors" not in sys.modules:
    try:
        import safetensors  # noqa: F401
    except ImportError:  # random weights never read a checkpoint: a stub lets executor import
        sys.modules["safetensors"] = types.SimpleNamespace(safe_open=None)

from executor.lora import (  # noqa: E402
    LORA_GROUPS,
    LORA_MODULES,
    LoraModuleWeights,
    LoraSlotPool,
    LoraWeights,
    TorchLoraBackend,
    TritonLoraBackend,
)
from executor.model_config import ModelConfig  # noqa: E402
from kernels.reference import TOLERANCES, sgmv_fused_ref, sgmv_shrink_ref  # noqa: E402
from kernels.sgmv_shrink import sgmv_shrink  # noqa: E402

DEVICE = "cpu" if OPTS.smoke else "cuda"
MODEL = "tiny" if OPTS.smoke else "llama-3-8b"
CFG = ModelConfig.named(MODEL)
TOKENS = (4,) if OPTS.smoke else (1, 16, 64, 256, 2048)
ADAPTERS = (1, 2) if OPTS.smoke else (1, 8, 32, 64, 128)
RANKS = (16,) if OPTS.smoke else (8, 16, 64)
START = time.perf_counter()
REPORT: list[str] = []


def bench_ms(fn) -> float:
    """Median ms of fn: do_bench on CUDA (L2 flushed between calls), one wall-clock run on CPU."""
    if DEVICE == "cuda":
        return triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def section(title: str):
    def wrap(fn):
        def run(*a, **kw):
            print(f"\n== {title} ({time.perf_counter() - START:.0f} s)", flush=True)
            REPORT.append(f"\n## {title}\n")
            try:
                return fn(*a, **kw)
            except Exception:  # noqa: BLE001 (report and go on: the other sections still measure)
                err = traceback.format_exc()
                print(err, flush=True)
                REPORT.append(f"**FAILED**\n\n```\n{err[-3000:]}\n```\n")
            finally:
                write_report()
        return run
    return wrap


def write_report() -> None:
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke)"
    head = [f"# GPU check: SGMV LoRA kernels ({MODEL} shapes)\n",
            (f"Device: {device}; torch {torch.__version__}, triton {triton.__version__}; "
             f"{time.strftime('%Y-%m-%d %H:%M')}; {time.perf_counter() - START:.0f} s.\n")]
    Path(OPTS.out).parent.mkdir(parents=True, exist_ok=True)
    Path(OPTS.out).write_text("\n".join(head + REPORT) + "\n")


def table(header: list[str], rows: list[list]) -> str:
    fmt = [[f"{v:.3g}" if isinstance(v, float) else str(v) for v in r] for r in rows]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in fmt]) + "\n"


def random_adapter(config: ModelConfig, ranks: dict[str, int], seed: int,
                   layers=None) -> LoraWeights:
    """ranks: module -> rank (modules left out are not targeted)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    mods = {}
    for layer in layers if layers is not None else range(config.num_hidden_layers):
        for m, r in ranks.items():
            in_f, out_f = config.module_shape(m)
            a = torch.randn(r, in_f, generator=g, device=DEVICE) * in_f ** -0.5
            b = torch.randn(out_f, r, generator=g, device=DEVICE) * 0.02
            mods[(layer, m)] = LoraModuleWeights(a, b, 2.0)
    return LoraWeights(mods)


def one_layer_pool(num_slots: int, max_rank: int, dtype, rank_of) -> LoraSlotPool:
    """A one-layer pool; slot s holds an adapter with ranks rank_of(s) (module -> rank)."""
    pool = LoraSlotPool(CFG.replace(num_hidden_layers=1), num_slots=num_slots, max_rank=max_rank,
                        dtype=dtype, device=DEVICE)
    for s in range(num_slots):
        pool.load(s, random_adapter(pool.config, rank_of(s), s))
    return pool


def group_shapes(group: str) -> tuple[int, int]:
    """(in_features, sum of out_features) of a group's fused projection."""
    modules = LORA_GROUPS[group]
    return CFG.module_shape(modules[0])[0], sum(CFG.module_shape(m)[1] for m in modules)


@section("1. Copy bandwidth")
def copy_bandwidth() -> float:
    n = (1 << 30) if DEVICE == "cuda" else (1 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    gbs = 2 * n / ms / 1e6  # read + write
    REPORT.append(f"Device-to-device copy of {n >> 20} MiB: {ms:.3f} ms, **{gbs:.0f} GB/s** "
                  f"(read + write bytes). All GB/s below are against this.\n")
    print(f"copy: {gbs:.0f} GB/s")
    return gbs


@section("2. Kernels vs torch references (real shapes)")
def correctness() -> None:
    mixed = {0: 64, 1: 16, 2: 8}  # slot % 3 -> rank; every 5th adapter leaves k/v/up untargeted
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        def rank_of(s):
            return {m: mixed[s % 3] for m in LORA_MODULES
                    if not (s % 5 == 4 and m in ("k_proj", "v_proj", "up_proj"))}
        pool = one_layer_pool(48, 64, dtype, rank_of)
        scenarios = {  # name -> row slots (-1 = no adapter)
            "decode 64 rows, 40 adapters": torch.tensor(
                sorted([-1] * 8 + [s for s in range(40)] + [7] * 16)),
            "prefill 700 rows, 3 adapters": torch.tensor([-1] * 20 + [2] * 300 + [4] * 7
                                                         + [5] * 373),
        }
        if OPTS.smoke:
            scenarios = {"smoke": torch.tensor([-1, 0, 0, 1, 2, 2, 2])}
        for name, row_slots in scenarios.items():
            for path, fused_max_rows in (("fused", 1 << 30), ("shrink+expand", 0)):
                backend = TritonLoraBackend(pool, fused_max_rows=fused_max_rows)
                meta = backend.prepare(row_slots)
                torch_backend = TorchLoraBackend(pool)
                torch_meta = torch_backend.prepare(row_slots)
                for group in LORA_GROUPS:
                    rows.append([str(dtype)[6:], name, path, group,
                                 *check_group(pool, backend, meta, torch_backend, torch_meta,
                                              group, len(row_slots), dtype)])
    REPORT.append("err = max |kernel - reference| / (tolerance); pass when <= 1. The torch "
                  "backend (PEFT rounding order) is compared at 4x the tolerance.\n\n")
    REPORT.append(table(["dtype", "rows", "path", "group", "err vs sgmv ref",
                         "err vs torch backend", "pass"], rows))
    print(table(["dtype", "rows", "path", "group", "err", "err torch", "pass"], rows))


def check_group(pool, backend, meta, torch_backend, torch_meta, group, num_rows, dtype):
    g, work = pool.groups[group], meta.work
    in_f, n = group_shapes(group)
    gen = torch.Generator(device=DEVICE).manual_seed(num_rows)
    x = torch.randn(num_rows, in_f, generator=gen, device=DEVICE).to(dtype)
    base = torch.randn(num_rows, n, generator=gen, device=DEVICE).to(dtype)
    got, ref, via_torch = base.clone(), base.clone(), base.clone()
    backend.apply(0, group, x, got, meta)
    torch_backend.apply(0, group, x, via_torch, torch_meta)
    m = slice(g.first_module, g.first_module + len(g.modules))
    rank_block = work.rank_block(g.first_module, len(g.modules))
    sgmv_fused_ref(x, g.a[0], g.bt[0], ref, work.items, work.ranks[0, m], work.scales[0, m],
                   g.out_sizes, block_m=work.block_m, rank_block=rank_block)
    rtol, atol = TOLERANCES[dtype]
    scale = float(ref.float().abs().max())

    def err(a, b, k=1.0):
        bound = k * (atol * scale + rtol * b.float().abs())
        return float(((a.float() - b.float()).abs() / bound).max())

    e_ref, e_torch = err(got, ref), err(got, via_torch, 4.0)
    if backend.fused_max_rows == 0:  # the shrink's fp32 intermediate too
        t = sgmv_shrink(x, g.a[0], work.items, work.ranks[0, m], block_m=work.block_m,
                        rank_block=rank_block)
        t_ref = sgmv_shrink_ref(x, g.a[0], work.items, work.ranks[0, m], block_m=work.block_m,
                                rank_block=rank_block)
        rows = torch.cat([torch.arange(s, e) for s, e in work.items[:2].t().tolist()])
        e_ref = max(e_ref, err(t[rows], t_ref[rows]))
    return [e_ref, e_torch, "yes" if e_ref <= 1 and e_torch <= 1 else "**NO**"]



class Driver:
    """A stand-in scheduler for the decode-step bench: fresh block ids, rows sorted by slot."""

    def __init__(self, runner) -> None:
        self.runner, self.free = runner, list(range(runner.kv.num_blocks))
        self.state: dict[int, list] = {}  # seq id -> [computed, total, blocks, slot]

    def add(self, seq_id: int, prompt: list[int], slot: int) -> None:
        from executor.runner import SamplingParams
        self.runner.add_sequence(seq_id, prompt, SamplingParams(), slot)
        self.state[seq_id] = [0, len(prompt), [], slot]

    def step(self, chunk: int) -> None:
        from executor.runner import Row
        rows, bs = [], self.runner.kv.block_size
        for sid, st in sorted(self.state.items(), key=lambda item: item[1][3]):
            n = min(chunk, st[1] - st[0])
            new = [self.free.pop() for _ in range(-(-(st[0] + n) // bs) - len(st[2]))]
            st[2] += new
            rows.append(Row(sid, n, tuple(new)))
        for s in self.runner.step(rows):
            self.state[s.seq_id][1] += 1
        for r in rows:
            self.state[r.seq_id][0] += r.num_tokens


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def time_decode(runner, slots: list[int], prompt_len: int, steps: int) -> tuple[float, float]:
    """(prefill step ms, median decode step ms) for one row per entry of `slots`."""
    runner.free_all()
    driver = Driver(runner)
    g = torch.Generator().manual_seed(0)
    for sid, slot in enumerate(slots):
        driver.add(sid, torch.randint(2, runner.config.vocab_size, (prompt_len,),
                                      generator=g).tolist(), slot)
    sync()
    t0 = time.perf_counter()
    driver.step(prompt_len)  # the whole prompt: a prefill step of len(slots) * prompt_len rows
    sync()
    prefill_ms = (time.perf_counter() - t0) * 1e3
    times = []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        driver.step(1)  # the runner samples on the host: every step ends synchronised
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
    return prefill_ms, statistics.median(times)


@section("3. Executor decode step, 64 rows (8B-shaped random weights, bf16)")
def decode_step(copy_gbs: float) -> None:
    from executor.runner import ModelRunner
    num_rows, rank = (4, 8) if OPTS.smoke else (64, 16)
    dtype = torch.float32 if OPTS.smoke else torch.bfloat16
    t0 = time.perf_counter()
    runner = ModelRunner.random(MODEL, dtype=dtype, device=DEVICE, num_kv_blocks=1024,
                                block_size=16, num_slots=num_rows + 1, max_rank=rank,
                                lora_backend="triton")  # the last slot: for section 4
    ranks = dict.fromkeys(LORA_MODULES, rank)
    for s in range(num_rows):
        runner.load_adapter(s, random_adapter(runner.config, ranks, 1000 + s))
    sync()
    print(f"model + {num_rows} adapters ready in {time.perf_counter() - t0:.0f} s", flush=True)
    c = runner.config
    w = runner.weights
    base_bytes = w.num_bytes() - w.embed.numel() * w.embed.element_size()  # embed: rows only
    per_adapter = c.num_hidden_layers * sum(rank * sum(c.module_shape(m)) for m in LORA_MODULES)
    per_adapter *= torch.empty((), dtype=dtype).element_size()
    steps = 2 if OPTS.smoke else 10
    cases = [("base only", [-1] * num_rows, 0), ("1 adapter (all rows)", [0] * num_rows, 1),
             (f"{num_rows} distinct adapters", list(range(num_rows)), num_rows)]
    rows, base_ms = [], None
    for name, slots, num_adapters in cases:
        prefill_ms, ms = time_decode(runner, slots, 32, steps)
        floor_ms = (base_bytes + num_adapters * per_adapter) / copy_gbs / 1e6
        base_ms = base_ms or ms
        rows.append([name, "triton", ms, ms / base_ms, floor_ms, ms / floor_ms, prefill_ms])
        print(rows[-1], flush=True)
    runner.lora = runner.model.lora = TorchLoraBackend(runner.pool)
    prefill_ms, ms = time_decode(runner, list(range(num_rows)), 32, 2)
    floor_ms = (base_bytes + num_rows * per_adapter) / copy_gbs / 1e6
    rows.append([f"{num_rows} distinct adapters", "torch", ms, ms / base_ms, floor_ms,
                 ms / floor_ms, prefill_ms])
    REPORT.append(
        f"Median of {steps} decode steps (after 3 warm-up) of {num_rows} sequences, 32-token "
        f"prompts, rank-{rank} adapters on all 7 projections ({per_adapter / 1e6:.0f} MB each). "
        f"Floor = (base weights read per step {base_bytes / 1e9:.2f} GB + adapters' bytes) / "
        f"copy bandwidth. Targets: 1 adapter <= 1.05x base; {num_rows} distinct <= 1.15x floor."
        f" Step time is wall time (eager PyTorch: includes host launch overhead).\n\n")
    REPORT.append(table(["batch", "backend", "decode step ms", "x base step", "floor ms",
                         "x floor", "prefill step ms"], rows))
    runner.lora = runner.model.lora = TritonLoraBackend(runner.pool)
    adapter_load(runner, rank, steps)
    del runner
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def gather_bmm(pool, group: str, x, out, row_slots) -> None:
    """Baseline: per row, gather its adapter's A and B (padded rank), two batched matmuls."""
    g, off = pool.groups[group], 0
    for i, n in enumerate(g.out_sizes):
        a = g.a[0, :, i][row_slots]  # [T, R, K]
        bt = g.bt[0, :, :, off: off + n][row_slots]  # [T, R, N]
        t = torch.bmm(x[:, None, :], a.transpose(1, 2))  # [T, 1, R]
        out[:, off: off + n] += torch.bmm(t, bt)[:, 0] * 2.0
        off += n


def host_us(fn, n: int = 50) -> float:
    """Host time per call (launch overhead), queueing n calls without waiting for the GPU."""
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    sync()
    return us


def time_group(pool, group, meta, other, other_meta, row_slots, rank, num_adapters,
               copy_gbs, base_cache, auto) -> list:
    """One row of the timing table: a LoRA group of one layer at one (tokens, adapters, rank)."""
    dtype, e, tokens = pool.groups[group].a.dtype, 2, len(row_slots)
    in_f, n = group_shapes(group)
    x = torch.randn(tokens, in_f, device=DEVICE).to(dtype)
    out = torch.zeros(tokens, n, device=DEVICE, dtype=dtype)
    if (tokens, group) not in base_cache:
        w = torch.randn(n, in_f, device=DEVICE).to(dtype)
        base_cache[(tokens, group)] = bench_ms(lambda: F.linear(x, w))
    ms = bench_ms(lambda: auto.apply(0, group, x, out, meta))
    other_ms = (bench_ms(lambda: other.apply(0, group, x, out, other_meta))
                if tokens <= 256 else float("nan"))
    slots_dev = row_slots.to(DEVICE)
    baseline_ms = bench_ms(lambda: gather_bmm(pool, group, x, out, slots_dev))
    moved = e * (tokens * in_f + num_adapters * rank * (len(LORA_GROUPS[group]) * in_f + n)
                 + 2 * tokens * n)
    gbs = moved / ms / 1e6
    path = "fused" if meta.max_seg_len <= auto.fused_max_rows else "shr+exp"
    return [tokens, num_adapters, rank, group, path, ms * 1e3, other_ms * 1e3, gbs,
            gbs / copy_gbs, ms / base_cache[(tokens, group)], baseline_ms / ms,
            host_us(lambda: auto.apply(0, group, x, out, meta))]


def time_rank(rank: int, copy_gbs: float, base_cache: dict) -> tuple[list, int]:
    """Timing rows for every (tokens, adapters) at one rank; and how many configs were skipped."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    pool = one_layer_pool(max(ADAPTERS), rank, dtype, lambda s: dict.fromkeys(LORA_MODULES, rank))
    auto, rows, skipped = TritonLoraBackend(pool), [], 0
    for tokens in TOKENS:
        for num_adapters in (a for a in ADAPTERS if a <= tokens):
            if time.perf_counter() > START + OPTS.budget_s:
                skipped += 1
                continue
            row_slots = torch.arange(tokens) * num_adapters // tokens  # sorted, all adapted
            meta = auto.prepare(row_slots)
            is_fused = meta.max_seg_len <= auto.fused_max_rows
            other = TritonLoraBackend(pool, fused_max_rows=0 if is_fused else 1 << 30)
            other_meta = other.prepare(row_slots)
            for group in LORA_GROUPS:
                rows.append(time_group(pool, group, meta, other, other_meta, row_slots, rank,
                                       num_adapters, copy_gbs, base_cache, auto))
            print(rows[-4:], flush=True)
    return rows, skipped


def staged_adapter(config: ModelConfig, rank: int, dtype, staging: torch.Tensor,
                   seed: int) -> tuple[LoraWeights, LoraWeights]:
    """(views into `staging`, as the executor's parse makes them; the same values elsewhere)."""
    g = torch.Generator().manual_seed(seed)
    staged, source, offset = {}, {}, 0
    for layer in range(config.num_hidden_layers):
        for m in LORA_MODULES:
            in_f, out_f = config.module_shape(m)
            pair = []
            for shape in ((rank, in_f), (out_f, rank)):
                values = (torch.randn(shape, generator=g) * 0.02).to(dtype)
                size = values.numel() * values.element_size()
                view = staging[offset:offset + size].view(dtype).view(shape)
                view.copy_(values)
                pair.append((view, values))
                offset += size
            staged[(layer, m)] = LoraModuleWeights(pair[0][0], pair[1][0], 2.0)
            source[(layer, m)] = LoraModuleWeights(pair[0][1], pair[1][1], 2.0)
    return LoraWeights(staged), LoraWeights(source)


def slot_matches(pool: LoraSlotPool, slot: int, weights: LoraWeights) -> bool:
    """The slot holds exactly `weights` in the pool's dtype, and zero above each rank."""
    for (layer, m), w in weights.modules.items():
        r = w.a.shape[0]
        a, b = pool.a[m][layer, slot].cpu(), pool.b[m][layer, slot].cpu()
        if not (torch.equal(a[:r], w.a.to(a.dtype)) and torch.equal(b[:, :r], w.b.to(b.dtype))
                and not a[r:].any() and not b[:, r:].any()):
            return False
    return True


def plain_copy_ms(host: torch.Tensor) -> float:
    """One host-to-device copy of `host` (pinned on CUDA), the bound for loading it."""
    dst = torch.empty_like(host, device=DEVICE)
    return bench_ms(lambda: dst.copy_(host, non_blocking=True))


@section("4. Adapter load into a slot (pinned staging, side stream) beside decode steps")
def adapter_load(runner, rank: int, steps: int) -> None:
    import threading

    from executor.slot_copy import SlotCopier, StagingBuffers
    pool, slot, copier = runner.pool, runner.pool.num_slots - 1, SlotCopier(runner)
    staging = StagingBuffers(pin_memory=DEVICE == "cuda")
    rows, loaded = [], {}
    for file_dtype in dict.fromkeys((pool.a["q_proj"].dtype, torch.float32)):
        per_adapter = runner.config.num_hidden_layers * sum(
            rank * sum(runner.config.module_shape(m)) for m in LORA_MODULES)
        num_bytes = per_adapter * torch.empty((), dtype=file_dtype).element_size()
        buffer = staging.take(num_bytes)
        staged, source = staged_adapter(runner.config, rank, file_dtype, buffer, seed=7)
        times = []
        for _ in range(6):
            runner.unload_adapter(slot)
            sync()
            t0 = time.perf_counter()
            copier.copy(slot, staged)
            times.append((time.perf_counter() - t0) * 1e3)
        ok = slot_matches(pool, slot, source)
        plain_ms = plain_copy_ms(buffer[:num_bytes])
        ms = statistics.median(times[1:])
        rows.append([f"{str(file_dtype).removeprefix('torch.')} file", f"{num_bytes / 1e6:.0f}",
                     ms, num_bytes / ms / 1e6, plain_ms, ms / plain_ms,
                     "yes" if ok else "**NO**"])
        loaded[file_dtype] = staged
    REPORT.append(
        f"A rank-{rank} adapter on all 7 projections of every layer, as the loader hands it over "
        f"(views into one {'pinned ' if DEVICE == 'cuda' else ''}staging buffer), copied into an "
        f"empty slot (`SlotCopier.copy`: side stream, one wait); the pool is "
        f"{str(pool.a['q_proj'].dtype).removeprefix('torch.')}. Median of 5 after one warm-up; "
        f"'plain copy' = one pinned host-to-device copy of the same bytes (do_bench).\n\n")
    REPORT.append(table(["source", "MB", "load ms", "GB/s", "plain copy ms", "x plain",
                         "slot bit-exact"], rows))
    # Decode steps of every other slot while a thread loads the spare one again and again.
    busy = list(range(slot))
    _, alone_ms = time_decode(runner, busy, 32, steps)
    stop, num_loads = threading.Event(), [0]

    def keep_loading() -> None:
        weights = loaded[pool.a["q_proj"].dtype]
        while not stop.is_set():
            runner.unload_adapter(slot)
            copier.copy(slot, weights)
            num_loads[0] += 1

    thread = threading.Thread(target=keep_loading, daemon=True)
    thread.start()
    try:
        _, beside_ms = time_decode(runner, busy, 32, steps)
    finally:
        stop.set()
        thread.join()
    REPORT.append(
        f"\nDecode step, {len(busy)} rows of {len(busy)} distinct adapters: {alone_ms:.2f} ms "
        f"alone, {beside_ms:.2f} ms while {num_loads[0]} loads ran beside it in another thread "
        f"(**{beside_ms / alone_ms:.2f}x**; the loads share the GPU's copy engine and memory "
        f"bandwidth, not its stream).\n")
    print(rows, f"decode {alone_ms:.2f} -> {beside_ms:.2f} ms beside {num_loads[0]} loads",
          flush=True)


@section("5. Kernel timings (bf16, Llama-3-8B projections, one layer)")
def kernel_timings(copy_gbs: float) -> None:
    rows, base_cache, skipped = [], {}, 0
    for rank in RANKS:
        rank_rows, rank_skipped = time_rank(rank, copy_gbs, base_cache)
        rows += rank_rows
        skipped += rank_skipped
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    REPORT.append(
        "Per LoRA group of one layer (qkv: q|k|v slices; gate_up: gate|up). Rows split evenly "
        "over the adapters, every row adapted, each adapter at the stated rank. us = GPU time "
        "(do_bench median, L2 flushed); 'other path' = the path not chosen (fused vs shrink + "
        "expand), timed up to 256 tokens; GB/s on the bytes the op must move (x, each adapter's "
        "A and B once, the output read and written); x base = LoRA time / the base matmul "
        "of the same projection; speed-up vs a torch gather + bmm; host us = launch overhead "
        "per call.\n\n")
    REPORT.append(table(["tokens", "adapters", "rank", "group", "path", "us", "other path us",
                         "GB/s", "of copy", "x base", "speed-up vs gather+bmm", "host us"],
                        rows))
    if skipped:
        REPORT.append(f"\n{skipped} configs skipped: past the {OPTS.budget_s:.0f} s budget.\n")


def main() -> None:
    copy_gbs = copy_bandwidth() or float("nan")
    correctness()
    decode_step(copy_gbs)
    kernel_timings(copy_gbs)
    print(f"\nwrote {OPTS.out} in {time.perf_counter() - START:.0f} s")


if __name__ == "__main__":
    main()
