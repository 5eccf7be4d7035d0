"""SGMV Triton kernels against their torch references, through the Triton interpreter on CPU;
the Triton LoRA backend against the torch backend and against HF + PEFT.

The full matrix at real shapes (bf16, fp16, CUDA) is bench/gpu_check.sh.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit is defined

import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from common.peft.modules import LORA_MODULES  # noqa: E402
from executor.lora_torch import TorchLoraBackend  # noqa: E402
from executor.lora_triton import TritonLoraBackend  # noqa: E402
from executor.model_config import ModelConfig  # noqa: E402
from executor.slot_pool import LORA_GROUPS, LoraSlotPool  # noqa: E402
from kernels.reference import (  # noqa: E402
    TOLERANCES,
    sgmv_fused_ref,
    sgmv_shrink_ref,
)
from kernels.segments import SegmentWork  # noqa: E402
from kernels.sgmv_expand import sgmv_expand  # noqa: E402
from kernels.sgmv_fused import sgmv_fused  # noqa: E402
from kernels.sgmv_shrink import sgmv_shrink  # noqa: E402
from tests.oracle import hf_greedy  # noqa: E402
from tests.random_adapters import random_adapter  # noqa: E402
from tests.runner_driver import make_runner, prompts, run  # noqa: E402

# Small tiles keep the interpreter fast; target_ctas 4 makes the column chunking split slices.
TUNING = {"target_ctas": 4, "block_k": 32}
EXPAND_TUNING = {"target_ctas": 4, "block_n": 16}


def assert_close(actual, expected, dtype):
    rtol, atol = TOLERANCES[dtype]
    scale = float(expected.float().abs().max()) if expected.numel() else 1.0
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol * scale)


def make_case(seed, *, num_adapters, rank, out_sizes, in_features, dtype, block_m=4,
              max_rows=9):
    """A group's weights for num_adapters + 2 slots and one step's work: segments in row order
    with random lengths (some empty), gaps of rows without adapter, each adapter at its own rank
    per slice (the first at `rank`, some slices untargeted)."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_slots, n = num_adapters + 2, len(out_sizes)
    a = torch.randn(num_slots, n, rank, in_features, generator=g).to(dtype)
    bt = torch.randn(num_slots, rank, sum(out_sizes), generator=g).to(dtype)
    starts, lens, slots, row = [], [], [], 0
    for slot in rng.sample(range(num_slots), num_adapters):
        row += rng.choice([0, 0, 1, 3])  # rows without adapter before the segment
        length = rng.choice([0, 1, 1, 2, rng.randint(1, max_rows)]) or (not starts and 2)
        starts.append(row)
        lens.append(length)
        slots.append(slot)
        row += length
    num_rows = row + rng.randint(0, 2)
    ranks = torch.tensor([[rng.choice([rank, rng.randint(0, rank)]) for _ in range(n)]
                          for _ in range(num_slots)], dtype=torch.int32)  # [slots, n]
    ranks[slots[0]] = rank
    rank_table = ranks[None]  # [L=1, slots, n]
    scale_table = torch.rand(1, num_slots, n, generator=g) * 2
    work = SegmentWork.build(torch.tensor(starts), torch.tensor(lens), torch.tensor(slots),
                             rank_table, scale_table, block_m=block_m, device="cpu")
    x = torch.randn(num_rows, in_features, generator=g).to(dtype)
    out = torch.randn(num_rows, sum(out_sizes), generator=g).to(dtype)
    return x, a, bt, out, work


GROUP_SHAPES = {  # (in_features, out_sizes): odd sizes, GQA-shaped q | k | v, gate | up
    1: (37, (53,)), 2: (48, (40, 40)), 3: (97, (44, 22, 22))}
CASES = [(1, 1), (8, 3), (16, 16), (64, 5), (16, 1)]  # (rank, number of adapters)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rank,num_adapters", CASES)
@pytest.mark.parametrize("num_slices", [1, 2, 3])
def test_fused_and_two_kernel_paths_match_reference(dtype, rank, num_adapters, num_slices):
    in_features, out_sizes = GROUP_SHAPES[num_slices]
    x, a, bt, out, work = make_case(rank * 100 + num_adapters + num_slices, rank=rank,
                                    num_adapters=num_adapters, out_sizes=out_sizes,
                                    in_features=in_features, dtype=dtype)
    ranks, scales = work.ranks[0], work.scales[0]
    rank_block = work.rank_block(0, num_slices)
    kw = {"block_m": work.block_m, "rank_block": rank_block}
    expected = out.clone()
    sgmv_fused_ref(x, a, bt, expected, work.items, ranks, scales, out_sizes, **kw)

    fused = out.clone()
    sgmv_fused(x, a, bt, fused, work.items, ranks, scales, out_sizes, **kw, **TUNING,
               block_n=16)
    assert_close(fused, expected, dtype)

    t = sgmv_shrink(x, a, work.items, ranks, **kw, **TUNING)
    t_ref = sgmv_shrink_ref(x, a, work.items, ranks, **kw)
    rows = torch.cat([torch.arange(s, e) for s, e, *_ in work.items.t().tolist()] or
                     [torch.zeros(0, dtype=torch.long)])
    assert_close(t[rows], t_ref[rows], torch.float32)
    two_kernel = out.clone()
    sgmv_expand(t, bt, two_kernel, work.items, ranks, scales, out_sizes,
                block_m=work.block_m, **EXPAND_TUNING)
    assert_close(two_kernel, expected, dtype)
    untouched = torch.ones(out.shape[0], dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(fused[untouched], out[untouched])  # rows without adapter: not written


def test_fp16_and_expand_reference_rounding():
    x, a, bt, out, work = make_case(5, rank=16, num_adapters=4, out_sizes=(44, 22, 22),
                                    in_features=97, dtype=torch.float16)
    ranks, scales = work.ranks[0], work.scales[0]
    kw = {"block_m": work.block_m, "rank_block": 16}
    expected, fused = out.clone(), out.clone()
    sgmv_fused_ref(x, a, bt, expected, work.items, ranks, scales, (44, 22, 22), **kw)
    sgmv_fused(x, a, bt, fused, work.items, ranks, scales, (44, 22, 22), **kw, **TUNING)
    assert_close(fused, expected, torch.float16)


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


def test_launchers_reject_bad_inputs():
    x, a, bt, out, work = make_case(1, rank=8, num_adapters=2, out_sizes=(40, 40),
                                    in_features=48, dtype=torch.float32)
    ranks, scales = work.ranks[0], work.scales[0]
    kw = {"block_m": 4, "rank_block": 16}
    with pytest.raises(ValueError, match="a must be torch.float32"):
        sgmv_fused(x, a.half(), bt, out, work.items, ranks, scales, (40, 40), **kw)
    with pytest.raises(ValueError, match="do not fit"):
        sgmv_fused(x, a, bt, out, work.items, ranks, scales, (40, 41), **kw)
    with pytest.raises(ValueError, match="items must be int32"):
        sgmv_shrink(x, a, work.items.long(), ranks, **kw)
    with pytest.raises(ValueError, match="power of two"):
        sgmv_shrink(x, a, work.items, ranks, block_m=4, rank_block=24)


@pytest.mark.parametrize("fused_max_rows", [64, 0], ids=["fused", "shrink_expand"])
def test_triton_backend_matches_torch_backend(fused_max_rows):
    config = ModelConfig(hidden_size=48, intermediate_size=72, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=32)
    pool = LoraSlotPool(config, num_slots=4, max_rank=16)
    pool.load(0, random_adapter(config, 16, 0))
    pool.load(1, random_adapter(config, 1, 1, modules=("q_proj", "down_proj")))
    pool.load(3, random_adapter(config, 8, 3, layers=[1]))
    triton_backend = TritonLoraBackend(pool, fused_max_rows=fused_max_rows, target_ctas=4)
    torch_backend = TorchLoraBackend(pool, exact=True)  # the exact per-segment reference
    row_slots = torch.tensor([-1, 0, 0, 0, 1, -1, 3, 3, 3, 3, 3, 3])
    meta_triton, meta_torch = triton_backend.prepare(row_slots), torch_backend.prepare(row_slots)
    for layer in range(2):
        for group, modules in LORA_GROUPS.items():
            in_f = config.module_shape(modules[0])[0]
            n = sum(config.module_shape(m)[1] for m in modules)
            x, base = torch.randn(len(row_slots), in_f), torch.randn(len(row_slots), n)
            got, want = base.clone(), base.clone()
            triton_backend.apply(layer, group, x, got, meta_triton)
            torch_backend.apply(layer, group, x, want, meta_torch)
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
    for sid, name in enumerate(names):
        ref_tokens, ref_logits = hf_greedy(hf_peft, requests[sid][0], num_tokens, name)
        assert got[sid][0] == ref_tokens, f"greedy tokens differ for adapter {name}"
        torch.testing.assert_close(got[sid][1], ref_logits, atol=1e-4, rtol=0)


def test_kernels_compile_for_hopper():
    """Ahead-of-time compile for sm_90 with Triton's bundled ptxas (no GPU needed): catches
    lowering errors and shared-memory overruns the interpreter cannot see."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "kernels.compile_check", "--arch", "90"],
                            check=False, env=env, cwd=Path(__file__).resolve().parents[2],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
