"""Prefix-cache hits across KV groups: the longest cached prefix every group can serve.

A cached prefix of n blocks is usable when each group holds what the next query (at
position n * block_size) reads:

    full_attention   blocks 0 .. n-1, all cached (a run from the start)
    sliding_window   blocks first .. n-1 cached, first = first_needed_block(n * block_size);
                     the blocks before `first` are never read again: the table holds the
                     null block there

    full group:     [h0 h1 h2 h3 h4 h5]          run from 0: n <= 6
    sliding group:  [ .  .  .  h3 h4 h5]         window 2 blocks: n = 6 needs h4 h5 -> ok
                    [ .  .  h2  . h4  .]         n = 6 needs h4 h5 -> no; n = 5 needs h3 h4 -> no;
                                                 n = 3 needs h1 h2 -> no ... n = 0

n starts at the full groups' run and only shrinks: each sliding group gives the largest
n' <= n it serves (one right-to-left scan), until no group shrinks it (vLLM's
find_longest_cache_hit works the same way). Group g's cache keys are the block hashes
salted by g (`group_key`): a block holds one group's layers, so only that group may hit
it. Group 0 keeps the plain hashes, which the router and the KV tiers see.
"""
from __future__ import annotations

from collections.abc import Callable

from kv.block_pool import Block
from kv.kv_groups import KVGroupSpec

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def group_key(block_hash: int, group: int) -> int:
    """The prefix-cache key of a block of group `group` (group 0: the block hash itself)."""
    return block_hash if group == 0 else (block_hash ^ (group * _GOLDEN)) & _MASK64


def _full_run(keys: list[int], lookup: Callable[[int], Block | None], limit: int) -> int:
    n = 0
    while n < limit and lookup(keys[n]) is not None:
        n += 1
    return n


def _sliding_best(spec: KVGroupSpec, keys: list[int], lookup: Callable[[int], Block | None], limit: int,
                  block_size: int) -> int:
    """The largest n <= limit whose needed blocks this sliding group holds (n = 0 needs
    none). One scan right to left: `run` cached blocks in a row end at index end - 1."""
    end, run = limit, 0
    need = end - spec.first_needed_block(end * block_size, block_size)
    for i in range(limit - 1, -1, -1):
        if need <= 0:
            return end
        if lookup(keys[i]) is None:
            end, run = i, 0
            need = end - spec.first_needed_block(end * block_size, block_size)
            continue
        run += 1
        if run >= need:
            return end
    return end if need <= 0 else 0


def longest_hit(groups: tuple[KVGroupSpec, ...], keys_of: Callable[[int], list[int]],
                lookup: Callable[[int], Block | None], max_blocks: int, block_size: int,
                null_block: Block | None) -> list[list[Block]]:
    """Per group, the hit blocks of the longest prefix every group serves (the null block
    where a sliding group reads nothing). `keys_of(g)`: group g's keys, at least
    `max_blocks` of them (each asked for once)."""
    memo: dict[int, list[int]] = {}

    def keys(group: int) -> list[int]:
        if group not in memo:
            memo[group] = keys_of(group)
        return memo[group]

    n = max_blocks
    for gi, spec in enumerate(groups):
        if not spec.frees_blocks:
            n = min(n, _full_run(keys(gi), lookup, n))
    changed = True
    while changed and n > 0:
        changed = False
        for gi, spec in enumerate(groups):
            if spec.frees_blocks:
                m = _sliding_best(spec, keys(gi), lookup, n, block_size)
                if m < n:
                    n, changed = m, True
    hits: list[list[Block]] = []
    for gi, spec in enumerate(groups):
        first = spec.first_needed_block(n * block_size, block_size) if spec.frees_blocks else 0
        assert first == 0 or null_block is not None
        row = [null_block] * first + [lookup(k) for k in keys(gi)[first:n]]
        hits.append(row)  # type: ignore[arg-type]
    return hits
