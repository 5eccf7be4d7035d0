"""The dequantize-in-the-GEMM kernels (kernels/quant_gemm.py, kernels/quant_fp8_gemm.py) against
their torch references under the Triton interpreter: int4 / int8 with group and channel scales,
zeros or none, act-order g_idx, NF4's codebook; FP8 per channel and in blocks, W8A16 and W8A8
(dynamic per token and static); odd M and N, rows past a tile, no rows; fp32 and bf16.

Tolerances (TOLERANCES): fp32 results differ from the reference by accumulation order only
(~1e-6 relative); bf16 by one rounding of the fp32 sum (the reference rounds once too, but its
sum runs in another order: 1 bf16 ulp)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit is defined

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.quant_fp8_gemm import fp8_block_k, fp8_gemm, fp8_w8a8_gemm  # noqa: E402
from kernels.quant_gemm import int_gemm  # noqa: E402
from kernels.quant_gemm_ref import (  # noqa: E402
    fp8_gemm_ref,
    fp8_w8a8_gemm_ref,
    int_gemm_ref,
    pack_int4,
    quantize_rows,
)

TOLERANCES = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}  # relative to the output's max
NF4 = torch.tensor([-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0, 0.0796,
                    0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.723, 1.0])


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    scale = float(want.float().abs().max()) or 1.0
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=TOLERANCES[dtype] * scale)


def int_weight(n: int, k: int, bits: int, group: int, *, zeros: bool, act_order: bool,
               codebook: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    num_groups = -(-k // (group or k))
    if bits == 4:
        codes = pack_int4(torch.randint(0, 16, (n, k), generator=g))
    else:
        codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, num_groups, generator=g) * 0.02 + 1e-3
    z = (torch.randint(-3, 4, (n, num_groups), generator=g, dtype=torch.int8) if zeros
         else None)
    g_idx = (torch.randperm(k, generator=g) % num_groups).to(torch.int32) if act_order else None
    return codes, scales, z, g_idx, NF4.clone() if codebook else None


CASES = {  # name -> (bits, group, zeros, act_order, codebook)
    "int4-g32-sym": (4, 32, False, False, False),
    "int4-g64-zeros": (4, 64, True, False, False),
    "int4-g32-act-order-zeros": (4, 32, True, True, False),
    "int4-channel": (4, 0, False, False, False),
    "int8-channel": (8, 0, False, False, False),
    "int8-g32-zeros": (8, 32, True, False, False),
    "nf4-g64": (4, 64, False, False, True),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", [1, 19])
def test_int_gemm_matches_its_reference(case, dtype, m):
    bits, group, zeros, act_order, codebook = CASES[case]
    n, k = 40, 192  # (N past one 32-wide tile; K over several 64-wide tiles and groups)
    w = int_weight(n, k, bits, group, zeros=zeros, act_order=act_order, codebook=codebook)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    kw = dict(bits=bits, group_size=group)
    got = int_gemm(x, *w, **kw, block_m=16, block_n=32, block_k=64)
    close(got, int_gemm_ref(x, *w, **kw), dtype)


def test_int_gemm_takes_no_rows_and_checks_its_layout():
    codes, scales, zeros, g_idx, book = int_weight(8, 64, 4, 32, zeros=True, act_order=False,
                                                   codebook=False)
    assert int_gemm(torch.zeros(0, 64), codes, scales, zeros, None, None, bits=4,
                    group_size=32).shape == (0, 8)
    with pytest.raises(ValueError, match="codes"):
        int_gemm(torch.zeros(2, 64), codes, scales, zeros, None, None, bits=8, group_size=32)
    with pytest.raises(ValueError, match="zeros"):
        int_gemm(torch.zeros(2, 64), codes, scales, zeros[:, :1], None, None, bits=4,
                 group_size=32)


def fp8_weight(n: int, k: int, block: tuple[int, int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    shape = (-(-n // (block[0] or n)), -(-k // (block[1] or k)))
    return w, torch.rand(shape, generator=g) * 1e-3 + 1e-4


BLOCKS = {"channel": (1, 0), "tensor": (0, 0), "blocks-32x32": (32, 32)}


@pytest.mark.parametrize("block", list(BLOCKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", [1, 19])
def test_fp8_w8a16_and_w8a8_match_their_references(block, dtype, m):
    n, k = 72, 160  # (blocks of 32: N and K not multiples of the tiles)
    w, scales = fp8_weight(n, k, BLOCKS[block])
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    got = fp8_gemm(x, w, scales, BLOCKS[block], block_m=16, block_n=32, block_k=64)
    close(got, fp8_gemm_ref(x, w, scales, BLOCKS[block]), dtype)
    got = fp8_w8a8_gemm(x, w, scales, BLOCKS[block], block_m=16, block_n=32, block_k=64)
    xq, x_scales = quantize_rows(x)
    close(got, fp8_w8a8_gemm_ref(xq, x_scales, w, scales, BLOCKS[block], out_dtype=dtype), dtype)


def test_fp8_w8a8_with_a_static_scale_and_the_k_tile_rule():
    w, scales = fp8_weight(16, 64, (1, 0))
    x = torch.randn(5, 64)
    static = torch.tensor([0.01])
    got = fp8_w8a8_gemm(x, w, scales, (1, 0), x_scales=static, block_n=16, block_k=32)
    xq, x_scales = quantize_rows(x, static)
    assert torch.equal(x_scales, torch.full((5,), 0.01))
    close(got, fp8_w8a8_gemm_ref(xq, x_scales, w, scales, (1, 0), out_dtype=x.dtype),
          torch.float32)
    assert fp8_block_k(4096, 128, 128) == 128 and fp8_block_k(512, 48, 128) == 16
    with pytest.raises(ValueError, match="multiple of 16"):
        fp8_block_k(512, 40, 128)
    with pytest.raises(ValueError, match="scales must be fp32"):
        fp8_gemm(x, w, scales[:, :0], (1, 0))


@pytest.mark.timeout(600)
def test_the_kernels_compile_for_sm90():
    """Lowering and shared memory as a Hopper build sees them (Triton's own ptxas, no GPU):
    the bf16 decode tiles of each variant (`python -m kernels.quant_compile_check` does all)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "kernels.quant_compile_check", "--arch", "90",
                          "--quick"], env=env, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert run.stdout.count(": ok,") == 6
