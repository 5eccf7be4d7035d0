"""The torch-free finiteness check (common/peft/finite.py) against torch.isfinite, per float
format: NaN and both infinities are found and counted in the tensor that holds them; the largest
finite value, subnormals and -0 are not; tensors of mixed formats are each read in their own."""

import math

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
