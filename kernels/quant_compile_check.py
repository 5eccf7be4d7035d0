"""Compile the dequantize-in-the-GEMM kernels ahead of time for a GPU target without a GPU (as
kernels/compile_check.py does for the LoRA and attention kernels), with the tiles their
launchers choose, and print each variant's shared memory.

    python -m kernels.quant_compile_check [--arch 90] [--quick]

Must run without TRITON_INTERPRET. W8A8's fp8 x fp8 dot needs sm_89 or later.
"""

from __future__ import annotations

import argparse

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.compile_check import SHARED_LIMIT
from kernels.quant_fp8_gemm import _fp8_gemm_kernel
from kernels.quant_gemm import _int_gemm_kernel, int_tiles

ACT = {"bf16": tl.bfloat16, "fp16": tl.float16}


def _compile(fn, pointers: dict[str, str], constexprs: dict, num_warps: int, arch: int) -> int:
    signature = {name: ("constexpr" if name in constexprs else pointers.get(name, "i32"))
                 for name in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, signature, constexprs=constexprs),
                            target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    return kernel.metadata.shared


def variants(quick: bool = False):
    """(name, kernel, pointer types, constexprs, num_warps) as the launchers choose them
    (quick: bf16 decode tiles only)."""
    for act, dt in ACT.items():
        if quick and act != "bf16":
            continue
        common = {"DT": dt, "UPCAST": False, "EMULATE_RNE": False, "IEEE": False}
        for m in (1,) if quick else (1, 2048):
            block_m, block_n, block_k, warps = int_tiles(m)
            tiles = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k}
            for bits, zeros, gidx, book in ((4, False, False, False), (4, True, True, False),
                                            (8, False, False, False), (4, False, False, True)):
                pointers = {"x_ptr": f"*{act}", "out_ptr": f"*{act}",
                            "codes_ptr": "*u8" if bits == 4 else "*i8", "scales_ptr": "*fp32",
                            "zeros_ptr": "*i8", "gidx_ptr": "*i32", "codebook_ptr": "*fp32"}
                name = (f"int{bits}{' zeros' if zeros else ''}{' g_idx' if gidx else ''}"
                        f"{' codebook' if book else ''} {act} M={m}")
                yield (name, _int_gemm_kernel, pointers,
                       {**common, **tiles, "BITS": bits, "HAS_ZEROS": zeros, "HAS_GIDX": gidx,
                        "HAS_CODEBOOK": book, "TILE_IN_GROUP": not gidx}, warps)
            for w8a8 in (False, True):
                pointers = {"x_ptr": "*fp8e4nv" if w8a8 else f"*{act}", "xs_ptr": "*fp32",
                            "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "out_ptr": f"*{act}"}
                yield (f"fp8 {'W8A8' if w8a8 else 'W8A16'} {act} M={m}", _fp8_gemm_kernel,
                       pointers, {**common, "W8A8": w8a8, "BLOCK_M": 16 if m <= 16 else 64,
                                  "BLOCK_N": 64, "BLOCK_K": 128}, 4)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90")
    p.add_argument("--quick", action="store_true", help="bf16 decode tiles only")
    args = p.parse_args(argv)
    for name, fn, pointers, constexprs, warps in variants(args.quick):
        shared = _compile(fn, pointers, constexprs, warps, args.arch)
        if shared > SHARED_LIMIT:
            raise SystemExit(f"{name}: {shared} bytes of shared memory > {SHARED_LIMIT}")
        print(f"{name}: ok, {shared} bytes shared")


if __name__ == "__main__":
    main()
