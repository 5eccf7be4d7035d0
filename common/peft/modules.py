"""The projections a LoRA adapter may target in a decoder layer, their shapes, and how PEFT names
their tensors. Two layouts: the LLaMA one (Llama, Mistral, Qwen, Gemma) and the fused one of
models whose q/k/v and gate/up are single weights (Phi-3), where adapters target the fused
modules and a B spans the fused output (q | k | v; gate | up).

    LLaMA: model.layers.{i}.self_attn.{q,k,v,o}_proj      model.layers.{i}.mlp.{gate,up,down}_proj
    fused: model.layers.{i}.self_attn.{qkv,o}_proj        model.layers.{i}.mlp.{gate_up,down}_proj

A PEFT adapter_model.safetensors holds, per targeted projection, A [r, in] and B [out, r] under
    base_model.model.{layers}.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight
exactly as PEFT's save_pretrained writes them (no adapter-name infix: PEFT strips it on save),
{layers} being where the model it was trained on keeps its decoder layers (LAYERS_PATHS):
    model.layers                   a text model (LlamaForCausalLM, Gemma3ForCausalLM, ...)
    model.language_model.layers    a multimodal model's language model (Gemma 3 4B+), trained
                                   with transformers >= 4.52
    language_model.model.layers    the same, trained with transformers < 4.52
The module paths PEFT matched its target_modules and patterns against start with it too, so an
adapter's paths (module_path) are its own naming's. A multimodal model's adapter may also hold
LoRA on its vision tower or projector ("all-linear" adapts their linears): served text-only, the
model never runs them, so those tensors are recognised and set aside, never mapped to a decoder
projection (TensorKey.is_served).
"""

import dataclasses
import re

from common.errors import InvalidArgument

# The LLaMA layout's, in the order the executor stacks them (q/k/v, o, gate/up, down).
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The fused layout's, likewise: an adapter's B of qkv_proj is [q + 2 kv, r], of gate_up_proj
# [2 intermediate, r] (gate's rows, then up's).
FUSED_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# Every name an adapter may target; which a model has is its layout's (projection_shapes).
ADAPTABLE_MODULES = (*LORA_MODULES, "qkv_proj", "gate_up_proj")
BLOCK_OF = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
            "qkv_proj": "self_attn", "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp",
            "gate_up_proj": "mlp", "down_proj": "mlp"}
# Each expert's projections as the pool keeps them (transformers 5's fused expert weights: gate
# and up one [2 moe_intermediate, hidden] weight, gate's rows first), named by expert_module.
# How adapters' expert tensors map to them: common/peft/experts.py.
EXPERT_PROJECTIONS = ("gate_up_proj", "down_proj")
_EXPERT_MODULE = re.compile(r"experts\.(\d{1,6})\.(gate_up_proj|down_proj)")
# Where a model keeps its decoder layers (see the module docstring); a text model's first.
TEXT_LAYERS = "model.layers"
LAYERS_PATHS = (TEXT_LAYERS, "model.language_model.layers", "language_model.model.layers")
# The linears of Gemma 3's vision tower (SigLIP) that are not also projection names: PEFT lists
# them in target_modules when "all-linear" adapted them. Their LoRA is set aside, never served.
VISION_MODULES = ("out_proj", "fc1", "fc2")
TENSOR_KEY_FORMAT = ("base_model.model.{model.layers|model.language_model.layers|language_model."
                     "model.layers}.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight")
_TENSOR_KEY = re.compile(
    r"base_model\.model\.(model\.layers|model\.language_model\.layers|language_model\.model\.layers)"
    r"\.(\d{1,9})\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight")
_LAYERS = r"(model\.layers|model\.language_model\.layers|language_model\.model\.layers)"
# A mixture-of-experts layer's LoRA (common/peft/experts.py has the layouts): on its fused expert
# weights through PEFT's target_parameters, one pair per weight, the inner wrapper's under
# `base_layer.`; or on each expert's own projections (transformers 4: Qwen's gate/up/down_proj,
# Mixtral's w1/w3/w2 under block_sparse_moe); or on the router (`gate`), which is refused.
_EXPERTS_KEY = re.compile(
    r"base_model\.model\." + _LAYERS + r"\.(\d{1,9})\.(mlp|block_sparse_moe)\.experts\."
    r"((?:base_layer\.)*)lora_(A|B)\.weight")
_PER_EXPERT_KEY = re.compile(
    r"base_model\.model\." + _LAYERS + r"\.(\d{1,9})\.(mlp|block_sparse_moe)\.experts\."
    r"(\d{1,6})\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.lora_(A|B)\.weight")
_ROUTER_KEY = re.compile(
    r"base_model\.model\." + _LAYERS + r"\.\d{1,9}\.(?:mlp|block_sparse_moe)\.gate\.(?:\w+\.)*"
    r"lora_[AB]\.weight")
# Mixtral's per-expert names -> the projection each is
EXPERT_PARTS = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj",
                "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# (a vision tower or projector, under the model's top module or under `model.`)
_VISION_KEY = re.compile(
    r"base_model\.model\.((?:model\.)?(?:vision_tower|multi_modal_projector)(?:\.\w+)+)"
    r"\.lora_(A|B)\.weight")


@dataclasses.dataclass(frozen=True)
class TensorKey:
    """Where a LoRA tensor applies: a decoder projection, or (layer None) a module of a
    multimodal model's vision tower or projector, which text-only serving never runs."""

    path: str  # the module's path in the model PEFT adapted ("model.layers.3.mlp.up_proj")
    which: str  # "A" or "B"
    # its last name ("up_proj"; "fc1" in a vision tower); an expert's projection by what it is
    # ("gate_proj" for Mixtral's w1); "experts" for a pair on the fused expert weights
    module: str
    layer: int | None = None  # the decoder layer; None: not served
    layers: str = ""  # where its model keeps the decoder layers (LAYERS_PATHS); "": not served
    expert: int | None = None  # an expert's own projection: which expert
    # a pair on the fused expert weights: how many PEFT wrappers lie inside its own (0 or 1)
    depth: int | None = None

    @property
    def is_served(self) -> bool:
        return self.layer is not None

    @property
    def is_expert(self) -> bool:
        return self.expert is not None or self.depth is not None


def module_path(layer: int, module: str, layers: str = TEXT_LAYERS) -> str:
    """The projection's name inside the base model, what PEFT matches patterns against, in a
    model that keeps its decoder layers at `layers` (LAYERS_PATHS)."""
    return f"{layers}.{layer}.{BLOCK_OF[module]}.{module}"


def _why_not_lora(name: str) -> str:
    """What PEFT option saves a tensor like `name` that is no LoRA weight, where one does."""
    if name.endswith(".bias"):
        return (" (a trained bias, saved by PEFT's bias='lora_only' or 'all': it rewrites the "
                "base model's bias, which loraplex does not do; train with bias='none')")
    if "trainable_tokens" in name:
        return (" (PEFT's trainable_token_indices, new embedding rows, which loraplex does not "
                "serve)")
    return ""


def parse_tensor_key(name: str) -> TensorKey:
    """Where LoRA tensor `name` applies; INVALID_ARGUMENT for a name that is neither a decoder
    projection's nor a vision tower's or projector's."""
    if _ROUTER_KEY.fullmatch(name):
        raise InvalidArgument(f"tensor {name!r}: LoRA on an MoE layer's router (its gate) is not "
                              "served; train the adapter without the router in target_modules")
    expert = _expert_key(name)
    if expert is not None:
        return expert
    match = _TENSOR_KEY.fullmatch(name)  # fullmatch: "$" would accept a trailing newline
    if match is None:
        vision = _VISION_KEY.fullmatch(name)
        if vision is not None:
            path = vision[1]
            return TensorKey(path, vision[2], path.rsplit(".", 1)[-1])
        raise InvalidArgument(f"tensor {name!r} is not a LoRA weight of a decoder projection"
                              f"{_why_not_lora(name)}; expected {TENSOR_KEY_FORMAT}")
    layers, layer, block, module, which = (match[1], int(match[2]), match[3], match[4],
                                           match[5])
    if BLOCK_OF.get(module) != block:
        raise InvalidArgument(f"tensor {name!r}: {block}.{module} is not a projection loraplex "
                              f"serves (supported: {', '.join(ADAPTABLE_MODULES)})")
    return TensorKey(module_path(layer, module, layers), which, module, layer, layers)


def expert_module(expert: int, projection: str) -> str:
    """The pool's name of one expert's projection (EXPERT_PROJECTIONS): "experts.3.down_proj"."""
    return f"experts.{expert}.{projection}"


def parse_expert_module(module: str) -> tuple[int, str] | None:
    """(expert, projection) of an expert module's name; None for a dense projection's."""
    match = _EXPERT_MODULE.fullmatch(module)
    return None if match is None else (int(match[1]), match[2])


def _expert_key(name: str) -> TensorKey | None:
    """The key of a mixture-of-experts layer's LoRA tensor (see _EXPERTS_KEY); None for any other
    name."""
    fused = _EXPERTS_KEY.fullmatch(name)
    if fused is not None:
        layers, layer, block, wrappers, which = fused.groups()
        return TensorKey(f"{layers}.{layer}.{block}.experts", which, "experts", int(layer),
                         layers, depth=wrappers.count("base_layer."))
    own = _PER_EXPERT_KEY.fullmatch(name)
    if own is not None:
        layers, layer, block, expert, part, which = own.groups()
        return TensorKey(f"{layers}.{layer}.{block}.experts.{expert}.{part}", which,
                         EXPERT_PARTS[part], int(layer), layers, expert=int(expert))
    return None


def projection_shapes(hidden_size: int, intermediate_size: int, num_attention_heads: int,
                      num_key_value_heads: int, head_dim: int, *, fused: bool = False,
                      num_experts: int = 0, moe_intermediate_size: int = 0,
                      dense_mlp: bool = True) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection, in LORA_MODULES order (FUSED_MODULES order
    for a model whose q/k/v and gate/up are single weights); a mixture-of-experts model's are
    followed by each expert's (expert_module: gate_up_proj [hidden -> 2 moe_intermediate], then
    down_proj), its dense MLP's left out when no layer has one (`dense_mlp`)."""
    h, i = hidden_size, intermediate_size
    q, kv = num_attention_heads * head_dim, num_key_value_heads * head_dim
    if fused:
        shapes = {"qkv_proj": (h, q + 2 * kv), "o_proj": (q, h), "gate_up_proj": (h, 2 * i),
                  "down_proj": (i, h)}
    else:
        shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                  "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    if not num_experts:
        return shapes
    if not dense_mlp:
        shapes = {m: s for m, s in shapes.items() if BLOCK_OF[m] == "self_attn"}
    e_i = moe_intermediate_size
    for e in range(num_experts):
        shapes[expert_module(e, "gate_up_proj")] = (h, 2 * e_i)
        shapes[expert_module(e, "down_proj")] = (e_i, h)
    return shapes
