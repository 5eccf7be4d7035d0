"""Compile the SGMV and paged-attention kernels ahead of time for a GPU target without a GPU
(Triton's bundled ptxas), with the tile choices the launchers make, and print each variant's
shared memory.

    python -m kernels.compile_check [--arch 90] [--all]

Catches what the interpreter cannot: lowering errors, unsupported dot shapes, and shared memory
beyond the target's limit. Must run without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.paged_attention import _paged_attention_kernel, attention_tiles
from kernels.sgmv_expand import _sgmv_expand_kernel
from kernels.sgmv_fused import _sgmv_fused_kernel, fused_block_k
from kernels.sgmv_shrink import _sgmv_shrink_kernel, shrink_tiles, slices_per_launch

SHARED_LIMIT = 227 * 1024  # Hopper's opt-in shared memory per block
DTYPES = {"bf16": (tl.bfloat16, 2), "fp16": (tl.float16, 2), "fp32": (tl.float32, 4)}
PTR_TYPES = {"items_ptr": "*i32", "rank_ptr": "*i32", "scale_ptr": "*fp32", "t_ptr": "*fp32",
             "tables_ptr": "*i32", "ctx_ptr": "*i32", "q_start_ptr": "*i32", "q_len_ptr": "*i32",
             "a_rows_ptr": "*i64", "b_rows_ptr": "*i64"}
# layer_base passes 2^31 on large models (Llama-3-8B: 31 x blocks x 16384 elements). Other
# scalars are i32.
SCALAR_TYPES = {"scale_log2e": "fp32", "scale": "fp32", "softcap": "fp32", "layer_base": "i64"}
CHUNK = 16384  # Llama-3-8B's region (block 16 x 8 KV heads x head_dim 128): its chunk


def compile_variant(fn, dtype_name: str, constexprs: dict, num_warps: int, arch: int) -> int:
    """Compile one specialisation; returns its shared memory in bytes."""
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = PTR_TYPES.get(name, "*" + dtype_name)
        else:
            signature[name] = SCALAR_TYPES.get(name, "i32")
    src = ASTSource(fn, signature, constexprs=constexprs)
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": num_warps})
    return kernel.metadata.shared


def variants(everything: bool):
    """(name, kernel, dtype name, constexprs, num_warps) as the launchers would choose them."""
    for dtype_name in DTYPES if everything else ("bf16",):
        dt, size = DTYPES[dtype_name]
        common = {"DT": dt, "UPCAST": False, "EMULATE_RNE": False,
                  "IEEE": dtype_name == "fp32"}
        for rb in (16, 32, 64, 128, 256) if everything else (16, 64, 256):
            c = {**common, "RANK_BLOCK": rb, "CHUNK": CHUNK}
            yield (f"fused {dtype_name} r{rb}", _sgmv_fused_kernel, dtype_name,
                   {**c, "BLOCK_M": 16, "BLOCK_K": fused_block_k(rb, size), "BLOCK_N": 128}, 4)
            for num_slices in (1, 2, 3) if everything else (3,):
                num_slices = slices_per_launch(num_slices, rb, 64)
                block_k, warps = shrink_tiles(num_slices, rb, 64, size)
                yield (f"shrink {dtype_name} r{rb} x{num_slices}", _sgmv_shrink_kernel,
                       dtype_name, {**c, "NUM_SLICES": num_slices,
                                    "SLICES_P2": triton.next_power_of_2(num_slices),
                                    "BLOCK_M": 64, "BLOCK_K": block_k, "ATOMIC": True}, warps)
            yield (f"expand {dtype_name} r{rb}", _sgmv_expand_kernel, dtype_name,
                   {**c, "BLOCK_M": 64, "BLOCK_N": 128}, 4)
        for max_query_len, has_window in ((1, False), (1, True), (512, False)):
            block_m = attention_tiles(max_query_len, 4)  # Llama-3-8B: 32 / 8 heads, D 128
            yield (f"paged attention {dtype_name} BLOCK_M {block_m}"
                   f"{' window' if has_window else ''}", _paged_attention_kernel, dtype_name,
                   {**common, "GROUP": 4, "PAGE": 16, "BLOCK_M": block_m, "BLOCK_N": 64,
                    "BLOCK_D": 128, "HAS_WINDOW": has_window, "HAS_SOFTCAP": False}, 4)
        for max_query_len in (1, 512):  # Gemma 2 9B: 16 / 8 heads, D 256, a window, a cap
            block_m = attention_tiles(max_query_len, 2)
            yield (f"paged attention {dtype_name} BLOCK_M {block_m} D 256 window softcap",
                   _paged_attention_kernel, dtype_name,
                   {**common, "GROUP": 2, "PAGE": 16, "BLOCK_M": block_m, "BLOCK_N": 64,
                    "BLOCK_D": 256, "HAS_WINDOW": True, "HAS_SOFTCAP": True}, 4)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90")
    p.add_argument("--all", action="store_true", help="every dtype, rank tile and slice count")
    args = p.parse_args(argv)
    for name, fn, dtype_name, constexprs, warps in variants(args.all):
        shared = compile_variant(fn, dtype_name, constexprs, warps, args.arch)
        if shared > SHARED_LIMIT:
            raise SystemExit(f"{name}: {shared} bytes of shared memory > {SHARED_LIMIT}")
        print(f"{name}: ok, {shared} bytes shared")


if __name__ == "__main__":
    main()
