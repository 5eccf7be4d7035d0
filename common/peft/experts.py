"""LoRA on a mixture-of-experts layer's experts, in the two layouts adapters exist in, read into
the pool's per-expert modules (common.peft.modules.expert_module: each expert's gate_up_proj
[hidden -> 2 moe_intermediate, gate's rows first] and down_proj [moe_intermediate -> hidden]).

(a) PEFT's target_parameters on transformers 5's fused expert weights (PEFT >= 0.17, its
    ParamWrapper): one tensor pair per targeted weight of an MoE layer,

        base_model.model.{layers}.{i}.mlp.experts[.base_layer].lora_{A|B}.weight
        A [r * E, in]    expert e's rows at e * r .. e * r + r - 1      (expert-major)
        B [out, r * E]   expert e's column j at j * E + e               (rank-major)

    (PEFT reshapes A to [E, r, in] and B to [out, r, E]), in and out those of one expert's
    weight: gate_up_proj hidden -> 2 moe_intermediate, down_proj moe_intermediate -> hidden. Its
    scale is alpha / r of the weight's path, {layers}.{i}.mlp.experts.{weight}: rank_pattern and
    alpha_pattern keys match it. With both weights targeted PEFT wraps one wrapper in the other,
    the inner one's tensors under `base_layer.`; which pair is which is read from the shapes,
    which always differ (gate_up's (in, out) is (hidden, 2 moe_intermediate), down's the
    reverse of half that), not from the nesting order.
(b) each expert's own projections, as transformers 4 built MoE layers and trainers on it saved
    them (Qwen: mlp.experts.{e}.gate_proj / up_proj / down_proj; Mixtral:
    block_sparse_moe.experts.{e}.w1 / w3 / w2), plain LoRA modules matched by target_modules.
    An expert's gate and up become its one gate_up_proj module: A = [A_gate; A_up] (rank
    r_gate + r_up) and B block-diagonal ([B_gate, 0] over gate's rows, [0, B_up] over up's),
    each part's scale folded into its B block where the two differ; one of them alone is that
    module with the other's rows of B zero.

Running example, (a) with E = 4 experts at r = 2: A is [8, in], expert 2's rows are 4 and 5; B is
[out, 8], expert 2's columns 2 and 6.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from common.errors import InvalidArgument
from common.peft.config import LoraConfig
from common.peft.modules import TensorKey, expert_module
from common.peft.safetensors_header import WEIGHTS_FILE, TensorEntry


@dataclasses.dataclass(frozen=True)
class ExpertPart:
    """One file tensor pair's share of a pool module: rows a_rows of `a`, columns b_cols
    (start, stop, step) of `b`, landing on the module's output rows from out_offset."""

    a: TensorEntry
    b: TensorEntry
    a_rows: tuple[int, int]
    b_cols: tuple[int, int, int]
    out_offset: int
    rank: int
    scale: float
    path: str  # the PEFT path it was matched by (a weight's or a module's)


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """One expert's projection at one layer: the parts of the file it is made of."""

    layer: int
    expert: int
    projection: str  # "gate_up_proj" or "down_proj"
    parts: tuple[ExpertPart, ...]
    out_features: int

    @property
    def module(self) -> str:
        return expert_module(self.expert, self.projection)

    @property
    def is_per_expert(self) -> bool:
        """Made of an expert's own modules (layout (b)), not a fused weight's pair."""
        return not self.parts[0].path.endswith(("experts.gate_up_proj", "experts.down_proj"))

    @property
    def rank(self) -> int:
        return sum(p.rank for p in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].a.shape[1]

    @property
    def scale(self) -> float:
        """The module's scale: its parts' when they agree, else 1 (each folded into its B)."""
        scales = {p.scale for p in self.parts}
        return scales.pop() if len(scales) == 1 else 1.0


def _invalid(message: str) -> InvalidArgument:
    return InvalidArgument(f"{WEIGHTS_FILE}: {message}")


def plan_experts(config: LoraConfig, pairs: Mapping[tuple[int, str, int | None, int | None],
                                                    dict[str, TensorEntry]],
                 keys: Mapping[tuple[int, str, int | None, int | None], TensorKey]
                 ) -> dict[tuple[int, str], ExpertLayout]:
    """(layer, pool module) -> layout of an adapter's expert tensors, checked: `pairs` maps
    (layer, module, expert, depth) (TensorKey's) to its "A" and "B" entries, `keys` to a key of
    its tensors."""
    fused = {k: v for k, v in pairs.items() if k[3] is not None}
    own = {k: v for k, v in pairs.items() if k[2] is not None}
    if fused and own:
        raise _invalid("it holds LoRA on both the fused expert weights (target_parameters) and "
                       "single experts' projections: one adapter uses one layout")
    for key, pair in pairs.items():
        for which, other in (("A", "B"), ("B", "A")):
            if which not in pair:
                raise _invalid(f"{keys[key].path} has lora_{other} but no lora_{which}")
    return _plan_fused(config, fused, keys) if fused else _plan_own(config, own, keys)


def _plan_fused(config: LoraConfig, pairs, keys) -> dict[tuple[int, str], ExpertLayout]:
    by_layer: dict[int, list] = {}
    for key, pair in sorted(pairs.items(), key=lambda kv: kv[0]):
        by_layer.setdefault(key[0], []).append((keys[key], pair))
    out: dict[tuple[int, str], ExpertLayout] = {}
    num_experts = None
    for layer, found in by_layer.items():
        if len(found) > 2:
            raise _invalid(f"{found[0][0].path} holds {len(found)} LoRA pairs on its expert "
                           "weights; an MoE layer has two (gate_up_proj, down_proj)")
        for key, pair, projection in _name_weights(config, found):
            path = f"{key.path}.{projection}"
            if not config.targets_parameter(path):
                out = config.left_out([key.path])[0]
                raise _invalid(f"it adapts {path}, which " + (
                    f"{out} leaves out" if out else
                    f"target_parameters {list(config.target_parameters)} does not name"))
            ((rank, alpha),) = config.ranks_and_alphas([path])
            a, b = pair["A"], pair["B"]
            experts, rest = divmod(a.shape[0], rank)
            if rest or not experts or b.shape[1] != a.shape[0]:
                raise _invalid(f"{path}: lora_A {list(a.shape)} and lora_B {list(b.shape)} are "
                               f"not [r * experts, in] and [out, r * experts] at r = {rank}, the "
                               "rank adapter_config.json gives it")
            if num_experts not in (None, experts):
                raise _invalid(f"{path} holds LoRA for {experts} experts, another weight of the "
                               f"adapter for {num_experts}")
            num_experts = experts
            scale = config.scale(rank, alpha)
            for e in range(experts):
                part = ExpertPart(a, b, (e * rank, (e + 1) * rank), (e, rank * experts, experts),
                                  0, rank, scale, path)
                out[(layer, expert_module(e, projection))] = ExpertLayout(
                    layer, e, projection, (part,), b.shape[0])
    for target in config.target_parameters:
        if not any(p.path == target or p.path.endswith("." + target)
                   for layout in out.values() for p in layout.parts):
            raise _invalid(f"target_parameters lists {target!r} but there are no tensors for it")
    return out


def _name_weights(config: LoraConfig, found: list) -> list[tuple[TensorKey, dict, str]]:
    """Which expert weight each pair of one layer adapts: the one target_parameters names when
    it names one at that layer; with both, by their shapes (gate_up's output is twice down's
    input, its input down's output)."""
    if len(found) == 1:
        (key, pair), = found
        named = [p for p in ("gate_up_proj", "down_proj")
                 if config.targets_parameter(f"{key.path}.{p}")]
        if len(named) != 1:
            raise _invalid(f"{key.path} holds one LoRA pair but target_parameters names "
                           f"{len(named) or 'neither'} of its expert weights: the other's "
                           "tensors are missing" if named else
                           f"{key.path}: target_parameters names none of its expert weights")
        return [(key, pair, named[0])]
    (k1, p1), (k2, p2) = found

    def is_gate_up(mine: dict, other: dict) -> bool:
        return mine["B"].shape[0] == 2 * other["A"].shape[1] and \
            mine["A"].shape[1] == other["B"].shape[0]

    if is_gate_up(p1, p2) == is_gate_up(p2, p1):
        raise _invalid(f"{k1.path}: the shapes of its two LoRA pairs (lora_A {list(p1['A'].shape)}"
                       f", {list(p2['A'].shape)}) are not an MoE layer's gate_up_proj and "
                       "down_proj")
    first = "gate_up_proj" if is_gate_up(p1, p2) else "down_proj"
    second = "down_proj" if first == "gate_up_proj" else "gate_up_proj"
    return [(k1, p1, first), (k2, p2, second)]


def _plan_own(config: LoraConfig, pairs, keys) -> dict[tuple[int, str], ExpertLayout]:
    ordered = sorted(pairs)
    paths = [keys[k].path for k in ordered]
    for path, hit in zip(paths, config.targets(paths)):
        if not hit:
            out = config.left_out([path])[0]
            raise _invalid(f"it adapts {path}, which "
                           + (f"{out} leaves out" if out else "target_modules does not name"))
    parts: dict[tuple[int, int, str], dict[str, ExpertPart]] = {}
    dims: dict[str, tuple[int, int]] = {}
    for key, path, (rank, alpha) in zip(ordered, paths, config.ranks_and_alphas(paths)):
        layer, name, expert, _ = key
        a, b = pairs[key]["A"], pairs[key]["B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise _invalid(f"{path}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not "
                           f"have rank {rank}, the rank adapter_config.json gives it")
        seen = dims.setdefault(name, (a.shape[1], b.shape[0]))
        if seen != (a.shape[1], b.shape[0]):
            raise _invalid(f"{path} maps {a.shape[1]} -> {b.shape[0]} features, other experts' "
                           f"{name} {seen[0]} -> {seen[1]}")
        projection = "down_proj" if name == "down_proj" else "gate_up_proj"
        offset = b.shape[0] if name == "up_proj" else 0
        parts.setdefault((layer, expert, projection), {})[name] = ExpertPart(
            a, b, (0, rank), (0, rank, 1), offset, rank, config.scale(rank, alpha), path)
    if "gate_proj" in dims and "up_proj" in dims and dims["gate_proj"] != dims["up_proj"]:
        raise _invalid(f"experts' gate_proj maps {dims['gate_proj']} features, up_proj "
                       f"{dims['up_proj']}: an expert's two are alike")
    out = {}
    for (layer, expert, projection), named in parts.items():
        ordered_parts = tuple(named[n] for n in ("gate_proj", "up_proj", "down_proj")
                              if n in named)
        size = ordered_parts[0].b.shape[0]
        out_features = 2 * size if projection == "gate_up_proj" else size
        out[(layer, expert_module(expert, projection))] = ExpertLayout(
            layer, expert, projection, ordered_parts, out_features)
    return out
