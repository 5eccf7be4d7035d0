"""What the registry stores: immutable version records, the mutable per-name index, and the
rules for names and aliases live in common.adapter_ref. Plain data, JSON in and out; no I/O here."""

import dataclasses
import json
import math
import time

from common.adapter_ref import AdapterRef
from common.errors import InvalidArgument

ROOT = "adapters/"
MANIFEST_FILENAME = "manifest.json"
INDEX_FILENAME = "index.json"


@dataclasses.dataclass(frozen=True)
class VersionMeta:
    """What the pusher states about a version, beyond what the files say."""

    training_dataset: str = ""  # e.g. "support-tickets@2026-10-01"
    eval_scores: dict[str, float] = dataclasses.field(default_factory=dict)
    base_model_revision: str = ""  # overrides adapter_config.json's "revision"
    source: str = ""  # "upload" or the URI the version was registered from

    def check(self) -> None:
        """INVALID_ARGUMENT for an eval score that is unnamed or not finite."""
        for metric, score in self.eval_scores.items():
            if not metric or not math.isfinite(score):
                raise InvalidArgument(f"eval score {metric!r}={score} must be named and finite")


@dataclasses.dataclass(frozen=True)
class AdapterRecord:
    """One immutable adapter version; the fields of AdapterInfo (common.proto) and the rest of
    AdapterDetails (adapter_store.proto)."""

    name: str
    version: int
    owner_tenant: str  # "" for public adapters
    is_public: bool
    base_model: str
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    num_bytes: int
    sha256: str
    created_unix: float
    config_json: str
    # Added by issue 5; defaults keep manifests written before it readable.
    base_model_revision: str = ""
    base_config_sha256: str = ""  # of the registered base config.json it was checked against
    dtype: str = ""
    rank_pattern: dict[str, int] = dataclasses.field(default_factory=dict)
    alpha_pattern: dict[str, float] = dataclasses.field(default_factory=dict)
    training_dataset: str = ""
    eval_scores: dict[str, float] = dataclasses.field(default_factory=dict)
    source: str = ""
    weights_key: str = ""  # "" = the pre-issue-5 layout, v{version}/adapter_model.safetensors
    crc32: int | None = None  # zlib.crc32 of the weights; None in manifests written before it
    # Added with base fingerprints (common/base_fingerprint.py): base_model is then the matched
    # registered base's id, and these say from what and how. "" in manifests written before.
    base_model_name_or_path: str = ""  # as adapter_config.json states it
    base_match: str = ""  # adapter_store.base_models.MatchKind's value
    base_fingerprint: str = ""  # of the registered base matched to
    # Where its tensors put the decoder layers (common.peft.modules.LAYERS_PATHS); "" in
    # manifests written before multimodal bases: "model.layers"
    layers_path: str = ""
    # Each pool module it adapts -> its largest rank (AdapterLayout.module_ranks); {} in
    # manifests written before mixture-of-experts bases
    module_ranks: dict[str, int] = dataclasses.field(default_factory=dict)
    # An activated LoRA's invocation token ids (common/alora.py); () for a plain adapter
    alora_invocation_tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.weights_key:
            legacy = f"{version_prefix(self.name, self.version)}adapter_model.safetensors"
            object.__setattr__(self, "weights_key", legacy)

    @property
    def ref(self) -> AdapterRef:
        return AdapterRef(self.name, self.version)

    def is_visible_to(self, tenant: str) -> bool:
        """An empty tenant is a trusted caller and sees everything."""
        return not tenant or self.is_public or self.owner_tenant == tenant

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "AdapterRecord":
        raw = json.loads(text)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        required = {n for n, f in fields.items() if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING}
        if not required <= raw.keys():
            raise ValueError(f"manifest lacks {sorted(required - raw.keys())}")
        values = {k: raw[k] for k in fields if k in raw}
        values["target_modules"] = tuple(values["target_modules"])
        values["alora_invocation_tokens"] = tuple(values.get("alora_invocation_tokens", ()))
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class NameIndex:
    """The mutable part of a name: alias -> version, and the versions deleted."""

    aliases: dict[str, int] = dataclasses.field(default_factory=dict)
    deleted: frozenset[int] = frozenset()

    def to_json(self) -> bytes:
        return json.dumps({"aliases": self.aliases, "deleted": sorted(self.deleted),
                           "updated_unix": time.time()}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "NameIndex":
        raw = json.loads(data)
        return cls({str(k): int(v) for k, v in raw.get("aliases", {}).items()},
                   frozenset(int(v) for v in raw.get("deleted", ())))

    def aliases_of(self, version: int) -> list[str]:
        return sorted(a for a, v in self.aliases.items() if v == version)


def version_prefix(name: str, version: int) -> str:
    return f"{ROOT}{name}/v{version}/"
