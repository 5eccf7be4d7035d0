"""HF + PEFT on a tiny mixture-of-experts model, for the MoE oracle tests: PEFT's expert adapters
(its ParamWrapper) refuse mixed-adapter batches, so each adapter's reference runs alone, in a
model of its own; and an adapter of PEFT's target_parameters layout
rewritten as per-expert modules (transformers 4's layout: the same LoRA, another file)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from tests.oracle import hf_greedy


class Oracles:
    """The base model and, per adapter, a PeftModel of its own (PEFT loads two adapters whose
    target_parameters differ into no one model)."""

    def __init__(self, base, folders: dict[str, Path]) -> None:
        from peft import PeftModel

        self.base = base.eval()
        self.models = {name: PeftModel.from_pretrained(copy.deepcopy(base), folder).eval()
                       for name, folder in folders.items()}

    def greedy(self, prompt: list[int], num_tokens: int, adapter: str | None):
        """hf_greedy's tokens and logits of `adapter` (None: the base model)."""
        if adapter is None:
            return hf_greedy(self.base, prompt, num_tokens)
        return hf_greedy(self.models[adapter], prompt, num_tokens, "default")


def as_per_expert(folder: Path, out: Path, *, mixtral: bool) -> Path:
    """The target_parameters adapter of `folder` (both expert weights, any attention LoRA) as
    per-expert modules: expert e's gate and up each with A_e and their half of B_e, its down with
    A_e and B_e; Mixtral's naming (block_sparse_moe, w1 / w3 / w2) with `mixtral`."""
    config = json.loads((folder / "adapter_config.json").read_text())
    tensors = load_file(folder / "adapter_model.safetensors")
    written = {}
    for name, t in tensors.items():
        if ".experts." not in name:
            written[name] = t
    for name in [n for n in tensors if n.endswith("experts.lora_A.weight")
                 or n.endswith("experts.base_layer.lora_A.weight")]:
        a, b = tensors[name], tensors[name.replace("lora_A", "lora_B")]
        prefix = name.split(".experts.")[0]
        other = [n for n in tensors if n.startswith(prefix + ".experts.") and "lora_A" in n
                 and n != name][0]
        is_gate_up = b.shape[0] == 2 * tensors[other].shape[1]
        r = config["r"]  # (the rewritten fixtures have no rank_pattern on their experts)
        num_experts = a.shape[0] // r
        block = prefix.replace(".mlp", ".block_sparse_moe") if mixtral else prefix
        for e in range(num_experts):
            a_e, b_e = a[e * r:(e + 1) * r], b[:, e::num_experts]
            if is_gate_up:
                half = b_e.shape[0] // 2
                parts = {"w1" if mixtral else "gate_proj": b_e[:half],
                         "w3" if mixtral else "up_proj": b_e[half:]}
            else:
                parts = {"w2" if mixtral else "down_proj": b_e}
            for part, b_part in parts.items():
                key = f"{block}.experts.{e}.{part}"
                written[f"{key}.lora_A.weight"] = a_e.clone()
                written[f"{key}.lora_B.weight"] = b_part.clone()
    config["target_modules"] = sorted(set(config.get("target_modules") or []) | (
        {"w1", "w2", "w3"} if mixtral else {"gate_proj", "up_proj", "down_proj"}))
    config["target_parameters"] = None
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(config))
    save_file(written, out / "adapter_model.safetensors")
    return out

