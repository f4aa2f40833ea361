"""Properties of the engine's pure index decisions (shared by the engine and the planner's simulator)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.core.masks import MaskBytes, layers_of
from kvstrata.engine.chains import Chains
from kvstrata.engine.index import BlockIndex, Entry, lowest_priority_fn, pick_victims, snapshot_room
from kvstrata.policies import EVICTION
from kvstrata.policies.admission import AdmitAll

SIZES = MaskBytes([100, 200, 50, 25])  # four layers; layer 3 is a state snapshot
SNAP = 0b1000
ALL = 0b1111
LOWEST = lowest_priority_fn([(0b0011, 0), (0b0100, -1), (0b1000, 0)])

keys = st.integers(0, 30)
masks = st.integers(1, ALL)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), keys, masks, st.integers(0, 40)),
        st.tuples(st.just("evict"), keys, masks, st.just(0)),
        st.tuples(st.just("pin"), keys, st.just(0), st.just(0)),
        st.tuples(st.just("release"), keys, st.just(0), st.just(0)),
        st.tuples(st.just("pick"), st.integers(0, 2000), st.just(0), st.just(0)),
    ),
    max_size=60,
)


def run(index: BlockIndex[int], program: list[tuple[str, int, int, int]]) -> dict[int, int]:
    """Apply ``program``; returns the bytes taken out of the index and not released yet, per key."""
    leaving: dict[int, int] = {}
    for op, key, mask, pos in program:
        e = index.entries.get(key)
        if op == "add" and key not in index.evicting:
            new = mask & ~(e.layers if e else 0)
            if new:
                index.add(key, new, SIZES(new), key - 1 if key else None, pos)
        elif op == "evict" and e is not None and key not in index.evicting and not e.pins:
            part = e if mask & e.layers == e.layers else Entry(mask & e.layers, SIZES(mask & e.layers), e.parent)
            if part.layers:
                index.evict(key, part)
                leaving[key] = leaving.get(key, 0) + part.nbytes
        elif op == "pin" and e is not None:
            index.pin([key])
        elif op == "release" and key in leaving:
            index.release(key, leaving.pop(key))
        elif op == "pick":
            for k, part in pick_victims(index, key, LOWEST):
                index.evict(k, part)
                leaving[k] = leaving.get(k, 0) + part.nbytes
    return leaving


def new_index(eviction: str) -> BlockIndex[int]:
    return BlockIndex(EVICTION.get(eviction)(), AdmitAll(), mask_bytes=SIZES, snap_mask=SNAP)


@settings(max_examples=150, deadline=None)
@given(ops, st.sampled_from(["lru", "prefix-aware"]))
def test_live_bytes_are_the_entries_plus_what_is_leaving(
    program: list[tuple[str, int, int, int]], eviction: str
) -> None:
    index = new_index(eviction)
    leaving = run(index, program)
    assert index.live_bytes == sum(e.nbytes for e in index.entries.values()) + sum(leaving.values())
    assert index.leaving_bytes == sum(leaving.values())
    for key, e in index.entries.items():
        assert e.nbytes == SIZES(e.layers), key
    snaps = {k for k, e in index.entries.items() if e.layers & SNAP}
    assert set(index.snapshots) == snaps
    assert index.snapshot_bytes == sum(SIZES(e.layers & SNAP) for e in index.entries.values())
    for key, nbytes in list(leaving.items()):
        index.release(key, nbytes)
    assert index.live_bytes == sum(e.nbytes for e in index.entries.values())


@settings(max_examples=150, deadline=None)
@given(ops, st.integers(0, 3000), st.booleans(), st.sampled_from(["lru", "prefix-aware"]))
def test_victims_skip_pinned_and_evicting_and_cover_the_need(
    program: list[tuple[str, int, int, int]], need: int, shed: bool, eviction: str
) -> None:
    index = new_index(eviction)
    run(index, program)
    victims = pick_victims(index, need, LOWEST if shed else None)
    got = [k for k, _ in victims]
    assert len(got) == len(set(got))
    for key, part in victims:
        e = index.entries[key]
        assert not e.pins and key not in index.evicting
        assert part.layers and part.layers & ~e.layers == 0 and part.nbytes == SIZES(part.layers)
    candidates = [k for k, e in index.entries.items() if not e.pins and k not in index.evicting]
    freed = sum(part.nbytes for _, part in victims)
    if freed < need:  # not enough: every candidate is taken (whole, or shedding its lowest layers)
        assert sorted(got) == sorted(candidates)
        if not shed:
            assert all(part is index.entries[k] for k, part in victims)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(keys, st.integers(1, 50)), max_size=40), st.integers(0, 400))
def test_snapshot_budget_is_never_exceeded(snapshots: list[tuple[int, int]], budget: int) -> None:
    index = new_index("lru")
    size = SIZES(SNAP)
    for key, position in snapshots:
        if key in index.evicting or (key in index.entries and index.entries[key].layers & SNAP):
            continue
        shed: list[tuple[int, Entry[int]]] = []
        before = index.snapshot_bytes
        if snapshot_room(index, key, size, position, budget, shed):
            index.add(key, SNAP, size, None, position)
            assert all(p.layers == SNAP for _, p in shed)
        else:
            assert index.snapshot_bytes <= max(before, budget)
        for k, part in shed:
            assert index.snapshots.get(k, -1) == -1 or k == key
            index.release(k, part.nbytes)
        assert index.snapshot_bytes <= budget or not index.snapshots or before > budget


def test_snapshot_room_keeps_the_longest_prefixes() -> None:
    index = new_index("lru")
    size = SIZES(SNAP)
    for key, position in [(1, 10), (2, 20)]:
        shed: list[tuple[int, Entry[int]]] = []
        assert snapshot_room(index, key, size, position, 2 * size, shed) and not shed
        index.add(key, SNAP, size, None, position)
    shed = []
    assert not snapshot_room(index, 3, size, 5, 2 * size, shed) and not shed  # shorter than both: refused
    assert snapshot_room(index, 4, size, 30, 2 * size, shed)  # longer: drops the shortest (10)
    assert [k for k, _ in shed] == [1] and sorted(index.snapshots.values()) == [20]


def test_pinned_block_is_never_a_victim_and_unpin_frees_doomed() -> None:
    index = new_index("lru")
    index.add(1, ALL, SIZES(ALL), None)
    index.add(2, ALL, SIZES(ALL), 1)
    pinned = index.pin([1, None, 7])
    assert [k for k, _ in pinned] == [1]
    assert [k for k, _ in pick_victims(index, 10**6)] == [2]
    index.entries[1].doomed = True
    assert [k for k, _ in index.unpin(pinned)] == [1]


def test_lowest_priority_sheds_only_the_lowest_groups() -> None:
    assert LOWEST is not None
    assert LOWEST(ALL) == 0b0100
    assert LOWEST(0b1011) == 0b1011  # one priority present: the whole block
    assert lowest_priority_fn([(0b1, 0), (0b10, 0)]) is None
    assert layers_of(0b1010) == (1, 3)


def test_after_drop_cools_the_rest_of_a_broken_chain() -> None:
    chains: Chains[int] = Chains(prefix_mask=0b0011)
    for k in range(1, 5):
        chains.note(k, k - 1 if k > 1 else None, 0, 0)
    held = {1: 0, 2: ALL, 3: ALL, 4: ALL}
    cooled: list[int] = []
    chains.after_drop([(1, Entry(ALL, SIZES(ALL), None))], held.__getitem__, cooled.append)
    assert sorted(cooled) == [2, 3, 4]
    assert 1 not in chains.children


def state_of(index: BlockIndex[int]) -> tuple[object, ...]:
    entries = {k: (e.layers, e.nbytes, e.parent, e.pins) for k, e in index.entries.items()}
    victims = [(k, e.layers) for k, e in pick_victims(index, 10**9, None)]  # every victim, in the policy's order
    return entries, index.live_bytes, index.snapshot_bytes, dict(index.snapshots), victims


bulk = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(keys, min_size=1, max_size=8, unique=True), st.integers(1, ALL)),
        st.tuples(st.just("drop"), st.integers(0, 2000), st.just(0)),
    ),
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(program=bulk, eviction=st.sampled_from(["lru", "prefix-aware"]))
def test_bulk_forms_do_what_their_single_forms_do(program: list[tuple[str, object, int]], eviction: str) -> None:
    """add_blocks == add per key, drop_blocks == pop + release per victim (the simulator's fast
    paths must not make its decisions drift from the engine's)."""
    one, many = new_index(eviction), new_index(eviction)
    for op, arg, mask in program:
        if op == "add":
            assert isinstance(arg, list)
            fresh = [k for k in arg if k not in one.entries]  # whole blocks, as the simulator writes them
            parents = [k - 1 if k else None for k in fresh]
            for k, p in zip(fresh, parents, strict=True):
                one.add(k, mask, SIZES(mask), p)
            many.add_blocks(fresh, mask, SIZES(mask), parents)
        else:
            assert isinstance(arg, int)
            a, b = pick_victims(one, arg, None), pick_victims(many, arg, None)
            assert [(k, e.layers) for k, e in a] == [(k, e.layers) for k, e in b]
            for k, e in a:
                one.pop(k)
                one.release(k, e.nbytes)
            many.drop_blocks(b)
        assert state_of(one) == state_of(many)
