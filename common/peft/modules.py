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
    module: str  # its last name ("up_proj"; "fc1" in a vision tower)
    layer: int | None = None  # the decoder layer; None: not served
    layers: str = ""  # where its model keeps the decoder layers (LAYERS_PATHS); "": not served

    @property
    def is_served(self) -> bool:
        return self.layer is not None


def module_path(layer: int, module: str, layers: str = TEXT_LAYERS) -> str:
    """The projection's name inside the base model, what PEFT matches patterns against, in a
    model that keeps its decoder layers at `layers` (LAYERS_PATHS)."""
    return f"{layers}.{layer}.{BLOCK_OF[module]}.{module}"


def parse_tensor_key(name: str) -> TensorKey:
    """Where LoRA tensor `name` applies; INVALID_ARGUMENT for a name that is neither a decoder
    projection's nor a vision tower's or projector's."""
    match = _TENSOR_KEY.fullmatch(name)  # fullmatch: "$" would accept a trailing newline
    if match is None:
        vision = _VISION_KEY.fullmatch(name)
        if vision is not None:
            path = vision[1]
            return TensorKey(path, vision[2], path.rsplit(".", 1)[-1])
        raise InvalidArgument(f"tensor {name!r} is not a LoRA weight of a decoder projection; "
                              f"expected {TENSOR_KEY_FORMAT}")
    layers, layer, block, module, which = (match[1], int(match[2]), match[3], match[4],
                                           match[5])
    if BLOCK_OF.get(module) != block:
        raise InvalidArgument(f"tensor {name!r}: {block}.{module} is not a projection loraplex "
                              f"serves (supported: {', '.join(ADAPTABLE_MODULES)})")
    return TensorKey(module_path(layer, module, layers), which, module, layer, layers)


def projection_shapes(hidden_size: int, intermediate_size: int, num_attention_heads: int,
                      num_key_value_heads: int, head_dim: int, *,
                      fused: bool = False) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection, in LORA_MODULES order (FUSED_MODULES order
    for a model whose q/k/v and gate/up are single weights)."""
    h, i = hidden_size, intermediate_size
    q, kv = num_attention_heads * head_dim, num_key_value_heads * head_dim
    if fused:
        return {"qkv_proj": (h, q + 2 * kv), "o_proj": (q, h), "gate_up_proj": (h, 2 * i),
                "down_proj": (i, h)}
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
