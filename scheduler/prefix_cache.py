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
Blocks are never shared between adapters: LoRA changes K and V at every layer.

A block's hash is BLAKE2b-128 of (the previous block's hash, the key, its token ids): equal
hashes mean equal prefixes under the same key, with a collision chance no adversary can steer
(unlike Python's hash of a tuple of ints).
"""

import hashlib
from array import array

from common.adapter_ref import AdapterRef

SCOPES = ("tenant", "pool", "off")


def cache_key(scope: str, tenant: str, adapter: AdapterRef | None, salt: str) -> bytes:
    """Who may reuse a request's blocks; the root of its hash chain."""
    who = tenant if scope == "tenant" else ""
    parts = (who, str(adapter) if adapter else "", salt)
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=16,
                           person=b"loraplex-kv").digest()


def extend_hashes(hashes: list[bytes], key: bytes, token_ids: list[int], block_size: int) -> None:
    """Append to `hashes` the hash of every full block of `token_ids` it lacks."""
    previous = hashes[-1] if hashes else key
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        h = hashlib.blake2b(previous, digest_size=16)
        h.update(key)
        h.update(array("I", token_ids[start:start + block_size]).tobytes())
        previous = h.digest()
        hashes.append(previous)
