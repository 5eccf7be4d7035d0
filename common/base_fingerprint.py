"""A base model's fingerprint: which model a folder holds, whatever its folder, name or path.

Two copies of one model (other folders, other names; a hub id here, a local path there) get the
same fingerprint; two fine-tunes of one architecture, or a model of another shape, get different
ones. The adapter store records it when a base model is registered (`loraplex adapters base
add`), the CLI computes it for the local folder an adapter's base_model_name_or_path names, and an
executor for the folder it serves, so the three agree on a base without comparing strings.

What it hashes (sha256, each piece length-prefixed), in this order:
  - a version tag, so a change of this recipe never matches a fingerprint made by another;
  - config.json as canonical JSON (sorted keys, no spaces) without the keys that say where and
    with which tools it was saved (VOLATILE_CONFIG_KEYS: _name_or_path, transformers_version,
    torch_dtype/dtype, ...);
  - every tensor of the safetensors checkpoint (the shards model.safetensors.index.json lists,
    else model.safetensors), in name order: its name, dtype and shape, then SAMPLE_BYTES of its
    data at its start, its middle and its end (all of it when smaller). Tensors are taken by name,
    not by file or offset, so a copy sharded differently agrees.

Cost: config.json, each shard's header (~100 bytes per tensor) and at most 3 x 4 KiB per tensor,
whatever the model's size: an 8B LLaMA (16 GB, 291 tensors) reads ~3.5 MB in ~900 small reads,
milliseconds from the page cache and well under a second from an SSD. Cheap enough for every
executor start and every push.

What it does not see: a change confined to bytes that no sample covers. A fine-tune, full or a
merged LoRA (W + BA is dense), changes every element of the tensors it touches, so their samples
change; a single weight edited in the middle of a large tensor is not seen.
"""

import contextlib
import hashlib
import json
import os
import re
from pathlib import Path

from common.errors import InvalidArgument
from common.peft.safetensors_header import WEIGHTS_FILE, TensorEntry, data_start, parse_header
from protos import common_pb2

FINGERPRINT_VERSION = b"loraplex base fingerprint v1"
SAMPLE_BYTES = 4096  # read at the start, middle and end of every tensor
# config.json keys that differ between copies of one model: where and how it was saved.
VOLATILE_CONFIG_KEYS = frozenset({
    "_name_or_path", "_commit_hash", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "_attn_implementation", "_attn_implementation_autoset"})
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_FINGERPRINT_RE = re.compile(r"[0-9a-f]{64}")


def canonical_config(config_json: str) -> str:
    """config.json as the fingerprint hashes it: sorted keys, no spaces, no volatile keys."""
    raw = json.loads(config_json)
    if not isinstance(raw, dict):
        raise ValueError("config.json must be a JSON object")
    kept = {k: v for k, v in raw.items() if k not in VOLATILE_CONFIG_KEYS}
    return json.dumps(kept, sort_keys=True, separators=(",", ":"))


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of an HF checkpoint: the shards its index lists, else
    model.safetensors; [] when it has neither (no safetensors weights)."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no weight_map")
        return [model_dir / shard for shard in sorted(set(weight_map.values()))]
    single = model_dir / SINGLE_FILE
    return [single] if single.is_file() else []


def base_fingerprint(model_dir: str | Path) -> str | None:
    """The fingerprint of the model in `model_dir` (64 hex digits), or None when it holds no
    safetensors weights. FileNotFoundError without config.json; ValueError for a checkpoint that
    cannot be read as safetensors (see the module docstring for what is read)."""
    model_dir = Path(model_dir)
    config_json = (model_dir / "config.json").read_text()
    files = checkpoint_files(model_dir)
    if not files:
        return None
    digest = hashlib.sha256()
    _add(digest, FINGERPRINT_VERSION)
    _add(digest, canonical_config(config_json).encode())
    with contextlib.ExitStack() as stack:
        # name -> (its file, the file's descriptor, where its data section starts, the entry)
        tensors: dict[str, tuple[Path, int, int, TensorEntry]] = {}
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            stack.callback(os.close, fd)
            start, entries = _read_header(fd, path)
            for name, entry in entries.items():
                if name in tensors:
                    raise ValueError(f"{model_dir}: tensor {name!r} is in more than one shard")
                tensors[name] = (path, fd, start, entry)
        for name in sorted(tensors):
            path, fd, start, entry = tensors[name]
            _add(digest, json.dumps([name, entry.dtype, list(entry.shape)]).encode())
            for begin, end in sample_ranges(entry.begin, entry.end):
                sample = os.pread(fd, end - begin, start + begin)
                if len(sample) != end - begin:
                    raise ValueError(f"{path}: file ends inside tensor {name!r} (truncated?)")
                _add(digest, sample)
    return digest.hexdigest()


def sample_ranges(begin: int, end: int) -> list[tuple[int, int]]:
    """The byte ranges of a tensor at [begin, end) that are hashed: SAMPLE_BYTES at its start,
    middle and end, or the whole tensor when it is no larger than three samples."""
    if end - begin <= 3 * SAMPLE_BYTES:
        return [(begin, end)]
    middle = begin + (end - begin - SAMPLE_BYTES) // 2
    return [(start, start + SAMPLE_BYTES) for start in (begin, middle, end - SAMPLE_BYTES)]


def check_fingerprint(text: str, field: str) -> None:
    """"" (none) or 64 lowercase hex digits; INVALID_ARGUMENT naming `field` otherwise."""
    if text and not _FINGERPRINT_RE.fullmatch(text):
        raise InvalidArgument(f"{field} must be 64 lowercase hex digits (a sha256 made by "
                              f"common/base_fingerprint.py), got {text[:80]!r}")


def is_same_base(adapter: common_pb2.AdapterInfo, model_id: str, model_fingerprint: str) -> bool:
    """Whether an adapter fits a model that calls itself `model_id` and has `model_fingerprint`:
    the base the store matched it to is that id, or both sides know a fingerprint and they are
    equal (the model was started under another name, e.g. its folder's)."""
    if adapter.base_model.rstrip("/") == model_id:
        return True
    return bool(adapter.base_fingerprint) and adapter.base_fingerprint == model_fingerprint


def same_model_hint(named: str, served: str | None = None) -> str:
    """What to do when an adapter's base, `named`, may be a served model under another name: the
    pool's model `served`, or (None) one of a gateway's pools."""
    hint = (f"If they are one model, register it as {served!r}" if served is not None else
            "If it is one of those under another name, register that model")
    hint += (f" with the name the adapter gives it (loraplex adapters base add MODEL_DIR --id "
             f"{served or 'ID'} --name {named}; `loraplex up` registers its model) and push the "
             "adapter again")
    if not named.startswith(("/", ".", "~")):  # (an id, not a path: a pool may take it)
        hint += (f", or {'start the pool' if served is not None else 'serve the model'} under "
                 f"that id (--model-id {named})")
    return hint


def _add(digest, piece: bytes) -> None:
    """Length-prefixed, so no two sequences of pieces hash alike."""
    digest.update(len(piece).to_bytes(8, "little"))
    digest.update(piece)


class _FileBytes:
    """Enough of a bytes object over an open file for parse_header: its length and slices,
    read on demand (the header, never the weights)."""

    def __init__(self, fd: int):
        self._fd = fd
        self._size = os.fstat(fd).st_size

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, span: slice) -> bytes:
        start, stop, _ = span.indices(self._size)
        return os.pread(self._fd, max(stop - start, 0), start)


def _read_header(fd: int, path: Path) -> tuple[int, dict[str, TensorEntry]]:
    """(where the data section starts, the tensor entries) of one safetensors file, its header
    checked against the file's size by the one safetensors reader (common.peft)."""
    view = _FileBytes(fd)
    try:
        entries = parse_header(view)
    except InvalidArgument as err:
        raise ValueError(f"{path}: {str(err).removeprefix(WEIGHTS_FILE + ': ')}") from None
    return data_start(view), entries
