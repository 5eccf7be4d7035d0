"""Tiny quantized checkpoints for the quantized-base tests, each written by the format's own tool
where one runs on CPU (compressed-tensors, bitsandbytes through transformers), else by an
encoder written here from the format's published layout (GPTQ, AWQ, FP8 weight_scale_inv
blocks; as vLLM's test packers and the AutoGPTQ / AutoAWQ kernels read them). The encoders keep
their integer codes, zeros and scales as plain tensors and save the weights those dequantize to
as a dense model beside: the reference HF + PEFT runs on, independent of loraplex's unpacking.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from loraplex import fixtures

# hidden 128 (4 heads of 32, 2 KV heads), intermediate 256: groups of 32, bitsandbytes' blocks
# of 64 and FP8 blocks of 16 stay whole on each of 2 tensor-parallel ranks
SHAPE = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "num_hidden_layers": 2, "intermediate_size": 256}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def base_model(out: Path, family: str = "llama", seed: int = 5) -> Path:
    return fixtures.save_tiny_model(out, family, seed=seed, **SHAPE)


def _projection_names(tensors: dict) -> list[str]:
    return [n for n in tensors if n.endswith("_proj.weight") and n.split(".")[-2] in PROJECTIONS]


def _with_config(src: Path, out: Path, tensors: dict, quantization: dict | None) -> Path:
    shutil.copytree(src, out)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    if quantization is None:
        config.pop("quantization_config", None)
    else:
        config["quantization_config"] = quantization
    (out / "config.json").write_text(json.dumps(config))
    return out


def _int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 bit patterns held in int64 -> int32 tensors of the same bits."""
    return (((words & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000).to(torch.int32)


def _pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, n] unsigned values -> int32 [rows, n * bits / 32], value i at bit i * bits."""
    per = 32 // bits
    v = (values.to(torch.int64) & ((1 << bits) - 1)).view(values.shape[0], -1, per)
    return _int32(sum(v[:, :, i] << (bits * i) for i in range(per))).contiguous()


def _rtn(w: torch.Tensor, bits: int, group: int, sym: bool, g_idx: torch.Tensor):
    """Round-to-nearest of w [out, in] by groups (g_idx names each column's): (q [out, in]
    unsigned, zeros [out, G] unsigned, scales [out, G] fp16)."""
    maxq, groups = (1 << bits) - 1, int(g_idx.max()) + 1
    scales = torch.empty(w.shape[0], groups)
    zeros = torch.empty(w.shape[0], groups, dtype=torch.int64)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if sym:
            hi = torch.maximum(lo.abs(), hi)
            scales[:, g], zeros[:, g] = 2 * hi / maxq, (maxq + 1) // 2
        else:  # (zeros from 1: a v1 checkpoint stores zero - 1, which 0 would wrap)
            scales[:, g] = (hi - lo) / maxq
            zeros[:, g] = torch.round(-lo / scales[:, g]).clamp(1, maxq)
    scales = scales.clamp(min=1e-8).half()
    s, z = scales.float()[:, g_idx.long()], zeros[:, g_idx.long()]
    q = torch.clamp(torch.round(w / s) + z, 0, maxq).to(torch.int64)
    return q, zeros, scales


def gptq(base: Path, out: Path, *, bits: int = 4, group: int = 32, desc_act: bool = False,
         sym: bool = False, v1: bool = True, seed: int = 0) -> tuple[Path, Path]:
    """(a GPTQ checkpoint of `base`, the dense model of its dequantized weights)."""
    gen = torch.Generator().manual_seed(seed)
    tensors, dense, orders = {}, {}, {}
    for name, t in load_file(base / "model.safetensors").items():
        if name not in _projection_names({name: t}):
            tensors[name] = dense[name] = t
            continue
        w = t.float()
        out_f, in_f = w.shape
        # act-order: columns by a permutation of the input's (GPTQ's, from the Hessian of the
        # input: one per input, so q / k / v share theirs, as gate / up do)
        reads = name.rsplit(".", 2)[0] + ("" if name.split(".")[-2] in ("o_proj", "down_proj")
                                          else "." + name.split(".")[-3])
        if reads not in orders:
            orders[reads] = (torch.randperm(in_f, generator=gen) if desc_act
                             else torch.arange(in_f))
        order = orders[reads]
        g_idx = torch.empty(in_f, dtype=torch.int32)
        g_idx[order] = (torch.arange(in_f) // group).to(torch.int32)  # act-order: by `order`
        q, zeros, scales = _rtn(w, bits, group, sym, g_idx)
        dense[name] = ((q - zeros[:, g_idx.long()]).float() * scales.float()[:, g_idx.long()])
        module = name.removesuffix(".weight")
        tensors[f"{module}.qweight"] = _pack(q, bits).T.contiguous()  # [in / per, out]
        tensors[f"{module}.qzeros"] = _pack(zeros.T.contiguous() - (1 if v1 else 0), bits)
        tensors[f"{module}.scales"] = scales.T.contiguous()  # [G, out]
        tensors[f"{module}.g_idx"] = g_idx
    config = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act,
              "sym": sym, "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    return (_with_config(base, out / "gptq", tensors, config),
            _with_config(base, out / "gptq-dense", dense, None))


def awq(base: Path, out: Path, *, group: int = 32) -> tuple[Path, Path]:
    """(an AWQ GEMM checkpoint of `base`, the dense model of its dequantized weights)."""
    tensors, dense = {}, {}
    order = torch.tensor(AWQ_ORDER)
    for name, t in load_file(base / "model.safetensors").items():
        if name not in _projection_names({name: t}):
            tensors[name] = dense[name] = t
            continue
        w = t.float()
        g_idx = (torch.arange(w.shape[1]) // group).to(torch.int32)
        q, zeros, scales = _rtn(w, 4, group, False, g_idx)
        dense[name] = (q - zeros[:, g_idx.long()]).float() * scales.float()[:, g_idx.long()]

        def interleaved(v: torch.Tensor) -> torch.Tensor:  # [rows, out]: 8 columns a word
            return _pack(v.view(v.shape[0], -1, 8)[:, :, order].reshape(v.shape[0], -1), 4)

        module = name.removesuffix(".weight")
        tensors[f"{module}.qweight"] = interleaved(q.T.contiguous())  # [in, out / 8]
        tensors[f"{module}.qzeros"] = interleaved(zeros.T.contiguous())  # [G, out / 8]
        tensors[f"{module}.scales"] = scales.T.contiguous()  # [G, out]
    config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
              "version": "gemm"}
    return (_with_config(base, out / "awq", tensors, config),
            _with_config(base, out / "awq-dense", dense, None))


def fp8_blocks(base: Path, out: Path, *, block: int = 16) -> Path:
    """An FP8 checkpoint with weight_scale_inv blocks (Qwen3 / DeepSeek's FP8 releases' layout:
    W = fp8 * weight_scale_inv, one fp32 scale per block x block)."""
    tensors = {}
    for name, t in load_file(base / "model.safetensors").items():
        if name not in _projection_names({name: t}):
            tensors[name] = t
            continue
        out_f, in_f = t.shape
        g = t.float().view(out_f // block, block, in_f // block, block)
        scale = g.abs().amax((1, 3)).clamp(min=1e-12) / 448.0  # [out / B, in / B]
        tensors[name] = (g / scale[:, None, :, None]).view(out_f, in_f).to(torch.float8_e4m3fn)
        tensors[f"{name}_scale_inv"] = scale
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
              "weight_block_size": [block, block]}
    return _with_config(base, out / "fp8-blocks", tensors, config)


def fbgemm_fp8(base: Path, out: Path, *, bound: float) -> tuple[Path, Path]:
    """(a checkpoint in the layout of Meta's FP8 releases (quant_method fbgemm_fp8: fp8 weights,
    an fp32 scale per row, activations quantized per token, each row's amax clamped to
    activation_scale_ub), the dense model of its dequantized weights)."""
    tensors, dense = {}, {}
    for name, t in load_file(base / "model.safetensors").items():
        if name not in _projection_names({name: t}):
            tensors[name] = dense[name] = t
            continue
        scale = (t.float().abs().amax(1, keepdim=True) / 448.0).clamp(min=1e-12)  # [out, 1]
        tensors[name] = (t.float() / scale).to(torch.float8_e4m3fn)
        tensors[name.removesuffix("weight") + "weight_scale"] = scale
        dense[name] = tensors[name].float() * scale
    config = {"quant_method": "fbgemm_fp8", "activation_scale_ub": bound,
              "modules_to_not_convert": ["lm_head"]}
    return (_with_config(base, out / "fbgemm", tensors, config),
            _with_config(base, out / "fbgemm-dense", dense, None))


def fbgemm_fake_quantize(x: torch.Tensor, bound: float) -> torch.Tensor:
    """fbgemm's quantize_fp8_per_row, then back: each row times 448 / min(amax, bound), clamped,
    rounded to e4m3, divided back."""
    inverse = 448.0 / x.abs().amax(-1, keepdim=True).clamp(min=1e-12, max=bound)
    q = (x * inverse).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.to(x.dtype) / inverse


def compressed_tensors(base: Path, out: Path, name: str, weights: dict,
                       activations: dict | None = None, calibration: list[int] | None = None
                       ) -> Path:
    """A compressed-tensors checkpoint made by the library itself (its ModelCompressor packs and
    writes the config): `weights` / `activations` its QuantizationArgs; the weights' scales and
    zero points by min / max per group, channel, tensor or block (calculate_qparams); a static
    activation scale from one calibration prompt's amax per projection."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    amax = _input_amax(model, calibration) if calibration else {}
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights),
                                input_activations=(QuantizationArgs(**activations)
                                                   if activations else None))
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": scheme}, ignore=["lm_head"],
        quantization_status="initialized"))
    for path, module in model.named_modules():
        args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
        if args is None:
            continue
        lo, hi = _ranges(module.weight.data, args)
        scale, zero = calculate_qparams(lo, hi, args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
        if hasattr(module, "input_scale") and path in amax:
            module.input_scale.data.fill_(amax[path] / 448.0)
    compressor = ModelCompressor.from_pretrained_model(
        model, quantization_format="pack-quantized" if weights["type"] == "int"
        else "float-quantized")
    compressor.compress_model(model)
    folder = out / name
    model.save_pretrained(folder)
    compressor.update_config(folder)
    for extra in ("generation_config.json",):
        if (base / extra).exists():
            shutil.copy(base / extra, folder / extra)
    return folder


def _ranges(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of w [out, in] per the strategy's groups, shaped as its scales."""
    out_f, in_f = w.shape
    if args.strategy == "group":
        g = w.view(out_f, -1, args.group_size)
    elif args.strategy == "channel":
        g = w.view(out_f, 1, in_f)
    elif args.strategy == "tensor":
        g = w.reshape(1, 1, -1)
    else:  # block
        bn, bk = args.block_structure
        g = w.view(out_f // bn, bn, in_f // bk, bk).transpose(1, 2).reshape(
            out_f // bn, in_f // bk, -1)
    return g.amin(-1), g.amax(-1)


@torch.no_grad()
def _input_amax(model, prompt: list[int]) -> dict[str, float]:
    """Each projection's largest input magnitude over `prompt` (a static activation scale)."""
    amax, hooks = {}, []
    for path, module in model.named_modules():
        if path.endswith(PROJECTIONS):
            hooks.append(module.register_forward_pre_hook(
                lambda m, args, path=path: amax.__setitem__(path, float(args[0].abs().max()))))
    model(input_ids=torch.tensor([prompt]))
    for h in hooks:
        h.remove()
    return amax


def bitsandbytes(base: Path, out: Path, quant_type: str, double_quant: bool) -> Path:
    """A bitsandbytes 4-bit checkpoint as transformers saves one (a QLoRA base)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                bnb_4bit_use_double_quant=double_quant,
                                bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=config,
                                                 device_map="cpu")
    folder = out / f"bnb-{quant_type}{'-dq' if double_quant else ''}"
    model.save_pretrained(folder)
    return folder
