"""GPU check of the SGMV LoRA kernels (issue 3) and the paged-attention kernel (issue 16). Run it
with `bench/gpu_check.sh`.

Sections, each catching its own failure (printed; the script goes on), the markdown report
rewritten after each so a cut-off run still leaves one:
  1. device-to-device copy bandwidth (the roofline every number below is compared with);
  2. every kernel vs its torch reference, bf16 and fp16, at Llama-3-8B shapes;
  3. a whole executor decode step of a random-weight 8B model, 64 rows: base only, one rank-16
     adapter, 64 distinct rank-16 adapters, with the memory floor beside it;
  4. the last hop of an adapter load as the executor makes it (executor/lora/slot_copy.py): views
     into a pinned staging buffer copied into a slot on a side stream, bf16 and fp32 files; checked
     bit for bit; its time against a plain pinned copy of the same bytes; decode steps timed
     while loads run beside them (the step loop must not wait on a load);
  5. the paged-attention kernel vs its torch reference at 8B attention shapes (64 decode rows of
     mixed lengths up to 4k, sliding window on and off, prefill chunks beside decode rows), and
     its time against the old padded gather + SDPA decode path (bench/gpu_attention.py);
  6. adapters in pages at their ranks (a 70/20/10 mix of ranks 8/16/64) against the same number
     padded to rank 64 (what vLLM and LoRAX store and multiply), decode and prefill, per group;
  7. SGMV kernel timings (triton.testing.do_bench, median) over tokens x adapters x ranks: GB/s vs
     the copy, LoRA time / base matmul time, speed-up over a torch gather+bmm baseline (within
     --budget-s: the section that is cut short when time runs out);
  8. a step's sampling with penalties, logit_bias and alternatives on every row against none
     (bench/gpu_sampling.py; run before 7, whose budget takes what is left);
  9. a mixture-of-experts layer at Qwen3-30B-A3B's shapes: the grouped expert matmul kernel vs
     its reference and a per-expert loop, the experts' LoRA on the SGMV kernels vs the torch
     path (bench/gpu_moe.py; run before 7 too);
 10. the quantized GEMM kernels (int4 / int8 / NF4 weight-only, FP8 W8A16 and W8A8) at 8B
     shapes vs their references and vs bf16 F.linear (bench/gpu_quant.py; run before 7 too);
 11. decode steps replayed from CUDA graphs (executor/decode_graphs.py) vs eager at 8B shapes:
     the start-up check, then step times and greedy tokens both ways (bench/gpu_graphs.py; run
     before 7 too).
`--smoke` runs a tiny version on CPU through the Triton interpreter (checks the script itself).
"""

from __future__ import annotations

import time

from gpu_harness import (ADAPTERS, BLOCK_SIZE, CFG, DEVICE, OPTS, RANKS, REPORT,  # first
                         START, TOKENS, bench_ms, pages_of, random_adapter, section, sync, table)

import torch
import torch.nn.functional as F
from common.peft.modules import LORA_MODULES
from executor.lora.torch_backend import TorchLoraBackend
from executor.model.kv_cache import PagedKVCache
from executor.lora.triton_backend import TritonLoraBackend
from executor.lora.slot_pool import LORA_GROUPS, LoraSlotPool
from gpu_attention import paged_attention_check
from gpu_graphs import graphs_check
from gpu_moe import moe_check
from gpu_quant import quant_check
from gpu_sampling import sampling_check
from gpu_step import decode_step
from kernels.reference import TOLERANCES, sgmv_fused_ref, sgmv_shrink_ref
from kernels.sgmv_shrink import sgmv_shrink


def one_layer_pool(num_slots: int, max_rank: int, dtype, rank_of) -> LoraSlotPool:
    """A one-layer pool over a KV cache of just its pages (random elsewhere: a kernel reading
    outside its rows shows); slot s holds an adapter with ranks rank_of(s) (module -> rank),
    in consecutive blocks."""
    config = CFG.replace(num_hidden_layers=1)
    counts = [pages_of(config, rank_of(s)) for s in range(num_slots)]
    kv = PagedKVCache(num_layers=1, num_blocks=sum(counts) + 1, block_size=BLOCK_SIZE,
                      num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                      dtype=dtype, device=DEVICE)
    kv.storage.normal_()
    pool = LoraSlotPool(config, num_slots=num_slots, max_rank=max_rank, kv=kv)
    first = 1  # (block 0 stays noise)
    for s, count in enumerate(counts):
        pool.load(s, random_adapter(config, rank_of(s), s), range(first, first + count))
        first += count
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
    m = g.modules_slice
    rank_block = work.rank_block(g.first_module, len(g.modules))
    rows = dict(first_module=g.first_module, layer_base=0, chunk=pool.chunk)
    store, (a_offsets, b_offsets) = pool.kv.flat, pool.offsets(0)
    sgmv_fused_ref(x, store, a_offsets, b_offsets, ref, work.items, work.ranks[0, m],
                   work.scales[0, m], g.out_sizes, rank_block=rank_block, **rows)
    rtol, atol = TOLERANCES[dtype]
    scale = float(ref.float().abs().max())

    def err(a, b, k=1.0):
        bound = k * (atol * scale + rtol * b.float().abs())
        return float(((a.float() - b.float()).abs() / bound).max())

    e_ref, e_torch = err(got, ref), err(got, via_torch, 4.0)
    if backend.fused_max_rows == 0:  # the shrink's fp32 intermediate too
        t = sgmv_shrink(x, store, a_offsets, work.items, work.ranks[0, m],
                        block_m=work.block_m, rank_block=rank_block, **rows)
        t_ref = sgmv_shrink_ref(x, store, a_offsets, work.items, work.ranks[0, m],
                                rank_block=rank_block, **rows)
        done = torch.cat([torch.arange(s, e) for s, e in work.items[:2].t().tolist()])
        e_ref = max(e_ref, err(t[done], t_ref[done]))
    return [e_ref, e_torch, "yes" if e_ref <= 1 and e_torch <= 1 else "**NO**"]



def padded_slots(pool, group: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The group's layer-0 weights as a pool padded to max_rank keeps them (vLLM, LoRAX): per
    slice, A [slots, R, K] and B^T [slots, R, N], zero above each adapter's rank."""
    g, out = pool.groups[group], []
    for module, n in zip(g.modules, g.out_sizes):
        a = torch.zeros(pool.num_slots, pool.max_rank, g.in_features, dtype=pool.dtype,
                        device=DEVICE)
        bt = torch.zeros(pool.num_slots, pool.max_rank, n, dtype=pool.dtype, device=DEVICE)
        for slot in range(pool.num_slots):
            rows = pool.rows(0, slot, module)
            if rows is not None:
                r = rows[0].shape[0]
                a[slot, :r], bt[slot, :r] = rows[0], rows[1].T
        out.append((a, bt))
    return out


def gather_bmm(padded, x, out, row_slots) -> None:
    """Baseline: per row, gather its adapter's padded A and B, two batched matmuls."""
    off = 0
    for a_all, bt_all in padded:
        n = bt_all.shape[2]
        a, bt = a_all[row_slots], bt_all[row_slots]  # [T, R, K], [T, R, N]
        t = torch.bmm(x[:, None, :], a.transpose(1, 2))  # [T, 1, R]
        out[:, off: off + n] += torch.bmm(t, bt)[:, 0] * 2.0
        off += n


def host_us(fn, n: int = 2 if OPTS.smoke else 50) -> float:
    """Host time per call (launch overhead), queueing n calls without waiting for the GPU (smoke:
    2, each call a run of the interpreter)."""
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
    dtype, e, tokens = pool.dtype, 2, len(row_slots)
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
    padded = padded_slots(pool, group)
    baseline_ms = bench_ms(lambda: gather_bmm(padded, x, out, slots_dev))
    moved = e * (tokens * in_f + num_adapters * rank * (len(LORA_GROUPS[group]) * in_f + n)
                 + 2 * tokens * n)
    gbs = moved / ms / 1e6
    path = "fused" if meta.is_fused else "shr+exp"
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
            other = TritonLoraBackend(pool, fused_max_rows=0 if meta.is_fused else 1 << 30)
            other_meta = other.prepare(row_slots)
            for group in LORA_GROUPS:
                rows.append(time_group(pool, group, meta, other, other_meta, row_slots, rank,
                                       num_adapters, copy_gbs, base_cache, auto))
            print(rows[-4:], flush=True)
    return rows, skipped


@section("7. Kernel timings (bf16, Llama-3-8B projections, one layer)")
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
        "of the same projection; speed-up vs a torch gather + bmm over copies of the weights "
        "padded to the rank (as vLLM and LoRAX keep them); host us = launch overhead per "
        "call.\n\n")
    REPORT.append(table(["tokens", "adapters", "rank", "group", "path", "us", "other path us",
                         "GB/s", "of copy", "x base", "speed-up vs gather+bmm", "host us"],
                        rows))
    if skipped:
        REPORT.append(f"\n{skipped} configs skipped: past the {OPTS.budget_s:.0f} s budget.\n")


MIX = (8,) * 7 + (16,) * 2 + (64,)  # adapter i has rank MIX[i % 10]: 70% 8, 20% 16, 10% 64


@section("6. Adapters in pages at their ranks vs padded to rank 64 (bf16, one layer)")
def paged_vs_padded() -> None:
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    num = 4 if OPTS.smoke else 64
    pools = {"pages": one_layer_pool(num, 64, dtype,
                                     lambda s: dict.fromkeys(LORA_MODULES, MIX[s % len(MIX)])),
             "padded": one_layer_pool(num, 64, dtype, lambda s: dict.fromkeys(LORA_MODULES, 64))}
    shapes = ({"decode": torch.arange(num)} if OPTS.smoke else
              {f"decode {num} rows": torch.arange(num),
               "prefill 2048 rows, 16 adapters": torch.arange(2048) * 16 // 2048})
    rows = []
    for name, row_slots in shapes.items():
        for group in LORA_GROUPS:
            in_f, n = group_shapes(group)
            x = torch.randn(len(row_slots), in_f, device=DEVICE).to(dtype)
            out = torch.zeros(len(row_slots), n, device=DEVICE, dtype=dtype)
            us = {}
            for memory, pool in pools.items():
                backend = TritonLoraBackend(pool)
                meta = backend.prepare(row_slots)
                us[memory] = bench_ms(lambda: backend.apply(0, group, x, out, meta)) * 1e3
            rows.append([name, group, us["pages"], us["padded"], us["padded"] / us["pages"]])
        print(rows[-4:], flush=True)
    REPORT.append(
        f"{num} adapters on all 7 projections; in pages at ranks 8/16/64 (70/20/10%), or every "
        "one at rank 64 (padded: the same bytes and multiplies as zero-padded slots). Decode: "
        "one row per adapter (fused path, one launch at the step's largest rank tile); prefill: "
        "2048 rows over 16 adapters (shrink + expand, a launch per rank tier). us = do_bench "
        "median.\n\n")
    REPORT.append(table(["rows", "group", "pages us", "padded us", "padded / pages"], rows))


def main() -> None:
    copy_gbs = copy_bandwidth() or float("nan")
    correctness()
    decode_step(copy_gbs)
    paged_attention_check(copy_gbs)
    paged_vs_padded()
    sampling_check()
    moe_check()
    quant_check()
    graphs_check()
    kernel_timings(copy_gbs)
    print(f"\nwrote {OPTS.out} in {time.perf_counter() - START:.0f} s")


if __name__ == "__main__":
    main()
