"""Publishing: objects built from a write batch, tombstones for deletes."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from kvstrata.core.buffers import Buffer, copy_bytes, nbytes
from kvstrata.tiers.base import BlockId
from kvstrata.tiers.fs.catalog import ObjectInfo, TombInfo
from kvstrata.tiers.fs.format import Name, Rec, pack_header, pack_tomb, plan_object, record_tag
from kvstrata.tiers.fs.state import FSState
from kvstrata.tiers.records import acceptable_buffer, block_key, checksum, key_or_none

log = logging.getLogger("kvstrata.tiers.fs")


class Publisher(FSState):
    """Writes objects and tombstones (objects never change once published)."""

    def _next_name(self) -> Name:
        with self._name_lock:
            self._last_ts = max(int(time.time() * 1000), self._last_ts)
            self._seq += 1
            return Name(self._last_ts, self._writer, self._seq)

    def _build(
        self, items: Sequence[tuple[BlockId, Buffer]], lineage: tuple[str, ...] = ()
    ) -> tuple[ObjectInfo, memoryview]:
        """Pack records into one object: header table, then records at 64-byte offsets (keyed
        and named in the header with a secret, see fs.format); ``lineage``: compaction's, the
        objects it replaces."""
        lengths = [nbytes(buf) for _, buf in items]
        key = self._key
        size, offsets = plan_object(lengths, keyed=key is not None, lineage=lineage)
        data = np.zeros(size, dtype=np.uint8)
        entries: list[tuple[bytes, Rec]] = []
        for (bid, buf), off, n in zip(items, offsets, lengths, strict=True):
            dst = data[off : off + n]
            copy_bytes(dst, buf)
            bkey = block_key(bid)
            rec = Rec(off, n, checksum(dst)) if key is None else Rec(off, n, 0, record_tag(key, bkey, dst))
            entries.append((bkey, rec))
        name = self._next_name()
        header = pack_header(entries, key, name.stem, lineage)
        data[: len(header)] = np.frombuffer(header, dtype=np.uint8)
        return ObjectInfo(name, size, dict(entries), area=self.area, lineage=lineage), data.data

    def _publish_tomb(self, groups: dict[str, list[bytes]]) -> None:
        """Record deletes (already applied to the catalog) in a tombstone; TierError if the store
        fails, in which case they stay pending and go into the next tombstone published."""
        with self._lock:
            for stem, bkeys in groups.items():
                self._pending.setdefault(stem, set()).update(bkeys)
        self._flush_pending()

    def _flush_pending(self) -> None:
        """Publish every pending delete in one tombstone; TierError when the store fails."""
        with self._flush_lock:
            with self._lock:
                groups = {stem: sorted(bkeys) for stem, bkeys in self._pending.items()}
            if not groups:
                return
            name = self._next_name()
            self.store.put(name.tomb_path(self.area), pack_tomb(groups, self._key, name.stem))
            with self._lock:
                for stem, bkeys in groups.items():
                    left = self._pending.get(stem, set())
                    left.difference_update(bkeys)
                    if not left:
                        self._pending.pop(stem, None)
                now = time.time()
                self.catalog.add_tomb(TombInfo(name, frozenset(groups), now), {}, now)
                self.counters.tombstones_written += 1

    def _acceptable(self, bid: BlockId, buf: Buffer) -> bool:
        if key_or_none(bid) is None or bid[1] >= self.context.layout.num_layers:
            return False
        return acceptable_buffer(buf, self.context.layout.layer_nbytes(bid[1]))
