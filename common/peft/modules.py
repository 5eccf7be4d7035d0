"""The projections a LoRA adapter may target in a decoder layer, their shapes, and how PEFT names
their tensors. Two layouts: the LLaMA one (Llama, Mistral, Qwen, Gemma) and the fused one of
models whose q/k/v and gate/up are single weights (Phi-3), where adapters target the fused
modules and a B spans the fused output (q | k | v; gate | up).

    LLaMA: model.layers.{i}.self_attn.{q,k,v,o}_proj      model.layers.{i}.mlp.{gate,up,down}_proj
    fused: model.layers.{i}.self_attn.{qkv,o}_proj        model.layers.{i}.mlp.{gate_up,down}_proj

A PEFT adapter_model.safetensors holds, per targeted projection, A [r, in] and B [out, r] under
    base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight
exactly as PEFT's save_pretrained writes them (no adapter-name infix: PEFT strips it on save).
"""

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
TENSOR_KEY_FORMAT = "base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight"
_TENSOR_KEY = re.compile(
    r"base_model\.model\.model\.layers\.(\d{1,9})\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight")


def module_path(layer: int, module: str) -> str:
    """The projection's name inside the base model, what PEFT matches patterns against."""
    return f"model.layers.{layer}.{BLOCK_OF[module]}.{module}"


def parse_tensor_key(name: str) -> tuple[int, str, str]:
    """(layer, module, "A" or "B") of a LoRA tensor; INVALID_ARGUMENT for any other name."""
    match = _TENSOR_KEY.fullmatch(name)  # fullmatch: "$" would accept a trailing newline
    if match is None:
        raise InvalidArgument(f"tensor {name!r} is not a LoRA weight of a decoder projection; "
                              f"expected {TENSOR_KEY_FORMAT}")
    layer, block, module, which = int(match[1]), match[2], match[3], match[4]
    if BLOCK_OF.get(module) != block:
        raise InvalidArgument(f"tensor {name!r}: {block}.{module} is not a projection loraplex "
                              f"serves (supported: {', '.join(ADAPTABLE_MODULES)})")
    return layer, module, which


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
