"""Base models the store knows: the shapes an adapter must fit, from the model's HF config.json.

An operator registers a base model once (`RegisterBaseModel`, `loraplex adapters base add DIR`);
its config.json (and revision) is stored at base-models/{model_id}/base.json beside the
adapters, so every
replica sees it. A push whose `base_model_name_or_path` names a registered model is checked
tensor by tensor against it (features in and out of each projection, layer count) and, when both
sides state one, against its revision. With `require_base_model` a push for an unregistered base is
refused; without it (the default) only the adapter's own consistency is checked, and the scheduler
still refuses a base mismatch when a request names the adapter.
"""

import dataclasses
import hashlib
import json
import logging
import re

from adapter_store.blobs import BlobStore
from common.errors import FailedPrecondition, InvalidArgument, NotFound
from common.peft.config import load_json_object
from common.peft.layout import BaseShapes
from common.peft.modules import projection_shapes

log = logging.getLogger(__name__)

ROOT = "base-models/"
RECORD_FILENAME = "base.json"  # {"model_id", "revision", "config_json"}
# HF model ids: "org/name" or "name", plus local-path-like ids made of the same characters.
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_MODEL_ID_RE = re.compile(rf"{_PART}(/{_PART}){{0,3}}")  # fullmatch: no trailing newline
_FAMILIES = {"llama", "mistral", "qwen2", "qwen3"}


@dataclasses.dataclass(frozen=True)
class BaseModel:
    """A registered base model: (in, out) features of each LoRA target projection."""

    model_id: str
    revision: str
    config_sha256: str
    num_layers: int
    module_shapes: dict[str, tuple[int, int]]  # module -> (in_features, out_features)
    config_json: str

    @classmethod
    def from_config(cls, model_id: str, config_json: str, revision: str = "") -> "BaseModel":
        check_model_id(model_id)

        def invalid(message: str) -> InvalidArgument:
            return InvalidArgument(f"base model {model_id!r} config.json: {message}")

        raw = load_json_object(config_json, f"base model {model_id!r} config.json")
        if raw.get("model_type") not in _FAMILIES:
            raise invalid(f"model_type {raw.get('model_type')!r} is not a LLaMA-family model "
                          f"({', '.join(sorted(_FAMILIES))})")
        values = {}
        for field in ("hidden_size", "intermediate_size", "num_attention_heads",
                      "num_hidden_layers"):
            value = raw.get(field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise invalid(f"{field} must be a positive integer, got {value!r}")
            values[field] = value
        hidden, heads = values["hidden_size"], values["num_attention_heads"]
        kv_heads = raw.get("num_key_value_heads") or heads
        head_dim = raw.get("head_dim") or hidden // heads
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                   for v in (kv_heads, head_dim)):
            raise invalid("num_key_value_heads and head_dim must be positive integers")
        shapes = projection_shapes(hidden, values["intermediate_size"], heads, kv_heads,
                                   head_dim)
        return cls(model_id=model_id, revision=revision,
                   config_sha256=hashlib.sha256(config_json.encode()).hexdigest(),
                   num_layers=values["num_hidden_layers"], module_shapes=shapes,
                   config_json=config_json)

    @property
    def shapes(self) -> BaseShapes:
        return BaseShapes(self.model_id, self.num_layers, self.module_shapes)

    def to_json(self) -> str:
        return json.dumps({"model_id": self.model_id, "revision": self.revision,
                           "config_json": self.config_json}, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "BaseModel":
        raw = json.loads(text)
        return cls.from_config(raw["model_id"], raw["config_json"], raw.get("revision", ""))


def check_model_id(model_id: str) -> None:
    if not _MODEL_ID_RE.fullmatch(model_id) or ".." in model_id:
        raise InvalidArgument(f"base model id {model_id!r} is invalid: use an HF-style id like "
                              "'org/name' (letters, digits, . _ -)")


def base_model_key(model_id: str) -> str:
    return f"{ROOT}{model_id}/{RECORD_FILENAME}"


class BaseModels:
    """The registered base models, read from and written to the blob store (every replica sees
    them). With `require_registered`, an adapter naming an unregistered base is refused."""

    def __init__(self, blobs: BlobStore, *, require_registered: bool = False):
        self._blobs = blobs
        self._require_registered = require_registered

    async def register(self, model_id: str, config_json: str, revision: str = "") -> BaseModel:
        """Register (or replace) a base model's config.json."""
        base = BaseModel.from_config(model_id, config_json, revision)
        await self._blobs.put(base_model_key(model_id), base.to_json().encode())
        log.info("registered base model %s (revision %r)", model_id, revision)
        return base

    async def get(self, model_id: str) -> BaseModel | None:
        check_model_id(model_id)
        try:
            data = await self._blobs.get(base_model_key(model_id))
        except NotFound:
            return None
        return BaseModel.from_json(data.decode("utf-8"))

    async def for_adapter(self, config_json: str) -> BaseModel | None:
        """The registered base model an adapter_config.json names, if any (FAILED_PRECONDITION
        when none is and registration is required)."""
        try:
            model_id = json.loads(config_json).get("base_model_name_or_path")
        except (ValueError, AttributeError, RecursionError):
            return None  # the config's own validation names the fault
        if not isinstance(model_id, str) or not model_id:
            return None
        try:
            base = await self.get(model_id.rstrip("/"))
        except InvalidArgument:
            base = None  # not a registrable id (e.g. a local path): cannot be registered
        if base is None and self._require_registered:
            raise FailedPrecondition(
                f"base model {model_id!r} is not registered in this store; register its "
                "config.json first (loraplex adapters base add MODEL_DIR --id ID)")
        return base
