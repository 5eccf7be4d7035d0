"""A longrope model's switch (Phi-3-128k, Phi-3.5: executor/model/rope.py), as the scheduler plans
it.

transformers' generate() computes a sequence of n tokens with the short RoPE factors while n is at
most the switch (original_max_position_embeddings), and with the long ones, at every position, once
n is past it: when a sequence outgrows the switch, its cached KV is dropped and computed again.
An executor computes a sequence it is sent with more tokens than the switch with the long factors,
any other one with the short factors and never past the switch (executor.proto:
InfoResponse.longrope_switch_len, which ExecutorState.rope_switch_len keeps). So here:

  - a run that starts with at most `switch` tokens ends once it has switch + 1 (`run_end`, its
    Sequence.max_tokens): its last row computes position switch - 1, whose sample is token
    number switch + 1. Unless its request finished on that token, the request is recomputed
    (core.py): it goes back to the front of its queue, as after a preemption, and runs again
    from all its tokens, long. (Pipelined steps change nothing: no row computes past a run's
    end, and the recompute waits for the sample that ends it.)
  - a block's KV below the switch differs between the two kinds, so a long run's blocks are
    named under a cache key of its own (`enter_long`): the prefix cache never gives a block of
    one kind to a run of the other. A request's key turns long at its first long admission and
    stays so (its tokens only grow).

Running example (switch 32): a 20-token prompt runs short until it has 33 tokens, then runs again
from those 33, long; a 40-token prompt runs long from the start. The short run's blocks are cached
under the request's key, the long runs' under its long key: a 20-token prompt asked again reuses
the first, a 40-token one with the same start reuses neither.
"""

from __future__ import annotations

import hashlib

from scheduler.request import Request


def is_long(num_tokens: int, switch: int) -> bool:
    """A run that starts with `num_tokens` tokens computes with the long factors."""
    return 0 < switch < num_tokens


def run_end(req: Request, num_tokens: int, switch: int) -> int:
    """The tokens a run of `req` that starts with `num_tokens` ends at: its request's end, or,
    for a short run, the first token past the switch."""
    if switch and num_tokens <= switch:
        return min(req.max_tokens, switch + 1)
    return req.max_tokens


def enter_long(req: Request) -> None:
    """req is admitted for a long run: from now on its blocks are named under its long key (a
    new root for its hash chain), never matching a short run's."""
    if req.runs_long:
        return
    req.runs_long = True
    if req.cache_key:
        req.cache_key = _long(req.cache_key)
        if req.base_cache_key:
            req.base_cache_key = _long(req.base_cache_key)
        req.block_hashes.clear()  # (chained from the short key)


def _long(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=16, person=b"loraplex-long").digest()
