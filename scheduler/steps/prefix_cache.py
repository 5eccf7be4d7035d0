"""Names of cached KV blocks: who may share them (the cache key) and the chained block hash.

Scope (the pool's `prefix_cache` limit):
  "tenant" (default)  a block is reused only by requests of the tenant that computed it, with the
                      same adapter version (or both on the base model) and the same cache_salt.
                      Whether a prefix is cached shows in time to first token; keeping each
                      tenant's cache its own means no tenant can learn what another one sent.
  "pool"              tenants share blocks of the same adapter version (or the base model): more
                      hits for a public adapter and common system prompts, at the price of that
                      timing side channel. A request's cache_salt still keeps its blocks apart.
  "off"               nothing is cached.
Blocks are never shared between adapters: LoRA changes K and V at every layer. An activated
LoRA (common/alora.py) changes none before its activation point: its blocks that lie wholly before
it are named as the base model's blocks of the same tokens (its base key), shared with base
requests and other activated LoRAs; from the block holding the activation point on, under its
adapter's key. The chain runs through both: a block's hash covers every block before it.

A block's hash is BLAKE2b-128 of (the previous block's hash, the key, its token ids): equal
hashes mean equal prefixes under the same key, with a collision chance no adversary can steer
(unlike Python's hash of a tuple of ints).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from typing import TYPE_CHECKING

from common.adapter_ref import AdapterRef

if TYPE_CHECKING:  # (limits.py imports this module)
    from scheduler.request import Request
    from scheduler.steps.block_manager import BlockManager
    from scheduler.steps.sequence import Sequence

SCOPES = ("tenant", "pool", "off")


def cache_key(scope: str, tenant: str, adapter: AdapterRef | None, salt: str) -> bytes:
    """Who may reuse a request's blocks; the root of its hash chain."""
    who = tenant if scope == "tenant" else ""
    parts = (who, str(adapter) if adapter else "", salt)
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=16,
                           person=b"loraplex-kv").digest()


def name_blocks(req: Request, scope: str) -> None:
    """Give a request just submitted the key its blocks are named under (`scope`: the pool's
    prefix_cache; "off": none, nothing cached), and an activated LoRA's the base key of its
    blocks before its activation point."""
    if scope != "off":
        ask = req.ask
        req.cache_key = cache_key(scope, ask.tenant, ask.adapter, ask.cache_salt)
        if ask.lora_from:
            req.base_cache_key = cache_key(scope, ask.tenant, None, ask.cache_salt)


def extend_hashes(hashes: list[bytes], key: bytes, token_ids: list[int], block_size: int,
                  base_key: bytes = b"", lora_from: int = 0) -> None:
    """Append to `hashes` the hash of every full block of `token_ids` it lacks; a block that
    ends at or before `lora_from` under `base_key` (an activated LoRA's), if given."""
    previous = hashes[-1] if hashes else (base_key if base_key and lora_from >= block_size
                                          else key)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        block_key = base_key if base_key and start + block_size <= lora_from else key
        h = hashlib.blake2b(previous, digest_size=16)
        h.update(block_key)
        h.update(array("I", token_ids[start:start + block_size]).tobytes())
        previous = h.digest()
        hashes.append(previous)


def _extend(req: Request, token_ids: list[int], block_size: int) -> list[bytes]:
    """req's chain of block hashes at `block_size`, extended over `token_ids`."""
    hashes = req.block_hashes.setdefault(block_size, [])
    extend_hashes(hashes, req.cache_key, token_ids, block_size, req.base_cache_key,
                  req.ask.lora_from)
    return hashes


def cached_prefix(blocks: BlockManager, req: Request, tokens: list[int]) -> list[int]:
    """The cached blocks that hold the longest prefix of `tokens` (req's tokens), none when
    caching is off; the chain of hashes is kept on the request. The last token is always left to
    compute: its logits make the next sample. A request that needs its prompt's logprobs takes
    none: they come from computing the whole prompt."""
    if not req.cache_key or req.needs_prompt_logprobs:
        return []
    bs = blocks.block_size
    return blocks.match(_extend(req, tokens, bs)[:(len(tokens) - 1) // bs])


def publish(blocks: BlockManager, seq: Sequence) -> None:
    """Cache seq's blocks that are now full, computed (in the steps sent: an executor runs its
    steps in order, so a later step may read them) and named (their tokens known)."""
    req, bs = seq.request, blocks.block_size
    if not req.cache_key:
        seq.publish_at = sys.maxsize  # (never again)
    else:
        full = min(seq.num_computed, len(seq.token_ids)) // bs
        if full > seq.num_published:
            hashes = _extend(req, seq.token_ids, bs)
            base_blocks = req.ask.lora_from // bs if req.base_cache_key else 0
            for index in range(seq.num_published, full):
                # (an adapter's blocks go with it when it is evicted; the base model's stay)
                owner = req.ask.adapter if index >= base_blocks else None
                blocks.publish(seq.seq_id, index, hashes[index], owner)
            seq.num_published = full
        seq.publish_at = (seq.num_published + 1) * bs
