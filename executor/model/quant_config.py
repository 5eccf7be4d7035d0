"""A quantized base's `quantization_config` (config.json), read into typed records: which method
and layout its tools wrote, and per projection how its weight is stored (WeightScheme). Every
method, bit width or layout loraplex does not serve is refused here, at executor start, by name.

    compressed-tensors   pack-quantized: int4 / int8 weight-only, group or channel scales,
                         symmetric or with zero points, act-order (g_idx); float-quantized: FP8
                         (E4M3) weights per tensor, channel or block, activations none, dynamic
                         per token or static per tensor (llm-compressor's W4A16, W8A16, FP8,
                         FP8_DYNAMIC, FP8_BLOCK)
    fp8                  FP8 (E4M3) weights with `weight_scale_inv` blocks (Qwen3 / DeepSeek FP8
                         releases): served W8A16 (their dynamic per-token-group activation
                         quantization is not emulated: activations stay at the serving dtype, as
                         transformers' dequantized model computes)
    fbgemm_fp8           FP8 weights per channel, activations per token with an amax bound
                         (Meta's Llama FP8 releases)
    gptq                 4 / 8 bit, group or channel, desc_act (g_idx), sym or not, v1 (zeros
                         stored minus one) or v2 checkpoint format
    awq                  4 bit GEMM packing, zero points
    bitsandbytes         NF4 / FP4 as transformers saves them (a QLoRA base), double quantization
    mxfp4                gpt-oss's experts only (executor/model/mxfp4.py, dequantized at load)

The projections (q/k/v/o, gate/up/down, Phi-3's fused ones) are what is served quantized; the
embeddings and lm_head must be in full precision (a quantized one is refused at load).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

INT, FP8, NF4, FP4 = "int", "fp8", "nf4", "fp4"  # how a weight's values are coded
NO_ACTIVATIONS, DYNAMIC, STATIC = "none", "dynamic", "static"  # FP8 activation quantization
METHODS = ("compressed-tensors", "fp8", "fbgemm_fp8", "gptq", "awq", "bitsandbytes")


@dataclass(frozen=True)
class WeightScheme:
    """How one projection's weight [out, in] is stored in the checkpoint and served."""

    kind: str  # INT, FP8, NF4 or FP4
    bits: int  # 4 or 8
    group_size: int = 0  # input columns per scale (INT, NF4 / FP4); 0: one scale per row
    symmetric: bool = True  # no zero points
    act_order: bool = False  # each column's group is named by a g_idx (GPTQ desc_act)
    block: tuple[int, int] = (1, 0)  # FP8: (rows, columns) per scale; 0: the whole dimension
    activations: str = NO_ACTIVATIONS  # FP8: the activations quantized too (W8A8), and how
    activation_scale_ub: float = 0.0  # DYNAMIC: each row's amax clamped to this first (0: not)

    def describe(self) -> str:
        if self.kind == FP8:
            rows, cols = self.block
            scales = ("per tensor" if rows == 0 and cols == 0 else "per channel" if cols == 0
                      else f"{rows}x{cols} blocks")
            acts = {NO_ACTIVATIONS: "W8A16", DYNAMIC: "W8A8 dynamic per token",
                    STATIC: "W8A8 static"}[self.activations]
            if self.activation_scale_ub:
                acts += f" (amax bound {self.activation_scale_ub:g})"
            return f"fp8 e4m3 {scales} {acts}"
        name = f"{self.kind}{self.bits}" if self.kind == INT else self.kind
        parts = [name, f"group {self.group_size}" if self.group_size else "per channel"]
        if not self.symmetric:
            parts.append("zero points")
        if self.act_order:
            parts.append("act-order")
        return " ".join(parts)


@dataclass(frozen=True)
class Quantization:
    """A checkpoint's quantization: its method and layout, and the scheme of each projection
    (the first group whose targets match it; none for an ignored module: full precision)."""

    method: str  # quant_method, as config.json names it
    layout: str  # how its tensors are written: pack-quantized, float-quantized, gptq, gptq_v2,
    # awq-gemm, fp8-blocks, bnb-4bit
    groups: tuple[tuple[tuple[str, ...], WeightScheme], ...]  # (targets, scheme), in order
    ignore: tuple[str, ...] = ()
    double_quant: bool = False  # bitsandbytes: the absmax themselves quantized (read at load)

    def scheme_for(self, module: str) -> WeightScheme | None:
        """The scheme of projection `module` ("model.layers.0.self_attn.q_proj"), None when it is
        left in full precision."""
        if any(_matches(pattern, module) for pattern in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(_matches(t, module) for t in targets):
                return scheme
        return None

    def describe(self) -> str:
        schemes = sorted({s.describe() for _, s in self.groups})
        return f"{self.method} ({self.layout}): {', '.join(schemes)}"


def _matches(pattern: str, module: str) -> bool:
    """compressed-tensors' target syntax: "Linear" (every projection), "re:<regex>" (matched
    against the module's path), or a path's last parts ("lm_head", "mlp.down_proj")."""
    if pattern == "Linear":
        return True
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern or module.endswith("." + pattern)


def parse_quantization(raw: Any, model_type: str) -> Quantization | None:
    """config.json's quantization_config -> Quantization; None for gpt-oss's MXFP4 (read with
    its experts) and for no quantization at all. ValueError naming what is not served."""
    if not raw:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"model config: quantization_config must be an object, got {raw!r}")
    method = raw.get("quant_method")
    if method == "mxfp4" and model_type == "gpt_oss":
        return None
    if method not in METHODS:
        raise ValueError(f"model config: quantization_config {method!r} is not supported "
                         f"(served: {', '.join(METHODS)}; mxfp4 on gpt-oss)")
    return {"compressed-tensors": _compressed_tensors, "fp8": _fp8_blocks, "gptq": _gptq,
            "awq": _awq, "bitsandbytes": _bitsandbytes, "fbgemm_fp8": _fbgemm_fp8}[method](raw)


def _refuse(method: str, what: str) -> ValueError:
    return ValueError(f"model config: quantization_config {method!r}: {what} is not supported")


def _compressed_tensors(raw: dict) -> Quantization:
    method = "compressed-tensors"
    fmt = raw.get("format")
    if raw.get("quantization_status", "compressed") != "compressed":
        raise _refuse(method, f"quantization_status {raw.get('quantization_status')!r} (only "
                              "compressed checkpoints are read)")
    for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if raw.get(key):
            raise _refuse(method, f"{key} (sparse, rotated or FP8-KV checkpoints)")
    groups = []
    for name, group in (raw.get("config_groups") or {}).items():
        group_fmt = group.get("format") or fmt
        if group_fmt not in ("pack-quantized", "float-quantized"):
            raise _refuse(method, f"format {group_fmt!r} (served: pack-quantized, "
                                  "float-quantized)")
        if group.get("output_activations"):
            raise _refuse(method, f"{name}: output activation quantization")
        scheme = _ct_scheme(name, group.get("weights") or {}, group.get("input_activations"))
        if (scheme.kind == INT) != (group_fmt == "pack-quantized"):
            raise _refuse(method, f"{name}: {scheme.describe()} in format {group_fmt!r}")
        targets = group.get("targets") or []
        groups.append((tuple(targets), scheme))
    if not groups:
        raise _refuse(method, "a quantization_config without config_groups")
    layouts = {"pack-quantized" if s.kind == INT else "float-quantized" for _, s in groups}
    return Quantization(method, "+".join(sorted(layouts)), tuple(groups),
                        tuple(raw.get("ignore") or ()))


def _ct_scheme(name: str, w: dict, acts: dict | None) -> WeightScheme:
    method = "compressed-tensors"
    kind, bits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy")
    if w.get("dynamic"):
        raise _refuse(method, f"{name}: dynamic weight quantization")
    if kind == "float":
        if bits != 8:
            raise _refuse(method, f"{name}: float weights of {bits} bits (FP8 only)")
        if not w.get("symmetric", True):
            raise _refuse(method, f"{name}: asymmetric FP8 weights")
        blocks = {"tensor": (0, 0), "channel": (1, 0)}
        if strategy == "block":
            rows, cols = w.get("block_structure") or (0, 0)
            if rows <= 0 or cols <= 0:
                raise _refuse(method, f"{name}: block_structure {w.get('block_structure')!r}")
            blocks["block"] = (int(rows), int(cols))
        if strategy not in blocks:
            raise _refuse(method, f"{name}: FP8 weight strategy {strategy!r} (served: tensor, "
                                  "channel, block)")
        return WeightScheme(FP8, 8, block=blocks[strategy], activations=_ct_activations(name,
                                                                                          acts))
    if kind != "int":
        raise _refuse(method, f"{name}: weight type {kind!r}")
    if bits not in (4, 8):
        raise _refuse(method, f"{name}: int{bits} weights (served: int4, int8)")
    if acts:
        raise _refuse(method, f"{name}: int{bits} weights with quantized activations (W{bits}A"
                              f"{acts.get('num_bits')}; served: weight-only)")
    if strategy not in ("group", "channel"):
        raise _refuse(method, f"{name}: int weight strategy {strategy!r} (served: group, "
                              "channel)")
    group = int(w.get("group_size") or 0) if strategy == "group" else 0
    if strategy == "group" and group <= 0:
        raise _refuse(method, f"{name}: group strategy without a group_size")
    return WeightScheme(INT, bits, group_size=group, symmetric=bool(w.get("symmetric", True)),
                        act_order=w.get("actorder") == "group")


def _ct_activations(name: str, acts: dict | None) -> str:
    if not acts:
        return NO_ACTIVATIONS
    method = "compressed-tensors"
    if acts.get("type") != "float" or acts.get("num_bits") != 8:
        raise _refuse(method, f"{name}: activations {acts.get('type')}{acts.get('num_bits')} "
                              "beside FP8 weights (served: FP8)")
    if not acts.get("symmetric", True):
        raise _refuse(method, f"{name}: asymmetric activation quantization")
    if acts.get("dynamic") and acts.get("strategy") == "token":
        return DYNAMIC
    if not acts.get("dynamic") and acts.get("strategy") == "tensor":
        return STATIC
    raise _refuse(method, f"{name}: activation strategy {acts.get('strategy')!r} dynamic="
                          f"{acts.get('dynamic')!r} (served: dynamic per token, static per "
                          "tensor)")


def _fp8_blocks(raw: dict) -> Quantization:
    if raw.get("fmt", "e4m3") != "e4m3":
        raise _refuse("fp8", f"fmt {raw.get('fmt')!r} (E4M3 only)")
    block = raw.get("weight_block_size")
    if not block or len(block) != 2 or min(block) <= 0:
        raise _refuse("fp8", f"weight_block_size {block!r} (served: weight_scale_inv blocks, "
                             "e.g. [128, 128])")
    if raw.get("activation_scheme", "dynamic") != "dynamic":
        raise _refuse("fp8", f"activation_scheme {raw.get('activation_scheme')!r}")
    scheme = WeightScheme(FP8, 8, block=(int(block[0]), int(block[1])))
    return Quantization("fp8", "fp8-blocks", ((("Linear",), scheme),),
                        tuple(raw.get("modules_to_not_convert") or ()))


def _fbgemm_fp8(raw: dict) -> Quantization:
    """Meta's FP8 releases (Llama 3.1 405B FP8): FP8 weights per channel, activations per token
    with each row's amax clamped to activation_scale_ub, as fbgemm's quantize_fp8_per_row."""
    bound = raw.get("activation_scale_ub", 1200.0)
    if not isinstance(bound, (int, float)) or isinstance(bound, bool) or not bound > 0:
        raise _refuse("fbgemm_fp8", f"activation_scale_ub {bound!r}")
    scheme = WeightScheme(FP8, 8, block=(1, 0), activations=DYNAMIC,
                          activation_scale_ub=float(bound))
    return Quantization("fbgemm_fp8", "fbgemm-fp8", ((("Linear",), scheme),),
                        tuple(raw.get("modules_to_not_convert") or ()))


def _gptq(raw: dict) -> Quantization:
    bits, fmt = raw.get("bits"), raw.get("checkpoint_format", "gptq")
    if bits not in (4, 8):
        raise _refuse("gptq", f"{bits}-bit weights (served: 4, 8)")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("gptq", f"checkpoint_format {fmt!r} (served: gptq, gptq_v2)")
    if raw.get("dynamic"):
        raise _refuse("gptq", "per-module `dynamic` overrides")
    if raw.get("lm_head"):
        raise _refuse("gptq", "a quantized lm_head")
    group = int(raw.get("group_size") or -1)
    scheme = WeightScheme(INT, bits, group_size=max(group, 0), symmetric=bool(raw.get("sym",
                                                                                     True)),
                          act_order=bool(raw.get("desc_act")))
    return Quantization("gptq", fmt, ((("Linear",), scheme),),
                        tuple(raw.get("modules_to_not_convert") or ()))


def _awq(raw: dict) -> Quantization:
    bits, version = raw.get("bits", raw.get("w_bit")), str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("awq", f"version {version!r} (served: the GEMM packing)")
    if bits != 4:
        raise _refuse("awq", f"{bits}-bit weights (served: 4)")
    if not raw.get("zero_point", True):
        raise _refuse("awq", "zero_point=false")
    group = int(raw.get("group_size", raw.get("q_group_size", 128)) or -1)
    scheme = WeightScheme(INT, 4, group_size=max(group, 0), symmetric=False)
    return Quantization("awq", "awq-gemm", ((("Linear",), scheme),),
                        tuple(raw.get("modules_to_not_convert") or ()))


def _bitsandbytes(raw: dict) -> Quantization:
    if raw.get("load_in_8bit") or raw.get("_load_in_8bit"):
        raise _refuse("bitsandbytes", "load_in_8bit (LLM.int8's outlier decomposition)")
    if not (raw.get("load_in_4bit") or raw.get("_load_in_4bit")):
        raise _refuse("bitsandbytes", "a config that loads in neither 4 nor 8 bits")
    kind = raw.get("bnb_4bit_quant_type", "fp4")
    if kind not in (NF4, FP4):
        raise _refuse("bitsandbytes", f"bnb_4bit_quant_type {kind!r}")
    if raw.get("bnb_4bit_quant_storage", "uint8") != "uint8":
        raise _refuse("bitsandbytes", f"bnb_4bit_quant_storage "
                                      f"{raw.get('bnb_4bit_quant_storage')!r} (uint8 only)")
    scheme = WeightScheme(kind, 4, group_size=64)  # (the blocksize read with each weight)
    return Quantization("bitsandbytes", "bnb-4bit", ((("Linear",), scheme),),
                        tuple(raw.get("llm_int8_skip_modules") or ()),
                        double_quant=bool(raw.get("bnb_4bit_use_double_quant")))


PRESETS = {  # `loraplex budget --quantization`: the common releases' schemes
    "fp8": WeightScheme(FP8, 8, block=(128, 128)),
    "int8": WeightScheme(INT, 8, group_size=0),
    "int4": WeightScheme(INT, 4, group_size=128),
    "nf4": WeightScheme(NF4, 4, group_size=64),
}


def preset(name: str) -> Quantization:
    """The Quantization of a budget preset (every projection quantized alike)."""
    return Quantization(name, "preset", ((("Linear",), PRESETS[name]),))
