"""The index half of the ``fs`` tier: which layer-block is live in which object.

Pure Python, no I/O (the tier feeds it what it published or discovered); every
method must be called with the tier's lock held.

Rules, the same in every process, so that independent nodes converge on one view:

* a block is live in at most one object, its *winner*: the newest object (by name,
  i.e. publication order) holding it whose record no tombstone deleted;
* a tombstone deletes a block from the objects it names only, so it never touches a
  newer copy written after the delete. A delete names every object this process knows to
  hold the block (the winner and the older copies it *shadows*), so a process that opens
  the tier later, and sees the older copies, does not bring the block back; when the winner
  goes any other way (a tombstone from a node that did not know an older copy, the object
  vanished), the newest remaining copy wins, as it would in a freshly opened process.
  A named object includes its *heirs*, the objects
  compaction made of it (their header names it in their lineage): their records are the
  same copies, so a delete racing another node's compaction still deletes the block, and
  the tombstone is kept while an heir exists;
* an object with no live record is *dead* from the moment this process noticed it
  (``dead_since``, local wall clock, so a late observer waits longer, never shorter);
  dead objects are collected after the grace period by whichever node sees it first;
* capacity is charged per object: a live object costs its whole size until it dies
  (``compact`` rewrites sparse ones), a dead one costs nothing (it is garbage waiting
  for the grace period; see the tier's space policy).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from kvstrata.tiers.fs.format import Name, Rec


@dataclass(eq=False)
class ObjectInfo:
    """One data object as this process knows it."""

    name: Name
    size: int
    recs: dict[bytes, Rec]
    live: set[bytes] = field(default_factory=set)
    live_bytes: int = 0  # sum of the lengths of live records
    dead_since: float | None = None  # wall time this process saw the last live record go
    claimed: bool = False  # this process handed one of its blocks to its engine (write, scan, contains)
    area: str = ""  # where it lives: "" (unkeyed) or "k<key id>/" (see fs.format)
    lineage: tuple[str, ...] = ()  # stems of the objects it was compacted from (newest first)
    _by_offset: dict[int, bytes] | None = field(default=None, repr=False)

    def key_at(self, offset: int) -> bytes | None:
        """The block key of the record at ``offset`` (records never share an offset)."""
        if self._by_offset is None:
            self._by_offset = {rec.offset: bkey for bkey, rec in self.recs.items()}
        return self._by_offset.get(offset)

    @property
    def stem(self) -> str:
        return self.name.stem

    @property
    def rel(self) -> str:
        return self.name.object_path(self.area)

    @property
    def written_s(self) -> float:
        return self.name.ts_ms / 1000

    def live_fraction(self) -> float:
        return self.live_bytes / self.size if self.size else 0.0


@dataclass(frozen=True)
class TombInfo:
    name: Name
    objects: frozenset[str]  # stems of the objects it deletes blocks from
    seen: float  # wall time this process published or first listed it


class Catalog:
    """Objects, tombstones and the winner of every live block."""

    def __init__(self) -> None:
        self.objects: dict[str, ObjectInfo] = {}
        self.tombs: dict[str, TombInfo] = {}
        self.charged = 0  # bytes of live objects (see the module docstring)
        self._winner: dict[bytes, ObjectInfo] = {}
        self._killed: dict[str, set[bytes]] = {}  # object stem -> blocks tombstones deleted from it
        self._heirs: dict[str, set[str]] = {}  # object stem -> stems of known objects compacted from it
        self._shadowed: dict[bytes, set[str]] = {}  # block -> stems of objects holding an older, unkilled copy

    def __len__(self) -> int:
        return len(self._winner)

    def lookup(self, bkey: bytes) -> tuple[ObjectInfo, Rec] | None:
        info = self._winner.get(bkey)
        return None if info is None else (info, info.recs[bkey])

    def live_items(self) -> Iterator[tuple[bytes, Rec, ObjectInfo]]:
        for bkey, info in self._winner.items():
            yield bkey, info.recs[bkey], info

    # -- learning about objects -------------------------------------------------------------
    def add(self, info: ObjectInfo, now: float, expect: ObjectInfo | None = None, expired: bool = False) -> list[bytes]:
        """Insert an object just published or discovered.

        Each record becomes live unless a tombstone deleted it from this object or a newer
        object holds the block; an older winner loses it. With ``expect`` (compaction) a
        record becomes live only where ``expect`` holds the block now; returns the blocks
        refused for that reason. ``expired``: the object is past its TTL, nothing is live."""
        self.objects[info.stem] = info
        killed = self._killed_in(info)
        for ancestor in info.lineage:
            self._heirs.setdefault(ancestor, set()).add(info.stem)
        refused: list[bytes] = []
        for bkey in info.recs:
            if expired or bkey in killed:
                continue
            cur = self._winner.get(bkey)
            if expect is not None and cur is not expect:
                refused.append(bkey)
                continue
            if cur is not None:
                if expect is None and cur.name > info.name:
                    self._shadowed.setdefault(bkey, set()).add(info.stem)
                    continue
                self._unlive(cur, bkey, now)
                self._shadowed.setdefault(bkey, set()).add(cur.stem)
            self._make_live(info, bkey)
        if not info.live:
            info.dead_since = now
        return refused

    def add_tomb(self, tomb: TombInfo, groups: dict[str, list[bytes]], now: float) -> None:
        """Apply a tombstone: each object (and its heirs) loses the blocks listed for it."""
        self.tombs[tomb.name.stem] = tomb
        lost: set[bytes] = set()
        for stem, bkeys in groups.items():
            self._killed.setdefault(stem, set()).update(bkeys)
            for target in (stem, *self._heirs.get(stem, ())):
                info = self.objects.get(target)
                if info is None:
                    continue
                for bkey in bkeys:
                    self._unshadow(bkey, target)
                    if bkey in info.live:
                        self._unlive(info, bkey, now)
                        del self._winner[bkey]
                        lost.add(bkey)
        for bkey in lost:
            self._promote(bkey)

    def needed(self, tomb: TombInfo) -> bool:
        """Whether ``tomb`` still deletes something: an object it names, or an heir of one, is known."""
        return any(stem in self.objects or stem in self._heirs for stem in tomb.objects)

    def forget(self, stem: str) -> ObjectInfo | None:
        """An object left the store (collected, vanished, quarantined): its live blocks are gone."""
        info = self.objects.pop(stem, None)
        if info is None:
            return None
        for ancestor in info.lineage:
            heirs = self._heirs.get(ancestor)
            if heirs is not None:
                heirs.discard(stem)
                if not heirs:
                    del self._heirs[ancestor]
        lost = [bkey for bkey in info.live if self._winner.get(bkey) is info]
        for bkey in lost:
            del self._winner[bkey]
        for bkey in info.recs:
            self._unshadow(bkey, stem)
        if info.live:
            self.charged -= info.size
        info.live.clear()
        info.live_bytes = 0
        for bkey in lost:
            self._promote(bkey)
        return info

    def forget_tomb(self, stem: str) -> None:
        tomb = self.tombs.pop(stem, None)
        if tomb is not None:
            for obj in tomb.objects:
                if obj not in self.objects and obj not in self._heirs:
                    self._killed.pop(obj, None)

    # -- deleting ----------------------------------------------------------------------------
    def remove(self, bkeys: Iterable[bytes], now: float) -> dict[str, list[bytes]]:
        """Delete blocks here; returns, per object stem, the blocks a tombstone must record:
        each block under its winner and under every object holding an older copy of it."""
        groups: dict[str, list[bytes]] = {}
        for bkey in bkeys:
            info = self._winner.pop(bkey, None)
            if info is None:
                continue
            self._unlive(info, bkey, now)
            for stem in (info.stem, *sorted(self._shadowed.pop(bkey, ()))):
                self._killed.setdefault(stem, set()).add(bkey)
                groups.setdefault(stem, []).append(bkey)
        return groups

    def expire(self, info: ObjectInfo, now: float) -> list[bytes]:
        """Every live block of ``info`` goes (TTL or capacity); returns them."""
        gone = list(info.live)
        for bkey in gone:
            del self._winner[bkey]
            self._unlive(info, bkey, now)
        return gone

    # -- queries for housekeeping ----------------------------------------------------------------
    def live_objects(self) -> list[ObjectInfo]:
        return [info for info in self.objects.values() if info.live]

    def dead_objects(self) -> list[ObjectInfo]:
        return [info for info in self.objects.values() if not info.live]

    def sparse(self, threshold: float, among: Iterable[str] | None = None) -> list[ObjectInfo]:
        """Live objects whose live records fill less than ``threshold`` of them."""
        pool = self.objects.values() if among is None else (self.objects[s] for s in among if s in self.objects)
        return [info for info in pool if info.live and info.live_fraction() < threshold]

    # -- internals ------------------------------------------------------------------------------
    def _killed_in(self, info: ObjectInfo) -> set[bytes]:
        """The blocks tombstones deleted from ``info`` (or from an object it was compacted from)."""
        return set().union(*(self._killed.get(stem, ()) for stem in (info.stem, *info.lineage)))

    def _unshadow(self, bkey: bytes, stem: str) -> None:
        holders = self._shadowed.get(bkey)
        if holders is not None:
            holders.discard(stem)
            if not holders:
                del self._shadowed[bkey]

    def _promote(self, bkey: bytes) -> None:
        """The winner of ``bkey`` went: the newest older copy no tombstone deleted wins (the
        view a process opening the tier now would have)."""
        holders = [self.objects[s] for s in self._shadowed.get(bkey, ()) if s in self.objects]
        for info in sorted(holders, key=lambda i: i.name, reverse=True):
            if not any(bkey in self._killed.get(stem, ()) for stem in (info.stem, *info.lineage)):
                self._unshadow(bkey, info.stem)
                self._make_live(info, bkey)
                return

    def _make_live(self, info: ObjectInfo, bkey: bytes) -> None:
        if not info.live:
            self.charged += info.size
            info.dead_since = None
        info.live.add(bkey)
        info.live_bytes += info.recs[bkey].length
        self._winner[bkey] = info

    def _unlive(self, info: ObjectInfo, bkey: bytes, now: float) -> None:
        """``bkey`` stops being live in ``info`` (the caller fixes ``_winner``)."""
        info.live.discard(bkey)
        info.live_bytes -= info.recs[bkey].length
        if not info.live:
            self.charged -= info.size
            info.dead_since = now
