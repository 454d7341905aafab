"""Chained block hashes: a full block is named by (parent block's hash, its token ids).

Two sequences share block i's KV only if they agree on every token up to the end of
block i, which is exactly what the chain encodes. The hash is stable across processes
(blake2b, not Python's `hash`), so a router can compare hashes reported by workers.

    block i's hash = blake2b_64(le_u64(hash of block i-1, root for i = 0) || le_u32 x block_size tokens)
    root = ROOT_HASH, or root_hash(extra keys) for a request that has any

Extra keys partition the cache: a request's blocks are shared only with requests that
agree on its extra keys as well as its tokens (a tenant's cache salt, and whatever else
makes equal tokens different KV). They seed only the root, so the chain stays one hash
per block, and a router that hashes a prompt with the same root finds where it lives.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# The parent of a sequence's first block when the request has no extra keys.
ROOT_HASH = 0


def root_hash(extra_keys: Sequence[str]) -> int:
    """The parent of the first block of a request with these extra keys (ROOT_HASH for
    none). Each key is length-framed, so no two different key lists give one payload."""
    if not extra_keys:
        return ROOT_HASH
    payload = bytearray(b"kvserve-root")
    for key in extra_keys:
        data = key.encode("utf-8", "surrogatepass")
        payload += struct.pack("<I", len(data)) + data
    return int.from_bytes(hashlib.blake2b(bytes(payload), digest_size=8).digest(), "little")


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    payload = struct.pack(f"<Q{len(token_ids)}I", parent_hash, *token_ids)
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, known: list[int] | None = None, root: int = ROOT_HASH
) -> list[int]:
    """Hashes of every full block of `token_ids`; extends `known` (already-hashed prefix) in place.
    `root`: the chain's root (root_hash of the request's extra keys).

    The same chain as folding `hash_block`, computed faster: the new tokens are packed
    once and each digest (the parent's little-endian bytes) feeds the next block as is:
    routers and engines hash every prompt, so this is on every request's path."""
    hashes = known if known is not None else []
    start = len(hashes) * block_size
    num_new = (len(token_ids) - start) // block_size
    if num_new <= 0:
        return hashes
    data = struct.pack(f"<{num_new * block_size}I", *token_ids[start : start + num_new * block_size])
    stride = 4 * block_size
    blake2b, from_bytes = hashlib.blake2b, int.from_bytes
    parent = (hashes[-1] if hashes else root).to_bytes(8, "little")
    for offset in range(0, num_new * stride, stride):
        parent = blake2b(parent + data[offset : offset + stride], digest_size=8).digest()
        hashes.append(from_bytes(parent, "little"))
    return hashes
