"""A tiny Gemma 3 multimodal checkpoint (Gemma3ForConditionalGeneration: a tiny vision tower beside
a tiny Gemma 3 text model) in both key layouts transformers has saved, and PEFT adapters made on it
in both namings PEFT has written, for the executor's and the store's tests.

    weights     language_model.model.layers.N... (transformers < 4.52, and 5, which saves this)
                model.language_model.layers.N... (transformers 4.52 .. 4.x)
    adapters    base_model.model.model.language_model.layers.N... (PEFT on transformers >= 4.52)
                base_model.model.language_model.model.layers.N... (PEFT on transformers < 4.52)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from loraplex import fixtures

WEIGHTS = "adapter_model.safetensors"
# The text model: a window of 6 keys, sliding layers on a RoPE base of 100 between global ones on
# linear scaling, head_dim x heads below hidden (as the gemma_oracle tests' Gemma 3), and a final
# soft cap that Gemma3ForConditionalGeneration's forward does not apply
TEXT = {"sliding_window": 6, "query_pre_attn_scalar": 32, "head_dim": 48,
        "sliding_window_pattern": 2, "rope_local_base_freq": 100.0, "rope_theta": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0}, "final_logit_softcapping": 3.0}
_PROJECTIONS = "q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj"
ADAPTERS = {
    # the language model's projections by a regex over whole module paths (a list would also
    # take the vision tower's q/k/v_proj), an alpha and a rank by full path
    "lm": {"r": 8, "lora_alpha": 16, "target_modules": rf".*language_model.*\.({_PROJECTIONS})",
           "rank_pattern": {"model.language_model.layers.1.mlp.down_proj": 4},
           "alpha_pattern": {"model.language_model.layers.2.self_attn.o_proj": 64}},
    # every linear layer: the vision tower's too (its projector holds none)
    "all_linear": {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"},
}
# transformers 5's layout -> 4.52's (the model's tensors), PEFT's new naming -> its old one
_NEW_WEIGHTS = (("language_model.model.", "model.language_model."),
                ("language_model.lm_head.", "lm_head."),
                ("vision_tower.", "model.vision_tower."),
                ("multi_modal_projector.", "model.multi_modal_projector."))
_OLD_ADAPTER = (
    ("base_model.model.model.language_model.", "base_model.model.language_model.model."),
    ("base_model.model.model.vision_tower.", "base_model.model.vision_tower."))


def save_model(out: Path) -> Path:
    """The tiny checkpoint as the installed transformers saves it (untied head: lm_head's name
    shows)."""
    return fixtures.save_tiny_model(out, "gemma3", seed=5, **TEXT)


def renamed_model(model_dir: Path, out: Path) -> Path:
    """A copy of the checkpoint with its tensors under the 4.52 layout's names."""
    shutil.copytree(model_dir, out)
    tensors = load_file(model_dir / "model.safetensors")
    save_file({_renamed(name, _NEW_WEIGHTS): t for name, t in tensors.items()},
              out / "model.safetensors", metadata={"format": "pt"})
    return out


def old_naming(adapter_dir: Path, out: Path) -> Path:
    """A copy of a PEFT adapter as PEFT on transformers < 4.52 would have saved it: its tensors
    and the full module paths of its config under language_model.model."""
    out.mkdir(parents=True)
    config = (adapter_dir / "adapter_config.json").read_text()
    (out / "adapter_config.json").write_text(
        config.replace("model.language_model.", "language_model.model."))
    tensors = load_file(adapter_dir / WEIGHTS)
    save_file({_renamed(name, _OLD_ADAPTER): t for name, t in tensors.items()}, out / WEIGHTS,
              metadata={"format": "pt"})
    return out


def tensor_names(folder: Path, filename: str) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(folder / filename), "pt") as f:
        return sorted(f.keys())


def config_of(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def _renamed(name: str, prefixes: tuple[tuple[str, str], ...]) -> str:
    for old, new in prefixes:
        if name.startswith(old):
            return new + name.removeprefix(old)
    return name
