"""Session KV retention (kv/retention.py) on a real KVCacheManager: exact block ids of
what is retained, evicted under pressure (and recorded to move down a tier), expired by
TTL, displaced by the share bound, and hit by the session's next turn."""
from __future__ import annotations

import pytest

from kv.cache_manager import KVCacheManager

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def manager(num_blocks: int = 8, ttl_s: float = 60.0, share: float = 0.5,
            retain: bool = True) -> tuple[KVCacheManager, Clock]:
    kv = KVCacheManager(num_blocks, BS)
    clock = Clock()
    if retain:
        kv.enable_retention(ttl_s, share, clock)
    return kv, clock


def run_turn(kv: KVCacheManager, request_id: str, tokens: list[int], session: str | None = None) -> list[int]:
    """Admit `tokens` (with its cache hits), compute them all, finish it; returns its table."""
    hits = kv.get_computed_blocks(request_id, tokens)
    assert kv.can_allocate(request_id, len(tokens), hits)
    table = list(kv.allocate(request_id, len(tokens), hits))
    kv.cache_computed(request_id, tokens, len(tokens))
    kv.free(request_id, session_id=session)
    return table


def prompt(start: int, n: int = 9) -> list[int]:
    return list(range(start, start + n))


def test_finished_session_turn_outlives_later_lru_blocks() -> None:
    for retain in (False, True):
        kv, _ = manager(retain=retain)
        assert run_turn(kv, "a", prompt(100), session="s") == [0, 1, 2]  # blocks 0, 1 cached
        assert run_turn(kv, "d", prompt(200)) == [3, 4, 5]  # no session: 3, 4 cached
        table = kv.allocate("b", 6 * BS)  # a cold request takes six blocks
        if retain:  # the session's blocks are evicted last: the later cold blocks went
            assert table == [6, 7, 2, 5, 4, 3]
            assert kv.retention.queue.block_ids() == [1, 0]
            assert [b.block_id for b in kv.get_computed_blocks("a2", prompt(100, 13))] == [0, 1]
        else:  # plain LRU: the session's older blocks went first
            assert table == [6, 7, 2, 1, 0, 5]
            assert kv.get_computed_blocks("a2", prompt(100, 13)) == []


def test_pressure_evicts_retained_tail_first_and_records_the_move_down() -> None:
    kv, _ = manager()
    kv.pool.evicted = []  # as with KV tiers: evicted cached blocks are copied down first
    run_turn(kv, "a", prompt(100), session="s")
    kv.get_computed_blocks("probe", prompt(100))  # hashes the prompt (no reference taken)
    hashes = kv.block_hashes("probe")
    assert kv.num_free_blocks == 8  # retained blocks are free: no headroom lost
    assert kv.can_allocate("b", 7 * BS)
    assert kv.allocate("b", 7 * BS) == [3, 4, 5, 6, 7, 2, 1]  # then the retained tail block
    assert kv.pool.evicted == [(hashes[1], 1)]
    assert kv.retention.moved_down == [hashes[1]]  # for the host tier to keep apart
    assert kv.retention.retained_block_ids("s") == [0]
    assert kv.retention.num_pressure_evictions == 1
    assert kv.allocate("b", 8 * BS) == [3, 4, 5, 6, 7, 2, 1, 0]  # admission never starves
    assert kv.pool.evicted == [(hashes[1], 1), (hashes[0], 0)]
    assert kv.retention.num_tagged == 0 and kv.num_free_blocks == 0


def test_ttl_releases_blocks_to_the_front_of_the_lru() -> None:
    kv, clock = manager(ttl_s=60.0)
    run_turn(kv, "a", prompt(100), session="s")
    run_turn(kv, "d", prompt(200))
    clock.now = 59.9
    kv.expire_retention()
    assert kv.retention.retained_block_ids("s") == [0, 1]
    clock.now = 60.0
    kv.expire_retention()
    assert kv.retention.sessions() == [] and kv.retention.num_tagged == 0
    assert kv.retention.queue.num_free == 0
    # Past its TTL the session's blocks are evicted first among cached ones, tail first.
    assert kv.pool.free_queue.block_ids() == [6, 7, 1, 0, 2, 5, 4, 3]
    assert kv.retention.num_expired_blocks == 2


def test_share_bound_displaces_the_oldest_session() -> None:
    kv, _ = manager(num_blocks=8, share=0.25)  # at most 2 blocks retained
    assert kv.retention.max_blocks == 2
    run_turn(kv, "a", prompt(100), session="s")
    assert kv.retention.retained_block_ids("s") == [0, 1]
    run_turn(kv, "t1", prompt(300), session="t")  # blocks 3, 4 (5 partial)
    assert kv.retention.sessions() == ["t"]
    assert kv.retention.retained_block_ids("t") == [3, 4]
    assert kv.retention.queue.block_ids() == [4, 3]
    assert kv.retention.num_displaced_blocks == 2
    # Displaced, s's blocks are ordinary cached blocks at the LRU's tail (used lately).
    assert kv.pool.free_queue.block_ids() == [6, 7, 2, 0, 1, 5]
    # A turn longer than the bound keeps its leading blocks only.
    run_turn(kv, "u1", prompt(400, 17), session="u")
    assert kv.retention.sessions() == ["u"]
    assert len(kv.retention.retained_block_ids("u")) == 2
    assert kv.retention.num_tagged == 2


def test_next_turn_hits_and_replaces_the_retained_turn() -> None:
    kv, _ = manager()
    run_turn(kv, "a1", prompt(100), session="s")
    turn2 = prompt(100, 17)  # the history grew: the first 2 blocks are the first turn's
    hits = kv.get_computed_blocks("a2", turn2)
    assert [b.block_id for b in hits] == [0, 1]
    table = kv.allocate("a2", len(turn2), hits)
    assert table[:2] == [0, 1]
    assert kv.retention.queue.num_free == 0  # hit blocks are referenced now
    kv.cache_computed("a2", turn2, len(turn2))
    kv.free("a2", session_id="s")
    assert kv.retention.retained_block_ids("s") == table[:4]
    assert kv.retention.num_tagged == 4 and kv.retention.num_sessions == 1
    assert kv.stats().retained_blocks == 4
    assert kv.cached_block_hashes(2) == [kv.pool.blocks[i].block_hash for i in table[:2]]


def test_shared_prefix_block_moves_to_the_newer_session() -> None:
    kv, clock = manager(ttl_s=10.0)
    run_turn(kv, "a", prompt(100), session="s")
    clock.now = 5.0
    run_turn(kv, "b", prompt(100), session="t")  # same prompt: hits 0, 1 and retains them
    assert kv.retention.retained_block_ids("s") == []
    assert kv.retention.retained_block_ids("t") == [0, 1]
    assert kv.retention.num_tagged == 2
    clock.now = 10.0
    kv.expire_retention()  # s's TTL is over, but t keeps the blocks
    assert kv.retention.retained_block_ids("t") == [0, 1]
    clock.now = 15.0
    kv.expire_retention()
    assert kv.retention.num_tagged == 0


def test_reset_prefix_cache_releases_every_session() -> None:
    kv, _ = manager()
    run_turn(kv, "a", prompt(100), session="s")
    kv.pool.reset_prefix_cache()
    assert kv.retention.num_tagged == 0 and kv.pool.cached == {}
    assert kv.num_free_blocks == 8


def test_bad_settings_refused() -> None:
    kv = KVCacheManager(8, BS)
    with pytest.raises(ValueError):
        kv.enable_retention(0.0, 0.5, Clock())
    with pytest.raises(ValueError):
        kv.enable_retention(10.0, 1.5, Clock())
    with pytest.raises(ValueError):
        KVCacheManager(8, BS, enable_prefix_caching=False).enable_retention(10.0, 0.5, Clock())


def test_expired_blocks_are_dropped_not_moved_down_unless_hit_again() -> None:
    kv, clock = manager(ttl_s=60.0)
    kv.pool.evicted = []  # as with KV tiers
    run_turn(kv, "a", prompt(100), session="s")  # retains 0, 1
    run_turn(kv, "d", prompt(200))  # 3, 4 cached, no session
    kv.get_computed_blocks("probe", prompt(200))
    cold = kv.block_hashes("probe")
    clock.now = 60.0
    kv.expire_retention()
    assert kv.retention.expired == {0, 1}
    # The expired session's blocks go first and are dropped; d's cached blocks move down.
    assert kv.allocate("b", 8 * BS) == [6, 7, 1, 0, 2, 5, 4, 3]
    assert kv.pool.evicted == [(cold[1], 4), (cold[0], 3)]
    assert kv.retention.expired == set()
    kv.free("b")
    # A block hit after its TTL is an ordinary block again: it moves down when evicted.
    run_turn(kv, "a2", prompt(100), session="t")
    clock.now = 200.0
    kv.expire_retention()
    hits = kv.get_computed_blocks("a3", prompt(100))
    assert kv.retention.expired == {b.block_id for b in hits}
    kv.allocate("a3", 9, hits)
    assert kv.retention.expired == set()


def test_displaced_blocks_move_down_to_be_kept_in_the_host_tier() -> None:
    kv, _ = manager(num_blocks=8, share=0.25)  # at most 2 blocks retained
    kv.pool.evicted = []  # as with KV tiers
    run_turn(kv, "a", prompt(100), session="s")  # retains 0, 1
    kv.get_computed_blocks("probe", prompt(100))
    s_hashes = kv.block_hashes("probe")
    run_turn(kv, "t1", prompt(300), session="t")  # displaces s: 0, 1 to the LRU's tail
    assert kv.retention.displaced == {0, 1}
    assert kv.allocate("b", 6 * BS) == [6, 7, 2, 0, 1, 5]
    assert kv.pool.evicted == [(s_hashes[0], 0), (s_hashes[1], 1)]  # moved down, not dropped
    assert kv.retention.moved_down == s_hashes[:2] and kv.retention.displaced == set()
