"""The base model fingerprint (common/base_fingerprint.py): copies of one model agree, whatever
their folder, name or sharding; a changed sampled weight byte, shape or config changes it; what
it reads is bounded by the number of tensors, not their size."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from common import base_fingerprint as bf
from common.errors import InvalidArgument
from protos import common_pb2

CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 4096,
          "_name_or_path": "/home/someone/models/tiny", "transformers_version": "4.56.0",
          "torch_dtype": "float32"}
BIG = "model.embed_tokens.weight"  # [4096, 64] F32: 1 MiB, much larger than its three samples


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {BIG: torch.randn(4096, 64, generator=gen), "model.norm.weight": torch.ones(64)}
    for i in range(2):
        out[f"model.layers.{i}.self_attn.q_proj.weight"] = torch.randn(64, 64, generator=gen)
    return out


def write_model(folder: Path, weights: dict[str, torch.Tensor] | None = None,
                config: dict | None = None, shards: int = 1) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config or CONFIG, indent=2))
    weights = tensors() if weights is None else weights
    if shards == 1:
        save_file(weights, folder / "model.safetensors")
        return folder
    names = sorted(weights)
    weight_map = {}
    for i in range(shards):
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: weights[n] for n in names[i::shards]}
        save_file(part, folder / shard)
        weight_map.update(dict.fromkeys(part, shard))
    (folder / bf.INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    return folder


def data_offset(path: Path, name: str) -> int:
    """Where tensor `name`'s bytes start in the file."""
    raw = path.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    return 8 + header_len + json.loads(raw[8:8 + header_len])[name]["data_offsets"][0]


def flip_byte(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.fixture
def model(tmp_path) -> Path:
    return write_model(tmp_path / "tiny")


def test_copies_agree_whatever_their_folder_name_config_noise_or_sharding(model, tmp_path):
    fingerprint = bf.base_fingerprint(model)
    assert fingerprint is not None and len(fingerprint) == 64
    copy = tmp_path / "elsewhere" / "Some-Other-Name"
    shutil.copytree(model, copy)
    assert bf.base_fingerprint(copy) == fingerprint
    # Saved by another transformers, from another path, in another dtype field, indented anew.
    noisy = {**CONFIG, "_name_or_path": "org/tiny", "transformers_version": "5.0.0",
             "dtype": "float32"}
    del noisy["torch_dtype"]
    (copy / "config.json").write_text(json.dumps(noisy))
    assert bf.base_fingerprint(copy) == fingerprint
    sharded = write_model(tmp_path / "sharded", shards=2)
    assert bf.base_fingerprint(sharded) == fingerprint


def test_a_changed_sampled_byte_changes_it(model):
    fingerprint = bf.base_fingerprint(model)
    path = model / "model.safetensors"
    size = 4096 * 64 * 4
    start = data_offset(path, BIG)
    for inside in (0, size // 2, size - 1):  # in the start, middle and end samples
        flip_byte(path, start + inside)
        assert bf.base_fingerprint(model) != fingerprint, inside
        flip_byte(path, start + inside)
    assert bf.base_fingerprint(model) == fingerprint
    # A small tensor is hashed whole: any byte of it counts.
    flip_byte(path, data_offset(path, "model.norm.weight") + 101)
    assert bf.base_fingerprint(model) != fingerprint


def test_a_byte_no_sample_covers_is_not_seen(model):
    """The documented price of reading ~12 KiB per tensor: an edit between samples."""
    fingerprint = bf.base_fingerprint(model)
    path = model / "model.safetensors"
    flip_byte(path, data_offset(path, BIG) + 100 * 1024)
    assert bf.base_fingerprint(model) == fingerprint


def test_another_fine_tune_shape_or_config_differs(model, tmp_path):
    fingerprint = bf.base_fingerprint(model)
    tuned = tensors()
    tuned["model.layers.0.self_attn.q_proj.weight"] += 1e-3  # every element of one tensor
    assert bf.base_fingerprint(write_model(tmp_path / "tuned", tuned)) != fingerprint
    wider = {**tensors(), "model.norm.weight": torch.ones(65)}
    assert bf.base_fingerprint(write_model(tmp_path / "wider", wider)) != fingerprint
    as_bf16 = {name: t.to(torch.bfloat16) for name, t in tensors().items()}
    assert bf.base_fingerprint(write_model(tmp_path / "bf16", as_bf16)) != fingerprint
    other_rope = {**CONFIG, "rope_theta": 500000.0}
    assert bf.base_fingerprint(write_model(tmp_path / "rope", config=other_rope)) != fingerprint


def test_folders_without_weights_or_config(tmp_path, model):
    (tmp_path / "config-only").mkdir()
    (tmp_path / "config-only" / "config.json").write_text(json.dumps(CONFIG))
    assert bf.base_fingerprint(tmp_path / "config-only") is None
    with pytest.raises(FileNotFoundError):
        bf.base_fingerprint(tmp_path)
    path = model / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ValueError, match="model.safetensors: .*data"):
        bf.base_fingerprint(model)


def test_what_it_reads_is_bounded_per_tensor():
    s = bf.SAMPLE_BYTES
    assert bf.sample_ranges(10, 10 + 3 * s) == [(10, 10 + 3 * s)]
    big = bf.sample_ranges(0, 1 << 34)  # a 16 GiB tensor: three samples
    assert [end - begin for begin, end in big] == [s, s, s]
    assert big[0][0] == 0 and big[-1][1] == 1 << 34


def test_check_fingerprint_and_is_same_base():
    bf.check_fingerprint("", "f")
    bf.check_fingerprint("ab" * 32, "f")
    for bad in ("AB" * 32, "ab" * 31, "x" * 64):
        with pytest.raises(InvalidArgument, match="f must be 64"):
            bf.check_fingerprint(bad, "f")
    fp = "ab" * 32
    adapter = common_pb2.AdapterInfo(base_model="org/tiny", base_fingerprint=fp)
    assert bf.is_same_base(adapter, "org/tiny", "")
    assert bf.is_same_base(adapter, "tiny-folder", fp)
    assert not bf.is_same_base(adapter, "tiny-folder", "cd" * 32)
    assert not bf.is_same_base(common_pb2.AdapterInfo(base_model="x"), "tiny-folder", "")
