"""adapter_config.json as PEFT writes it, limited to what loraplex serves: plain LoRA on the
projections of a decoder layer (common.peft.modules: the LLaMA layout's 7, or a fused layout's),
and on a mixture-of-experts layer's experts (common.peft.experts: `target_parameters` on the
fused expert weights, or each expert's own projections in target_modules).
The adapter store checks it at a push's header (before any upload) and executors read the same
fields at every load.

    {"peft_type": "LORA", "r": 16, "lora_alpha": 32, "use_rslora": false,
     "target_modules": ["q_proj", "v_proj"],            or a PEFT regex, or "all-linear"
     "rank_pattern": {"v_proj": 8}, "alpha_pattern": {"layers.0.self_attn.q_proj": 64},
     "base_model_name_or_path": "meta-llama/Llama-3.1-8B", "revision": null}

Scale of a module = alpha / r (alpha / sqrt(r) with rsLoRA), r and alpha from the first matching
rank_pattern / alpha_pattern key (PEFT's rule, see common.peft.patterns), else `r`, `lora_alpha`.
"""

import dataclasses
import json
import math
import re
from collections.abc import Sequence

from common.alora import MAX_INVOCATION_TOKENS
from common.errors import InvalidArgument
from common.peft.modules import (
    ADAPTABLE_MODULES,
    EXPERT_PARTS,
    EXPERT_PROJECTIONS,
    LAYERS_PATHS,
    VISION_MODULES,
    module_path,
)
from common.peft.patterns import compile_pattern, fullmatches

# A PEFT config is well under 4 KiB; one of this size still lists thousands of patterns. Bigger
# ones are refused at the header: the config travels in every Fetch and listing.
MAX_CONFIG_BYTES = 64 * 1024
# init_lora_weights whose initialisation rewrites the base weights, which PEFT redoes when it
# loads the adapter (PiSSA, CorDA: W - B0 A0 from an SVD; OLoRA: from a QR; LoftQ: quantized;
# LoRA-GA: from gradients): served on the unchanged base, such an adapter answers wrong
BASE_REWRITING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")
# The largest lora_alpha served: scales (alpha / r) are fp32 in the store's records and pages
MAX_ALPHA = 1e30
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")  # a module path's decoder layer
# Modules PEFT may adapt that loraplex never serves: the vocabulary-sized ones (by their paths in
# a text model and in a multimodal one's language model, for a regex to be checked against).
_VOCAB_MODULES = ("lm_head", "embed_tokens")
_VOCAB_PATHS = ("lm_head", "language_model.lm_head",
                *(f"{layers.removesuffix('.layers')}.embed_tokens" for layers in LAYERS_PATHS))
# PEFT's "every linear layer but the output head": the model's projections, whatever its layout
# (PEFT writes the names it found in a saved config; a hand-written one may say this).
ALL_LINEAR = "all-linear"


def _invalid(message: str) -> InvalidArgument:
    return InvalidArgument(f"adapter_config.json: {message}")


def load_json_object(text: str, what: str) -> dict:
    """`text` parsed as a JSON object; INVALID_ARGUMENT prefixed with `what` otherwise."""
    try:
        raw = json.loads(text)
    except RecursionError:
        raise InvalidArgument(f"{what}: JSON nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, or an integer of more than 4300 digits
        raise InvalidArgument(f"{what}: not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise InvalidArgument(f"{what}: must be a JSON object")
    return raw


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    base_model: str  # base_model_name_or_path
    r: int
    alpha: float
    use_rslora: bool
    # A list of projection names or dotted suffixes of module paths ("self_attn.q_proj"), or one
    # regex matched against whole module paths (PEFT's two forms), or ALL_LINEAR.
    target_modules: tuple[str, ...] | str
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    revision: str  # of the base model, "" when the config names none
    # PEFT's target_parameters: the fused expert weights adapted ("mlp.experts.gate_up_proj"),
    # sorted; matched as a whole dotted suffix of a parameter's path
    target_parameters: tuple[str, ...] = ()
    # Activated LoRA (common/alora.py): the invocation token ids it applies from; (): always
    alora_invocation_tokens: tuple[int, ...] = ()
    # PEFT's layers_to_transform: the decoder layers adapted (None: every one)
    layers_to_transform: frozenset[int] | None = None
    # PEFT's exclude_modules: module names or dotted suffixes, or one regex, left unadapted
    exclude_modules: tuple[str, ...] | str = ()

    @property
    def lowest_rank(self) -> int:
        """The least rank an adapter of this config can have: each module's rank is r or a
        rank_pattern value, so its rank (AdapterLayout.rank, the largest its tensors use) is at
        least the smallest of them. A check that sees the config alone, before the tensors,
        may hold this against a rank limit; the largest of them may name no module at all."""
        return min([self.r, *self.rank_pattern.values()])

    def scale(self, rank: int, alpha: float) -> float:
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    def targets(self, paths: Sequence[str]) -> list[bool]:
        """Whether each module path ("model.layers.3.mlp.up_proj") is one the adapter targets:
        named by target_modules, and not left out (left_out)."""
        if self.target_modules == ALL_LINEAR:
            hits = [p.rsplit(".", 1)[-1] in (*ADAPTABLE_MODULES, *EXPERT_PARTS) for p in paths]
        else:
            hits = _named(self.target_modules, paths, "target_modules")
        return [hit and not out for hit, out in zip(hits, self.left_out(paths))]

    def targets_parameter(self, path: str) -> bool:
        """Whether a parameter's path ("model.layers.3.mlp.experts.down_proj") is one of
        target_parameters (PEFT's rule: the whole path, or a dotted suffix of it), its module
        not left out."""
        return any(path == t or path.endswith("." + t) for t in self.target_parameters) \
            and not self.left_out([path.rsplit(".", 1)[0]])[0]

    def left_out(self, paths: Sequence[str]) -> list[str]:
        """Per module path, why the adapter leaves it unadapted whatever target_modules says:
        "layers_to_transform [...]" or "exclude_modules ..." (PEFT's rules), else ""."""
        out = [""] * len(paths)
        if self.layers_to_transform is not None:
            for i, path in enumerate(paths):
                layer = _LAYER.search(path)
                if layer is None or int(layer[1]) not in self.layers_to_transform:
                    out[i] = f"layers_to_transform {sorted(self.layers_to_transform)}"
        hits = _named(self.exclude_modules, paths, "exclude_modules")
        return [why or (f"exclude_modules {shown(self.exclude_modules)}" if hit else "")
                for why, hit in zip(out, hits)]

    def ranks_and_alphas(self, paths: Sequence[str]) -> list[tuple[int, float]]:
        """(rank, alpha) of each module path by PEFT's rule: the first rank_pattern /
        alpha_pattern key, in the config's order, matching a whole dotted suffix of the path (an
        exact key is one such suffix, not preferred over an earlier one), else r / lora_alpha.
        Keys are matched with a time bound (common.peft.patterns), both fields in one go."""
        rank_keys, alpha_keys = list(self.rank_pattern), list(self.alpha_pattern)
        fields = " and ".join(f for f, keys in (("rank_pattern", rank_keys),
                                                ("alpha_pattern", alpha_keys)) if keys)
        matched = fullmatches(rank_keys + alpha_keys, list(paths),
                              f"adapter_config.json: {fields} keys", as_suffix=True)
        rank_rows, alpha_rows = matched[:len(rank_keys)], matched[len(rank_keys):]
        out = []
        for j in range(len(paths)):
            rank = next((self.rank_pattern[k] for k, row in zip(rank_keys, rank_rows) if row[j]),
                        self.r)
            alpha = next((self.alpha_pattern[k] for k, row in zip(alpha_keys, alpha_rows)
                          if row[j]), self.alpha)
            out.append((rank, alpha))
        return out


def parse_config(config_json: str) -> LoraConfig:
    """The config, checked; INVALID_ARGUMENT naming the field at fault."""
    if len(config_json.encode("utf-8", "surrogatepass")) > MAX_CONFIG_BYTES:
        raise _invalid(f"is over {MAX_CONFIG_BYTES} bytes; a LoRA config is a few hundred "
                       "(drop unused fields or long pattern lists)")
    raw = load_json_object(config_json, "adapter_config.json")
    if raw.get("peft_type", "LORA") != "LORA":
        raise _invalid(f"peft_type {raw['peft_type']!r} is not supported; only LORA is")
    for flag, what in (("use_dora", "DoRA"), ("lora_bias", "LoRA biases"),
                       ("fan_in_fan_out", "fan_in_fan_out (Conv1D layouts)"),
                       # (each changes the math: served as plain LoRA they would answer wrong)
                       ("layer_replication", "layer replication"),
                       ("use_qalora", "QALoRA"), ("use_bdlora", "block-diagonal LoRA")):
        if raw.get(flag):
            raise _invalid(f"{flag}: {what} is not supported; push a plain LoRA adapter")
    init = raw.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(BASE_REWRITING_INITS):
        raise _invalid(f"init_lora_weights {init!r}: PEFT loads such an adapter on base weights "
                       "it rewrites from the initial LoRA (W - B0 A0), which loraplex does not "
                       "do; convert it to a plain LoRA when saving it (PEFT's "
                       "path_initial_model_for_weight_conversion) and push that")
    if raw.get("modules_to_save"):
        raise _invalid(f"modules_to_save {raw['modules_to_save']!r} is not supported: loraplex "
                       "serves LoRA on the projections only, with the base model's own heads")
    r = raw.get("r")
    if not _is_int(r) or r <= 0:
        raise _invalid(f"r must be a positive integer, got {r!r}")
    alpha = raw.get("lora_alpha")
    if not _is_alpha(alpha):
        raise _invalid(f"lora_alpha must be a positive number below {MAX_ALPHA:g}, got "
                       f"{alpha!r}")
    use_rslora = raw.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise _invalid(f"use_rslora must be true or false, got {use_rslora!r}")
    base_model = raw.get("base_model_name_or_path")
    if not isinstance(base_model, str) or not base_model:
        raise _invalid("base_model_name_or_path is missing; set it to the base model's name")
    rank_pattern = raw.get("rank_pattern") or {}
    if not isinstance(rank_pattern, dict):
        raise _invalid("rank_pattern must map module patterns to ranks")
    for pattern, rank in rank_pattern.items():
        if not _is_int(rank) or rank <= 0:
            raise _invalid(f"rank_pattern[{pattern!r}] must be a positive integer, got {rank!r}")
        compile_pattern(pattern, "adapter_config.json: rank_pattern key")
    alpha_pattern = raw.get("alpha_pattern") or {}
    if not isinstance(alpha_pattern, dict):
        raise _invalid("alpha_pattern must map module patterns to finite numbers")
    for pattern, value in alpha_pattern.items():
        if not _is_alpha(value):
            raise _invalid(f"alpha_pattern[{pattern!r}] must be a positive number below "
                           f"{MAX_ALPHA:g}, got {value!r}")
        compile_pattern(pattern, "adapter_config.json: alpha_pattern key")
    revision = raw.get("revision") or ""
    if not isinstance(revision, str):
        raise _invalid(f"revision must be a string, got {revision!r}")
    layers = _layers_to_transform(raw.get("layers_to_transform"), raw.get("layers_pattern"))
    exclude = _exclude_modules(raw.get("exclude_modules"))
    parameters = _target_parameters(raw.get("target_parameters"))
    invocation = _invocation(raw.get("alora_invocation_tokens"))
    modules = raw.get("target_modules")
    return LoraConfig(base_model=base_model, r=r, alpha=float(alpha), use_rslora=use_rslora,
                      target_modules=(() if parameters and not modules
                                      else _target_modules(modules)),
                      rank_pattern=dict(rank_pattern),
                      alpha_pattern={k: float(v) for k, v in alpha_pattern.items()},
                      revision=revision, target_parameters=parameters,
                      alora_invocation_tokens=invocation, layers_to_transform=layers,
                      exclude_modules=exclude)


def _layers_to_transform(value: object, pattern: object) -> frozenset[int] | None:
    """PEFT's layers_to_transform (an index or a list of them; null: every layer), counted in
    the decoder's `layers` (layers_pattern, when given, must name them)."""
    if value is None or value == []:
        return None
    indices = [value] if _is_int(value) else value
    if not isinstance(indices, list) or not all(_is_int(i) and i >= 0 for i in indices):
        raise _invalid(f"layers_to_transform must be a layer index or a list of them, got "
                       f"{value!r}")
    if pattern not in (None, "layers", ["layers"]):
        raise _invalid(f"layers_pattern {pattern!r} is not supported: the decoder's layers "
                       "are model.layers (leave it out, or say \"layers\")")
    return frozenset(indices)


def _exclude_modules(value: object) -> tuple[str, ...] | str:
    """PEFT's exclude_modules: a list of names or dotted suffixes, or one regex."""
    if value is None:
        return ()
    if isinstance(value, str):
        compile_pattern(value, "adapter_config.json: exclude_modules regex")
        return value
    if not isinstance(value, list) or not all(isinstance(e, str) and e for e in value):
        raise _invalid(f"exclude_modules must be a list of module names or a regex string, "
                       f"got {value!r}")
    return tuple(sorted(set(value)))


def _invocation(value: object) -> tuple[int, ...]:
    """PEFT's alora_invocation_tokens: a non-empty list of token ids (or absent)."""
    if value is None:
        return ()
    if not isinstance(value, list) or not value or not all(
            _is_int(t) and t >= 0 for t in value) or len(value) > MAX_INVOCATION_TOKENS:
        raise _invalid(f"alora_invocation_tokens must be 1 to {MAX_INVOCATION_TOKENS} token ids "
                       f"(non-negative integers), got {value!r}")
    return tuple(value)


def _target_parameters(value: object) -> tuple[str, ...]:
    """PEFT's target_parameters: only a mixture-of-experts layer's fused expert weights
    (common.peft.modules.EXPERT_PROJECTIONS) are served, named by a dotted suffix of their path
    ("experts.down_proj", or bare "down_proj" as PEFT writes it when it converts an MoE adapter's
    target_modules: a dense MLP's parameter is "mlp.down_proj.weight", which it does not end)."""
    if value is None or value == []:
        return ()
    if not isinstance(value, list) or not all(isinstance(t, str) and t for t in value):
        raise _invalid(f"target_parameters must be a list of parameter names, got {value!r}")
    for target in value:
        parts = target.split(".")
        if parts[-1] not in EXPERT_PROJECTIONS or parts[-2:-1] not in ([], ["experts"]) \
                or not all(part.isidentifier() or part.isdigit() for part in parts):
            raise _invalid(f"target_parameters entry {target!r} is not supported: only an MoE "
                           "layer's fused expert weights are (experts.gate_up_proj, "
                           "experts.down_proj, or bare gate_up_proj, down_proj)")
    return tuple(sorted(set(value)))


def _target_modules(value: object) -> tuple[str, ...] | str:
    supported = ", ".join(ADAPTABLE_MODULES)
    if value == ALL_LINEAR:
        return ALL_LINEAR
    if isinstance(value, str):
        if value in ADAPTABLE_MODULES:
            return (value,)
        compile_pattern(value, "adapter_config.json: target_modules regex")
        paths = [module_path(0, m) for m in ADAPTABLE_MODULES]
        (hits,) = fullmatches([value], paths + list(_VOCAB_PATHS),
                              "adapter_config.json: target_modules regex")
        if any(hits[len(paths):]):
            raise _invalid(f"target_modules regex {value!r} matches lm_head or embed_tokens; "
                           f"only the projections can be adapted ({supported})")
        return value
    if not isinstance(value, list) or not value or not all(isinstance(t, str) for t in value):
        raise _invalid(f"target_modules must be a non-empty list of names or a regex string, "
                       f"got {value!r}")
    for target in value:
        last = target.rsplit(".", 1)[-1]
        if last == "gate":
            raise _invalid(f"target module {target!r}: LoRA on an MoE layer's router (its gate) "
                           "is not served; train the adapter without it")
        if last in _VOCAB_MODULES:
            raise _invalid(f"target module {target!r} is not supported: adapters on lm_head or "
                           f"embed_tokens are not served (only {supported})")
        # (a vision tower's linears: "all-linear" on a multimodal model lists them; their LoRA
        # is never served, common.peft.modules)
        if last not in (*ADAPTABLE_MODULES, *VISION_MODULES, *EXPERT_PARTS) or not all(
                part.isidentifier() or part.isdigit() for part in target.split(".")):
            raise _invalid(f"target module {target!r} is not supported; use a subset of "
                           f"{supported}")
    return tuple(sorted(set(value)))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _named(names: tuple[str, ...] | str, paths: Sequence[str], field: str) -> list[bool]:
    """Whether PEFT's list-or-regex `field` (target_modules, exclude_modules) names each module
    path: the regex matching the whole path, or a list entry that is the path or a dotted
    suffix of it."""
    if isinstance(names, str):
        (hits,) = fullmatches([names], list(paths), f"adapter_config.json: {field} regex")
        return hits
    return [any(p == n or p.endswith("." + n) for n in names) for p in paths]


def shown(names: tuple[str, ...] | str) -> str:
    """target_modules or exclude_modules as the config wrote it: a regex, or a list."""
    return repr(names) if isinstance(names, str) else str(list(names))


def _is_alpha(value: object) -> bool:
    """A lora_alpha or alpha_pattern value: positive, and a scale fp32 holds (1e300 went into
    the registry and failed every load)."""
    return _is_number(value) and 0 < value < MAX_ALPHA


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
