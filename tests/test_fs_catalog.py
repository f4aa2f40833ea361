"""The fs tier's catalog rules, checked against the store: whatever two nodes write, delete,
compact and collect, a node that has absorbed the store serves exactly what a process opening
the tier now would serve (the same winner for every block), so a deleted block never comes back
after a reopen and a block another node's tombstone took from its winner falls back to the copy
a fresh process would find.

Pure catalog, no I/O: the "store" is the list of published objects and tombstones, and a
node's absorb step feeds the catalog what the tier's discovery would, in discovery's order
(new tombstones, then new objects, then what vanished)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from kvstrata.tiers.fs.catalog import Catalog, ObjectInfo, TombInfo
from kvstrata.tiers.fs.format import MAX_LINEAGE, Name, Rec

KEYS = [bytes([i]) * 8 for i in range(10)]


@dataclass
class Store:
    """What is published: object prototypes (name, records, lineage) and tombstones."""

    objects: dict[str, tuple[Name, tuple[bytes, ...], tuple[str, ...]]] = field(default_factory=dict)
    tombs: dict[str, tuple[Name, dict[str, list[bytes]]]] = field(default_factory=dict)
    clock: int = 0

    def name(self, writer: str) -> Name:
        self.clock += 1
        return Name(self.clock, writer, self.clock)


def make_info(name: Name, keys: tuple[bytes, ...], lineage: tuple[str, ...]) -> ObjectInfo:
    """A fresh ObjectInfo (catalogs mutate theirs) for a published object."""
    recs = {k: Rec(i * 100, 100, 0) for i, k in enumerate(keys)}
    return ObjectInfo(name=name, size=100 * len(keys), recs=recs, lineage=lineage)


class Node:
    def __init__(self, store: Store, writer: str) -> None:
        self.store, self.writer, self.cat = store, writer, Catalog()
        self.known: set[str] = set()
        self.known_tombs: set[str] = set()

    def write(self, keys: tuple[bytes, ...]) -> None:
        name = self.store.name(self.writer)
        self.store.objects[name.stem] = (name, keys, ())
        self.cat.add(make_info(name, keys, ()), 0.0)
        self.known.add(name.stem)

    def delete(self, keys: list[bytes]) -> None:
        groups = self.cat.remove(keys, 0.0)
        if groups:
            self._publish_tomb(groups)

    def _publish_tomb(self, groups: dict[str, list[bytes]]) -> None:
        name = self.store.name(self.writer)
        self.store.tombs[name.stem] = (name, {s: sorted(b) for s, b in groups.items()})
        self.cat.add_tomb(TombInfo(name, frozenset(groups), 0.0), {}, 0.0)
        self.known_tombs.add(name.stem)

    def compact(self, rng: random.Random) -> None:
        live = [i for i in self.cat.live_objects() if i.stem in self.store.objects]
        if not live:
            return
        old = rng.choice(sorted(live, key=lambda i: i.name))
        keys = tuple(sorted(old.live))
        name = self.store.name(self.writer)
        lineage = (old.stem, *old.lineage)[:MAX_LINEAGE]
        self.store.objects[name.stem] = (name, keys, lineage)
        refused = self.cat.add(make_info(name, keys, lineage), 0.0, expect=old)
        self.known.add(name.stem)
        if refused:
            self._publish_tomb({name.stem: refused})

    def collect(self) -> None:
        """Remove the objects this node sees dead, and tombstones no longer needed, right after a
        full listing (the tier's grace period stands for that: whatever was published before
        the collection is known to the collector)."""
        self.absorb()
        for info in self.cat.dead_objects():
            self.store.objects.pop(info.stem, None)
            self.cat.forget(info.stem)
            self.known.discard(info.stem)
        for stem, tomb in list(self.cat.tombs.items()):
            if not self.cat.needed(tomb):
                self.store.tombs.pop(stem, None)
                self.cat.forget_tomb(stem)
                self.known_tombs.discard(stem)

    def absorb(self) -> None:
        """What the tier's full discovery does: new tombstones, new objects, then what vanished."""
        for stem, (name, groups) in sorted(self.store.tombs.items()):
            if stem not in self.known_tombs:
                self.cat.add_tomb(TombInfo(name, frozenset(groups), 0.0), groups, 0.0)
                self.known_tombs.add(stem)
        for stem, (name, keys, lineage) in sorted(self.store.objects.items()):
            if stem not in self.known:
                self.cat.add(make_info(name, keys, lineage), 0.0)
                self.known.add(stem)
        for stem in self.known - set(self.store.objects):
            self.cat.forget(stem)
        self.known &= set(self.store.objects)
        for stem in self.known_tombs - set(self.store.tombs):
            self.cat.forget_tomb(stem)
        self.known_tombs &= set(self.store.tombs)

    def view(self) -> dict[bytes, str]:
        return {k: info.stem for k, _, info in self.cat.live_items()}


def fresh_view(store: Store, rng: random.Random) -> dict[bytes, str]:
    """The winners of a process opening the tier now (objects listed in any order)."""
    node = Node(store, "fresh")
    objects = list(store.objects.items())
    rng.shuffle(objects)
    store_copy = Store(dict(objects), dict(store.tombs), store.clock)
    node.store = store_copy
    node.absorb()
    return node.view()


def test_a_block_rewritten_then_deleted_stays_deleted_after_a_reopen() -> None:
    store = Store()
    a = Node(store, "a")
    a.write((KEYS[0], KEYS[1]))
    a.write((KEYS[0],))  # a newer copy: it wins, the first object shadows an older one
    a.delete([KEYS[0]])
    assert KEYS[0] not in a.view()
    assert KEYS[0] not in fresh_view(store, random.Random(1)), "the older copy came back"
    assert fresh_view(store, random.Random(1)) == a.view()


def test_a_block_deleted_after_compaction_stays_deleted_before_the_old_object_is_collected() -> None:
    store = Store()
    a = Node(store, "a")
    a.write((KEYS[0], KEYS[1], KEYS[2]))
    a.compact(random.Random(0))  # the new object holds all three; the old one waits for collection
    a.delete([KEYS[1]])
    assert fresh_view(store, random.Random(2)) == a.view() and KEYS[1] not in a.view()


def test_a_tombstone_from_a_node_that_missed_an_older_copy_falls_back_to_it() -> None:
    """Node B deletes the block from the only copy it knows; node A, which also holds an older
    copy that B never saw, serves that copy afterwards, as a freshly opened process would."""
    store = Store()
    a, b = Node(store, "a"), Node(store, "b")
    a.write((KEYS[3],))
    old = dict(store.objects)
    store.objects.clear()  # B's listing predates A's first object
    b.write((KEYS[3],))
    store.objects.update(old)
    a.absorb()  # A: B's newer copy wins, A's own one is shadowed
    assert a.view() == {KEYS[3]: b.view()[KEYS[3]]}
    b.delete([KEYS[3]])  # B's tombstone names its own object only
    a.absorb()
    assert a.view() == fresh_view(store, random.Random(3)) == {KEYS[3]: next(iter(old))}


@pytest.mark.parametrize("seed", range(60))
def test_two_nodes_agree_with_a_fresh_process_after_every_step(seed: int) -> None:
    rng = random.Random(20261202 + seed)
    store = Store()
    nodes = [Node(store, "a"), Node(store, "b")]
    for step in range(60):
        node = rng.choice(nodes)
        op = rng.random()
        if op < 0.35:
            node.write(tuple(sorted(rng.sample(KEYS, rng.randint(1, 4)))))
        elif op < 0.6:
            node.delete(rng.sample(KEYS, rng.randint(1, 3)))
        elif op < 0.75:
            node.compact(rng)
        elif op < 0.85:
            node.collect()
        else:
            node.absorb()
        node.absorb()
        fresh = fresh_view(store, rng)
        assert node.view() == fresh, f"seed {seed} step {step}: node {node.writer} and a fresh process disagree"
