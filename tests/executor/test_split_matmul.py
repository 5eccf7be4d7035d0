"""gate|up in halves on CPU (executor/model/split_matmul.py): the halves give the fused matmul's
bits, so the choice the executor makes at start by timing never changes a logit."""

import pytest
import torch
import torch.nn.functional as F

from executor.model.split_matmul import faster_in_halves, in_halves
from tests.runner_driver import make_runner, prompts, run


@pytest.mark.parametrize("rows, width, hidden", [(1, 688, 256), (16, 2816, 1024), (37, 96, 48)])
def test_the_halves_are_the_fused_matmul_bit_for_bit(rows, width, hidden):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(2 * width, hidden, generator=g)
    x = torch.randn(rows, hidden, generator=g)
    assert torch.equal(in_halves(x, weight), F.linear(x, weight))


def test_a_probe_whose_results_differ_keeps_the_fused_matmul():
    weight = torch.randn(64, 32)
    weight[0, 0] = float("nan")  # (NaN equals nothing: the halves cannot be shown equal)
    assert not faster_in_halves(weight)


def test_a_runner_in_halves_serves_the_fused_runner_s_logits(tiny):
    """Prefill chunks and decode steps over two adapters and the base model: every token and
    every logit the same either way (LoRA adds to the fused output both ways)."""
    fused, halves = make_runner(tiny), make_runner(tiny)
    fused.model.gate_up_in_halves, halves.model.gate_up_in_halves = False, True
    requests = {i: (p, slot) for i, (p, slot) in enumerate(zip(prompts(5, seed=3),
                                                               [0, -1, 1, 0, 1]))}
    want = run(fused, requests, num_tokens=4, chunk=8)
    got = run(halves, requests, num_tokens=4, chunk=8)
    for seq_id in requests:
        assert got[seq_id][0] == want[seq_id][0]
        assert torch.equal(got[seq_id][1], want[seq_id][1])
