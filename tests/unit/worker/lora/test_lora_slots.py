"""LoRA device-slot bookkeeping (worker/lora/slots.py) and the adapter-keyed prefix-cache
chain (kv/block_hash.py root_hash), with exact slot and block ids."""
from __future__ import annotations

from kv.block_hash import ROOT_HASH, hash_full_blocks, root_hash
from kv.cache_manager import KVCacheManager
from worker.lora.slots import LoRASlots


def test_slots_lowest_first_then_least_recently_released() -> None:
    slots = LoRASlots(2)
    assert slots.acquire("a") == (0, True)
    assert slots.acquire("b") == (1, True)
    assert slots.acquire("a") == (0, False)  # resident: no load
    assert not slots.can_acquire("c")  # both held
    assert slots.can_acquire("a")
    slots.release(1)  # b idle
    slots.release(0)
    slots.release(0)  # a idle, released after b
    assert slots.acquire("c") == (1, True)  # evicts b, the least recently released
    assert slots.slot_of("b") is None and slots.resident == ["a", "c"]
    assert slots.acquire("a") == (0, False)  # still resident: taken back from the idle list
    assert not slots.can_acquire("b")
    assert slots.num_loads == 3


def test_active_lists_the_held_slots_adapters_by_slot_id() -> None:
    slots = LoRASlots(3)
    slots.acquire("a"), slots.acquire("b"), slots.acquire("c")
    slots.release(1)  # b idle: resident, not active
    assert slots.resident == ["a", "b", "c"] and slots.active == ["a", "c"]
    slots.release(0)
    assert slots.active == ["c"]


def test_evict_only_when_unheld() -> None:
    slots = LoRASlots(2)
    slot, _ = slots.acquire("a")
    assert not slots.evict("a")
    slots.release(slot)
    assert slots.evict("a") and slots.slot_of("a") is None
    assert slots.acquire("b") == (0, True)  # the freed slot, lowest first


def test_root_hash_separates_chains() -> None:
    tokens = list(range(40))
    assert root_hash(()) == ROOT_HASH
    base = hash_full_blocks(tokens, 16)
    a = hash_full_blocks(tokens, 16, root=root_hash(("lora:a:/p",)))
    b = hash_full_blocks(tokens, 16, root=root_hash(("lora:b:/p",)))
    assert len(base) == len(a) == 2 and not set(base) & set(a) and not set(a) & set(b)
    # Extending a known prefix continues the same chain.
    assert hash_full_blocks(tokens, 16, a[:1], root=root_hash(("lora:a:/p",))) == a


def test_cache_manager_never_shares_blocks_across_roots() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(9))  # two full blocks and one token
    root = root_hash(("lora:x:/p",))
    assert m.get_computed_blocks("a", tokens, root) == []
    assert m.allocate("a", 9) == [0, 1, 2]
    m.cache_computed("a", tokens, 8, root)
    m.free("a")
    assert m.get_computed_blocks("base", tokens) == []  # no root: the plain chain
    assert [b.block_id for b in m.get_computed_blocks("again", tokens, root)] == [0, 1]
