"""Pieces shared by the SGMV kernels: work-item loads, the column-chunk -> slice map, the expand
of one rank-r tile into the output, bf16 rounding under the interpreter, and launcher checks.

Columns: a group's output holds its slices side by side (q | k | v: widths N0, N1, N2 differ
under GQA). Each slice is cut into chunks of CHUNK_N columns; chunks are numbered slice by
slice, so a grid over sum(cdiv(N_i, CHUNK_N)) chunks has no program straddling two slices and
none left empty. Example: N = (256, 128, 128), CHUNK_N 128 -> chunks 0, 1 -> q, 2 -> k, 3 -> v.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def load_item(items_ptr, num_items, item):
    """(row_start, row_end, slot, segment) of work item `item` ([4, W] int32 rows)."""
    row_start = tl.load(items_ptr + item)
    row_end = tl.load(items_ptr + num_items + item)
    slot = tl.load(items_ptr + 2 * num_items + item)
    seg = tl.load(items_ptr + 3 * num_items + item)
    return row_start, row_end, slot, seg


@triton.jit
def chunk_to_slice(chunk, N0, N1, N2, CHUNK_N):
    """(slice, first column, end column, column offset of the slice) of a column chunk."""
    c0 = tl.cdiv(N0, CHUNK_N)
    c1 = tl.cdiv(N1, CHUNK_N)
    in1 = chunk >= c0
    in2 = chunk >= c0 + c1
    sl = in1.to(tl.int32) + in2.to(tl.int32)
    first_chunk = tl.where(in2, c0 + c1, tl.where(in1, c0, 0))
    n_offset = tl.where(in2, N0 + N1, tl.where(in1, N0, 0))
    n_size = tl.where(in2, N2, tl.where(in1, N1, N0))
    n_start = (chunk - first_chunk) * CHUNK_N
    n_end = tl.minimum(n_start + CHUNK_N, n_size)
    return sl, n_start, n_end, n_offset


@triton.jit
def cast_rne(x, DT: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """fp32 -> DT rounding to nearest even. The interpreter truncates fp32 -> bf16, so under it
    (EMULATE_RNE) the rounding is done on the bits first; the cast is then exact."""
    if EMULATE_RNE:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(DT)


@triton.jit
def expand_into(t, store_ptr, b_rows_ptr, out_ptr, rows, row_mask, rank, scale, n_start, n_end,
                stride_or, stride_ot, RANK_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                CHUNK: tl.constexpr, DT: tl.constexpr, UPCAST: tl.constexpr,
                EMULATE_RNE: tl.constexpr, IEEE: tl.constexpr):
    """out[rows, n_start:n_end] += scale * round(t) @ Bt[:rank, n_start:n_end].

    t [BLOCK_M, RANK_BLOCK] fp32 (zero above rank); store_ptr at the layer (layer_base added);
    b_rows_ptr at the slot's and slice's table of B^T rows ([R, chunks] element offsets, rows
    stride_or apart); out_ptr at the slice's first column. A column tile never straddles a
    chunk (BLOCK_N divides CHUNK and n_start). Rounding t to DT first keeps the reference's
    order (x@A^T is a DT tensor)."""
    t = cast_rne(t, DT, EMULATE_RNE)
    if UPCAST:
        t = t.to(tl.float32)
    r = tl.arange(0, RANK_BLOCK)
    r_mask = r < rank
    for n0 in range(n_start, n_end, BLOCK_N):
        ns = n0 + tl.arange(0, BLOCK_N)
        n_mask = ns < n_end
        base = tl.load(b_rows_ptr + r * stride_or + n0 // CHUNK, mask=r_mask, other=0)  # [RB]
        b = tl.load(store_ptr + base[:, None] + (n0 % CHUNK + tl.arange(0, BLOCK_N))[None, :],
                    mask=r_mask[:, None] & n_mask[None, :], other=0.0)  # [RANK_BLOCK, BLOCK_N]
        if UPCAST:
            b = b.to(tl.float32)
        if IEEE:
            delta = tl.dot(t, b, input_precision="ieee")
        else:
            delta = tl.dot(t, b)  # [BLOCK_M, BLOCK_N] fp32
        o_ptrs = out_ptr + rows[:, None] * stride_ot + ns[None, :]
        o_mask = row_mask[:, None] & n_mask[None, :]
        o = tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
        tl.store(o_ptrs, cast_rne(o + scale * delta, DT, EMULATE_RNE),
                 mask=o_mask)


def column_chunks(out_sizes: tuple[int, ...], num_items: int, block_n: int,
                  target_ctas: int) -> tuple[int, int]:
    """(CHUNK_N, number of chunks): few enough chunks per slice that a program reads its
    adapter's A once (the fused kernel recomputes the shrink per chunk), enough for about
    `target_ctas` programs over all items."""
    max_tiles = max(triton.cdiv(n, block_n) for n in out_sizes)
    want = triton.cdiv(target_ctas, max(1, num_items * len(out_sizes)))  # chunks per slice
    chunk_n = triton.cdiv(max_tiles, min(max(want, 1), max_tiles)) * block_n
    return chunk_n, sum(triton.cdiv(n, chunk_n) for n in out_sizes)


def is_interpreted() -> bool:
    """Whether this process's kernels run in the Triton interpreter (CPU tensors)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(load_item, InterpretedFunction)


def numerics(x: torch.Tensor) -> dict:
    """Constexprs for x's dtype and device: UPCAST (interpreter: fp32 compute), EMULATE_RNE
    (interpreter bf16 rounding), IEEE (fp32 dots without tf32 on the GPU), DT."""
    if x.dtype not in TL_DTYPES:
        raise ValueError(f"the Triton kernels take {', '.join(map(str, TL_DTYPES))}, got {x.dtype}")
    upcast = x.device.type != "cuda"
    return {"DT": TL_DTYPES[x.dtype], "UPCAST": upcast,
            "EMULATE_RNE": upcast and x.dtype == torch.bfloat16, "IEEE": x.dtype == torch.float32}


def padded_sizes(out_sizes: tuple[int, ...]) -> tuple[int, int, int]:
    if not 1 <= len(out_sizes) <= 3:
        raise ValueError(f"SGMV kernels take 1 to 3 slices, got {len(out_sizes)}")
    return (*out_sizes, 0, 0)[:3]


def check_work(items: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor | None,
               num_slices: int, device: torch.device) -> None:
    if items.dtype != torch.int32 or items.dim() != 2 or items.shape[0] != 4:
        raise ValueError(f"items must be int32 [4, W], got {items.dtype} {tuple(items.shape)}")
    if ranks.dtype != torch.int32 or ranks.dim() != 2 or ranks.shape[0] != num_slices:
        raise ValueError(f"ranks must be int32 [{num_slices}, S], got {ranks.dtype} "
                         f"{tuple(ranks.shape)}")
    if scales is not None and (scales.dtype != torch.float32 or scales.shape != ranks.shape):
        raise ValueError(f"scales must be fp32 {tuple(ranks.shape)}, got {scales.dtype} "
                         f"{tuple(scales.shape)}")
    for name, t in (("items", items), ("ranks", ranks), ("scales", scales)):
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device}, the activations on {device}")
    if items.stride(1) != 1 or ranks.stride(1) != 1 or (scales is not None
                                                        and scales.stride(1) != 1):
        raise ValueError("items, ranks and scales need contiguous rows")


def check_dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} needs a contiguous last dimension, got strides {t.stride()}")


def check_rows(store: torch.Tensor, dtype: torch.dtype, tables: tuple[torch.Tensor, ...],
               first_module: int, num_slices: int, chunk: int, tile: int) -> None:
    """The paged weights: `store` 1-D contiguous of the activations' dtype; each offset table
    int64 [slots, 7, R, chunks] on its device, covering the group's modules; `chunk` a power of
    two that `tile` (BLOCK_K or BLOCK_N) divides."""
    check_dtype("store", store, dtype)
    if store.dim() != 1:
        raise ValueError(f"store must be 1-D (the KV storage, flattened), got {store.dim()}-D")
    for t in tables:
        if t.dtype != torch.int64 or t.dim() != 4 or t.device != store.device \
                or first_module + num_slices > t.shape[1] or not t.is_contiguous():
            raise ValueError(f"row offsets must be contiguous int64 [slots, 7, R, chunks] on "
                             f"{store.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    if chunk < tile or chunk & (chunk - 1) or chunk % tile:
        raise ValueError(f"chunk {chunk} must be a power of two that the tile {tile} divides")
