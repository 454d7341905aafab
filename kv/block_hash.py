"""Chained block hashes: a full block is named by (parent block's hash, its token ids).

Two sequences share block i's KV only if they agree on every token up to the end of
block i, which is exactly what the chain encodes. The hash is stable across processes
(blake2b, not Python's `hash`), so a router can compare hashes reported by workers.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# The parent of a sequence's first block.
ROOT_HASH = 0


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    payload = struct.pack(f"<Q{len(token_ids)}I", parent_hash, *token_ids)
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, known: list[int] | None = None
) -> list[int]:
    """Hashes of every full block of `token_ids`; extends `known` (already-hashed prefix) in place."""
    hashes = known if known is not None else []
    parent = hashes[-1] if hashes else ROOT_HASH
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
