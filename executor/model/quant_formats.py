"""Each quantized checkpoint format's tensors of one projection, as its tools write them, read
into the serving layouts (executor/model/quant.py, kernels/quant_gemm_ref.py). Every tensor is
checked against the projection's shape [out, in] and the scheme: a checkpoint whose scales,
zeros or g_idx do not fit its weights is refused, never served wrong.

    compressed-tensors  pack-quantized  weight_packed int32 [out, in * bits / 32] (element i at
                        bit i * bits, stored + 2^(bits-1)), weight_scale [out, G], weight_shape,
                        weight_zero_point int32 [out * bits / 32, G] (packed along the rows),
                        weight_g_idx [in]
                        float-quantized weight fp8 [out, in], weight_scale [1] / [out, 1] /
                        [out / BN, in / BK], input_scale [1] (static activations)
    fp8 (blocks)        weight fp8 [out, in], weight_scale_inv fp32 [out / BN, in / BK]
    fbgemm_fp8          weight fp8 [out, in], weight_scale fp32 [out, 1]
    gptq                qweight int32 [in * bits / 32, out] (packed along the inputs), qzeros
                        int32 [G, out * bits / 32], scales [G, out], g_idx [in]; v1 checkpoints
                        store each zero minus one
    awq (GEMM)          qweight int32 [in, out / 8], qzeros [G, out / 8] (the 8 columns of a word
                        in the order 0 2 4 6 1 3 5 7), scales [G, out]; W = (q - zero) * scale
    bitsandbytes        weight uint8 [(out * in + 1) / 2, 1] (the row-major values, first of a
                        pair in the high nibble), absmax per block of `blocksize` (uint8 under
                        double quantization: nested_quant_map[code] * nested_absmax + offset),
                        quant_map [16], quant_state.bitsandbytes__{nf4|fp4} (JSON)
"""

from __future__ import annotations

import json
import sys

import torch

from executor.model.quant import Fp8Weight, IntWeight
from executor.model.quant_config import FP8, Quantization, WeightScheme
from kernels.quant_gemm_ref import pack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column of each nibble of an AWQ word
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def read_weight(tensors: dict[str, torch.Tensor], q: Quantization, scheme: WeightScheme,
                shape: tuple[int, int], label: str) -> IntWeight | Fp8Weight:
    """One projection's quantized weight from its checkpoint tensors (suffix -> tensor: "qweight",
    "weight_scale", "weight.absmax", ...); ValueError naming the tensor that does not fit."""
    if sys.byteorder != "little":
        raise ValueError("quantized checkpoints are read on little-endian hosts only")
    if q.layout == "bnb-4bit":
        return _bitsandbytes(tensors, q, shape, label)
    if scheme.kind == FP8:
        return _fp8(tensors, q, scheme, shape, label)
    if q.method == "gptq":
        return _gptq(tensors, scheme, shape, label, v1=q.layout == "gptq")
    if q.method == "awq":
        return _awq(tensors, scheme, shape, label)
    return _pack_quantized(tensors, scheme, shape, label)


def _take(tensors: dict[str, torch.Tensor], suffix: str, shape: tuple[int, ...] | None,
          dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if suffix not in tensors:
        raise ValueError(f"its {suffix!r} is missing")
    t = tensors.pop(suffix)
    if t.dtype not in dtypes:
        raise ValueError(f"its {suffix!r} is {t.dtype}, expected {' or '.join(map(str, dtypes))}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"its {suffix!r} has shape {tuple(t.shape)}, expected {tuple(shape)} for "
                         "the weight")
    if t.is_floating_point() and not torch.isfinite(t.float()).all():
        raise ValueError(f"its {suffix!r} holds non-finite values")
    return t


def _words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., W] -> the unsigned values [..., W * 32 / bits] as int16, element i from bit
    i * bits (little-endian: byte b holds elements 2b (low nibble) and 2b + 1 at 4 bits)."""
    raw = words.contiguous().view(torch.uint8)  # [..., 4 W]
    if bits == 8:
        return raw.to(torch.int16)
    return torch.stack([raw & 0x0F, raw >> 4], -1).reshape(*raw.shape[:-1], -1).to(torch.int16)


def _groups(scheme: WeightScheme, width: int) -> int:
    return -(-width // scheme.group_size) if scheme.group_size else 1


def _int_weight(values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                g_idx: torch.Tensor | None, scheme: WeightScheme, label: str) -> IntWeight:
    """IntWeight of unsigned values [out, in] (0 .. 2^bits - 1), zeros unsigned too (None:
    2^(bits-1)), fp scales [out, G], g_idx [in]."""
    out_f, in_f = values.shape
    offset = 1 << (scheme.bits - 1)
    if in_f % 2:
        raise ValueError(f"{in_f} input columns: int codes are read in pairs")
    codes = pack_int4(values) if scheme.bits == 4 else (values - offset).to(torch.int8)
    signed = None if zeros is None else (zeros.to(torch.int16) - offset)
    if signed is not None and (signed.abs() > 127).any():
        raise ValueError("its zero points lie outside int8")
    if signed is not None and not signed.any():
        signed = None  # (a symmetric checkpoint that wrote its zeros out)
    if g_idx is not None:
        g_idx = g_idx.to(torch.int32)
        if g_idx.min() < 0 or g_idx.max() >= scales.shape[1]:
            raise ValueError(f"its g_idx names groups outside [0, {scales.shape[1]})")
        if scheme.group_size and torch.equal(
                g_idx, (torch.arange(in_f) // scheme.group_size).to(torch.int32)):
            g_idx = None  # (no act-order after all: the columns in order)
    return IntWeight(codes.contiguous(), scales.float().contiguous(),
                     None if signed is None else signed.to(torch.int8).contiguous(), g_idx,
                     None, bits=scheme.bits, group_size=scheme.group_size, label=label)


def _pack_quantized(tensors, scheme: WeightScheme, shape, label) -> IntWeight:
    out_f, in_f = shape
    bits, groups = scheme.bits, _groups(scheme, in_f)
    packed = _take(tensors, "weight_packed", (out_f, -(-in_f * bits // 32)), (torch.int32,))
    stored = _take(tensors, "weight_shape", (2,), (torch.int64, torch.int32))
    if tuple(stored.tolist()) != tuple(shape):
        raise ValueError(f"its weight_shape {tuple(stored.tolist())} is not {tuple(shape)}")
    scales = _take(tensors, "weight_scale", (out_f, groups), FLOATS)
    zeros = None
    if not scheme.symmetric:
        words = _take(tensors, "weight_zero_point", (-(-out_f * bits // 32), groups),
                      (torch.int32,))
        zeros = _words(words.T, bits)[:, :out_f].T  # (packed along the rows)
    g_idx = (_take(tensors, "weight_g_idx", (in_f,), (torch.int32, torch.int64))
             if "weight_g_idx" in tensors else None)
    return _int_weight(_words(packed, bits)[:, :in_f], scales, zeros, g_idx, scheme, label)


def _gptq(tensors, scheme: WeightScheme, shape, label, *, v1: bool) -> IntWeight:
    out_f, in_f = shape
    bits, groups = scheme.bits, _groups(scheme, in_f)
    per = 32 // bits
    if in_f % per or out_f % per:
        raise ValueError(f"[{out_f}, {in_f}] is not a multiple of the {per} values of a word")
    qweight = _take(tensors, "qweight", (in_f // per, out_f), (torch.int32,))
    qzeros = _take(tensors, "qzeros", (groups, out_f // per), (torch.int32,))
    scales = _take(tensors, "scales", (groups, out_f), FLOATS)
    g_idx = _take(tensors, "g_idx", (in_f,), (torch.int32, torch.int64)) \
        if "g_idx" in tensors else None
    if scheme.act_order and g_idx is None:
        raise ValueError("desc_act is set but its g_idx is missing")
    values = _words(qweight.T, bits)  # [out, in]: a word holds `per` consecutive input rows
    zeros = _words(qzeros, bits) + (1 if v1 else 0)  # [G, out]
    return _int_weight(values, scales.T, zeros.T, g_idx, scheme, label)


def _awq(tensors, scheme: WeightScheme, shape, label) -> IntWeight:
    out_f, in_f = shape
    groups = _groups(scheme, in_f)
    if out_f % 8:
        raise ValueError(f"{out_f} outputs: AWQ packs 8 per word")
    order = torch.tensor(AWQ_ORDER).argsort()  # nibble position of each column
    qweight = _take(tensors, "qweight", (in_f, out_f // 8), (torch.int32,))
    qzeros = _take(tensors, "qzeros", (groups, out_f // 8), (torch.int32,))
    scales = _take(tensors, "scales", (groups, out_f), FLOATS)

    def columns(words: torch.Tensor) -> torch.Tensor:
        nibbles = _words(words, 4).view(words.shape[0], -1, 8)  # [rows, words, position]
        return nibbles[:, :, order].reshape(words.shape[0], -1)

    return _int_weight(columns(qweight).T, scales.T, columns(qzeros).T, None, scheme, label)


def _fp8(tensors, q: Quantization, scheme: WeightScheme, shape, label) -> Fp8Weight:
    out_f, in_f = shape
    weight = _take(tensors, "weight", shape, (torch.float8_e4m3fn,))
    bn, bk = scheme.block
    if q.method == "fp8":
        scales = _take(tensors, "weight_scale_inv", (-(-out_f // bn), -(-in_f // bk)), FLOATS)
    elif q.method == "fbgemm_fp8":
        scales = _take(tensors, "weight_scale", (out_f, 1), FLOATS)
    elif scheme.block == (0, 0):  # per tensor: kept per channel (a fused q|k|v joins)
        scales = _take(tensors, "weight_scale", None, FLOATS)
        if scales.numel() != 1:
            raise ValueError(f"its per-tensor weight_scale has {scales.numel()} values")
        scales, bn, bk = scales.reshape(1, 1).expand(out_f, 1), 1, 0
    elif scheme.block == (1, 0):
        scales = _take(tensors, "weight_scale", (out_f, 1), FLOATS)
    else:
        scales = _take(tensors, "weight_scale", (-(-out_f // bn), -(-in_f // bk)), FLOATS)
    input_scale = None
    if scheme.activations == "static":
        input_scale = _take(tensors, "input_scale", None, FLOATS).float().reshape(-1)
        if input_scale.numel() != 1 or not input_scale.item() > 0:
            raise ValueError("its input_scale must be one positive value")
    return Fp8Weight(weight.contiguous(), scales.float().contiguous(), (bn, bk),
                     scheme.activations, input_scale, label=label,
                     scale_ub=scheme.activation_scale_ub)


def _bitsandbytes(tensors, q: Quantization, shape, label) -> IntWeight:
    out_f, in_f = shape
    states = [s for s in tensors if s.startswith("weight.quant_state.bitsandbytes__")]
    if len(states) != 1:
        raise ValueError("its weight.quant_state.bitsandbytes__nf4 / __fp4 is missing")
    state = json.loads(bytes(tensors.pop(states[0]).tolist()).decode())
    kind, block = state.get("quant_type"), int(state.get("blocksize", 0))
    if kind != q.groups[0][1].kind:
        raise ValueError(f"its quant_type {kind!r} is not the config's "
                         f"{q.groups[0][1].kind!r}")
    if tuple(state.get("shape", ())) != tuple(shape):
        raise ValueError(f"its quant_state shape {state.get('shape')} is not {list(shape)}")
    if block <= 0 or in_f % block:
        raise ValueError(f"blocks of {block} values cross its rows of {in_f} (served: blocks "
                         "within rows)")
    n = out_f * in_f
    packed = _take(tensors, "weight", ((n + 1) // 2, 1), (torch.uint8,)).reshape(-1)
    codebook = _take(tensors, "weight.quant_map", (16,), (torch.float32,))
    num_blocks = n // block
    if "weight.nested_absmax" in tensors:  # double quantization: the absmax are 8-bit codes
        nested = int(state.get("nested_blocksize", 0))
        if nested <= 0:
            raise ValueError(f"its nested_blocksize {state.get('nested_blocksize')!r}")
        codes = _take(tensors, "weight.absmax", (num_blocks,), (torch.uint8,))
        table = _take(tensors, "weight.nested_quant_map", (256,), (torch.float32,))
        nested_absmax = _take(tensors, "weight.nested_absmax", (-(-num_blocks // nested),),
                              (torch.float32,))
        absmax = table[codes.long()] * nested_absmax.repeat_interleave(nested)[:num_blocks]
        absmax = absmax + float(state["nested_offset"])  # (bitsandbytes' order: fp32)
    else:
        absmax = _take(tensors, "weight.absmax", (num_blocks,), (torch.float32,))
    values = torch.stack([packed >> 4, packed & 0x0F], -1).reshape(-1)[:n]  # high nibble first
    return IntWeight(pack_int4(values.view(out_f, in_f)), absmax.view(out_f, -1).contiguous(),
                     None, None, codebook.contiguous(), bits=4, group_size=block, label=label)


def describe(q: Quantization, scheme: WeightScheme) -> str:
    """The label a weight of `scheme` carries in messages: "gptq int4 group 128 act-order"."""
    return f"{q.method} {scheme.describe()}{' double-quant' if q.double_quant else ''}"
