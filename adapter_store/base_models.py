"""Base models the store knows: the shapes an adapter must fit, from the model's HF config.json,
and who the model is: its fingerprint (common/base_fingerprint.py) and the names it goes by.

An operator registers a base model once (`RegisterBaseModel`, `loraplex adapters base add DIR
--id ID [--name NAME ...]`); its config.json, revision, fingerprint and names are stored at
base-models/{model_id}/base.json beside the adapters, so every replica sees them. A push is
matched to a registered base (`match`): by fingerprint first (of the local folder the adapter's
base_model_name_or_path names, computed by the pusher), then by id, then by name; the adapter's
base_model becomes that base's id. A matched push is checked tensor by tensor against the base
(features in and out of each projection, layer count) and, when both sides state one, against its
revision. With `require_base_model` a push matching no base is refused; without it (the default)
only the adapter's own consistency is checked, its base_model is its own text, and the scheduler
still refuses a base mismatch when a request names the adapter.
"""

import dataclasses
import enum
import hashlib
import json
import logging
import re
from collections.abc import Sequence

from adapter_store.blobs import BlobStore
from common.base_fingerprint import check_fingerprint
from common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from common.model_families import base_shapes, read_config
from common.peft.config import load_json_object
from common.peft.layout import BaseShapes

log = logging.getLogger(__name__)

ROOT = "base-models/"
RECORD_FILENAME = "base.json"  # {"model_id", "revision", "config_json", "fingerprint", "names"}
# HF model ids: "org/name" or "name", plus local-path-like ids made of the same characters.
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_MODEL_ID_RE = re.compile(rf"{_PART}(/{_PART}){{0,3}}")  # fullmatch: no trailing newline
MAX_NAMES = 64  # other names of one base
MAX_NAME_CHARS = 1024  # a local path may be long


@dataclasses.dataclass(frozen=True)
class BaseModel:
    """A registered base model: (in, out) features of each LoRA target projection."""

    model_id: str
    revision: str
    config_sha256: str
    num_layers: int
    module_shapes: dict[str, tuple[int, int]]  # module -> (in_features, out_features)
    config_json: str
    moe_layers: tuple[int, ...] = ()  # the layers whose MLP is experts (their modules: experts.*)
    gate_up_interleaved: bool = False  # its experts' gate and up interleave (gpt-oss)
    vocab_size: int = 0  # its vocabulary (0: unknown): an aLoRA's invocation must lie in it
    fingerprint: str = ""  # "" = registered without one
    names: tuple[str, ...] = ()  # other names adapters may give it, sorted, never the id

    @classmethod
    def from_config(cls, model_id: str, config_json: str, revision: str = "",
                    fingerprint: str = "", names: Sequence[str] = ()) -> "BaseModel":
        check_model_id(model_id)
        check_fingerprint(fingerprint, "fingerprint")
        names = normalized_names(model_id, names)

        def invalid(message: str) -> InvalidArgument:
            return InvalidArgument(f"base model {model_id!r} config.json: {message}")

        raw = load_json_object(config_json, f"base model {model_id!r} config.json")
        try:
            shapes = base_shapes(raw)
        except ValueError as err:
            raise invalid(str(err).removeprefix("model config: ")) from None
        return cls(model_id=model_id, revision=revision,
                   config_sha256=hashlib.sha256(config_json.encode()).hexdigest(),
                   num_layers=shapes.num_layers, module_shapes=dict(shapes.projection_shapes),
                   moe_layers=tuple(sorted(shapes.moe_layers)),
                   gate_up_interleaved=shapes.gate_up_interleaved,
                   vocab_size=int(read_config(raw).get("vocab_size") or 0),
                   config_json=config_json, fingerprint=fingerprint, names=names)

    @property
    def shapes(self) -> BaseShapes:
        return BaseShapes(self.model_id, self.num_layers, self.module_shapes,
                          frozenset(self.moe_layers), self.gate_up_interleaved)

    def goes_by(self, name: str) -> bool:
        """Whether `name` is this base's id or one of its names."""
        return name == self.model_id or name in self.names

    def to_json(self) -> str:
        return json.dumps({"model_id": self.model_id, "revision": self.revision,
                           "config_json": self.config_json, "fingerprint": self.fingerprint,
                           "names": list(self.names)}, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "BaseModel":
        raw = json.loads(text)  # written before fingerprints: none, and no names
        return cls.from_config(raw["model_id"], raw["config_json"], raw.get("revision", ""),
                               raw.get("fingerprint", ""), raw.get("names", ()))


class MatchKind(enum.Enum):
    """How an adapter's base_model_name_or_path was matched (common.proto's BaseMatch)."""

    UNREGISTERED = "unregistered"
    ID = "id"
    NAME = "name"
    FINGERPRINT = "fingerprint"


@dataclasses.dataclass(frozen=True)
class BaseMatch:
    """The registered base an adapter was matched to (None when unregistered), and how."""

    text: str  # base_model_name_or_path as the adapter states it
    kind: MatchKind
    base: BaseModel | None

    @property
    def base_model(self) -> str:
        """What the adapter's base_model becomes: the base's id, else the adapter's own text."""
        return self.base.model_id if self.base else self.text


def normalized_names(model_id: str, names: Sequence[str]) -> tuple[str, ...]:
    """Other names of a base, checked, without a trailing "/", duplicates or the id; sorted."""
    if len(names) > MAX_NAMES:
        raise InvalidArgument(f"base model {model_id!r}: {len(names)} names; at most {MAX_NAMES}")
    kept = set()
    for name in names:
        if not isinstance(name, str):
            raise InvalidArgument(f"base model {model_id!r}: names must be strings")
        text = name.rstrip("/") or name
        if not text or len(text) > MAX_NAME_CHARS or not text.isprintable():
            raise InvalidArgument(f"base model {model_id!r}: name {name[:80]!r} must be 1-"
                                  f"{MAX_NAME_CHARS} printable characters (a hub id, a path)")
        if text != model_id:
            kept.add(text)
    return tuple(sorted(kept))


def check_model_id(model_id: str) -> None:
    if not _MODEL_ID_RE.fullmatch(model_id) or ".." in model_id:
        raise InvalidArgument(f"base model id {model_id!r} is invalid: use an HF-style id like "
                              "'org/name' (letters, digits, . _ -)")


def base_model_key(model_id: str) -> str:
    return f"{ROOT}{model_id}/{RECORD_FILENAME}"


class BaseModels:
    """The registered base models, read from and written to the blob store (every replica sees
    them; each replica keeps the ones it read, by listing etag, and answers from them while the
    blob store fails). With `require_registered`, an adapter matching no base is refused."""

    def __init__(self, blobs: BlobStore, *, require_registered: bool = False):
        self._blobs = blobs
        self._require_registered = require_registered
        self._known: dict[str, tuple[str, BaseModel]] = {}  # key -> (listing etag, base)

    async def register(self, model_id: str, config_json: str, revision: str = "",
                       fingerprint: str = "", names: Sequence[str] = ()) -> BaseModel:
        """Register (or replace) a base model. ALREADY_EXISTS when another base has the
        fingerprint, or one of the names (as its id or a name). Two registrations racing on two
        replicas are not checked against each other (operators register bases, rarely)."""
        base = BaseModel.from_config(model_id, config_json, revision, fingerprint, names)
        for other in await self.all():
            if other.model_id == model_id:
                continue
            if base.fingerprint and other.fingerprint == base.fingerprint:
                raise AlreadyExists(
                    f"this model (fingerprint {base.fingerprint[:16]}...) is registered as "
                    f"{other.model_id!r}; give its names to that id (adapters base add DIR --id "
                    f"{other.model_id} --name ...), or remove it first")
            taken = [n for n in (model_id, *base.names) if other.goes_by(n)]
            if taken:
                raise AlreadyExists(f"base model name {taken[0]!r} is taken by base model "
                                    f"{other.model_id!r}; a name maps to one base")
        await self._blobs.put(base_model_key(model_id), base.to_json().encode())
        log.info("registered base model %s (revision %r, fingerprint %s, names %s)", model_id,
                 revision, fingerprint[:16] or "-", ", ".join(base.names) or "-")
        return base

    async def all(self) -> list[BaseModel]:
        """Every registered base model, sorted by id; the ones read before when the blob store
        fails (UNAVAILABLE only when this replica never read any)."""
        try:
            listed = await self._blobs.list_objects(ROOT)
        except Unavailable:
            if not self._known:
                raise
            log.warning("base models: blob store unavailable, answering from the %d known",
                        len(self._known))
            return sorted((b for _, b in self._known.values()), key=lambda b: b.model_id)
        known = {}
        for key, etag in listed.items():
            if not key.endswith("/" + RECORD_FILENAME):
                continue
            seen = self._known.get(key)
            if seen is None or seen[0] != etag:
                try:
                    seen = (etag, BaseModel.from_json((await self._blobs.get(key)).decode()))
                except NotFound:  # replaced or removed since the listing
                    continue
            known[key] = seen
        self._known = known
        return sorted((b for _, b in known.values()), key=lambda b: b.model_id)

    async def find(self, name: str = "", fingerprint: str = "") -> BaseModel | None:
        """The base with this fingerprint, or whose id or one of whose names is `name`."""
        name = name.rstrip("/") or name
        for base in await self.all():
            if (fingerprint and base.fingerprint == fingerprint) or (name and base.goes_by(name)):
                return base
        return None

    async def match(self, config_json: str, fingerprint: str = "") -> BaseMatch:
        """The registered base an adapter_config.json's base_model_name_or_path maps to:
        - FINGERPRINT: `fingerprint` (of the local folder that text names, computed by the
          pusher) is a registered base's;
        - ID / NAME: the text is a base's id, or one of its names;
        - UNREGISTERED: neither (FAILED_PRECONDITION when registration is required).
        A text naming a base whose registered fingerprint differs from the folder's is refused
        (FAILED_PRECONDITION): the folder holds another model than the one registered."""
        check_fingerprint(fingerprint, "base_fingerprint")
        try:
            text = json.loads(config_json).get("base_model_name_or_path")
        except (ValueError, AttributeError, RecursionError):
            text = None
        if not isinstance(text, str) or not text:
            return BaseMatch("", MatchKind.UNREGISTERED, None)  # parse_config names the fault
        bases = await self.all()
        by_fingerprint = next((b for b in bases if fingerprint and b.fingerprint == fingerprint),
                              None)
        if by_fingerprint is not None:
            return BaseMatch(text, MatchKind.FINGERPRINT, by_fingerprint)
        name = text.rstrip("/") or text
        by_name = next((b for b in bases if b.goes_by(name)), None)
        if by_name is not None:
            if fingerprint and by_name.fingerprint:
                raise FailedPrecondition(
                    f"base_model_name_or_path {text!r} names base model {by_name.model_id!r}, but "
                    f"the folder {text!r} on the pushing machine holds another model (fingerprint "
                    f"{fingerprint[:16]}..., registered {by_name.fingerprint[:16]}...): train on "
                    "the registered model, or register this one under its own id")
            kind = MatchKind.ID if name == by_name.model_id else MatchKind.NAME
            return BaseMatch(text, kind, by_name)
        if self._require_registered:
            raise FailedPrecondition(
                f"base model {text!r} is not registered in this store; register its folder first "
                "(loraplex adapters base add MODEL_DIR --id ID --name NAME)")
        return BaseMatch(text, MatchKind.UNREGISTERED, None)
