"""Eviction and admission policies, the registries, and victim selection in the tier index."""

from __future__ import annotations

import pytest

from kvstrata.core.layout import KVLayout
from kvstrata.engine.index import BlockIndex
from kvstrata.errors import ConfigError, UnknownNameError
from kvstrata.policies import (
    ADMISSION,
    EVICTION,
    AdmitAll,
    EvictionPolicy,
    LRUPolicy,
    PrefixAwarePolicy,
    SecondTouch,
)
from kvstrata.tiers import TIERS
from kvstrata.tiers.memory import DRAMTier

A = [b"A%d" % i for i in range(4)]  # one chain: A0 <- A1 <- A2 <- A3
B = [b"B%d" % i for i in range(3)]


def insert_chain(policy: EvictionPolicy[bytes], chain: list[bytes]) -> None:
    parent = None
    for key in chain:
        policy.insert(key, parent)
        parent = key


def drain(policy: EvictionPolicy[bytes]) -> list[bytes]:
    """Evict one key at a time (first victim, then remove), the way a one-block eviction does."""
    order = []
    while len(policy):
        key = next(policy.victims())
        policy.remove(key)
        order.append(key)
    return order


# --------------------------------------------------------------------------- registries


def test_registries_know_their_names() -> None:
    assert EVICTION.names() == ["lru", "prefix-aware"]
    assert ADMISSION.names() == ["all", "second-touch"]
    assert {"dram", "hbm", "nvme"} <= set(TIERS.names())
    assert EVICTION.get("lru") is LRUPolicy and ADMISSION.get("second-touch") is SecondTouch
    assert TIERS.get("dram") is DRAMTier


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(UnknownNameError) as info:
        EVICTION.get("random")
    err: ConfigError = info.value
    assert str(err) == "unknown eviction 'random'; known: lru, prefix-aware"
    assert (err.field, err.value) == ("eviction", "random")
    assert isinstance(err, KeyError) and isinstance(err, ValueError)  # callers catching builtins still work


def test_lazy_registration_with_install_hint() -> None:
    from kvstrata.registry import Registry

    reg: Registry[object] = Registry("gadget")
    reg.register("missing", "kvstrata_no_such_module:Thing", install_hint="pip install kvstrata[gadget]")
    reg.register("ok", "collections:OrderedDict")
    with pytest.raises(ConfigError, match=r"install it with: pip install kvstrata\[gadget\]"):
        reg.get("missing")
    from collections import OrderedDict

    assert reg.get("ok") is OrderedDict

    @reg.register("deco")
    class Deco:
        pass

    assert reg.get("deco") is Deco and reg.names() == ["deco", "missing", "ok"]


# --------------------------------------------------------------------------- LRU


def test_lru_orders_by_last_use() -> None:
    lru: LRUPolicy[bytes] = LRUPolicy()
    for k in A:
        lru.insert(k, None)
    lru.access(A[0])
    lru.access(b"unknown")  # ignored
    assert list(lru.victims()) == [A[1], A[2], A[3], A[0]]
    lru.remove(A[2])
    lru.remove(b"unknown")
    assert list(lru.victims()) == [A[1], A[3], A[0]] and len(lru) == 3
    lru.insert(A[1], None)  # re-insert counts as a use
    assert list(lru.victims()) == [A[3], A[0], A[1]]


# --------------------------------------------------------------------------- prefix-aware


def test_prefix_aware_takes_the_tail_first() -> None:
    policy: PrefixAwarePolicy[bytes] = PrefixAwarePolicy()
    insert_chain(policy, A)
    assert next(policy.victims()) == A[3]
    assert len(policy) == 4


def test_prefix_aware_drains_a_chain_from_its_end() -> None:
    policy: PrefixAwarePolicy[bytes] = PrefixAwarePolicy()
    insert_chain(policy, A)
    insert_chain(policy, B)
    policy.access(A[3])  # chain A was used more recently than chain B
    assert drain(policy) == [B[2], B[1], B[0], A[3], A[2], A[1], A[0]]


def test_prefix_aware_parent_of_a_removed_tail_is_next() -> None:
    """When its last child leaves, a parent becomes a tail at the cold end: the chain behind it is cold."""
    policy: PrefixAwarePolicy[bytes] = PrefixAwarePolicy()
    insert_chain(policy, A)
    insert_chain(policy, B)  # B2 is the newest tail, A3 the oldest
    policy.remove(B[2])
    assert next(policy.victims()) == B[1]


def test_prefix_aware_tails_before_any_inner_key() -> None:
    policy: PrefixAwarePolicy[bytes] = PrefixAwarePolicy()
    insert_chain(policy, A)
    policy.insert(b"solo", None)
    for k in A[:3]:
        policy.access(k)  # inner keys used recently still come after every tail
    victims = list(policy.victims())
    assert victims[:2] == [A[3], b"solo"]
    assert set(victims[2:]) == set(A[:3])


def test_prefix_aware_branches_keep_a_shared_parent() -> None:
    policy: PrefixAwarePolicy[bytes] = PrefixAwarePolicy()
    insert_chain(policy, A[:2])
    policy.insert(b"A2'", A[1])  # a second child of A1
    policy.insert(A[2], A[1])
    policy.remove(A[2])
    assert next(policy.victims()) != A[1]  # A1 still has a cached child
    policy.remove(b"A2'")
    assert next(policy.victims()) == A[1]


def test_prefix_aware_child_inserted_before_its_parent() -> None:
    """Blocks may arrive out of order (e.g. demotions): a parent with a cached child is never a tail."""
    policy: PrefixAwarePolicy[bytes] = PrefixAwarePolicy()
    policy.insert(A[1], A[0])
    policy.insert(A[0], None)
    assert next(policy.victims()) == A[1]
    assert drain(policy) == [A[1], A[0]]


def test_prefix_aware_reinsert_and_removal_of_unknown_keys() -> None:
    policy: PrefixAwarePolicy[bytes] = PrefixAwarePolicy()
    insert_chain(policy, A)
    policy.insert(A[3], A[2])  # already there: a use, no double count
    policy.remove(b"unknown")
    assert len(policy) == 4
    assert drain(policy) == [A[3], A[2], A[1], A[0]]
    assert len(policy) == 0 and list(policy.victims()) == []


def test_prefix_aware_victim_order_is_children_before_parents() -> None:
    policy: PrefixAwarePolicy[bytes] = PrefixAwarePolicy()
    insert_chain(policy, A)
    assert list(policy.victims()) == [A[3], A[2], A[1], A[0]]


# --------------------------------------------------------------------------- admission


def test_admit_all() -> None:
    policy: AdmitAll[bytes] = AdmitAll()
    assert all(policy.admit(k) for k in A)


def test_second_touch_admits_the_second_offer() -> None:
    policy: SecondTouch[bytes] = SecondTouch()
    assert [policy.admit(A[0]) for _ in range(4)] == [False, True, False, True]
    assert policy.admit(A[1]) is False


def test_second_touch_ghost_set_is_bounded() -> None:
    policy: SecondTouch[bytes] = SecondTouch(ghost_entries=2)
    for k in A[:3]:
        assert policy.admit(k) is False  # A0 is forgotten when A2 arrives
    assert policy.admit(A[0]) is False
    assert policy.admit(A[2]) is True


# --------------------------------------------------------------------------- tier index


def make_index(layout: KVLayout, eviction: str = "prefix-aware") -> BlockIndex[bytes]:
    return BlockIndex(EVICTION.get(eviction)(), AdmitAll())


def test_index_pick_victims_skips_pinned_and_stops_when_enough(layout: KVLayout) -> None:
    index = make_index(layout, "lru")
    for k in A:
        index.add(k, 0b11, 100, None)
    index.entries[A[0]].pins = 1
    picked = index.pick_victims(150)
    assert [k for k, _ in picked] == [A[1], A[2]]
    assert index.pick_victims(10_000) == [(k, index.entries[k]) for k in A[1:]]
    assert index.pick_victims(0) == [(A[1], index.entries[A[1]])]


def test_index_add_merges_layers_and_pop_forgets(layout: KVLayout) -> None:
    index = make_index(layout)
    index.add(A[0], 0b01, 100, None)
    entry = index.add(A[0], 0b10, 100, None)
    assert (entry.layers, entry.nbytes) == (0b11, 200) and len(index.entries) == 1
    assert index.pop(A[0]) is entry and index.pop(A[0]) is None
    assert list(index.eviction.victims()) == []


def test_index_prefix_aware_multi_pick_takes_the_end_of_a_chain(layout: KVLayout) -> None:
    index = make_index(layout)
    parent = None
    for k in A:
        index.add(k, 0b11, 100, parent)
        parent = k
    assert [k for k, _ in index.pick_victims(200)] == [A[3], A[2]]
