"""Section 10 of the GPU check: the dequantize-in-the-GEMM kernels (kernels/quant_gemm.py,
kernels/quant_fp8_gemm.py) at Llama-3-8B's largest projections (gate|up 28672 x 4096, down
4096 x 14336), bf16 activations: int4 in groups of 128 with zeros (GPTQ / AWQ / W4A16), the
same with an act-order g_idx, int8 per channel (W8A16), NF4 (bitsandbytes' codebook, blocks of
64), FP8 in 128 x 128 blocks (W8A16) and FP8 per channel with per-token activation scales
(W8A8, the fp8 dot), each against its torch reference and timed against the bf16 F.linear of
the dense weight, for 1, 64 and 2048 rows. Run alone: python bench/gpu_quant.py [--smoke].
"""

from __future__ import annotations

from gpu_harness import DEVICE, OPTS, REPORT, bench_ms, section, sync, table  # first

import torch
import torch.nn.functional as F
from kernels.quant_fp8_gemm import fp8_gemm, fp8_w8a8_gemm
from kernels.quant_gemm import int_gemm
from kernels.quant_gemm_ref import (
    fp8_gemm_ref,
    fp8_w8a8_gemm_ref,
    int_gemm_ref,
    pack_int4,
    quantize_rows,
)
from kernels.reference import TOLERANCES

DT = torch.bfloat16
SHAPES = {"gate_up": (2 * 14336, 4096), "down": (4096, 14336)}  # (N, K)
NF4 = [-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0, 0.0796, 0.1609, 0.2461,
       0.3379, 0.4407, 0.5626, 0.723, 1.0]


def int_case(n: int, k: int, bits: int, group: int, g: torch.Generator, *, zeros: bool,
             act_order: bool = False, codebook: bool = False) -> tuple:
    groups = k // group if group else 1

    def ints(low, high, shape, dtype=torch.int64):
        return torch.randint(low, high, shape, generator=g, device=DEVICE, dtype=dtype)

    codes = pack_int4(ints(0, 16, (n, k))) if bits == 4 else ints(-128, 128, (n, k), torch.int8)
    scales = torch.rand(n, groups, generator=g, device=DEVICE) * 2e-3 + 1e-4
    z = ints(-4, 4, (n, groups), torch.int8) if zeros else None
    g_idx = (torch.randperm(k, generator=g, device=DEVICE) % groups).to(torch.int32) \
        if act_order else None
    book = torch.tensor(NF4, device=DEVICE) if codebook else None
    return (codes, scales, z, g_idx, book), dict(bits=bits, group_size=group)


def fp8_case(n: int, k: int, block: tuple[int, int], g: torch.Generator):
    w = (torch.randn(n, k, generator=g, device=DEVICE) * 64).clamp(-448, 448)
    shape = (-(-n // (block[0] or n)), -(-k // (block[1] or k)))
    return w.to(torch.float8_e4m3fn), torch.rand(shape, generator=g, device=DEVICE) * 1e-4


def formats(n: int, k: int, g: torch.Generator) -> dict:
    """name -> (kernel call, reference call): both x -> out."""
    out = {}
    group = 128 if not OPTS.smoke else 32
    for name, bits, grp, zeros, act, book in (("int4 g128 zeros", 4, group, True, False, False),
                                              ("int4 g128 act-order", 4, group, True, True, False),
                                              ("int8 channel", 8, 0, False, False, False),
                                              ("nf4 b64", 4, 64 if not OPTS.smoke else 32, False,
                                               False, True)):
        args, kw = int_case(n, k, bits, grp, g, zeros=zeros, act_order=act, codebook=book)
        out[name] = (lambda x, a=args, kw=kw: int_gemm(x, *a, **kw),
                     lambda x, a=args, kw=kw: int_gemm_ref(x, *a, **kw))
    block = (128, 128) if not OPTS.smoke else (16, 16)
    w, s = fp8_case(n, k, block, g)
    out["fp8 128x128 W8A16"] = (lambda x: fp8_gemm(x, w, s, block),
                                lambda x: fp8_gemm_ref(x, w, s, block))
    wc, sc = fp8_case(n, k, (1, 0), g)
    out["fp8 channel W8A8"] = (lambda x: fp8_w8a8_gemm(x, wc, sc, (1, 0)),
                               lambda x: fp8_w8a8_gemm_ref(*quantize_rows(x), wc, sc, (1, 0),
                                                           out_dtype=x.dtype))
    return out


@section("10. Quantized GEMM: dequantize in the kernel vs bf16 (Llama-3-8B projections)")
def quant_check() -> None:
    g = torch.Generator(device=DEVICE).manual_seed(4)
    rtol, atol = TOLERANCES[DT]
    rows_list = (4,) if OPTS.smoke else (1, 64, 2048)
    shapes = {"gate_up": (64, 128)} if OPTS.smoke else SHAPES
    rows = []
    for shape_name, (n, k) in shapes.items():
        dense = torch.randn(n, k, generator=g, device=DEVICE, dtype=DT) * 0.02
        cases = formats(n, k, g)
        for m in rows_list:
            x = torch.randn(m, k, generator=g, device=DEVICE, dtype=DT)
            dense_ms = bench_ms(lambda: F.linear(x, dense))
            for name, (kernel, ref) in cases.items():
                got, want = kernel(x), ref(x)
                sync()
                scale = float(want.float().abs().max()) or 1.0
                ok = bool(torch.allclose(got.float(), want.float(), rtol=rtol,
                                         atol=atol * scale))
                ms = bench_ms(lambda: kernel(x))
                weight_gb = n * k * (0.5 if name.startswith(("int4", "nf4")) else 1) / 1e9
                rows.append([shape_name, m, name, ms * 1e3, dense_ms * 1e3, dense_ms / ms,
                             weight_gb / (ms / 1e3), "yes" if ok else "NO"])
                print(rows[-1], flush=True)
    REPORT.append("Each projection's weight in the format (random codes and scales), bf16 "
                  "activations; the kernel against its torch reference (dequantize, then "
                  "matmul) and, for time, against F.linear of a bf16 weight of the same shape. "
                  "us = do_bench median; weight GB/s = the quantized weight's bytes / time.\n\n")
    REPORT.append(table(["projection", "rows", "format", "kernel us", "bf16 us",
                         "bf16 / kernel", "weight GB/s", "matches reference"], rows))


if __name__ == "__main__":
    quant_check()
