"""Quantized linear weights: what a projection of a quantized base holds, and its matmul.

The forward (executor/model/transformer.py) calls every projection through `project(x, w, bias)`: a
dense weight (a tensor) is F.linear, unchanged in numerics and speed; a quantized one is one of

    IntWeight    int4 / int8 codes with group-wise scales (and zeros, act-order g_idx), or NF4 /
                 FP4 codes with a codebook: GPTQ, AWQ, compressed-tensors pack-quantized,
                 bitsandbytes (kernels/quant_gemm_ref.py: the layout, whatever the checkpoint's)
    Fp8Weight    fp8 e4m3 with per-channel or block scales; activations quantized too (W8A8,
                 per token or static) when the checkpoint says so
    StackedWeight  parts that cannot share one layout (a fused q|k|v whose parts differ in
                 g_idx or static input scale, or mix dense and quantized), side by side

and runs, by device and dtype (measured: bench/results/quantized-cpu.md):

    CUDA                  the Triton dequantize-in-the-GEMM kernels (kernels/quant_gemm.py,
                          kernels/quant_fp8_gemm.py), W8A8's fp8 dot where the checkpoint asks
    CPU, bf16 / fp16      torch's weight-only kernels for steps of up to CPU_KERNEL_MAX_ROWS
                          rows where the layout fits them (int8 per channel symmetric:
                          _weight_int8pack_mm; int4 group-wise without g_idx:
                          _weight_int4pack_mm_for_cpu, with its packed copy beside the codes),
                          else as fp32
    CPU, fp32 (default)   dequantize + matmul, CHUNK_ROWS output rows at a time (torch's int
                          kernels are 5-60x slower than dense fp32 on CPU)

Activations and adapters stay in full precision: the LoRA of a projection reads the same x.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from executor.model.quant_config import DYNAMIC, NO_ACTIVATIONS, STATIC
from kernels.quant_gemm_ref import (
    dequantize_fp8,
    dequantize_int,
    quantize_rows,
    row_scales,
    unpack_int4,
)

CHUNK_ELEMENTS = 1 << 20  # dequantized at a time on CPU (4 MB of fp32: stays in cache)
# torch's CPU int kernels on bf16 run decode-sized steps (up to this many rows) 3-30x faster than
# dequantize + matmul, and larger ones slower (bench/results/quantized-cpu.md)
CPU_KERNEL_MAX_ROWS = 16
INT4_CPU_GROUPS = (32, 64, 128, 256)  # the group sizes _weight_int4pack_mm_for_cpu takes


class IntWeight:
    """W [out, in] in the integer layout of kernels/quant_gemm_ref.py."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 g_idx: torch.Tensor | None, codebook: torch.Tensor | None, *, bits: int,
                 group_size: int, label: str) -> None:
        self.codes, self.scales, self.zeros = codes, scales, zeros  # see the layout
        self.g_idx, self.codebook = g_idx, codebook
        self.bits, self.group_size, self.label = bits, group_size, label
        self._cpu: tuple | None = None  # torch's CPU kernel form, made by prepare()

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * (2 if self.bits == 4 else 1)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def _fields(self) -> tuple:
        return self.codes, self.scales, self.zeros, self.g_idx, self.codebook

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: slice = slice(None)):
        """W[rows] [n, in] in `dtype`."""
        codes, scales, zeros = self.codes[rows], self.scales[rows], self.zeros
        return dequantize_int(codes, scales, None if zeros is None else zeros[rows], self.g_idx,
                              self.codebook, bits=self.bits, group_size=self.group_size,
                              dtype=dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None, tp=None, *,
               triton: bool | None = None) -> torch.Tensor:
        """x [T, in] @ W^T (+ bias); triton: the Triton kernel (default: on CUDA; the tests run
        it under the interpreter)."""
        if x.device.type == "cuda" if triton is None else triton:
            from kernels.quant_gemm import int_gemm

            out = int_gemm(x, *self._fields(), bits=self.bits, group_size=self.group_size)
        elif self._cpu is not None and x.dtype == self._cpu[0] \
                and x.shape[0] <= CPU_KERNEL_MAX_ROWS:
            out = self._cpu_kernel(x)
        else:
            out = _chunked_linear(x, self.shape, self.dequantize, align=1)
        return out if bias is None else out + bias

    def prepare(self, dtype: torch.dtype) -> None:
        """Make torch's CPU kernel form for activations of `dtype` where the layout fits it."""
        if self.device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
            return
        plain = self.codebook is None and self.g_idx is None
        if plain and self.bits == 8 and self.zeros is None and self.scales.shape[1] == 1:
            self._cpu = (dtype, "int8", self.scales[:, 0].to(dtype))
        elif plain and self.bits == 4 and self.group_size in INT4_CPU_GROUPS \
                and self.shape[1] % self.group_size == 0:
            packed = torch._convert_weight_to_int4pack_for_cpu(
                unpack_int4(self.codes).to(torch.int32), 2)
            # tinygemm's form: W = (nibble - 8) * scale + zero, so zero = -(our zero) * scale
            zero = (torch.zeros_like(self.scales) if self.zeros is None
                    else -self.zeros.float() * self.scales)
            scales_zeros = torch.stack([self.scales.T, zero.T], -1).to(dtype).contiguous()
            self._cpu = (dtype, "int4", packed, scales_zeros)

    def _cpu_kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self._cpu[1] == "int8":
            return torch._weight_int8pack_mm(x, self.codes, self._cpu[2])
        return torch._weight_int4pack_mm_for_cpu(x, self._cpu[2], self.group_size, self._cpu[3])

    def narrow(self, dim: int, start: int, end: int) -> IntWeight:
        """Rows [start, end) (dim 0) or input columns (dim 1; the groups they cut must be whole,
        or named by a g_idx)."""
        if dim == 0:
            rows = slice(start, end)
            return self._with(self.codes[rows], self.scales[rows],
                              None if self.zeros is None else self.zeros[rows], self.g_idx)
        width, group = self.shape[1], self.group_size
        if self.bits == 4 and (start % 2 or end % 2):
            raise ValueError(f"columns [{start}, {end}) split a byte of two int4 codes")
        cols = slice(start // 2, end // 2) if self.bits == 4 else slice(start, end)
        if self.g_idx is not None or not group:  # (act-order: every group's scales kept, the
            # columns name theirs; per channel: one scale per row, whatever the columns)
            return self._with(self.codes[:, cols].contiguous(), self.scales, self.zeros,
                              None if self.g_idx is None else self.g_idx[start:end].contiguous())
        if start % group or (end % group and end != width):
            raise ValueError(f"columns [{start}, {end}) split a group of {group}")
        groups = slice(start // group, -(-end // group))
        return self._with(self.codes[:, cols].contiguous(), self.scales[:, groups].contiguous(),
                          None if self.zeros is None else self.zeros[:, groups].contiguous(),
                          None)

    def _with(self, codes, scales, zeros, g_idx) -> IntWeight:
        return IntWeight(codes, scales, zeros, g_idx, self.codebook, bits=self.bits,
                         group_size=self.group_size, label=self.label)

    def to(self, device: torch.device | str) -> IntWeight:
        moved = [None if t is None else t.to(device) for t in self._fields()]
        return IntWeight(*moved, bits=self.bits, group_size=self.group_size, label=self.label)

    def joins(self, other: object) -> bool:
        """Whether `other`'s rows can stack under this one's in one IntWeight."""
        return (isinstance(other, IntWeight) and other.shape[1] == self.shape[1]
                and (other.bits, other.group_size) == (self.bits, self.group_size)
                and (other.zeros is None) == (self.zeros is None)
                and _same(other.g_idx, self.g_idx) and _same(other.codebook, self.codebook))

    def num_bytes(self) -> int:
        tensors = [*self._fields(), *(self._cpu[2:] if self._cpu else ())]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class Fp8Weight:
    """W [out, in] = fp8 e4m3 x scales of `block` (rows, columns; 0: the whole dimension);
    `activations` quantized too (DYNAMIC per token, STATIC by input_scale) or not."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int],
                 activations: str = NO_ACTIVATIONS, input_scale: torch.Tensor | None = None, *,
                 label: str, scale_ub: float = 0.0) -> None:
        self.weight, self.scales, self.block = weight, scales, block
        self.activations, self.input_scale, self.label = activations, input_scale, label
        self.scale_ub = scale_ub  # DYNAMIC: each row's amax clamped to this (0: not; fbgemm)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: slice = slice(None)):
        n = self.shape[0]
        start, stop, _ = rows.indices(n)
        bn = self.block[0] or n
        if start % bn:
            return dequantize_fp8(self.weight, self.scales, self.block, dtype)[rows]
        scales = self.scales[start // bn: -(-stop // bn)] if self.scales.shape[0] > 1 \
            else self.scales
        return dequantize_fp8(self.weight[rows], scales, self.block, dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None, tp=None, *,
               triton: bool | None = None) -> torch.Tensor:
        """tp: the tensor-parallel group of a row-parallel projection, whose ranks each hold part
        of a row of x: a dynamic per-token scale is the whole row's (its amax all-reduced), so
        every rank quantizes alike and TP=N computes what TP=1 does. triton: as IntWeight's."""
        x_scales = self._activation_scales(x, tp)
        if x.device.type == "cuda" if triton is None else triton:
            from kernels.quant_fp8_gemm import fp8_gemm, fp8_w8a8_gemm

            out = (fp8_gemm(x, self.weight, self.scales, self.block)
                   if self.activations == NO_ACTIVATIONS else
                   fp8_w8a8_gemm(x, self.weight, self.scales, self.block, x_scales=x_scales))
        elif self.activations in (DYNAMIC, STATIC):
            xq, x_scales = quantize_rows(x, x_scales)
            out = _chunked_linear(xq, self.shape, self.dequantize, align=self.block[0] or 1,
                                  w8a8=(x_scales, x.dtype))
        else:
            out = _chunked_linear(x, self.shape, self.dequantize, align=self.block[0] or 1)
        return out if bias is None else out + bias

    def _activation_scales(self, x: torch.Tensor, tp) -> torch.Tensor | None:
        if self.activations == STATIC:
            return self.input_scale
        if self.activations != DYNAMIC:
            return None
        amax = x.abs().amax(-1).float()  # [T]
        if tp is not None and tp.world > 1:
            amax = tp.all_reduce_max(amax)
        return row_scales(amax.clamp(max=self.scale_ub) if self.scale_ub else amax)

    def prepare(self, dtype: torch.dtype) -> None:
        """(Nothing to make: the CPU path dequantizes, CUDA's kernels read the fp8 as stored.)"""

    def narrow(self, dim: int, start: int, end: int) -> Fp8Weight:
        """Rows (dim 0) or input columns (dim 1) [start, end): the scale blocks they cut must be
        whole."""
        size, per = self.shape[dim], self.block[dim] or self.shape[dim]
        if self.scales.shape[dim] > 1 and (start % per or (end % per and end != size)):
            raise ValueError(f"{'rows' if dim == 0 else 'columns'} [{start}, {end}) split a "
                             f"scale block of {per}")
        scales = self.scales
        if scales.shape[dim] > 1:
            scales = scales.narrow(dim, start // per, -(-end // per) - start // per)
        return self._with(self.weight.narrow(dim, start, end - start).contiguous(),
                          scales.contiguous(), self.input_scale)

    def _with(self, weight, scales, input_scale) -> Fp8Weight:
        return Fp8Weight(weight, scales, self.block, self.activations, input_scale,
                         label=self.label, scale_ub=self.scale_ub)

    def to(self, device: torch.device | str) -> Fp8Weight:
        return self._with(self.weight.to(device), self.scales.to(device),
                          None if self.input_scale is None else self.input_scale.to(device))

    def joins(self, other: object) -> bool:
        """Whether `other`'s rows can stack under this one's (this one's rows end a block)."""
        return (isinstance(other, Fp8Weight) and other.shape[1] == self.shape[1]
                and other.block == self.block and self.block[0] > 0
                and self.shape[0] % self.block[0] == 0 and other.activations == self.activations
                and other.scale_ub == self.scale_ub and _same(other.input_scale, self.input_scale))

    def num_bytes(self) -> int:
        tensors = (self.weight, self.scales, self.input_scale)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class StackedWeight:
    """Parts side by side along the output (dense tensors or quantized weights): one matmul
    each, outputs concatenated."""

    def __init__(self, parts: list) -> None:
        self.parts = parts
        self.label = " | ".join(getattr(p, "label", "dense") for p in parts)

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.to(dtype) if isinstance(p, torch.Tensor) else p.dequantize(dtype)
                          for p in self.parts])

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None, tp=None, *,
               triton: bool | None = None) -> torch.Tensor:
        out = torch.cat([F.linear(x, p) if isinstance(p, torch.Tensor)
                         else p.linear(x, tp=tp, triton=triton) for p in self.parts], dim=-1)
        return out if bias is None else out + bias

    def num_bytes(self) -> int:
        return sum(weight_bytes(p) for p in self.parts)


QuantizedWeight = IntWeight | Fp8Weight | StackedWeight


def project(x: torch.Tensor, w, bias: torch.Tensor | None = None, tp=None) -> torch.Tensor:
    """x [T, in] @ w^T (+ bias) -> [T, out]: F.linear for a dense weight, the quantized one's own
    matmul otherwise (tp: a row-parallel projection's group, for W8A8's per-token scales)."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    return w.linear(x, bias, tp)


def is_quantized(w: object) -> bool:
    return isinstance(w, (IntWeight, Fp8Weight, StackedWeight))


def weight_bytes(w) -> int:
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.num_bytes()


def join(parts: list, dim: int = 0):
    """Concatenate weights along `dim`: tensors by torch.cat; quantized weights' rows (dim 0)
    into one of them where their layouts agree, else a StackedWeight."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts, dim) if len(parts) > 1 else parts[0]
    if len(parts) == 1:
        return parts[0]
    if dim != 0:
        raise ValueError("quantized weights are joined along their rows only")
    first = parts[0]
    if isinstance(first, IntWeight) and all(first.joins(p) for p in parts[1:]):
        zeros = None if first.zeros is None else torch.cat([p.zeros for p in parts])
        return first._with(torch.cat([p.codes for p in parts]),
                           torch.cat([p.scales for p in parts]), zeros, first.g_idx)
    if isinstance(first, Fp8Weight) and all(a.joins(b) for a, b in zip(parts, parts[1:])):
        return first._with(torch.cat([p.weight for p in parts]),
                           torch.cat([p.scales for p in parts]), first.input_scale)
    flat = [q for p in parts for q in (p.parts if isinstance(p, StackedWeight) else [p])]
    return StackedWeight(flat)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _chunked_linear(x: torch.Tensor, shape: tuple[int, int], dequantize, *, align: int,
                    w8a8: tuple[torch.Tensor, torch.dtype] | None = None) -> torch.Tensor:
    """x @ W^T with W dequantized about CHUNK_ELEMENTS at a time (a multiple of `align` rows:
    whole scale blocks), each chunk giving its columns of the output; w8a8: (x's per-row scales,
    the output dtype) for fp8 activations x, whose product is scaled per row."""
    out_f, in_f = shape
    out = torch.empty(x.shape[0], out_f, dtype=w8a8[1] if w8a8 else x.dtype, device=x.device)
    step = max(align, CHUNK_ELEMENTS // in_f // align * align)
    for start in range(0, out_f, step):
        rows = slice(start, min(start + step, out_f))
        if w8a8:
            w = dequantize(torch.float32, rows)  # [rows, in]
            out[:, rows] = ((x.float() @ w.T) * w8a8[0][:, None]).to(w8a8[1])
        else:
            out[:, rows] = F.linear(x, dequantize(x.dtype, rows))
    return out
