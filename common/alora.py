"""Activated LoRA (PEFT's `alora_invocation_tokens`): an adapter that applies only from its
invocation on. Its activation point in a sequence is where the last occurrence of the invocation
token sequence in the prompt starts, as PEFT's calculate_alora_offsets finds it; the adapter's LoRA
applies to every position from there (generated tokens included), and none before it, so those
positions keep exactly the base model's K and V. No occurrence: the adapter never applies (PEFT's
offset None: the base model's output).

Running example, invocation [7, 8]: prompt [1, 7, 8, 5, 7, 8, 9] -> 4 (positions 4.. adapted);
[7, 8, 1] -> 0 (every position); [7, 1, 8] -> None.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_INVOCATION_TOKENS = 256  # an invocation is a few tokens ("<|assistant|>safety:")


def activation_start(token_ids: Sequence[int], invocation: Sequence[int]) -> int | None:
    """Where the last occurrence of `invocation` in `token_ids` starts; None when it does not
    occur (or `invocation` is empty)."""
    n = len(invocation)
    if n == 0 or n > len(token_ids):
        return None
    first, rest = invocation[0], list(invocation[1:])
    for start in range(len(token_ids) - n, -1, -1):
        if token_ids[start] == first and list(token_ids[start + 1:start + n]) == rest:
            return start
    return None
