"""Reading a quantized checkpoint's projections (executor/model/weights.py calls it): each
projection's tensors are gathered as the files are read, then made one weight of the serving layouts
(executor/model/quant_formats.py), cut to a tensor-parallel rank's part (executor/tp/shards.py: a
cut must keep the groups or scale blocks whole, else it is refused naming the layer) and placed on
the device. A projection its config leaves in full precision (compressed-tensors' ignore,
modules_to_not_convert, llm_int8_skip_modules) loads as a dense weight; the embeddings and
lm_head must be dense.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import torch
from safetensors import safe_open

from executor.model.config import ModelConfig
from executor.model.quant_formats import describe, read_weight
from executor.tp.shards import COLUMN_PARALLEL, Shard

# model.layers.{i}.{self_attn|mlp}.{x}_proj.{suffix}: a projection's tensor and its suffix
_PROJECTION = re.compile(r"^(model\.layers\.\d+\.(?:self_attn|mlp)\.[a-z_]+_proj)\.(.+)$")
_HEADS = ("model.embed_tokens.", "lm_head.")


class QuantizedParts:
    """Where each projection's tensors of a quantized checkpoint are, gathered file by file; then
    each projection read and made one weight at a time (a host holds one projection's tensors
    at once beside what it keeps: a rank of a tensor-parallel executor its part only)."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self._parts: dict[str, dict[str, tuple[Path, str]]] = {}  # module -> suffix -> where

    def take(self, name: str, path: Path, stored: str) -> bool:
        """Note tensor `name` (its text model's name; `stored` in file `path`) if it is part of a
        projection (but its bias); False: the caller loads it as a dense tensor."""
        if name.startswith(_HEADS) and not name.endswith(".weight"):
            raise ValueError(f"tensor {name!r}: a quantized {name.split('.')[-2]} is not served "
                             "(the embeddings and lm_head must be in full precision)")
        match = _PROJECTION.match(name)
        if match is None or match[2] == "bias":
            return False
        module, suffix = match.groups()
        if suffix in self._parts.setdefault(module, {}):
            raise ValueError(f"the checkpoint holds {name!r} twice")
        self._parts[module][suffix] = (path, stored)
        return True

    def build(self, expected_shape, shard: Shard | None, device, dtype: torch.dtype) -> dict:
        """Each gathered projection as `{module}.weight` -> its weight (a rank's part, on the
        device)."""
        out = {}
        with contextlib.ExitStack() as files:
            opened = {}
            for module in list(self._parts):
                tensors = {}
                for suffix, (path, stored) in self._parts.pop(module).items():
                    if path not in opened:
                        opened[path] = files.enter_context(safe_open(str(path), framework="pt",
                                                                     device="cpu"))
                    tensors[suffix] = opened[path].get_tensor(stored)
                name = f"{module}.weight"
                out[name] = self._one(module, tensors, expected_shape(self.config, name), shard,
                                      device, dtype)
        return out

    def _one(self, module: str, tensors: dict[str, torch.Tensor], shape: tuple[int, int],
             shard: Shard | None, device, dtype: torch.dtype):
        q = self.config.quantization
        name = f"{module}.weight"
        plain = tensors.get("weight")
        if set(tensors) == {"weight"} and plain.is_floating_point() \
                and plain.dtype != torch.float8_e4m3fn:  # (left in full precision)
            if tuple(plain.shape) != shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(plain.shape)}, expected "
                                 f"{shape} from the model config")
            return _cut(name, plain, shard).to(device=device, dtype=dtype)
        scheme = q.scheme_for(module)
        if scheme is None:
            raise ValueError(f"{module}: the quantization_config leaves it in full precision, "
                             f"but the checkpoint holds {sorted(tensors)} for it")
        label = describe(q, scheme)
        try:
            weight = read_weight(tensors, q, scheme, shape, label)
        except ValueError as err:
            raise ValueError(f"{module} ({label}): {err}") from None
        if tensors:
            raise ValueError(f"{module} ({label}): unexpected tensor {sorted(tensors)[0]!r} "
                             "beside its quantized weight")
        weight = _cut(name, weight, shard).to(device)
        weight.prepare(dtype)
        return weight


def _cut(name: str, weight, shard: Shard | None):
    """The rank's part of a projection's weight (dense or quantized)."""
    if shard is None or shard.world == 1:
        return weight
    try:
        return shard.take(name, lambda dim, a, b: weight.narrow(dim, a, b - a)
                          if isinstance(weight, torch.Tensor) else weight.narrow(dim, a, b),
                          lambda: weight)
    except ValueError as err:
        if isinstance(weight, torch.Tensor):
            raise
        module = name.removesuffix(".weight")
        kind = ("its output rows" if module.rsplit(".", 1)[-1] in COLUMN_PARALLEL
                else "its input columns")
        raise ValueError(f"tensor parallel {shard.world}: {module} ({weight.label}) cannot be "
                         f"cut into {shard.world} parts by {kind}: rank {shard.rank}'s {err} "
                         "(serve it on fewer ranks, or a checkpoint of smaller groups)") from None

