"""Base model weights: load an HF safetensors checkpoint (never pickle) or make random ones.

q/k/v are stored fused as one `wqkv` and gate/up as one `w_gate_up` (gpt-fast style): one dense
matmul each over all rows of a step; the LoRA backend then adds to the q/k/v (gate/up) column
slices of that output (Phi-3's checkpoints hold them fused already: qkv_proj, gate_up_proj).

The norms by the checkpoint's names (Gemma's sandwich in brackets):

    input_norm            input_layernorm                          before attention
    [attn_out_norm]       post_attention_layernorm                 on attention's output
    post_attention_norm   post_attention_layernorm [pre_feedforward_layernorm]   before the MLP
    [mlp_out_norm]        post_feedforward_layernorm               on the MLP's output

A mixture-of-experts layer (ModelConfig.moe_layers) holds a router and its experts instead of the
dense MLP, each expert's gate and up fused as transformers 5 keeps them:

    router              mlp.gate.weight [E, hidden]
    experts_gate_up     mlp.experts.{e}.gate_proj / up_proj.weight, stacked [E, 2 I, hidden]
    experts_down        mlp.experts.{e}.down_proj.weight, stacked [E, hidden, I]

read from any of the names checkpoints use: per expert as above (the hub's, and what transformers
5 saves), Mixtral's block_sparse_moe.experts.{e}.w1 / w3 / w2 (gate, up, down), or already fused
(mlp.experts.gate_up_proj [E, 2 I, hidden], mlp.experts.down_proj [E, hidden, I]).

gpt-oss keeps its experts fused and transposed, with biases (loaded as above, transposed:
experts_gate_up [E, 2 I, hidden], its gate and up rows interleaved as stored; experts_down
[E, hidden, I]), a router with a bias (mlp.router.weight / bias), an o_proj bias and each head's
attention sink (self_attn.sinks); its published checkpoints store the expert weights in MXFP4
(`{name}_blocks`, `{name}_scales`: executor/model/mxfp4.py), dequantized here to the serving dtype.

A multimodal checkpoint (ModelConfig.multimodal_checkpoint: Gemma 3 4B+) holds these under its
language model, named by the transformers that saved it, and a vision tower and projector beside
them, which are skipped unread (text-only input never runs them):

    language_model.model.X, language_model.lm_head.weight   transformers < 4.52, >= 5; Google's
    model.language_model.X, lm_head.weight                  transformers 4.52 .. 4.x
    [model.]vision_tower.*, [model.]multi_modal_projector.*  skipped

A quantized checkpoint's projections (ModelConfig.quantization) are read by
executor/model/quant_load.py into the weights of executor/model/quant.py, which the forward calls
through `project`; q/k/v (gate/up) join into one where their layouts agree.

A rank of a tensor-parallel executor loads its part only (`shard`, executor/tp/shards.py): each
tensor's rows or columns read from the safetensors files, nothing else; its LayerWeights then have
its part's shapes, and embed / lm_head its vocabulary rows (from `vocab_start`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from executor.model.config import ModelConfig
from executor.model.expert_weights import (
    FUSED_EXPERTS,
    Whole,
    dequantized,
    expert_name,
    experts_of,
    fused_experts_of,
    split_experts,
)
from executor.model.quant import join, weight_bytes
from executor.model.quant_load import QuantizedParts
from executor.tp.shards import Shard


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    wqkv: torch.Tensor  # [q_size + 2 * kv_size, hidden]
    bqkv: torch.Tensor | None  # [q_size + 2 * kv_size] (Qwen2) or None
    wo: torch.Tensor  # [hidden, q_size]
    post_attention_norm: torch.Tensor  # [hidden]: the norm before the MLP
    w_gate_up: torch.Tensor | None  # [2 * intermediate, hidden]; None: a mixture of experts
    w_down: torch.Tensor | None  # [hidden, intermediate]
    q_norm: torch.Tensor | None = None  # [head_dim]: each head of q normalised (Qwen3) or None
    k_norm: torch.Tensor | None = None  # [head_dim]: each head of k
    attn_out_norm: torch.Tensor | None = None  # [hidden]: on attention's output (Gemma) or None
    mlp_out_norm: torch.Tensor | None = None  # [hidden]: on the MLP's output (Gemma) or None
    router: torch.Tensor | None = None  # [E, hidden]: a mixture of experts' router, or None
    experts_gate_up: torch.Tensor | None = None  # [E, 2 * moe_intermediate, hidden]
    experts_down: torch.Tensor | None = None  # [E, hidden, moe_intermediate]
    # gpt-oss: the router's and the experts' biases, o_proj's bias, each head's sink logit
    router_bias: torch.Tensor | None = None  # [E]
    experts_gate_up_bias: torch.Tensor | None = None  # [E, 2 * moe_intermediate]
    experts_down_bias: torch.Tensor | None = None  # [E, hidden]
    bo: torch.Tensor | None = None  # [hidden]
    sinks: torch.Tensor | None = None  # [num_attention_heads]


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the same tensor as `embed` when tied
    vocab_start: int = 0  # the token id of embed's and lm_head's first row (a rank's part)

    def num_bytes(self) -> int:
        return sum(map(weight_bytes, self._tensors()))

    def dense_bytes(self) -> int:
        """What the weights would take with every quantized projection dense at the serving
        dtype (the embeddings'): num_bytes() itself for a full-precision model."""
        size = self.embed.element_size()
        return sum(weight_bytes(t) if isinstance(t, torch.Tensor) else
                   t.shape[0] * t.shape[1] * size for t in self._tensors())

    def _tensors(self) -> list:
        tensors = {id(t): t for t in (self.embed, self.norm, self.lm_head)}  # tied: counted once
        for layer in self.layers:
            tensors.update((id(t), t) for t in vars(layer).values() if t is not None)
        return list(tensors.values())


def _hf_names(config: ModelConfig) -> list[str]:
    """Every tensor name an HF checkpoint of this config must hold."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if config.sandwich_norms:
            names += [p + "pre_feedforward_layernorm.weight",
                      p + "post_feedforward_layernorm.weight"]
        if config.fused_projections:
            names += [f"{p}self_attn.{m}.weight" for m in ("qkv_proj", "o_proj")]
            names += [f"{p}mlp.{m}.weight" for m in ("gate_up_proj", "down_proj")]
        else:
            names += [f"{p}self_attn.{m}_proj.weight" for m in "qkvo"]
            if config.is_moe_layer(i) and config.moe_bias:  # (gpt-oss: fused, with biases)
                names += [f"{p}mlp.router.{t}" for t in ("weight", "bias")]
                names += [f"{p}mlp.experts.{m}{t}" for m in ("gate_up_proj", "down_proj")
                          for t in ("", "_bias")]
            elif config.is_moe_layer(i):
                names.append(f"{p}mlp.gate.weight")
                names += [f"{p}mlp.experts.{e}.{m}_proj.weight" for e in range(config.num_experts)
                          for m in ("gate", "up", "down")]
            else:
                names += [f"{p}mlp.{m}_proj.weight" for m in ("gate", "up", "down")]
        if config.attention_bias:
            names += [f"{p}self_attn.{m}_proj.bias" for m in "qkv"]
        if config.o_bias:
            names.append(f"{p}self_attn.o_proj.bias")
        if config.attention_sinks:
            names.append(f"{p}self_attn.sinks")
        if config.qk_norm:
            names += [f"{p}self_attn.q_norm.weight", f"{p}self_attn.k_norm.weight"]
    return names


# A multimodal checkpoint's names -> a text model's (see the module docstring).
_LANGUAGE_MODEL_PREFIXES = (("language_model.model.", "model."),
                            ("language_model.lm_head.", "lm_head."),
                            ("model.language_model.", "model."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")


def text_model_name(name: str, config: ModelConfig) -> str | None:
    """The text model's name of checkpoint tensor `name`; None for a multimodal checkpoint's
    vision tower and projector (never loaded). Any other name comes back as it is (and is then
    refused if the model has no such tensor)."""
    if not config.multimodal_checkpoint:
        return name
    if name.startswith(_VISION_PREFIXES):
        return None
    for prefix, text_prefix in _LANGUAGE_MODEL_PREFIXES:
        if name.startswith(prefix):
            return text_prefix + name.removeprefix(prefix)
    return name  # (lm_head.weight; or something unexpected, refused by the caller)


def _expected_shape(config: ModelConfig, name: str) -> tuple[int, ...]:
    h = config.hidden_size
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (config.vocab_size, h)
    if name.endswith(".mlp.gate.weight") or name.endswith(".mlp.router.weight"):  # a router
        return (config.num_experts, h)
    e, i = config.num_experts, config.moe_intermediate_size
    gpt_oss = {"router.bias": (e,), "experts.gate_up_proj": (e, h, 2 * i),
               "experts.gate_up_proj_bias": (e, 2 * i), "experts.down_proj": (e, i, h),
               "experts.down_proj_bias": (e, h)}
    for suffix, shape in gpt_oss.items():
        if name.endswith(".mlp." + suffix):
            return shape
    if name.endswith(".self_attn.sinks"):
        return (config.num_attention_heads,)
    if ".mlp.experts." in name:
        module = name.split(".")[-2]
        i = config.moe_intermediate_size
        return (h, i) if module == "down_proj" else (i, h)
    module, kind = name.split(".")[-2:]
    if module in ("q_norm", "k_norm"):
        return (config.head_dim,)
    if module.endswith("norm"):
        return (h,)
    in_features, out_features = config.module_shape(module)
    return (out_features,) if kind == "bias" else (out_features, in_features)


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(f"no model.safetensors or model.safetensors.index.json in {model_dir} "
                     "(only safetensors checkpoints are loaded, never pickle)")


def load_weights(model_dir: str | Path, config: ModelConfig, *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", shard: Shard | None = None) -> ModelWeights:
    """Load and check every tensor of an HF safetensors checkpoint of a served family (with
    `shard`: read only that rank's part of each)."""
    model_dir = Path(model_dir)
    expected = set(_hf_names(config))
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    raw: dict[str, torch.Tensor] = {}
    quantized = QuantizedParts(config) if config.quantization else None
    for path in _checkpoint_files(model_dir):
        if not path.is_file():
            raise ValueError(f"checkpoint shard {path} listed in the index is missing")
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for stored in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                name = text_model_name(stored, config)
                if name is None or name.endswith("rotary_emb.inv_freq"):
                    continue  # a vision tower's; or a buffer some old checkpoints saved
                name = expert_name(name) if config.num_experts else name
                if quantized and quantized.take(name, path, stored):
                    continue  # (a projection's: made one weight once every file is read)
                if name.endswith("_blocks") and config.moe_bias:  # (gpt-oss's MXFP4 experts)
                    name, tensor = dequantized(f, stored, name, _expected_shape(
                        config, name.removesuffix("_blocks")))
                    if name in raw:
                        raise ValueError(f"the checkpoint holds {name!r} twice")
                    raw[name] = _read(Whole(tensor), name, shard).to(device=device, dtype=dtype)
                    continue
                if name.endswith("_scales") and config.moe_bias:
                    continue  # (read with its blocks)
                if config.num_experts and not config.moe_bias and FUSED_EXPERTS.fullmatch(name):
                    for part, tensor in split_experts(name, f.get_tensor(stored),
                                                       config).items():
                        if part in raw:
                            raise ValueError(f"tensor {stored!r} in {path.name}: the "
                                             f"checkpoint holds {part!r} twice")
                        if shard is not None:
                            tensor = shard.take(part, lambda dim, a, b, t=tensor: t.narrow(
                                dim, a, b - a), lambda t=tensor: t)
                        raw[part] = tensor.to(device=device, dtype=dtype)
                    continue
                if name not in expected | optional:
                    raise ValueError(f"unexpected tensor {stored!r} in {path.name}")
                if name in raw:
                    raise ValueError(f"tensor {stored!r} in {path.name}: the checkpoint holds "
                                     f"{name!r} twice (under two names)")
                part = f.get_slice(stored)
                shape = tuple(part.get_shape())
                if shape != _expected_shape(config, name):
                    raise ValueError(f"tensor {stored!r} has shape {shape}, expected "
                                     f"{_expected_shape(config, name)} from the model config")
                tensor = _read(part, name, shard)
                raw[name] = tensor.to(device=device, dtype=dtype)
    if quantized:
        built = quantized.build(_expected_shape, shard, device, dtype)
        unexpected = sorted(built.keys() - expected)
        if unexpected:
            raise ValueError(f"unexpected tensors of {unexpected[0]!r} in the checkpoint")
        raw.update(built)
    missing = sorted(expected - raw.keys())
    if missing:
        raise ValueError(f"checkpoint is missing tensor {missing[0]!r} "
                         f"({len(missing)} missing in all)")
    return _assemble(config, raw, shard.vocab_start if shard else 0)


def _read(part, name: str, shard: Shard | None) -> torch.Tensor:
    """Tensor `name` of a safetensors file (`part`: its slice handle), or only the shard's part."""
    if shard is None:
        return part[:]
    return shard.take(name, lambda dim, a, b: part[(slice(None),) * dim + (slice(a, b),)],
                      lambda: part[:])


def _assemble(config: ModelConfig, raw: dict[str, torch.Tensor],
              vocab_start: int = 0) -> ModelWeights:
    layers = []
    for i in range(config.num_hidden_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        norm = f"model.layers.{i}.{{}}_layernorm.weight".format
        bqkv, experts = None, {}
        if config.is_moe_layer(i) and config.moe_bias:
            experts = fused_experts_of(raw, mlp)
        elif config.is_moe_layer(i):
            experts = experts_of(config, raw, mlp)
        if config.attention_bias:
            bqkv = torch.cat([raw.pop(f"{attn}{m}_proj.bias") for m in "qkv"])
        if config.fused_projections:
            wqkv = raw.pop(f"{attn}qkv_proj.weight")
            w_gate_up = raw.pop(f"{mlp}gate_up_proj.weight")
        else:  # (quantized weights join into one where their layouts agree: quant.py)
            wqkv = join([raw.pop(f"{attn}{m}_proj.weight") for m in "qkv"])
            w_gate_up = None if experts else join(
                [raw.pop(f"{mlp}{m}_proj.weight") for m in ("gate", "up")])
        sandwich = config.sandwich_norms
        layers.append(LayerWeights(
            input_norm=raw.pop(norm("input")),
            wqkv=wqkv,
            bqkv=bqkv,
            wo=raw.pop(f"{attn}o_proj.weight"),
            post_attention_norm=raw.pop(norm("pre_feedforward" if sandwich else "post_attention")),
            w_gate_up=w_gate_up,
            w_down=None if experts else raw.pop(f"{mlp}down_proj.weight"),
            q_norm=raw.pop(f"{attn}q_norm.weight") if config.qk_norm else None,
            k_norm=raw.pop(f"{attn}k_norm.weight") if config.qk_norm else None,
            attn_out_norm=raw.pop(norm("post_attention")) if sandwich else None,
            mlp_out_norm=raw.pop(norm("post_feedforward")) if sandwich else None,
            bo=raw.pop(f"{attn}o_proj.bias") if config.o_bias else None,
            sinks=raw.pop(f"{attn}sinks") if config.attention_sinks else None,
            **experts,
        ))
    embed = raw.pop("model.embed_tokens.weight")
    lm_head = embed if config.tie_word_embeddings else raw.pop("lm_head.weight")
    return ModelWeights(embed=embed, layers=layers, norm=raw.pop("model.norm.weight"),
                        lm_head=lm_head, vocab_start=vocab_start)


def random_weights(config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu", shard: Shard | None = None) -> ModelWeights:
    """A model at real shapes without a checkpoint (normal * 0.02, norms 1; (1 + w) norms 0),
    for benchmarks (with `shard`: that rank's part of the same model, each tensor made whole
    and cut)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    raw = {}
    for name in _hf_names(config):
        shape = _expected_shape(config, name)
        if name.endswith("norm.weight"):
            raw[name] = torch.full(shape, 0.0 if config.norm_unit_offset else 1.0, dtype=dtype,
                                   device=device)
        else:
            t = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
            raw[name] = t if shard is None else shard.take(
                name, lambda dim, a, b, t=t: t.narrow(dim, a, b - a).clone(), lambda t=t: t)
    return _assemble(config, raw, shard.vocab_start if shard else 0)
