"""Sections 3 and 4 of the GPU check: a whole executor decode step of an 8B-shaped random-weight
model (base only, one adapter, 64 distinct adapters, beside the memory floor), and the last hop of
an adapter load (pinned staging -> slot on a side stream) with decode steps running beside it.
"""

from __future__ import annotations

import statistics
import time

from gpu_harness import (BLOCK_SIZE, DEVICE, MODEL, OPTS, REPORT, bench_ms,  # first
                         pages_of, random_adapter, section, sync, table)

import torch
from common.peft.modules import LORA_MODULES
from executor.lora.torch_backend import TorchLoraBackend
from executor.lora.triton_backend import TritonLoraBackend
from executor.model.config import ModelConfig
from executor.lora.slot_pool import LoraModuleWeights, LoraSlotPool, LoraWeights


class Driver:
    """A stand-in scheduler for the decode-step bench: fresh block ids (none of `keep`, none an
    adapter's page), rows sorted by slot."""

    def __init__(self, runner, keep: tuple[int, ...] = ()) -> None:
        self.runner = runner
        self.free = [b for b in runner.free_blocks() if b not in set(keep)]
        self.state: dict[int, list] = {}  # seq id -> [computed, total, blocks, slot]

    def add(self, seq_id: int, prompt: list[int], slot: int) -> None:
        from common.sampling import SamplingParams
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


WARMUP = 0 if OPTS.smoke else 3  # decode steps before the timed ones (smoke: none, the interpreter)
PROMPT_LEN = 8 if OPTS.smoke else 32  # tokens per sequence prefilled before the decode steps


def time_decode(runner, slots: list[int], steps: int,
                keep: tuple[int, ...] = ()) -> tuple[float, float]:
    """(prefill step ms, median decode step ms) for one row per entry of `slots`, each after a
    PROMPT_LEN-token prompt (its KV in none of the blocks `keep`)."""
    runner.free_all()
    driver = Driver(runner, keep)
    g = torch.Generator().manual_seed(0)
    for sid, slot in enumerate(slots):
        driver.add(sid, torch.randint(2, runner.config.vocab_size, (PROMPT_LEN,),
                                      generator=g).tolist(), slot)
    sync()
    t0 = time.perf_counter()
    driver.step(PROMPT_LEN)  # the whole prompt: a prefill step of len(slots) * PROMPT_LEN rows
    sync()
    prefill_ms = (time.perf_counter() - t0) * 1e3
    times = []
    for i in range(steps + WARMUP):
        t0 = time.perf_counter()
        driver.step(1)  # the runner samples on the host: every step ends synchronised
        if i >= WARMUP:
            times.append((time.perf_counter() - t0) * 1e3)
    return prefill_ms, statistics.median(times)


@section("3. Executor decode step, 64 rows (8B-shaped random weights, bf16)")
def decode_step(copy_gbs: float) -> None:
    from executor.runner import ModelRunner
    num_rows, rank = (4, 8) if OPTS.smoke else (64, 16)
    dtype = torch.float32 if OPTS.smoke else torch.bfloat16
    t0 = time.perf_counter()
    ranks = dict.fromkeys(LORA_MODULES, rank)
    pages = pages_of(ModelConfig.named(MODEL), ranks)  # per adapter
    runner = ModelRunner.random(MODEL, dtype=dtype, device=DEVICE,
                                num_kv_blocks=(num_rows + 1) * pages + 1024,
                                block_size=BLOCK_SIZE, num_slots=num_rows + 1, max_rank=rank,
                                lora_backend="triton")  # the last slot: for section 4
    for s in range(num_rows):
        runner.load_adapter(s, random_adapter(runner.config, ranks, 1000 + s))
    sync()
    print(f"model + {num_rows} adapters ready in {time.perf_counter() - t0:.0f} s", flush=True)
    c = runner.config
    w = runner.weights
    base_bytes = w.num_bytes() - w.embed.numel() * w.embed.element_size()  # embed: rows only
    per_adapter = c.num_hidden_layers * sum(rank * sum(c.module_shape(m)) for m in LORA_MODULES)
    per_adapter *= torch.empty((), dtype=dtype).element_size()
    steps = 1 if OPTS.smoke else 10
    cases = [("base only", [-1] * num_rows, 0), ("1 adapter (all rows)", [0] * num_rows, 1),
             (f"{num_rows} distinct adapters", list(range(num_rows)), num_rows)]
    rows, base_ms = [], None
    for name, slots, num_adapters in cases:
        prefill_ms, ms = time_decode(runner, slots, steps)
        floor_ms = (base_bytes + num_adapters * per_adapter) / copy_gbs / 1e6
        base_ms = base_ms or ms
        rows.append([name, "triton", ms, ms / base_ms, floor_ms, ms / floor_ms, prefill_ms])
        print(rows[-1], flush=True)
    runner.lora = runner.model.lora = TorchLoraBackend(runner.pool)
    prefill_ms, ms = time_decode(runner, list(range(num_rows)), 2)
    floor_ms = (base_bytes + num_rows * per_adapter) / copy_gbs / 1e6
    rows.append([f"{num_rows} distinct adapters", "torch", ms, ms / base_ms, floor_ms,
                 ms / floor_ms, prefill_ms])
    REPORT.append(
        f"Median of {steps} decode steps (after {WARMUP} warm-up) of {num_rows} sequences, "
        f"{PROMPT_LEN}-token prompts, rank-{rank} adapters on all 7 projections "
        f"({per_adapter / 1e6:.0f} MB each). "
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
    """The slot's pages hold exactly `weights`, in the pool's dtype."""
    for (layer, m), w in weights.modules.items():
        a, b = (t.cpu() for t in pool.rows(layer, slot, m))
        if not (torch.equal(a, w.a.to(a.dtype)) and torch.equal(b, w.b.to(b.dtype))):
            return False
    return True


def plain_copy_ms(host: torch.Tensor) -> float:
    """One host-to-device copy of `host` (pinned on CUDA), the bound for loading it."""
    dst = torch.empty_like(host, device=DEVICE)
    return bench_ms(lambda: dst.copy_(host, non_blocking=True))


@section("4. Adapter load into a slot (pinned staging, side stream) beside decode steps")
def adapter_load(runner, rank: int, steps: int) -> None:
    import threading

    from executor.lora.slot_copy import SlotCopier, StagingBuffers
    pool, slot, copier = runner.pool, runner.pool.num_slots - 1, SlotCopier(runner.pool)
    staging = StagingBuffers(pin_memory=DEVICE == "cuda")
    rows, loaded = [], {}
    spare = tuple(runner.free_blocks()[:pages_of(runner.config,
                                                 dict.fromkeys(LORA_MODULES, rank))])
    for file_dtype in dict.fromkeys((pool.dtype, torch.float32)):
        per_adapter = runner.config.num_hidden_layers * sum(
            rank * sum(runner.config.module_shape(m)) for m in LORA_MODULES)
        num_bytes = per_adapter * torch.empty((), dtype=file_dtype).element_size()
        buffer = staging.take(num_bytes)
        staged, source = staged_adapter(runner.config, rank, file_dtype, buffer, seed=7)
        times = []
        for _ in range(6):
            copier.clear(slot)
            t0 = time.perf_counter()
            copier.copy(slot, staged, spare)
            times.append((time.perf_counter() - t0) * 1e3)
        ok = slot_matches(pool, slot, source)
        plain_ms = plain_copy_ms(buffer[:num_bytes])
        ms = statistics.median(times[1:])
        rows.append([f"{str(file_dtype).removeprefix('torch.')} file", f"{num_bytes / 1e6:.0f}",
                     ms, num_bytes / ms / 1e6, plain_ms, ms / plain_ms,
                     "yes" if ok else "**NO**"])
        loaded[file_dtype] = staged, source
    REPORT.append(
        f"A rank-{rank} adapter on all 7 projections of every layer, as the loader hands it over "
        f"(views into one {'pinned ' if DEVICE == 'cuda' else ''}staging buffer), copied into an "
        f"empty slot (`SlotCopier.copy`: side stream, one wait); the pool is "
        f"{str(pool.dtype).removeprefix('torch.')}. Median of 5 after one warm-up; "
        f"'plain copy' = one pinned host-to-device copy of the same bytes (do_bench).\n\n")
    REPORT.append(table(["source", "MB", "load ms", "GB/s", "plain copy ms", "x plain",
                         "slot bit-exact"], rows))
    # Decode steps of every other slot while a thread loads the spare one again and again.
    busy = list(range(slot))
    _, alone_ms = time_decode(runner, busy, steps, keep=spare)
    stop, num_loads = threading.Event(), [0]

    staged, source = loaded[pool.dtype]

    def keep_loading() -> None:  # as AdapterLoader does: clear and copy on the side stream
        while not stop.is_set():
            copier.clear(slot)
            copier.copy(slot, staged, spare)
            num_loads[0] += 1

    thread = threading.Thread(target=keep_loading, daemon=True)
    thread.start()
    try:
        _, beside_ms = time_decode(runner, busy, steps, keep=spare)
    finally:
        stop.set()
        thread.join()
    exact = "yes" if slot_matches(pool, slot, source) else "**NO**"
    REPORT.append(
        f"\nDecode step, {len(busy)} rows of {len(busy)} distinct adapters: {alone_ms:.2f} ms "
        f"alone, {beside_ms:.2f} ms while {num_loads[0]} loads ran beside it in another thread "
        f"(**{beside_ms / alone_ms:.2f}x**; the loads share the GPU's copy engine and memory "
        f"bandwidth, not its stream). Slot bit-exact after them: {exact}.\n")
    print(rows, f"decode {alone_ms:.2f} -> {beside_ms:.2f} ms beside {num_loads[0]} loads",
          flush=True)
