"""The churn soak's adapters (bench/soak_churn.py): many random PEFT LoRA adapters on the demo
model, cheap to make (seeded random tensors written as safetensors, no peft model built), their
pages, and greedy references for a sample of them from HF transformers + PEFT.

Adapter k is made from seed k alone, so any of them can be made again later (a reference for
one that answered differently, after the run). Its rank is 8, 16 or 64 (70/20/10%) and its
modules all seven projections, attention's four or the MLP's three (a third each).
"""

from __future__ import annotations

import json
import pathlib
import random
from dataclasses import dataclass

import torch
from safetensors.torch import save

from common.adapter_pages import PageGeometry, plan_pages
from common.peft.modules import BLOCK_OF, LORA_MODULES

RANKS = ((8, 0.7), (16, 0.2), (64, 0.1))
MODULE_SETS = {"all": LORA_MODULES, "attn": LORA_MODULES[:4], "mlp": LORA_MODULES[4:]}
DELTA_STD = 0.5  # about the std of one LoRA output element (A x then B, times the scale)


@dataclass(frozen=True)
class AdapterSpec:
    index: int  # its seed; adapter k is the k-th most popular (Zipf rank k + 1)
    rank: int
    modules: str  # a key of MODULE_SETS

    @property
    def name(self) -> str:
        return f"churn-{self.index:04d}-r{self.rank}-{self.modules}"

    def config_json(self, model_id: str) -> str:
        return json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": model_id,
            "r": self.rank, "lora_alpha": 2 * self.rank, "lora_dropout": 0.0, "bias": "none",
            "target_modules": list(MODULE_SETS[self.modules]), "fan_in_fan_out": False,
            "inference_mode": True, "use_rslora": False, "use_dora": False,
            "rank_pattern": {}, "alpha_pattern": {}})

    def weights(self, shapes: dict[str, tuple[int, int]], num_layers: int) -> bytes:
        """adapter_model.safetensors: per layer and module A [r, in] ~ N(0, 1/in) and
        B [out, r] ~ N(0, s^2) with s such that scale 2 * sqrt(r) * s = DELTA_STD."""
        gen = torch.Generator().manual_seed(self.index)
        b_std = DELTA_STD / (2.0 * self.rank ** 0.5)
        tensors = {}
        for layer in range(num_layers):
            for m in MODULE_SETS[self.modules]:
                in_f, out_f = shapes[m]
                key = f"base_model.model.model.layers.{layer}.{BLOCK_OF[m]}.{m}"
                tensors[f"{key}.lora_A.weight"] = (
                    torch.randn(self.rank, in_f, generator=gen) / in_f ** 0.5)
                tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, self.rank,
                                                              generator=gen) * b_std
        return save(tensors)

    def save(self, folder: pathlib.Path, model_id: str, shapes: dict[str, tuple[int, int]],
             num_layers: int) -> pathlib.Path:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "adapter_config.json").write_text(self.config_json(model_id))
        (folder / "adapter_model.safetensors").write_bytes(self.weights(shapes, num_layers))
        return folder


def specs(num_adapters: int, seed: int = 48) -> list[AdapterSpec]:
    rng = random.Random(seed)
    ranks, weights = zip(*RANKS)
    return [AdapterSpec(k, rng.choices(ranks, weights)[0], rng.choice(list(MODULE_SETS)))
            for k in range(num_adapters)]


@dataclass(frozen=True)
class ModelShapes:
    """What the adapters need to know of the base model (from its config.json)."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]  # module -> (in_features, out_features)
    geometry: PageGeometry  # at the executor's block size, in its dtype's elements

    @classmethod
    def read(cls, model_dir: pathlib.Path, block_size: int = 16) -> ModelShapes:
        cfg = json.loads((model_dir / "config.json").read_text())
        hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
        head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
        q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
        shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
                  "o_proj": (q, hidden), "gate_proj": (hidden, inter),
                  "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
        region = block_size * cfg["num_key_value_heads"] * head_dim
        return cls(cfg["num_hidden_layers"], shapes,
                   PageGeometry(cfg["num_hidden_layers"], region, shapes))

    def pages(self, spec: AdapterSpec) -> int:
        """KV blocks the adapter's weights take in the executor (common/adapter_pages.py)."""
        return plan_pages(dict.fromkeys(MODULE_SETS[spec.modules], spec.rank),
                          self.geometry).num_pages


def sample(all_specs: list[AdapterSpec], num: int, seed: int = 7) -> list[AdapterSpec]:
    """The 5 most popular adapters (mostly resident), one of every (rank, modules) kind from the
    rest (loaded cold, evicted, loaded again) and random others up to `num`."""
    rng = random.Random(seed)
    head, rest = all_specs[:5], all_specs[5:]
    kinds = sorted({(s.rank, s.modules) for s in rest})
    chosen = head + [rng.choice([s for s in rest if (s.rank, s.modules) == k]) for k in kinds]
    others = [s for s in rest if s not in chosen]
    chosen += rng.sample(others, max(0, min(num - len(chosen), len(others))))
    return sorted(chosen[:num], key=lambda s: s.index)


def hf_references(model_dir: pathlib.Path, model_id: str, chosen: list[AdapterSpec],
                  prompts: list[list[int]], num_tokens: int,
                  folder: pathlib.Path) -> dict[tuple[int, int], list[int]]:
    """(adapter index, prompt index) -> greedy token ids from HF transformers + PEFT (the tests'
    oracle, tests/oracle.py), EOS not stopping them, as the soak's requests ask."""
    import sys

    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from tests.oracle import hf_greedy, with_adapters

    shapes = ModelShapes.read(model_dir)
    folders = {s.name: s.save(folder / s.name, model_id, shapes.shapes, shapes.num_layers)
               for s in chosen}
    model = with_adapters(AutoModelForCausalLM.from_pretrained(model_dir), folders)
    out = {(s.index, i): hf_greedy(model, p, num_tokens, s.name)[0]
           for s in chosen for i, p in enumerate(prompts)}
    out.update({(-1, i): hf_greedy(model, p, num_tokens)[0] for i, p in enumerate(prompts)})
    return out
