"""Chained block hashes: a full block is named by (parent block's hash, its token ids).

Two sequences share block i's KV only if they agree on every token up to the end of
block i, which is exactly what the chain encodes. The hash is stable across processes
(blake2b, not Python's `hash`), so a router can compare hashes reported by workers.

    block i's hash = blake2b_64(le_u64(hash of block i-1, the root for i = 0) || le_u32 x block_size tokens)

The root is ROOT_HASH, or `chain_root(extra_keys)` when the KV of the same tokens differs
by something other than the tokens (a LoRA adapter changes every layer's K and V): two
chains with different roots share no block.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# The parent of a sequence's first block.
ROOT_HASH = 0


def chain_root(extra_keys: Sequence[str]) -> int:
    """The root of a chain whose KV also depends on `extra_keys` (e.g. ("lora:<name>",));
    no keys: ROOT_HASH, the plain chain."""
    if not extra_keys:
        return ROOT_HASH
    payload = "\x00".join(extra_keys).encode()
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8, person=b"kvs-root").digest(), "little")


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    payload = struct.pack(f"<Q{len(token_ids)}I", parent_hash, *token_ids)
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, known: list[int] | None = None, root: int = ROOT_HASH
) -> list[int]:
    """Hashes of every full block of `token_ids`, chained from `root`; extends `known`
    (already-hashed prefix of the same chain) in place.

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
