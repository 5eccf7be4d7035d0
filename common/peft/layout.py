"""What an adapter's safetensors file holds, checked against its config: per targeted projection
its A and B tensors, rank, alpha and scale. The store plans every push with it, executors every
load; both read the tensors through `common.peft.tensors`.

    layout = plan_adapter(parse_config(config_json), parse_header(data))
    check_fits(layout, base)   # against a base model's layer count and projection shapes

A multimodal model's adapter names its decoder layers its own way (common.peft.modules:
LAYERS_PATHS) and may hold LoRA on the vision tower or projector: those tensors are kept aside
(`AdapterLayout.unserved`), checked as the file's tensors but never mapped to a projection.
A mixture-of-experts model's adapter may adapt its experts (`AdapterLayout.experts`, per expert
and projection as the pool keeps them; common.peft.experts reads both layouts).
"""

import dataclasses
from collections.abc import Mapping

from common.errors import FailedPrecondition, InvalidArgument
from common.peft.config import LoraConfig, shown
from common.peft.experts import ExpertLayout, plan_experts
from common.peft.modules import (
    TEXT_LAYERS,
    TensorKey,
    module_path,
    parse_expert_module,
    parse_tensor_key,
)
from common.peft.safetensors_header import WEIGHTS_FILE, TensorEntry

# Floating dtypes a LoRA weight may have (what PEFT saves: the training dtype).
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


@dataclasses.dataclass(frozen=True)
class ModuleLayout:
    layer: int
    module: str
    rank: int
    alpha: float
    scale: float
    a: TensorEntry  # [rank, in_features]
    b: TensorEntry  # [out_features, rank]
    path: str  # in the model it was trained on ("model.layers.0.self_attn.q_proj")


@dataclasses.dataclass(frozen=True)
class AdapterLayout:
    config: LoraConfig
    modules: Mapping[tuple[int, str], ModuleLayout]  # (layer, module) -> layout, sorted
    # Where the model it was trained on keeps its decoder layers (common.peft.modules:
    # LAYERS_PATHS), what its patterns were matched under
    layers: str = TEXT_LAYERS
    # Its tensors on a multimodal model's vision tower or projector, by name: never served
    unserved: Mapping[str, TensorEntry] = dataclasses.field(default_factory=dict)
    # (layer, pool module "experts.{e}.{projection}") -> its LoRA on an MoE layer's experts
    experts: Mapping[tuple[int, str], ExpertLayout] = dataclasses.field(default_factory=dict)

    @property
    def rank(self) -> int:
        """The adapter's rank: the largest its tensors use, what a slot must hold and what
        every rank limit (the store's, an executor's --max-rank) is checked against. Not
        max(r, rank_pattern): a rank_pattern entry may match none of its modules. (An expert's
        gate_up_proj made of an expert's own gate and up LoRA has their two ranks summed.)"""
        return max((m.rank for m in (*self.modules.values(), *self.experts.values())),
                   default=0)

    @property
    def target_modules(self) -> tuple[str, ...]:
        """The projections it adapts in some layer, sorted; its experts' as
        experts.gate_up_proj / experts.down_proj."""
        experts = {f"experts.{e.projection}" for e in self.experts.values()}
        return tuple(sorted({module for _, module in self.modules} | experts))

    def module_ranks(self) -> dict[str, int]:
        """Each pool module it adapts (its experts' one by one) -> its largest rank over layers:
        what its pages are planned by (common.adapter_pages.plan_pages)."""
        out: dict[str, int] = {}
        for (_, module), m in (*self.modules.items(), *self.experts.items()):
            out[module] = max(out.get(module, 0), m.rank)
        return out

    def entries(self) -> list[TensorEntry]:
        """Every served tensor of the file, once."""
        served = {t.name: t for m in self.modules.values() for t in (m.a, m.b)}
        served.update((t.name, t) for e in self.experts.values() for p in e.parts
                      for t in (p.a, p.b))
        return list(served.values())

    @property
    def dtype(self) -> str:
        """Safetensors dtype of its weights ("F32"; comma-joined and sorted when mixed)."""
        return ",".join(sorted({t.dtype for t in self.entries()}))

    @property
    def file_dtypes(self) -> set[str]:
        """The dtypes of every tensor of the file, served or not."""
        return {t.dtype for t in (*self.entries(), *self.unserved.values())}

    @property
    def unserved_modules(self) -> tuple[str, ...]:
        """The paths of the vision-tower and projector modules it adapts, sorted."""
        return tuple(sorted({parse_tensor_key(name).path for name in self.unserved}))


@dataclasses.dataclass(frozen=True)
class BaseShapes:
    """What an adapter must fit in a base model."""

    model_id: str
    num_layers: int
    projection_shapes: Mapping[str, tuple[int, int]]  # module -> (in_features, out_features)
    # the layers whose MLP is a mixture of experts: theirs are the experts' modules, the dense
    # MLP's (gate_proj, up_proj, down_proj) only the other layers'
    moe_layers: frozenset[int] = frozenset()
    # its experts' gate and up outputs interleave (gpt-oss): an expert's own gate and up LoRA
    # (which adapters for it never hold) cannot be laid side by side
    gate_up_interleaved: bool = False


def plan_adapter(config: LoraConfig, entries: Mapping[str, TensorEntry]) -> AdapterLayout:
    """Pair every tensor with its projection and check it: names as PEFT writes them, floating
    dtypes, 2-D, A and B for every module, ranks as the config gives them, one (in, out) per
    projection across layers, only targeted modules, and a tensor for every listed target.
    A multimodal model's vision-tower and projector tensors are set aside (the first three
    checks and the last hold for them too)."""
    pairs: dict[tuple[int, str], dict[str, TensorEntry]] = {}
    expert_pairs: dict[tuple, dict[str, TensorEntry]] = {}  # (layer, module, expert, depth)
    expert_keys: dict[tuple, TensorKey] = {}
    served: dict[str, TensorKey] = {}  # name -> key, of the decoder projections' tensors
    unserved: dict[str, TensorEntry] = {}
    for name, entry in entries.items():
        key = parse_tensor_key(name)
        if entry.dtype not in FLOAT_DTYPES:
            raise InvalidArgument(f"tensor {name!r} has dtype {entry.dtype}; LoRA weights must be "
                                  f"one of {list(FLOAT_DTYPES)}")
        if len(entry.shape) != 2:
            raise InvalidArgument(f"tensor {name!r} has shape {list(entry.shape)}; LoRA weights "
                                  "are 2-D (A [r, in], B [out, r])")
        if not key.is_served:
            unserved[name] = entry
            continue
        served[name] = key
        if key.is_expert:
            at = (key.layer, key.module, key.expert, key.depth)
            expert_pairs.setdefault(at, {})[key.which] = entry
            expert_keys[at] = key
            continue
        pairs.setdefault((key.layer, key.module), {})[key.which] = entry
    if not pairs and not expert_pairs:
        raise InvalidArgument(f"{WEIGHTS_FILE} holds no LoRA tensors"
                              + (" of the language model" if unserved else ""))
    layers = _one_naming(served)
    experts = plan_experts(config, expert_pairs, expert_keys) if expert_pairs else {}
    keys = sorted(pairs)
    paths = [module_path(layer, module, layers) for layer, module in keys]
    for path, is_target in zip(paths, config.targets(paths)):
        if not is_target:
            out = config.left_out([path])[0]
            raise InvalidArgument(f"{WEIGHTS_FILE} adapts {path}, which " + (
                f"{out} leaves out" if out else
                f"target_modules {shown(config.target_modules)} does not name"))
    # (an entry with no tensors adapts nothing, as PEFT reads it: one list written for several
    # families, or emptied by exclude_modules or layers_to_transform)
    modules, dims = {}, {}  # dims: module -> (in, out), equal across layers
    for key, path, (rank, alpha) in zip(keys, paths, config.ranks_and_alphas(paths)):
        pair = pairs[key]
        for which, other in (("A", "B"), ("B", "A")):
            if which not in pair:
                raise InvalidArgument(f"module {path} has lora_{other} but no lora_{which} "
                                      f"(base_model.model.{path}.lora_{which}.weight)")
        a, b = pair["A"], pair["B"]  # a: [r, in], b: [out, r]
        for entry, got in ((a, a.shape[0]), (b, b.shape[1])):
            if got != rank:
                raise InvalidArgument(
                    f"tensor {entry.name!r} has shape {list(entry.shape)}: rank {got} differs from "
                    f"{rank}, the rank adapter_config.json gives {path} (r / rank_pattern)")
        seen = dims.setdefault(key[1], (a.shape[1], b.shape[0]))
        if seen != (a.shape[1], b.shape[0]):
            raise InvalidArgument(f"module {path} maps {a.shape[1]} -> {b.shape[0]} features "
                                  f"but {key[1]} maps {seen[0]} -> {seen[1]} in other layers")
        modules[key] = ModuleLayout(key[0], key[1], rank, alpha, config.scale(rank, alpha), a, b,
                                    path)
    return AdapterLayout(config, modules, layers, unserved, experts)


def _one_naming(served: Mapping[str, TensorKey]) -> str:
    """The one place the adapter's tensors put the decoder layers; INVALID_ARGUMENT when they
    name two (tensors of two models' adapters mixed in one file)."""
    namings: dict[str, str] = {}  # layers -> a tensor naming it so
    for name, key in served.items():
        namings.setdefault(key.layers, name)
    if len(namings) > 1:
        (a, first), (b, second) = sorted(namings.items())[:2]
        raise InvalidArgument(f"tensors {first!r} and {second!r} place the decoder layers at "
                              f"{a} and {b}: an adapter's tensors name one model's layers")
    return next(iter(namings))


def check_fits(layout: AdapterLayout, base: BaseShapes) -> None:
    """FAILED_PRECONDITION unless every module exists in `base` with the adapter's shapes: an
    adapter trained on another model (or another size of it) must not be served on this one."""
    for m in layout.modules.values():
        if m.layer in base.moe_layers and m.module in ("gate_proj", "up_proj", "down_proj"):
            raise FailedPrecondition(f"tensor {m.a.name!r}: layer {m.layer} of "
                                     f"{base.model_id!r} is a mixture of experts, it has no "
                                     f"dense {m.module}; was it trained on another model?")
        if m.layer >= base.num_layers:
            raise FailedPrecondition(f"tensor {m.a.name!r}: layer {m.layer} does not exist in "
                                     f"{base.model_id!r} ({base.num_layers} layers)")
        if m.module not in base.projection_shapes:
            raise FailedPrecondition(
                f"tensor {m.a.name!r}: {base.model_id!r} has no {m.module} (its projections: "
                f"{', '.join(base.projection_shapes)}); was it trained on another model?")
        in_f, out_f = base.projection_shapes[m.module]
        for entry, got, want, what in ((m.a, m.a.shape[1], in_f, "input"),
                                       (m.b, m.b.shape[0], out_f, "output")):
            if got != want:
                raise FailedPrecondition(
                    f"tensor {entry.name!r} has shape {list(entry.shape)}: {got} {what} "
                    f"features, but {m.module} of {base.model_id!r} has {want}; was it trained "
                    "on another model?")
    _check_experts_fit(layout, base)


def _check_experts_fit(layout: AdapterLayout, base: BaseShapes) -> None:
    for (layer, module), e in layout.experts.items():
        name = e.parts[0].a.name
        if layer not in base.moe_layers:
            raise FailedPrecondition(
                f"tensor {name!r}: layer {layer} of {base.model_id!r} has no experts"
                + ("" if base.moe_layers else " (it is not a mixture-of-experts model)")
                + "; was it trained on another model?")
        if module not in base.projection_shapes:
            num = sum(1 for m in base.projection_shapes if (parse_expert_module(m) or (0, ""))[1]
                      == "down_proj")
            raise FailedPrecondition(f"tensor {name!r}: expert {e.expert} does not exist in "
                                     f"{base.model_id!r} ({num} experts per layer)")
        if base.gate_up_interleaved and e.projection == "gate_up_proj" and e.is_per_expert:
            raise FailedPrecondition(
                f"tensor {name!r}: {base.model_id!r} interleaves its experts' gate and up "
                "outputs; LoRA on an expert's own gate_proj / up_proj is not served there (adapt "
                "its fused experts.gate_up_proj with target_parameters)")
        want = base.projection_shapes[module]
        if (e.in_features, e.out_features) != want:
            raise FailedPrecondition(
                f"tensor {name!r}: expert {e.expert}'s {e.projection} maps {e.in_features} -> "
                f"{e.out_features} features, {base.model_id!r}'s {want[0]} -> {want[1]}; was "
                "it trained on another model?")
