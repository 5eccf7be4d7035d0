"""Executor step timing through the tensor-parallel code path: a random-weight model (8B shapes)
on 1, 2, 4, ... ranks, one process per GPU (torch.distributed, NCCL), each rank a ModelRunner of
its part (executor/tp/shards.py) running the same steps in lockstep, as the ranks of
`loraplex serve executor --tensor-parallel N` do. Run it with `bench/tp_step.sh`.

Per rank count (those the machine has GPUs for; the others are listed as not measured) and
batch (64 decode rows: base only, one rank-16 adapter, 64 distinct rank-16 adapters): the
prefill step and the median decode step, rank 0's wall time (every step ends with the sampled
tokens on the host), against the same batch on 1 rank; the weights each GPU holds.

`--smoke`: the tiny model on CPU (gloo ranks, the torch LoRA backend), to check the script.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from common.adapter_pages import plan_pages  # noqa: E402
from common.peft.modules import LORA_MODULES  # noqa: E402
from common.sampling import SamplingParams  # noqa: E402
from executor.lora.slot_pool import LoraModuleWeights, LoraWeights, page_geometry  # noqa: E402
from executor.model.config import ModelConfig  # noqa: E402
from executor.runner import ModelRunner, Row  # noqa: E402
from executor.tp.collectives import TensorParallel  # noqa: E402
from executor.tp.shards import Shard  # noqa: E402

BLOCK_SIZE = 16


def options(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="1,2,4,8", help="rank counts to time, e.g. 1,2,4,8")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU (gloo), to check")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "tp-step.md"))
    return p.parse_args(argv)


def random_adapter(config, rank: int, seed: int, device) -> LoraWeights:
    """A rank-`rank` adapter on all 7 projections of every layer (the same on every rank)."""
    g = torch.Generator(device=device).manual_seed(seed)
    mods = {}
    for layer in range(config.num_hidden_layers):
        for m in LORA_MODULES:
            in_f, out_f = config.module_shape(m)
            mods[(layer, m)] = LoraModuleWeights(
                torch.randn(rank, in_f, generator=g, device=device) * in_f ** -0.5,
                torch.randn(out_f, rank, generator=g, device=device) * 0.02, 2.0)
    return LoraWeights(mods)


def time_batch(runner: ModelRunner, slots: list[int], prompt_len: int, steps: int,
               warmup: int) -> tuple[float, float, list[int]]:
    """(prefill step ms, median decode step ms, the last step's tokens) of one sequence per
    entry of `slots`, rows sorted by slot, fresh blocks (none an adapter's page)."""
    runner.free_all()
    free = runner.free_blocks()
    g = torch.Generator().manual_seed(0)
    tables: dict[int, list[int]] = {}
    for sid, slot in enumerate(slots):
        prompt = torch.randint(2, runner.config.vocab_size, (prompt_len,), generator=g).tolist()
        runner.add_sequence(sid, prompt, SamplingParams(), slot)
        tables[sid] = []
    order = sorted(range(len(slots)), key=lambda sid: slots[sid])
    times, length, tokens = [], 0, []
    for i in range(1 + warmup + steps):
        n = prompt_len if i == 0 else 1
        rows = []
        for sid in order:
            new = [free.pop() for _ in range(-(-(length + n) // BLOCK_SIZE) - len(tables[sid]))]
            tables[sid] += new
            rows.append(Row(sid, n, tuple(new)))
        t0 = time.perf_counter()
        tokens = [s.token_id for s in runner.step(rows)]
        times.append((time.perf_counter() - t0) * 1e3)
        length += n
    runner.free_all()
    return times[0], statistics.median(times[1 + warmup:]), tokens


def worker(rank: int, world: int, store_file: str, smoke: bool, results) -> None:
    """One rank: join the group, build its part, time every batch; rank 0 reports."""
    device = torch.device("cpu") if smoke else torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    tp = TensorParallel()
    if world > 1:
        tp = TensorParallel.join(rank, world, store_file, device=device, timeout_s=600)
    num_rows, adapter_rank = (4, 8) if smoke else (64, 16)
    config = ModelConfig.named("tiny" if smoke else "llama-3-8b")
    pages = plan_pages(dict.fromkeys(LORA_MODULES, adapter_rank),
                       page_geometry(Shard(config, rank, world).config, BLOCK_SIZE)).num_pages
    runner = ModelRunner.random(
        config, dtype=torch.float32 if smoke else torch.bfloat16,
        device=device, num_kv_blocks=num_rows * pages + 1024,
        block_size=BLOCK_SIZE, num_slots=num_rows, max_rank=adapter_rank,
        lora_backend="torch" if smoke else "triton", tp=tp)
    for slot in range(num_rows):
        runner.load_adapter(slot, random_adapter(runner.config, adapter_rank, 1000 + slot,
                                                 device))
    batches = [("base only", [-1] * num_rows), ("1 adapter (all rows)", [0] * num_rows),
               (f"{num_rows} distinct adapters", list(range(num_rows)))]
    steps, warmup, prompt_len = (2, 0, 8) if smoke else (10, 3, 32)
    rows = []
    for name, slots in batches:
        prefill_ms, ms, tokens = time_batch(runner, slots, prompt_len, steps, warmup)
        rows.append((name, ms, prefill_ms, tokens))
    if rank == 0:
        results.put((world, rows, runner.memory_budget().weights_bytes))
    if world > 1:
        torch.distributed.destroy_process_group()


def table(header: list[str], rows: list[list]) -> str:
    fmt = [[f"{v:.3g}" if isinstance(v, float) else str(v) for v in r] for r in rows]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in fmt]) + "\n"


def main() -> None:
    opts = options()
    wanted = [int(n) for n in opts.ranks.split(",")]
    gpus = 8 if opts.smoke else torch.cuda.device_count()  # (smoke: CPU ranks)
    if not gpus:
        sys.exit("error: the tensor-parallel step needs CUDA GPUs, and this machine's torch sees "
                 f"none (torch {torch.__version__}); --smoke runs it on CPU ranks")
    start, report, measured, skipped = time.perf_counter(), [], {}, []
    context = mp.get_context("spawn")
    for world in wanted:
        if world > gpus:
            skipped.append(world)
            continue
        results = context.SimpleQueue()
        with tempfile.TemporaryDirectory() as folder:
            mp.start_processes(worker, args=(world, os.path.join(folder, "store"), opts.smoke,
                                             results), nprocs=world, start_method="spawn")
        measured[world] = results.get()
        print(f"{world} rank(s): {[(n, round(ms, 3)) for n, ms, *_ in measured[world][1]]}",
              flush=True)
    rows = []
    for world, (_, batches, weights_bytes) in measured.items():
        for (name, ms, prefill_ms, tokens), (_, one_ms, _, one_tokens) in zip(
                batches, measured.get(1, (None, batches))[1]):
            same = sum(a == b for a, b in zip(tokens, one_tokens))
            rows.append([world, name, ms, ms / one_ms, prefill_ms, weights_bytes / 1e9,
                         f"{same}/{len(tokens)}"])
    device = ("cpu (smoke: gloo ranks)" if opts.smoke
              else f"{torch.cuda.get_device_name()} x {gpus}")
    report.append(f"# Executor step through the tensor-parallel path "
                  f"({'tiny' if opts.smoke else 'llama-3-8b'} shapes)\n")
    report.append(f"Device: {device}; torch {torch.__version__}; "
                  f"{time.strftime('%Y-%m-%d %H:%M')}; {time.perf_counter() - start:.0f} s.\n")
    report.append("Rank 0's wall time per step (eager; the step ends with the sampled tokens on "
                  "the host), median decode step after warm-up; 'x 1 rank' against the same batch "
                  "on one rank; 'same tokens': greedy tokens of the last step equal to one "
                  "rank's (random weights: near-ties may flip in bf16).\n")
    report.append(table(["ranks", "batch", "decode step ms", "x 1 rank", "prefill step ms",
                         "weights GB per GPU", "same tokens"], rows))
    if skipped:
        report.append(f"\nNot measured: {', '.join(map(str, skipped))} ranks (more than the "
                      f"{gpus} GPU(s) of this machine).\n")
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text("\n".join(report))
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
