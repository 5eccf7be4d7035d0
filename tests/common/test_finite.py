"""The torch-free finiteness check (common/peft/finite.py) against torch.isfinite, per float
format: NaN and both infinities are found and counted in the tensor that holds them; the largest
finite value, subnormals and -0 are not; tensors of mixed formats are each read in their own."""

import json
import math
import time

import pytest
import safetensors.torch
import torch

from common.errors import InvalidArgument
from common.peft.config import parse_config
from common.peft.finite import check_finite
from common.peft.layout import plan_adapter
from common.peft.safetensors_header import parse_header
from tests.store.helpers import lora_config, lora_tensors

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
V_B1 = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"


def layout_of(data: bytes):
    return plan_adapter(parse_config(lora_config()), parse_header(data))


def edge_values(dtype: torch.dtype) -> torch.Tensor:
    info = torch.finfo(dtype)
    return torch.tensor([info.max, -info.max, info.tiny, info.tiny / 4, -0.0, 0.0, 1.0],
                        dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_finite_weights_pass_whatever_their_edge_values(dtype):
    tensors = {k: v.to(dtype) for k, v in lora_tensors().items()}
    tensors[V_B1].view(-1)[:7] = edge_values(dtype)
    assert bool(torch.isfinite(tensors[V_B1]).all())
    data = safetensors.torch.save(tensors)
    check_finite(data, layout_of(data))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_each_non_finite_value_is_counted_in_its_tensor(dtype, bad):
    tensors = {k: v.to(dtype) for k, v in lora_tensors().items()}
    tensors[V_B1][3, 2] = bad
    tensors[V_B1][0, 0] = bad
    data = safetensors.torch.save(tensors)
    with pytest.raises(InvalidArgument, match=rf"'{V_B1}' has 2 NaN or infinite values"):
        check_finite(data, layout_of(data))


def test_mixed_dtypes_are_read_tensor_by_tensor_each_in_its_own_format():
    tensors = lora_tensors()
    tensors[sorted(tensors)[0]] = tensors[sorted(tensors)[0]].bfloat16()
    data = safetensors.torch.save(tensors)
    check_finite(data, layout_of(data))  # all finite, in two formats
    tensors[V_B1][1, 1] = math.nan
    data = safetensors.torch.save(tensors)
    with pytest.raises(InvalidArgument, match=rf"'{V_B1}' has 1 NaN or infinite values"):
        check_finite(data, layout_of(data))



def safetensors_file(entries: dict, data: bytes) -> bytes:
    header = json.dumps(entries).encode()
    return len(header).to_bytes(8, "little") + header + data


def test_a_header_with_thousands_of_huge_dimensions_is_refused_at_once():
    """Their product alone took minutes (a 3 MB push froze a store's event loop): refused before
    it is computed, with a message that names the shape's size, not the shape."""
    huge = {"w": {"dtype": "F32", "shape": [2**62] * 100_000, "data_offsets": [0, 4]}}
    start = time.process_time()
    with pytest.raises(InvalidArgument, match="100000 dimensions"):
        parse_header(safetensors_file(huge, b"\0" * 4))
    assert time.process_time() - start < 5
    long = {"w": {"dtype": "F32", "shape": [9, 1], "data_offsets": [0, 4]}}
    with pytest.raises(InvalidArgument, match="longer than the file"):
        parse_header(safetensors_file(long, b"\0" * 4))
