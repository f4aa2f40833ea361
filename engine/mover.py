"""The mover: every byte the engine moves, on its I/O threads (the "worker" half of the split).

* writing a job into a tier: admission (the placement's), make room, write, commit or roll back;
* write-through and promotion: background copies between tiers, bounded by ``max_background_bytes``;
* demotion: victims the index returns are queued as copies on the demotion lane of the tier below
  (one thread per tier, so a cascade never waits on itself); the writer that needs the room waits
  for them, holding only its tier's space lock (room made for one writer is not taken by another).
  A victim's bytes are read from its tier before its delete, and its space counts as live until
  the delete is done, so nothing reuses it early;
* reads, deletes of forgotten blocks, and pins released by transfers.

Index state changes under the engine lock; bytes move outside it. A tier fault is logged and
counted, loses at most a copy, never an acknowledged block of another tier, and never raises.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstrata.core.buffers import layers_row_addresses
from kvstrata.core.keys import Key
from kvstrata.core.masks import group_by_mask, layers_of
from kvstrata.engine.index import Entry
from kvstrata.engine.plans import Pin, WriteJob
from kvstrata.engine.slots import TierSlot
from kvstrata.engine.state import EngineState
from kvstrata.tiers import BlockId, IdBatch, KeyGroup, ReadStatus, SpanBatch, peekable
from kvstrata.units import total_size

if TYPE_CHECKING:
    from kvstrata.engine.placement import BlockPlacement

log = logging.getLogger("kvstrata.engine")

__all__ = ["MAX_ROOM_ROUNDS", "Mover"]

MAX_ROOM_ROUNDS = 10_000  # evict-until-it-fits rounds before a write gives up

Victims = list[tuple[Key, Entry[Key]]]


class Mover:
    """I/O threads and the transfers they run, over the shared :class:`EngineState`."""

    def __init__(self, state: EngineState, io_threads: int) -> None:
        self.s = state
        self.placement: BlockPlacement  # set by the engine right after construction
        self.pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvstrata-io")
        # loads get their own threads: a restore never waits behind queued stores and write-through
        self.load_pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvstrata-load")
        # demotion into tier i runs on lanes[i - 1]: a cascade only ever waits on a lower lane
        self.lanes = [
            ThreadPoolExecutor(1, thread_name_prefix=f"kvstrata-demote-{idx.name}") for idx in state.tiers[1:]
        ]
        self._demoting = threading.local()  # .kept: keys a demotion on this thread failed to read or write

    def close(self) -> None:
        self.load_pool.shutdown(wait=True)
        self.pool.shutdown(wait=True)
        for lane in self.lanes:
            lane.shutdown(wait=True)

    # ------------------------------------------------------------------ writing into a tier
    def write_into(self, idx: TierSlot, job: WriteJob, source: TierSlot | None) -> list[int]:
        """Write ``job`` into ``idx`` (admission, make room, write, commit). Returns written job positions."""
        with idx.space_lock:
            return self._write_locked(idx, job, source)

    def _write_locked(self, idx: TierSlot, job: WriteJob, source: TierSlot | None) -> list[int]:
        """:meth:`write_into` with ``idx.space_lock`` held."""
        place = self.placement
        todo, shed = place.admit(idx, job)
        if shed:
            self.evict(idx, shed)
        written: list[int] = []
        per_key = place.per_key_bytes(job, todo)
        chunk = max(1, idx.tier.capacity // (2 * per_key))  # a batch larger than the tier streams through
        for start in range(0, len(todo), chunk):
            part = todo[start : start + chunk]
            if not self.make_room(idx, place.part_sizes(job, part)):
                with self.s.lock:
                    idx.counters.write_failures += len(part)
                continue
            items = place.items(job, part, source, self, idx.tier.capabilities.host_spans)
            sent = items if source is None else [it for it in items if it[1] is not None]
            ok = self.safe_write(idx, sent)
            if source is not None and ok.count(True) != len(ok):
                self._keep([it[0][0] for it, k in zip(sent, ok, strict=True) if not k])
            written.extend(self._commit(idx, job, part, items, ok))
        return written

    def _commit(
        self,
        idx: TierSlot,
        job: WriteJob,
        part: list[tuple[int, int]],
        items: Sequence[tuple[BlockId, Any]],
        ok: list[bool],
    ) -> list[int]:
        s = self.s
        written: list[int] = []
        if len(ok) == len(items) and ok.count(True) == len(ok):  # usual: every layer-block written
            with s.lock:
                if job.masks is None and not self.placement.per_layer:  # every key all the job's layers
                    done = [j for j, _ in part]
                    s.record_blocks(idx, [job.keys[j] for j in done], job.mask, [job.parents[j] for j in done])
                    return done
                for j, m in part:
                    s.record(idx, job.keys[j], m, job.parents[j], job.position_of(j))
                    self.placement.committed(idx, job.keys[j], job.parents[j], m, job.position_of(j))
                    written.append(j)
            return written
        status = iter(ok)
        # True: written; False: this tier's write failed; None: never sent (the source could not
        # read it, a fault the source's counters already hold, not this tier's)
        good: dict[BlockId, bool | None] = {it[0]: (next(status) if it[1] is not None else None) for it in items}
        partial: list[BlockId] = []
        with s.lock:
            for j, m in part:
                key = job.keys[j]
                ids = [(key, layer) for layer in layers_of(m)]
                if all(good[b] for b in ids):
                    s.record(idx, key, m, job.parents[j], job.position_of(j))
                    self.placement.committed(idx, key, job.parents[j], m, job.position_of(j))
                    written.append(j)
                else:
                    partial.extend(b for b in ids if good[b])
                    if any(good[b] is False for b in ids):
                        idx.counters.write_failures += 1
        if partial and idx not in s.shared:
            # In a shared tier these stay: a delete by id removes every copy the tier knows of a
            # layer-block, another process's complete one too (a daemon that demoted these blocks
            # while this write read them). Strays are adopted and evicted like others' blocks.
            self.safe_delete(idx, partial)
        return written

    def source_views(self, source: TierSlot, ids: list[BlockId]) -> list[Any]:
        """The bytes of ``ids`` on ``source``: zero-copy views where the tier offers them, else copies."""
        tier = source.tier
        if peekable(tier):
            return list(tier.peek(ids))
        bufs = [np.empty(self.s.layer_bytes[layer], dtype=np.uint8) for _, layer in ids]
        statuses = self.safe_read(source, list(zip(ids, bufs, strict=True)))
        self._keep([bid[0] for bid, st in zip(ids, statuses, strict=True) if st is ReadStatus.ERROR])
        return [b if st is ReadStatus.OK else None for b, st in zip(bufs, statuses, strict=True)]

    # ------------------------------------------------------------------ making room, demotion
    def make_room(self, idx: TierSlot, sizes: list[int]) -> bool:
        """Evict (demoting where useful) until ``sizes`` fit. Caller holds ``idx.space_lock``."""
        need = total_size(sizes)
        if need > idx.tier.capacity:
            return False
        s = self.s
        rescanned = idx not in s.shared  # a private tier holds only what this index knows
        for _ in range(MAX_ROOM_ROUNDS):
            with s.lock:
                try:
                    if idx.tier.has_room(sizes, idx.live_bytes):
                        return True
                except Exception as exc:
                    log.warning("tier %s: has_room failed: %s", idx.name, exc)
                    idx.counters.io_errors += 1
                    return False
                over = max(idx.live_bytes + need - idx.tier.capacity, need // 4, 1)
                victims = self.placement.victims(idx, over)
                if not victims and rescanned:
                    return False
                idx.evict_many(victims)
                s.refresh_best_many([key for key, _ in victims])
                idx.counters.evictions += len(victims)
            if not victims:
                # A shared tier is full of blocks this index never saw (another process wrote
                # them since this engine opened): take them in once, then evict as usual.
                rescanned = True
                self.adopt_scan(idx)
                continue
            self.evict(idx, victims)
        return False

    def adopt_scan(self, idx: TierSlot) -> int:
        """Record what the shared tier ``idx`` holds that its index lacks (other processes'
        writes since start-up, which only a miss would adopt otherwise); returns the layer-blocks
        taken. Costs a scan of the tier's index (about 2.4 us per layer-block on NVMe), so it
        runs only when a write finds no victim left."""
        s = self.s
        try:
            found = list(idx.tier.scan())
        except Exception as exc:
            log.warning("tier %s: scan for blocks of other writers failed: %s", idx.name, exc)
            with s.lock:
                idx.counters.io_errors += 1
            return 0
        n = s.layout.num_layers
        taken = 0
        with s.lock:
            idx.counters.rescans += 1
        for start in range(0, len(found), 4096):  # short lock sections: lookups go on meanwhile
            with s.lock:
                for (key, layer), size in found[start : start + 4096]:
                    e = idx.entries.get(key)
                    if layer >= n or key in idx.evicting or (e is not None and e.layers >> layer & 1):
                        continue
                    s.record(idx, key, 1 << layer, None, nbytes=size)
                    taken += 1
        if taken:
            log.info("tier %s: took in %d layer-blocks other writers stored, to make room", idx.name, taken)
        return taken

    def evict(self, idx: TierSlot, victims: Victims) -> None:
        """Victims (already out of ``idx``'s index) leave: queued as a demotion into the next tier
        (what it lacks and admits), then deleted here; returns once their space is free."""
        lane = self.lanes[idx.position] if idx.position < len(self.lanes) else None
        if lane is None:
            self._drop(idx, victims, None)
            return
        done: Future[None] = lane.submit(self._drop, idx, victims, self.s.tiers[idx.position + 1])
        done.result()

    def _keep(self, keys: list[Key]) -> None:
        """During a demotion out of a shared tier: ``keys`` stay there (see :meth:`_drop`)."""
        kept = getattr(self._demoting, "kept", None)
        if kept is not None and keys:
            kept.update(keys)

    def _drop(self, idx: TierSlot, victims: Victims, nxt: TierSlot | None) -> None:
        """Demote ``victims`` into ``nxt``, then delete them from ``idx`` and release their bytes.

        Out of a private tier a fault loses the demotion (counted), never the space: that tier
        is this process's cache. Out of a persistent or shared tier (NVMe, a mount) a victim is
        deleted only once the tier below holds it, or declined it (admission, no room), or its
        bytes were already gone: one whose read failed (an I/O error, not a miss) or whose write
        below failed (a timeout, a store down) stays where it is, since it may be the only copy
        of an acknowledged block; another process, the daemon, or this engine after a rescan
        moves it later. Its space counts as used on disk until then, so a writer that needs it
        gets a failed write (a miss later), never a lost block."""
        kept: set[Key] = set()
        shared = nxt is not None and idx in self.s.shared
        self._demoting.kept = kept if shared else None
        try:
            if nxt is not None:
                self._demote(idx, nxt, victims)
        except Exception as exc:
            log.warning("tier %s: demoting %d blocks to %s failed: %s", idx.name, len(victims), nxt and nxt.name, exc)
            with self.s.lock:
                idx.counters.io_errors += 1
            if shared:
                kept.update(k for k, _ in victims)
        finally:
            self._demoting.kept = None
            gone = victims
            if kept:
                gone = [(k, e) for k, e in victims if k not in kept]
                log.warning(
                    "tier %s: %d blocks could not be read here or written to %s for their demotion: kept, not deleted",
                    idx.name,
                    len(victims) - len(gone),
                    nxt.name if nxt is not None else "",
                )
                with self.s.lock:
                    idx.counters.demotions_kept += len(victims) - len(gone)
            if gone:
                self.safe_delete(idx, self._ids(idx, gone))
            with self.s.lock:
                idx.release_many(victims)
            self.placement.after_drop(victims)

    def _demote(self, idx: TierSlot, nxt: TierSlot, victims: Victims) -> None:
        for group in group_by_mask(victims):
            mask = group[0][1].layers
            job = WriteJob(
                [k for k, _ in group],
                [e.parent for _, e in group],
                mask,
                [(layer, None) for layer in layers_of(mask)],
                list(range(len(group))),
                positions=self.placement.positions([k for k, _ in group]),
            )
            moved = self.write_into(nxt, job, source=idx)
            with self.s.lock:
                idx.counters.demotions += len(moved)

    # ------------------------------------------------------------------ background copies
    def write_through(self, idx: TierSlot, positions: list[int], job: WriteJob) -> None:
        """Copy what ``idx`` just committed of ``job`` into the next tier, when it is write-through."""
        s = self.s
        nxt = s.below(idx)
        if idx.config.write != "write-through" or nxt is None:
            return
        with s.lock:
            picked = self.placement.write_through_picks(idx, nxt, positions, job)
            cost = sum(s.mask_bytes(m) for _, m in picked)
            if not picked or s.backlog.background_bytes + cost > s.config.engine.max_background_bytes:
                return  # nothing the next tier takes, or too far behind (demotion on eviction instead)
            pinned = s.pin(idx, [job.keys[j] for j, _ in picked])
            s.backlog.background_bytes += cost
        sub = self.placement.copy_job(job, picked, pinned)
        self.pool.submit(self.run_copy, idx, nxt, sub, pinned, cost, False)

    def promote(self, served: Sequence[tuple[Key, TierSlot, Entry[Key]]], loaded: dict[int, Any] | None = None) -> None:
        """Copy blocks served below the top into the first tier above with ``promote``.

        ``loaded``: the load's destination buffers (layer -> rows in ``served``'s order), when the
        load put every layer of each block there. The copy up then comes from them, on the load's
        thread before its result, instead of reading the lower tier again in the background: the
        bytes were checked by the read that just put them there, and an NVMe restore read each
        block from the disk twice (README "Promotion from the load"). Only into a tier whose
        victims need no copy down (write-through, or the last tier): the load's result would
        otherwise wait for a write-back tier's demotions."""
        s = self.s
        by_src: dict[int, list[Key]] = {}
        at: dict[int, list[int]] = {}
        for i, (key, idx, _) in enumerate(served):
            if idx.position > 0:
                by_src.setdefault(idx.position, []).append(key)
                at.setdefault(idx.position, []).append(i)
        if self.placement.per_layer or (loaded is not None and set(loaded) != set(range(s.layout.num_layers))):
            loaded = None  # per-layer jobs carry masks and snapshot positions; a partial load lacks layers
        for pos, keys in by_src.items():
            dst = next((t for t in s.tiers[:pos] if t.config.promote), None)
            if dst is None:
                continue
            src = s.tiers[pos]
            if (
                loaded is not None
                and (dst.config.write == "write-through" or s.below(dst) is None)
                and self._addressable(loaded, at[pos])
                and self._promote_loaded(src, dst, keys, at[pos], loaded)
            ):
                continue
            with s.lock:
                pinned = s.pin(src, self.placement.promotable(src, keys))
                if not pinned:
                    continue
                cost = sum(e.nbytes for _, _, e in pinned)
                if s.backlog.background_bytes + cost > s.config.engine.max_background_bytes:
                    self.unpin(pinned)
                    continue
                s.backlog.background_bytes += cost
            job = self.placement.promote_job(pinned)
            self.pool.submit(self.run_copy, src, dst, job, pinned, cost, True)

    def _addressable(self, loaded: dict[int, Any], rows: list[int]) -> bool:
        """Whether the rows ``rows`` of every layer of ``loaded`` are host memory copied by
        address. Device memory (a GPU's KV cache) and strided views are not: they would go
        through a copy a layer-block, on the load's critical path, so their promotion still
        reads the lower tier in the background."""
        layers = sorted(loaded)
        sizes = [self.s.layer_bytes[layer] for layer in layers]
        try:
            return layers_row_addresses([loaded[layer] for layer in layers], rows, sizes, False) is not None
        except (IndexError, TypeError, ValueError):
            return False

    def _promote_loaded(
        self, src: TierSlot, dst: TierSlot, keys: list[Key], rows: list[int], loaded: dict[int, Any]
    ) -> bool:
        """:meth:`promote` from the load's buffers (``rows``: each key's row in them). False:
        another writer holds ``dst``'s space (a store making room, for as long as its copy): the
        load's result does not wait for it, and the promotion reads the lower tier in the
        background instead."""
        s = self.s
        with s.lock:
            entries = src.entries
            picked = [
                (k, r, e.parent)
                for k, r in zip(keys, rows, strict=True)
                if (e := entries.get(k)) is not None and e.layers == s.all_mask
            ]
        if not picked:
            return True
        if not dst.space_lock.acquire(blocking=False):
            with s.lock:
                dst.counters.promotions_deferred += 1
            return False
        try:
            job = WriteJob(
                [k for k, _, _ in picked],
                [p for _, _, p in picked],
                s.all_mask,
                sorted(loaded.items()),
                [r for _, r, _ in picked],
            )
            written = self._write_locked(dst, job, source=None)
        except Exception:  # never fail a load over its promotion
            log.exception("promotion %s -> %s from the load failed", src.name, dst.name)
            return True
        finally:
            dst.space_lock.release()
        with s.lock:
            dst.counters.promotions += len(written)
        return True

    def run_copy(
        self, src: TierSlot, dst: TierSlot, job: WriteJob, pinned: list[Pin], cost: int, promote: bool
    ) -> None:
        s = self.s
        try:
            written = self.write_into(dst, job, source=src)
            if promote:
                with s.lock:
                    dst.counters.promotions += len(written)
            elif written:
                self.write_through(dst, written, job)
        except Exception:
            log.exception("background copy %s -> %s failed", src.name, dst.name)
        finally:
            with s.lock:
                self.unpin(pinned)
                s.backlog.background_bytes -= cost
                s.notify_if_idle()

    # ------------------------------------------------------------------ pins, quarantine
    def unpin(self, pinned: Sequence[Pin]) -> None:
        """Lock held: release pins; an entry forgotten while pinned is deleted now."""
        for idx, key, e in pinned:  # BlockIndex.unpin, one pin at a time, without a call each
            e.pins -= 1
            if e.pins == 0 and e.doomed:
                self.pool.submit(self.delete_entry, idx, key, e)

    def forget(self, idx: TierSlot, key: Key, missing: bool = False) -> None:
        """Lock held: drop a block a tier failed to serve (quarantine corrupt/unreadable data).

        It leaves the index at once; its bytes are deleted when no transfer pins it any more,
        and until then the key cannot be written into this tier again. ``missing``: the tier no
        longer had it; in a shared tier nothing is deleted then, since another process moved or
        wrote it again, and a delete by id would remove that copy.
        """
        entry = idx.entries.get(key)
        if entry is None or entry.doomed:
            return
        idx.evict(key, entry)
        self.s.refresh_best(key)
        if missing and idx in self.s.shared:
            idx.release(key, entry.nbytes)
            self.placement.after_drop([(key, entry)])
            return
        entry.doomed = True
        if entry.pins == 0:
            self.pool.submit(self.delete_entry, idx, key, entry)
        self.placement.after_drop([(key, entry)])

    def delete_entry(self, idx: TierSlot, key: Key, entry: Entry[Key]) -> None:
        self.safe_delete(idx, [(key, layer) for layer in layers_of(entry.layers)])
        with self.s.lock:
            idx.release(key, entry.nbytes)

    # ------------------------------------------------------------------ tier calls, faults counted
    def safe_write(self, idx: TierSlot, items: Sequence[tuple[BlockId, Any]]) -> list[bool]:
        try:
            ok = idx.tier.write(items)
        except Exception as exc:
            log.warning("tier %s: write of %d layer-blocks failed: %s", idx.name, len(items), exc)
            with self.s.lock:
                idx.counters.io_errors += 1
            return [False] * len(items)
        done: Sequence[tuple[BlockId, Any]] = items
        if ok.count(True) != len(items):
            done = [it for it, k in zip(items, ok, strict=True) if k]
        written = self._bytes_of(done)
        with self.s.lock:
            idx.counters.bytes_written += written
            idx.counters.layer_blocks_written += len(done)
        return ok

    def safe_read(self, idx: TierSlot, items: Sequence[tuple[BlockId, Any]]) -> list[ReadStatus]:
        try:
            statuses = idx.tier.read(items)
        except Exception as exc:
            log.warning("tier %s: read of %d layer-blocks failed: %s", idx.name, len(items), exc)
            statuses = [ReadStatus.ERROR] * len(items)
        ok = ReadStatus.OK
        every = statuses.count(ok) == len(statuses)
        done: Sequence[tuple[BlockId, Any]] = items
        if not every:
            done = [it for it, st in zip(items, statuses, strict=True) if st is ok]
        got = self._bytes_of(done)
        with self.s.lock:
            c = idx.counters
            c.layer_blocks_read += len(done)
            c.bytes_read += got
            if not every:
                c.checksum_failures += statuses.count(ReadStatus.CORRUPT)
                c.io_errors += statuses.count(ReadStatus.ERROR)
        return statuses

    def _bytes_of(self, items: Sequence[tuple[BlockId, Any]]) -> int:
        """Bytes of the layer-blocks ``items`` name (their layers' sizes)."""
        if type(items) is SpanBatch:
            return items.nbytes
        return sum(map(self.s.layer_bytes.__getitem__, [it[0][1] for it in items]))

    @staticmethod
    def _ids(idx: TierSlot, victims: Victims) -> Sequence[BlockId]:
        """Every layer-block of ``victims``: grouped by layer for a ``host_spans`` tier (nothing
        built per layer-block), else key by key."""
        if idx.tier.capabilities.host_spans:
            masks = [e.layers for _, e in victims]
            groups = [victims] if masks.count(masks[0]) == len(masks) else group_by_mask(victims)
            keys = [[k for k, _ in group] for group in groups]
            return IdBatch(
                [
                    KeyGroup(layer, ks)
                    for group, ks in zip(groups, keys, strict=True)
                    for layer in layers_of(group[0][1].layers)
                ]
            )
        return [(k, layer) for k, e in victims for layer in layers_of(e.layers)]

    def safe_delete(self, idx: TierSlot, ids: Sequence[BlockId]) -> None:
        try:
            idx.tier.delete(ids)
        except Exception as exc:
            log.warning("tier %s: delete failed: %s", idx.name, exc)
            with self.s.lock:
                idx.counters.io_errors += 1
