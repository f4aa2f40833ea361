"""The ``nvme`` tier's public face: :class:`NVMeTier` (see the package docstring)."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator, Sequence

from kvstrata.core.buffers import Buffer
from kvstrata.tiers.base import BlockId, ReadStatus, TierCapabilities, TierContext, TierOptions, VerifyReport
from kvstrata.tiers.nvme.options import FRESH_S, GRACE_S, HEAD_ITEMS, NVMeOptions
from kvstrata.tiers.nvme.verify import Verifier
from kvstrata.tiers.records import key_or_none
from kvstrata.tiers.segments import ALIGN, Loc, block_key, parse_block_key


class NVMeTier(Verifier):
    """Local-disk tier: append-only segment files plus an LMDB index, checksummed records.

    Space policy: ``used_bytes`` is the physical size of all segment files of this
    namespace directory (live records, padding, deleted-but-not-reclaimed records and
    torn tails). Records are packed (see :mod:`kvstrata.tiers.segments`), so a batch
    costs its bytes rounded up to 64 per record plus under 4 KiB of padding per 16 MiB
    chunk and per segment it spans. ``has_room`` answers ``used_bytes + cost(sizes) <=
    capacity``, where ``cost`` lays the batch out exactly as an append now would, so the
    disk never holds more than ``capacity`` segment bytes (the LMDB index is not
    counted). ``delete`` reclaims space inline: a sealed segment with no live record is
    unlinked, one whose live fraction falls below ``compact_threshold`` is compacted
    (live records copied into the active segment, index updated, old file unlinked);
    the active segment is sealed and unlinked once it holds no live record. Deleting
    every block therefore brings ``used_bytes`` to zero, so the engine's evict-until-
    ``has_room`` loop terminates. Compaction needs up to ``compact_threshold`` of a
    segment in free space while it runs. The effective segment size is capped at
    ``capacity // 8`` so that dead space in the active segment stays small.

    Several processes (or tier instances) may share a directory: each appends only to
    its own segments (named ``<pid>-<random>-<seq>.seg``, flock-ed while in use);
    blocks written by others are found through the index on a miss and by ``scan``
    after reopening. Segment files are removed only under their flock and only after
    the index transaction that stops referencing them.

    ``checksum_failures`` counts records whose xxh3_64 did not match on read; such a
    record is reported ``CORRUPT`` once and dropped from the index (then ``MISSING``).

    With a secret (``secret_file`` / ``secret_env`` / ``secret``, see :mod:`kvstrata.tiers.auth`)
    each index entry carries the record's key id and keyed BLAKE3 tag instead of the checksum,
    bound to the record's block id and namespace. A record whose tag fails is handled the same
    way and counted in ``auth_failures``; entries written without the secret (from before it was
    configured) or with another one are misses that this tier neither serves nor drops.
    """

    capabilities = TierCapabilities(persistent=True, checksums=True, alignment=ALIGN, records=True, space="segments")

    Options = NVMeOptions

    def __init__(
        self, name: str, capacity: int, options: TierOptions, context: TierContext, read_only: bool = False
    ) -> None:
        """``read_only``: open only to read and check the directory (``verify`` without repair): no
        sweep, no probe file, LMDB read-only, and calls that would write raise ``TierError``."""
        super().__init__(name, capacity, options, context, read_only)
        try:
            if not read_only:
                self._sweep()
            self._rescan()
        except BaseException:
            self._index.close()
            raise
        # This machine's abilities, for this instance only (the class keeps what every NVMe tier can do).
        self.capabilities = dataclasses.replace(type(self).capabilities, gpu_direct=self._gds, direct_io=self.direct_io)

    @classmethod
    def open_to_verify(
        cls, name: str, capacity: int, options: TierOptions, context: TierContext, repair: bool
    ) -> NVMeTier:
        """Read-only unless ``repair``: a plain ``kvstrata verify`` leaves the directory as it was."""
        return cls(name, capacity, options, context, read_only=not repair)

    def write(self, items: Sequence[tuple[BlockId, Buffer]]) -> list[bool]:
        with self._using(writes=True):
            accepted, lengths = self._accepted_keys(items)
            ok = [key is not None for key in accepted]
            if all(ok):  # the usual batch: every item taken, no list of the chosen ones
                chosen: Sequence[int] = range(len(items))
                keys: list[bytes] = accepted  # type: ignore[assignment]
                bufs = [buf for _, buf in items]
            else:
                chosen = [i for i, good in enumerate(ok) if good]
                keys = [accepted[i] for i in chosen]  # type: ignore[misc]
                bufs = [items[i][1] for i in chosen]
                lengths = [lengths[i] for i in chosen]
            if chosen:
                applied, replaced = self._store(keys, bufs, lengths=lengths)
                for i, done in zip(chosen, applied, strict=True):
                    ok[i] = done  # False: the index refused a segment that was reclaimed under us
                self._reclaim(replaced)  # rewritten blocks leave dead records behind
            return ok

    def read(self, items: Sequence[tuple[BlockId, Buffer]]) -> list[ReadStatus]:
        out = [ReadStatus.MISSING] * len(items)
        keys: list[bytes | None] = [None] * len(items)  # each part's, as it is looked up
        bufs = [buf for _, buf in items]
        with self._using(), self._index_faults("read"):
            locs: list[Loc | None] = []

            def part(lo: int, hi: int) -> Callable[[], list[tuple[int, Loc]]]:
                def look() -> list[tuple[int, Loc]]:
                    keys[lo:hi] = [key_or_none(bid) for bid, _ in items[lo:hi]]
                    found = self._lookup(keys[lo:hi])
                    locs.extend(found)
                    return [(lo + j, loc) for j, loc in enumerate(found) if loc is not None]

                return look

            cuts = read_cuts(len(items))
            gone = self._read_parts([part(lo, hi) for lo, hi in itertools.pairwise(cuts)], keys, bufs, out)
            if gone:
                self._retry_moved(gone, locs, keys, bufs, out)
        return out

    def delete(self, ids: Sequence[BlockId]) -> None:
        keys = list(dict.fromkeys(k for k in map(key_or_none, ids) if k is not None))
        with self._using(writes=True):
            if keys:
                with self._index_faults("delete"):
                    infos = self._drop(keys)
                self._reclaim(infos)

    def records(self) -> list[tuple[BlockId, Loc]]:
        """Every block in the shared index (all writers) with its location, oldest write first.

        Segment ids only grow and a segment is appended to in order, so ``(segment, offset)``
        order is write order (compaction rewrites a record and so makes it young again). For
        the daemon: watermarks demote in this order, so whole segments die and are unlinked."""
        with self._using(), self._index_faults("records"):
            entries = self._index.blocks()
        entries.sort(key=lambda e: (e[1].seg, e[1].offset))
        return [(parse_block_key(key), loc) for key, loc in entries]

    def delete_at(self, records: Sequence[tuple[BlockId, Loc]]) -> list[bool]:
        """Delete blocks only where they still are at the given location (compare-and-swap in
        one index transaction), then reclaim space; True where a block was removed. A block
        another process rewrote (or compaction moved) since ``records`` was read is kept."""
        keys = [block_key(bid) for bid, _ in records]
        with self._using(writes=True):
            if not keys:
                return []
            with self._index_faults("delete"), self._index.write_lock:
                removed, infos = self._index.drop(keys, [loc for _, loc in records])
                with self._lock:
                    for key, old in zip(keys, removed, strict=True):
                        if old is not None:
                            self._mirror_pop(key)
            self._reclaim(infos)
            return [old is not None for old in removed]

    def compact(self) -> int:
        """Unlink dead segments and compact sparse ones of every writer of the directory (a
        delete reclaims only the segments it touched; sealed segments of writers that have
        gone stay sparse otherwise). Returns how many segments went away (live records moved)."""
        with self._using(writes=True), self._index_faults("compact"):
            infos = self._index.segments()
            self._reclaim(infos)
            gone = len(set(infos) - set(self._index.segments()))
            self._rescan()
            return gone

    @property
    def used_bytes(self) -> int:
        return self._physical()

    def refresh_used(self) -> int:
        """``used_bytes`` re-read from disk now (``used_bytes`` may lag other processes by
        ``RESCAN_S``): for a process that watches the directory's usage, like the daemon."""
        with self._using():
            self._rescan()
            return self._physical()

    def has_room(self, sizes: Sequence[int], live_bytes: int) -> bool:
        """Whether the segment files stay within ``capacity`` after appending ``sizes`` in one write.

        A "no" from the cached view (up to ``RESCAN_S`` old) is checked against the disk first:
        the daemon or another writer may have reclaimed segments since, and a stale "full" would
        make the engine evict blocks for room that is already there."""
        cost = self._append_cost(list(sizes))
        if self._physical() + cost <= self.capacity:
            return True
        if time.monotonic() - self._scanned_at > FRESH_S:
            self._rescan()
        return self._physical() + cost <= self.capacity

    def scan(self) -> Iterator[tuple[BlockId, int]]:
        with self._using(), self._index_faults("scan"):  # from the index, past the mirror
            snapshot = self._index.owned_lengths(None if self._key is None else self._key.kid)
        for raw, length in snapshot:
            yield parse_block_key(raw), length

    def verify(self, repair: bool = False, grace_s: float = GRACE_S) -> VerifyReport:
        """Read every indexed record and check it; count unreferenced bytes.

        With ``repair``: drop bad and missing entries, recount the live counters,
        reclaim dead or sparse segments, and delete unregistered segment files older
        than ``grace_s`` seconds (younger ones may belong to a writer that is starting
        up; pass 0 when no other process uses the directory).
        """
        with self._using(writes=repair), self._index_faults("verify"):
            return self._verify(repair, grace_s)

    def close(self) -> None:
        """Refuse new calls (``TierError``), let those in flight finish (their writes complete or
        fail, never land elsewhere), then close the segments, the I/O threads and the index."""
        self._close_after_calls()

    def contains(self, ids: Sequence[BlockId]) -> list[bool]:
        """Present now according to the shared LMDB index (authoritative across processes;
        refreshes this process's mirror, so entries others deleted are forgotten here too)."""
        with self._using():
            return [loc is not None and self._ours(loc) for loc in self._fetch([block_key(bid) for bid in ids])]


def read_cuts(n: int) -> list[int]:
    """Where a read of ``n`` items is cut into parts, each looked up, planned and on the disk before
    the next is looked up: ``HEAD_ITEMS``, then parts of doubling size (the last one less than twice
    what came before it), so that the first reads start at once and each part's lookup (~2-3 us an item) runs
    beside its predecessors' reads (~16 us a 64 KiB item at 4 GB/s)."""
    cuts = [0]
    while n - cuts[-1] >= 2 * max(HEAD_ITEMS, cuts[-1]):
        cuts.append(cuts[-1] + max(HEAD_ITEMS, cuts[-1]))
    return [*cuts, n]
