"""executor/model/quant.py's weights on their own: a dense weight's projection is F.linear bit for
bit; dequantize + matmul a chunk of rows at a time gives the whole product; a tensor-parallel cut
(narrow) and a fused join give what cutting and joining the dequantized weights give; parts that
cannot share a layout stack; torch's CPU int8 / int4 kernels take bf16 activations where the
layout fits (bf16 tolerance: one rounding of the output, 1.6e-2 of its max)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from executor.model import quant
from executor.model.quant import Fp8Weight, IntWeight, StackedWeight, join, project
from kernels.quant_gemm_ref import pack_int4


def int_weight(out_f=48, in_f=128, bits=4, group=32, zeros=True, g_idx=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    groups = in_f // group if group else 1
    codes = (pack_int4(torch.randint(0, 16, (out_f, in_f), generator=g)) if bits == 4
             else torch.randint(-128, 128, (out_f, in_f), generator=g, dtype=torch.int8))
    return IntWeight(codes, torch.rand(out_f, groups, generator=g) * 0.02 + 1e-3,
                     torch.randint(-2, 3, (out_f, groups), generator=g, dtype=torch.int8)
                     if zeros else None,
                     (torch.randperm(in_f, generator=g) % groups).to(torch.int32) if g_idx
                     else None, None, bits=bits, group_size=group, label=f"test int{bits}")


def test_a_dense_projection_is_f_linear_bit_for_bit():
    x, w, b = torch.randn(5, 64), torch.randn(32, 64), torch.randn(32)
    assert torch.equal(project(x, w, b), F.linear(x, w, b))


def test_chunks_of_rows_give_the_whole_product(monkeypatch):
    w = int_weight(out_f=50)
    x = torch.randn(7, 128)
    whole = F.linear(x, w.dequantize())
    monkeypatch.setattr(quant, "CHUNK_ELEMENTS", 128 * 8)  # 8 rows at a time: 7 chunks
    torch.testing.assert_close(w.linear(x), whole, atol=1e-6, rtol=0)


@pytest.mark.parametrize("g_idx", [False, True], ids=["groups", "act-order"])
def test_a_cut_and_a_join_are_those_of_the_dequantized_weight(g_idx):
    w = int_weight(g_idx=g_idx)
    full = w.dequantize()
    assert torch.equal(w.narrow(0, 8, 40).dequantize(), full[8:40])
    assert torch.equal(w.narrow(1, 32, 96).dequantize(), full[:, 32:96])
    joined = join([w.narrow(0, 0, 16), w.narrow(0, 16, 48)])
    assert isinstance(joined, IntWeight) and torch.equal(joined.dequantize(), full)
    if not g_idx:
        with pytest.raises(ValueError, match=r"columns \[16, 64\) split a group of 32"):
            w.narrow(1, 16, 64)


def test_parts_that_cannot_share_a_layout_stack():
    a, b = int_weight(g_idx=True, seed=1), int_weight(g_idx=True, seed=2)  # (other g_idx)
    dense = torch.randn(16, 128)
    stacked = join([a, b, dense])
    assert isinstance(stacked, StackedWeight) and stacked.shape == (112, 128)
    x = torch.randn(3, 128)
    want = F.linear(x, torch.cat([a.dequantize(), b.dequantize(), dense]))
    torch.testing.assert_close(project(x, stacked), want, atol=1e-5, rtol=0)
    assert stacked.num_bytes() == a.num_bytes() + b.num_bytes() + dense.numel() * 4


def test_fp8_blocks_are_cut_whole_or_refused():
    g = torch.Generator().manual_seed(0)
    w = Fp8Weight((torch.randn(64, 96, generator=g) * 50).to(torch.float8_e4m3fn),
                  torch.rand(4, 6, generator=g), (16, 16), label="test fp8")
    full = w.dequantize()
    assert torch.equal(w.narrow(0, 16, 48).dequantize(), full[16:48])
    assert torch.equal(w.narrow(1, 32, 96).dequantize(), full[:, 32:])
    with pytest.raises(ValueError, match=r"columns \[8, 96\) split a scale block of 16"):
        w.narrow(1, 8, 96)


@pytest.mark.parametrize("bits", [8, 4])
def test_torch_cpu_kernels_take_bf16_where_the_layout_fits(bits):
    w = int_weight(bits=bits, group=0 if bits == 8 else 32, zeros=bits == 4)
    x = torch.randn(6, 128).to(torch.bfloat16)
    want = F.linear(x.float(), w.dequantize(torch.bfloat16).float())
    w.prepare(torch.bfloat16)
    assert w._cpu[1] == f"int{bits}"  # (the path that runs)
    got = w.linear(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0, atol=1.6e-2 * float(want.abs().max()))
    torch.testing.assert_close(w.linear(x.float()), F.linear(x.float(), w.dequantize()),
                               atol=1e-5, rtol=0)  # (fp32 activations: dequantize + matmul)


def test_layouts_torch_kernels_do_not_take_dequantize():
    for w in (int_weight(bits=8, group=32), int_weight(g_idx=True)):  # (groups of int8; g_idx)
        w.prepare(torch.bfloat16)
        assert w._cpu is None
