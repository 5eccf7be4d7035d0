"""A sequence whose first blocks another sequence computed (a prefix cache hit: NewSequence
num_cached) gives the logits and greedy tokens of computing its whole prompt itself, for the
base model and for adapters."""

import pytest
import torch

from common.sampling import SamplingParams
from executor.runner import Row
from tests.runner_driver import BLOCK, make_runner, prompts


def decode(runner, seq_id: int, first: Row, blocks: list[int], steps: int):
    """Run `first`, then `steps` decode rows (new blocks from `blocks` as needed); the greedy
    tokens and the logits of every sample."""
    sampled, logits = runner.step_with_logits([first])
    tokens, all_logits = [sampled[0].token_id], [logits[0]]
    length = len(runner.tokens(seq_id))
    for _ in range(steps):
        new = (blocks.pop(),) if (length - 1) % BLOCK == 0 else ()
        sampled, logits = runner.step_with_logits([Row(seq_id, 1, new)])
        tokens.append(sampled[0].token_id)
        all_logits.append(logits[0])
        length += 1
    return tokens, torch.stack(all_logits)


@pytest.mark.parametrize("slot", [-1, 0, 1])
def test_a_cached_prefix_gives_the_tokens_and_logits_of_computing_it(tiny, slot):
    runner = make_runner(tiny)
    shared = prompts(1, seed=11)[0][:3] * 4  # 12 tokens: 3 full blocks of 4
    runner.add_sequence(1, shared + [5, 6], SamplingParams(), slot)
    runner.step([Row(1, 14, (0, 1, 2, 3))])  # computes the 3 shared blocks (and one more)

    prompt = shared + [7, 8, 9]
    runner.add_sequence(2, prompt, SamplingParams(), slot, num_cached=12)
    cached = decode(runner, 2, Row(2, 3, (0, 1, 2, 10)), [11, 12, 13, 14], steps=8)
    runner.add_sequence(3, prompt, SamplingParams(), slot)
    fresh = decode(runner, 3, Row(3, 15, (20, 21, 22, 23)), [24, 25, 26, 27], steps=8)
    assert cached[0] == fresh[0]
    torch.testing.assert_close(cached[1], fresh[1], atol=1e-5, rtol=0)


def test_num_cached_must_leave_a_token_to_compute(tiny):
    runner = make_runner(tiny)
    with pytest.raises(ValueError, match="num_cached 4 must be below its 4 tokens"):
        runner.add_sequence(1, [3, 4, 5, 6], SamplingParams(), -1, num_cached=4)
