"""SGMV Triton kernels against their torch references, through the Triton interpreter on CPU;
the Triton LoRA backend against the torch backend and against HF + PEFT.

The full matrix at real shapes (bf16, fp16, CUDA) is bench/gpu_check.sh.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit is defined

import dataclasses  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from common.adapter_pages import PageGeometry, plan_pages  # noqa: E402
from common.peft.modules import LORA_MODULES  # noqa: E402
from executor.lora.page_tables import layer_base, slot_tables  # noqa: E402
from executor.lora.torch_backend import TorchLoraBackend  # noqa: E402
from executor.lora.triton_backend import TritonLoraBackend  # noqa: E402
from executor.model.config import ModelConfig  # noqa: E402
from kernels.page_rows import row_index  # noqa: E402
from kernels.reference import (  # noqa: E402
    TOLERANCES,
    sgmv_fused_ref,
    sgmv_shrink_ref,
)
from kernels.segments import SegmentWork  # noqa: E402
from kernels.sgmv_expand import sgmv_expand  # noqa: E402
from kernels.sgmv_fused import sgmv_fused  # noqa: E402
from kernels.sgmv_shrink import sgmv_shrink, slices_per_launch  # noqa: E402
from tests.executor.lora_backends import backend_outputs, load, make_pool  # noqa: E402
from tests.oracle import assert_matches_hf  # noqa: E402
from tests.random_adapters import random_adapter  # noqa: E402
from tests.runner_driver import make_runner, prompts, run  # noqa: E402

# Small tiles keep the interpreter fast; target_ctas 4 makes the column chunking split slices.
TUNING = {"target_ctas": 4, "block_k": 32}
EXPAND_TUNING = {"target_ctas": 4, "block_n": 16}


def assert_close(actual, expected, dtype):
    rtol, atol = TOLERANCES[dtype]
    scale = float(expected.float().abs().max()) if expected.numel() else 1.0
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol * scale)


# Per number of slices: (first module, in_features, out_sizes): odd sizes, GQA-shaped q | k | v,
# gate | up. Regions of 48 elements (chunks of 32): rows cross chunks and pages.
GROUPS = {1: (6, 37, (53,)), 2: (4, 48, (40, 40)), 3: (0, 97, (44, 22, 22))}
REGION, LAYERS, LAYER = 48, 2, 1


def make_case(seed, *, num_adapters, rank, num_slices, dtype, block_m=4, max_rows=9,
              ranks_of=None):
    """Paged weights of one group for num_adapters + 2 slots, and one step's work (in LAYER):
    segments in row order with random lengths (some empty), gaps of rows without adapter, each
    adapter at its own rank per slice (the first at `rank`, some slices untargeted; in LAYER a
    slice may use fewer rows than its pages hold, as under a rank_pattern), or `ranks_of(slot)`.
    Every element of the store that is no row a segment's adapter uses in LAYER is NaN: a kernel
    that reads any other byte fails."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    first, in_features, out_sizes = GROUPS[num_slices]
    modules = LORA_MODULES[first: first + num_slices]
    shapes = {m: (in_features, n) for m, n in zip(modules, out_sizes)}
    geometry = PageGeometry(LAYERS, REGION, {m: shapes.get(m, (1, 1))  # (the tables' order)
                                             for m in LORA_MODULES})
    num_slots = num_adapters + 2
    module_ranks = [ranks_of(slot) if ranks_of else
                    [rng.choice([rank, rng.randint(0, rank)]) for _ in modules]
                    for slot in range(num_slots)]
    order = rng.sample(range(num_slots), num_adapters)
    if not ranks_of:
        module_ranks[order[0]] = [rank] * num_slices
    layouts = [plan_pages(dict(zip(modules, r)), geometry) for r in module_ranks]
    num_blocks = sum(lay.num_pages for lay in layouts) + 3
    free = rng.sample(range(num_blocks), num_blocks)
    chunk = geometry.chunk_elems
    num_chunks = -(-max(in_features, *out_sizes) // chunk)
    max_rank = max(max(r) for r in module_ranks)
    a_off = torch.zeros(num_slots, len(LORA_MODULES), max_rank, num_chunks, dtype=torch.int64)
    b_off = torch.zeros_like(a_off)
    for slot, layout in enumerate(layouts):
        pages = tuple(free.pop() for _ in range(layout.num_pages))
        a, b = slot_tables(layout, pages, num_blocks, geometry, max_rank=max_rank,
                           num_chunks=num_chunks)
        a_off[slot], b_off[slot] = a[0], b[0]  # (one layer group)
    rank_table = torch.zeros(LAYERS, num_slots, len(LORA_MODULES), dtype=torch.int32)
    for slot, ranks in enumerate(module_ranks):
        for i, r in enumerate(ranks):
            rank_table[:, slot, first + i] = r
            if r and not ranks_of and slot != order[0]:
                rank_table[LAYER, slot, first + i] = rng.choice([r, rng.randint(1, r)])
    scale_table = torch.rand(LAYERS, num_slots, len(LORA_MODULES), generator=g) * 2
    starts, lens, slots, row = [], [], [], 0
    for slot in order:
        row += rng.choice([0, 0, 1, 3])  # rows without adapter before the segment
        length = rng.choice([0, 1, 1, 2, rng.randint(1, max_rows)]) or (not starts and 2)
        starts.append(row)
        lens.append(length)
        slots.append(slot)
        row += length
    num_rows = row + rng.randint(0, 2)
    work = SegmentWork.build(torch.tensor(starts), torch.tensor(lens), torch.tensor(slots),
                             rank_table, scale_table, block_m=block_m, device="cpu")
    base = layer_base(LAYER, num_blocks, geometry)
    store = torch.randn(2 * LAYERS * num_blocks * REGION, generator=g).to(dtype)
    used = torch.zeros(store.numel(), dtype=torch.bool)
    for slot in set(slots):
        for i, (m, n) in enumerate(zip(modules, out_sizes)):
            r = int(rank_table[LAYER, slot, first + i])
            used[row_index(a_off[slot, first + i, :r], in_features, chunk) + base] = True
            used[row_index(b_off[slot, first + i, :r], n, chunk) + base] = True
    store[~used] = float("nan")
    x = torch.randn(num_rows, in_features, generator=g).to(dtype)
    out = torch.randn(num_rows, sum(out_sizes), generator=g).to(dtype)
    rows = {"first_module": first, "layer_base": base, "chunk": chunk}
    m = slice(first, first + num_slices)
    return Case(x, store, a_off, b_off, out, work, work.ranks[LAYER, m],
                work.scales[LAYER, m], out_sizes, rows, work.rank_block(first, num_slices))


@dataclass
class Case:
    x: torch.Tensor
    store: torch.Tensor
    a_off: torch.Tensor
    b_off: torch.Tensor
    out: torch.Tensor
    work: SegmentWork
    ranks: torch.Tensor
    scales: torch.Tensor
    out_sizes: tuple[int, ...]
    rows: dict
    rank_block: int

    def fused(self, kernel, out, **tuning):
        kernel(self.x, self.store, self.a_off, self.b_off, out, self.work.items, self.ranks,
               self.scales, self.out_sizes, block_m=self.work.block_m,
               rank_block=self.rank_block, **self.rows, **tuning)

    def shrink(self, kernel, **tuning):
        return kernel(self.x, self.store, self.a_off, self.work.items, self.ranks,
                      block_m=self.work.block_m, rank_block=self.rank_block, **self.rows,
                      **tuning)

    def expand(self, kernel, t, out, **tuning):
        kernel(t, self.store, self.b_off, out, self.work.items, self.ranks, self.scales,
               self.out_sizes, block_m=self.work.block_m, **self.rows, **tuning)

    def adapter_rows(self) -> torch.Tensor:
        items = self.work.items.t().tolist()
        return torch.cat([torch.arange(s, e) for s, e, *_ in items] or
                         [torch.zeros(0, dtype=torch.long)])


CASES = [(1, 1), (8, 3), (16, 16), (64, 5), (16, 1)]  # (rank, number of adapters)


def check_paths(case: Case, dtype) -> None:
    """Fused, and shrink then expand, against the reference; rows without adapter untouched."""
    expected = case.out.clone()
    case.fused(sgmv_fused_ref, expected)
    assert not expected.isnan().any()
    fused = case.out.clone()
    case.fused(sgmv_fused, fused, **TUNING, block_n=16)
    assert_close(fused, expected, dtype)
    rows = case.adapter_rows()
    t, t_ref = case.shrink(sgmv_shrink, **TUNING), case.shrink(sgmv_shrink_ref)
    assert_close(t[rows], t_ref[rows], torch.float32)
    two_kernel = case.out.clone()
    case.expand(sgmv_expand, t, two_kernel, **EXPAND_TUNING)
    assert_close(two_kernel, expected, dtype)
    untouched = torch.ones(case.out.shape[0], dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(fused[untouched], case.out[untouched])  # rows without adapter: unwritten


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rank,num_adapters", CASES)
@pytest.mark.parametrize("num_slices", [1, 2, 3])
def test_fused_and_two_kernel_paths_match_reference(dtype, rank, num_adapters, num_slices):
    check_paths(make_case(rank * 100 + num_adapters + num_slices, rank=rank,
                          num_adapters=num_adapters, num_slices=num_slices, dtype=dtype), dtype)


@pytest.mark.parametrize("block_m", [4, 64], ids=["stacked", "a_launch_per_slice"])
def test_ranks_1_to_256_in_one_batch_read_only_their_rows(block_m):
    """Adapters of ranks 1, 8, 16, 64 and 256 (and one mixing ranks across q, k, v) in one step:
    every path equals the reference, and, the store being NaN outside the rows they use, no
    kernel reads a padded row or another adapter's bytes. (At 64 rows a tile the shrink's
    stacked accumulator would not fit: a launch per slice.)"""
    ranks = [[1] * 3, [8] * 3, [16] * 3, [64] * 3, [256] * 3, [8, 0, 64], [0] * 3]
    case = make_case(7, num_adapters=6, rank=256, num_slices=3, dtype=torch.bfloat16,
                     ranks_of=lambda slot: ranks[slot % len(ranks)], max_rows=3,
                     block_m=block_m)
    assert case.rank_block == 256
    assert slices_per_launch(3, 256, block_m) == (3 if block_m == 4 else 1)
    check_paths(case, torch.bfloat16)


def test_fp16_and_expand_reference_rounding():
    check_paths(make_case(5, rank=16, num_adapters=4, num_slices=3, dtype=torch.float16),
                torch.float16)


def test_segment_work_running_example():
    row_slots = torch.tensor([3, 3, -1, 0, 0, 0, 0, 0])
    ranks = torch.zeros(2, 4, len(LORA_MODULES), dtype=torch.int32)
    ranks[1, 3, 2], ranks[0, 0, 6] = 8, 33
    scales = torch.arange(2 * 4 * 7, dtype=torch.float32).view(2, 4, 7)
    work = SegmentWork.build(torch.tensor([0, 3, 8]), torch.tensor([2, 5, 0]),
                             torch.tensor([3, 0, 1]), ranks, scales, block_m=4, device="cpu")
    assert work.items.tolist() == [[0, 3, 7], [2, 7, 8], [3, 0, 0], [0, 1, 1]]
    covered = {r for s, e in zip(*work.items[:2].tolist()) for r in range(s, e)}
    assert row_slots[2] == -1 and covered == {0, 1, 3, 4, 5, 6, 7}
    assert work.ranks.shape == (2, 7, 3) and work.ranks[1, 2, 0] == 8 and work.ranks[0, 6, 1] == 33
    assert work.scales[1, 4, 1] == scales[1, 0, 4]
    assert work.rank_block(0, 3) == 16 and work.rank_block(6, 1) == 64
    assert work.rank_block(3, 1) == 0  # o_proj: targeted by no segment's adapter
    empty = SegmentWork.build(*(torch.zeros(0, dtype=torch.long),) * 3, ranks, scales,
                              block_m=16, device="cpu")
    assert empty.num_items == 0 and empty.rank_block(0, 7) == 0
    # Rank tiers: slot 3 at rank 8 and slot 0 at rank 64 in a group get launches of their own.
    ranks[:, 3, 6], ranks[0, 0, 6] = 8, 64
    tiered = SegmentWork.build(torch.tensor([0, 3, 8]), torch.tensor([2, 5, 0]),
                               torch.tensor([3, 0, 1]), ranks, scales, block_m=4, device="cpu",
                               tiered=((6, 1), (3, 1)))
    assert [(tile, items.tolist()) for tile, items in tiered.tiers[(6, 1)]] == [
        (16, [[0], [2], [3], [0]]), (64, [[3, 7], [7, 8], [0, 0], [1, 1]])]
    assert tiered.tiers[(3, 1)] == () and torch.equal(tiered.items, work.items)


def test_launchers_reject_bad_inputs():
    case = make_case(1, rank=8, num_adapters=2, num_slices=2, dtype=torch.float32)
    with pytest.raises(ValueError, match="store must be torch.float32"):
        dataclasses.replace(case, store=case.store.half()).fused(sgmv_fused, case.out.clone())
    with pytest.raises(ValueError, match="do not fit"):
        dataclasses.replace(case, out_sizes=(40, 41)).fused(sgmv_fused, case.out.clone())
    with pytest.raises(ValueError, match="items must be int32"):
        work = dataclasses.replace(case.work, items=case.work.items.long())
        dataclasses.replace(case, work=work).shrink(sgmv_shrink)
    with pytest.raises(ValueError, match="power of two"):
        dataclasses.replace(case, rank_block=24).shrink(sgmv_shrink)
    with pytest.raises(ValueError, match="row offsets must be"):
        dataclasses.replace(case, a_off=case.a_off.int()).shrink(sgmv_shrink)
    with pytest.raises(ValueError, match="chunk 48 must be a power of two"):
        dataclasses.replace(case, rows={**case.rows, "chunk": 48}).shrink(sgmv_shrink)


@pytest.mark.parametrize("fused_max_rows", [64, 0], ids=["fused", "shrink_expand"])
def test_triton_backend_matches_torch_backend(fused_max_rows):
    """Adapters in random pages of a KV storage full of noise, ranks 16, 1, 8 and 72 (each
    module at its own rank, one adapter on one layer only): the shrink + expand path launches
    per rank tier (16 and 128)."""
    config = ModelConfig(hidden_size=48, intermediate_size=72, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=32)
    pool = make_pool(config, num_slots=4, max_rank=72, num_blocks=800)
    rng = random.Random(0)
    load(pool, 0, random_adapter(config, 16, 0), rng)
    load(pool, 1, random_adapter(config, 1, 1, modules=("q_proj", "down_proj")), rng)
    load(pool, 2, random_adapter(config, 72, 2), rng)
    load(pool, 3, random_adapter(config, 8, 3, layers=[1]), rng)
    triton_backend = TritonLoraBackend(pool, fused_max_rows=fused_max_rows, target_ctas=4)
    torch_backend = TorchLoraBackend(pool, exact=True)  # the exact per-segment reference
    row_slots = torch.tensor([-1, 0, 0, 0, 1, -1, 2, 2, 3, 3, 3, 3, 3, 3])
    if not fused_max_rows:
        tiers = triton_backend.prepare(row_slots).work.tiers[(0, 3)]
        assert [tile for tile, _ in tiers] == [16, 128]
    for *_, got, want in backend_outputs(config, triton_backend, torch_backend, row_slots, 1):
        assert_close(got, want, torch.float32)


@pytest.mark.parametrize("fused_max_rows", [64, 0], ids=["fused", "shrink_expand"])
def test_executor_oracle_with_triton_backend(tiny, hf_peft, fused_max_rows):
    """The foundation's oracle (mixed batch of every fixture adapter and base-only rows, paged
    KV, chunked prefill) with the Triton backend under the interpreter, on either path."""
    runner = make_runner(tiny, lora_backend="triton")
    assert isinstance(runner.lora, TritonLoraBackend)
    runner.lora = runner.model.lora = TritonLoraBackend(runner.pool, fused_max_rows=fused_max_rows)
    names = [*tiny["valid"], None]
    slots = [tiny["valid"].index(n) if n else -1 for n in names]
    requests = {sid: (p, slot) for sid, (p, slot) in enumerate(zip(prompts(len(names)), slots))}
    num_tokens = 2  # the prefill chunks, then a decode step beside the longer prompts' chunks
    got = run(runner, requests, num_tokens, chunk=8, admit=len(names))
    assert_matches_hf(hf_peft, requests, names, got, num_tokens, atol=1e-4,
                      adapter_matters=False)


def test_kernels_compile_for_hopper():
    """Ahead-of-time compile for sm_90 with Triton's bundled ptxas (no GPU needed): catches
    lowering errors and shared-memory overruns the interpreter cannot see."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "kernels.compile_check", "--arch", "90"],
                            check=False, env=env, cwd=Path(__file__).resolve().parents[2],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
