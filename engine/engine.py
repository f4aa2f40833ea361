"""The kvstrata engine: lookup, store and load of per-layer KV blocks across tiers.

Data path::

    store ──> top tier ──write-through──> next tier ──> ... (admission per tier)
                  │ eviction: demote to the next tier if it lacks the block, else drop
    load  <── fastest tier holding every requested layer ──promotion──> upper tier

Everything that moves bytes runs on the engine's I/O threads; the caller gets
futures. Index state changes happen under one lock, and bytes move outside it
between two phases (prepare: pin/reserve; complete: commit or roll back), so a
failed transfer leaves the index as it was and pinned blocks are never evicted.
Tier faults become misses and are counted; they are never raised to the caller.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstrata.config import KVStrataConfig, load_config, resolve_auto_capacity
from kvstrata.engine.buffers import Buffer, is_contiguous, nbytes
from kvstrata.engine.index import TierIndex
from kvstrata.engine.keys import BlockHasher, Key, Namespace
from kvstrata.engine.layout import KVLayout
from kvstrata.errors import KVStrataError
from kvstrata.policies import ADMISSION, EVICTION
from kvstrata.tiers import TIERS, BlockId, ReadStatus, TierContext

log = logging.getLogger("kvstrata.engine")

#: Longest a load waits for a queued store of a block it needs (then loads what is there).
INFLIGHT_WAIT_S = 30.0

Buffers = Mapping[int, Any]  # layer -> sequence of per-key buffers, or an array indexed by key position
Pin = tuple[TierIndex, Key, Any]  # (tier, key, entry) of a pinned block


@dataclass(frozen=True)
class LookupResult:
    """How much of a prefix can be restored, and from where."""

    num_blocks: int
    tier_positions: list[int]  # position (0 = top) of the tier serving each restorable block
    tier_names: tuple[str, ...]
    block_size: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def tiers(self) -> list[str]:
        """Name of the tier serving each restorable block."""
        return list(map(self.tier_names.__getitem__, self.tier_positions))


@dataclass
class StoreResult:
    stored: int = 0  # blocks newly written to the top tier
    present: int = 0  # blocks the top tier already had
    failed: int = 0  # blocks that could not be written (tier fault or no room)
    dropped: bool = False  # the whole batch was dropped because the queue was full


@dataclass
class LoadResult:
    """Outcome of a load: blocks ``0 .. loaded_blocks`` are in the caller's buffers."""

    requested: int
    loaded_blocks: int
    tiers: list[str]
    failed_keys: list[Key] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.loaded_blocks == self.requested


class LoadHandle:
    """An in-flight load. ``wait_layer(l)`` returns once layer ``l`` is in the buffers."""

    def __init__(self, layers: Sequence[int]) -> None:
        self.future: Future[LoadResult] = Future()
        self._events = {layer: threading.Event() for layer in layers}

    def _layer_done(self, layer: int) -> None:
        self._events[layer].set()

    def _all_done(self) -> None:
        for ev in self._events.values():
            ev.set()

    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        return self._events[layer].wait(timeout)

    def result(self, timeout: float | None = None) -> LoadResult:
        return self.future.result(timeout)

    def done(self) -> bool:
        return self.future.done()


def _done_future(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


class Engine:
    """A tiered KV block store. Use as a context manager or call :meth:`close`."""

    def __init__(
        self,
        config: KVStrataConfig | Mapping[str, Any] | str | None = None,
        *,
        layout: KVLayout,
        namespace: Namespace | None = None,
        tenant_salt: str = "",
    ) -> None:
        self.config = load_config(config)
        self.layout = layout
        self.namespace = namespace or Namespace(
            model=layout.model,
            kv_dtype=layout.layers[0].dtype,
            layout_fingerprint=layout.fingerprint(),
            block_size=layout.block_size,
            tenant_salt=tenant_salt,
        )
        self.hasher = BlockHasher(self.namespace)
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._best: dict[Key, int] = {}  # key -> position of the fastest tier holding all layers
        self._all_mask = layout.all_layers_mask
        self._layer_bytes = [spec.nbytes for spec in layout.layers]
        self._pending_stores = 0
        self._pending_bytes = 0
        self._background_bytes = 0
        self._dropped_stores = 0
        self._dropped_blocks = 0
        # keys of store batches queued or being written to the top tier -> (layer mask, done event):
        # lookups count them and loads wait for them (a process reads its own writes at once)
        self._inflight: dict[Key, tuple[int, threading.Event]] = {}
        self._closed = False
        self.tiers: list[TierIndex] = []
        try:
            self._open_tiers()
        except BaseException:
            self._close_tiers()
            raise
        self._tier_names = tuple(idx.name for idx in self.tiers)
        # tiers other processes write to (a directory on disk, a cluster pool): asked on a miss
        caps = [idx.tier.capabilities for idx in self.tiers]
        self._shared_tiers = [idx for idx, c in zip(self.tiers, caps, strict=True) if c.persistent or c.shared]
        self._pool = ThreadPoolExecutor(self.config.engine.io_threads, thread_name_prefix="kvstrata-io")
        # loads get their own threads: a restore never waits behind queued stores and write-through
        self._load_pool = ThreadPoolExecutor(self.config.engine.io_threads, thread_name_prefix="kvstrata-load")

    # ------------------------------------------------------------------ lifecycle
    def _open_tiers(self) -> None:
        ctx = TierContext(self.layout, self.namespace)
        for pos, tc in enumerate(self.config.tiers):
            cls = TIERS.get(tc.kind)
            tier = cls(tc.name, resolve_auto_capacity(tc), tc.options, ctx)
            idx = TierIndex(pos, tc, tier, EVICTION.get(tc.eviction)(), ADMISSION.get(tc.admission)())
            self.tiers.append(idx)
            self._rebuild(idx)

    def _rebuild(self, idx: TierIndex) -> None:
        for (key, layer), size in idx.tier.scan():
            if layer >= self.layout.num_layers:
                continue
            entry = idx.add(key, 1 << layer, size, None)
            idx.live_bytes += size
            if entry.layers == self._all_mask:
                self._mark_complete(key, idx.position)

    def close(self) -> None:
        """Finish queued work and close every tier. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.flush()  # queued stores still schedule their write-through: let the chain finish first
        self._load_pool.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        self._close_tiers()

    def _close_tiers(self) -> None:
        for idx in self.tiers:
            try:
                idx.tier.close()
            except Exception:  # pragma: no cover - best effort
                log.exception("closing tier %s failed", idx.name)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued store, write-through and promotion has finished."""
        with self._idle:
            return self._idle.wait_for(lambda: not (self._pending_stores or self._background_bytes), timeout)

    def _notify_if_idle(self) -> None:
        """Lock held: wake ``flush`` waiters when nothing is queued any more."""
        if not (self._pending_stores or self._background_bytes):
            self._idle.notify_all()

    # ------------------------------------------------------------------ keys / lookup
    def keys_for_tokens(self, tokens: Sequence[int] | np.ndarray) -> list[Key]:
        return self.hasher.keys_for_tokens(tokens)

    def lookup(self, keys: Sequence[Key], layers: Sequence[int] | None = None, *, count: bool = True) -> LookupResult:
        """Longest restorable prefix of ``keys`` for ``layers`` (default: all), with the tier of each block.

        Blocks of stores still queued count as held by the top tier (a load waits for them).
        ``count=False`` leaves the hit/miss counters alone (a scheduler asking on a worker's behalf).
        """
        full = layers is None or self._mask(layers) == self._all_mask
        mask = self._all_mask if layers is None else self._mask(layers)
        with self._lock:
            if full:
                served: list[Any] = list(map(self._best.get, keys))  # one C-level pass
                if None in served:
                    del served[served.index(None) :]
            else:
                served = self._lookup_partial(keys, mask)
            if len(served) < len(keys) and self._inflight:
                self._extend_inflight(keys, served, mask, full)
            n = len(served)
        if n < len(keys) and self._shared_tiers:
            served += self._adopt(keys[n:], mask)
            n = len(served)
        if count:
            with self._lock:
                self._count_lookup(served, len(keys) - n)
        return LookupResult(n, served, self._tier_names, self.layout.block_size)

    def _extend_inflight(self, keys: Sequence[Key], served: list[Any], mask: int, full: bool) -> None:
        """Lock held: extend ``served`` over blocks held by a tier or by a queued store (top tier)."""
        for key in keys[len(served) :]:
            pos = self._best.get(key) if full else self._serving_tier(key, mask)
            if pos is None:
                pending = self._inflight.get(key)
                if pending is None or pending[0] & mask != mask:
                    return
                pos = 0
            served.append(pos)

    def probe(self, keys: Sequence[Key], layers: Sequence[int]) -> LookupResult:
        """Longest prefix of ``keys`` the tiers shared between processes hold *now*, asking them
        directly (their own index, e.g. the NVMe tier's LMDB) and caching nothing: for a process
        that only answers lookups for others (vLLM's scheduler) and must not trust old answers."""
        self._check_open()
        served = self._adopt(keys, self._mask(layers), adopt=False) if self._shared_tiers else []
        return LookupResult(len(served), served, self._tier_names, self.layout.block_size)

    def _adopt(self, keys: Sequence[Key], mask: int, adopt: bool = True) -> list[int]:
        """Probe tiers shared with other processes for blocks this engine has not seen yet
        (another instance or worker stored them) and adopt those into the index. Probes
        1, 4, 16, ... keys at a time, so a cold prompt costs one small probe."""
        layers = _layers_of(mask)
        served: list[int] = []
        start, step = 0, 1
        while start < len(keys):
            chunk = keys[start : start + step]
            found = self._probe(chunk, layers, adopt)
            served += found
            if len(found) < len(chunk):
                break
            start, step = start + step, min(step * 4, 256)
        return served

    def _probe(self, keys: Sequence[Key], layers: list[int], adopt: bool = True) -> list[int]:
        """Tier position serving each key of the longest found prefix of ``keys``."""
        ids = [(key, layer) for key in keys for layer in layers]
        present = [False] * len(keys)
        where = [0] * len(keys)
        for idx in reversed(self._shared_tiers):  # the fastest holder wins
            try:
                got = idx.tier.contains(ids)
            except Exception as exc:
                log.warning("tier %s: contains() failed: %s", idx.name, exc)
                continue
            if got is None:
                continue
            per = len(layers)
            for i in range(len(keys)):
                if all(got[i * per : (i + 1) * per]):
                    present[i], where[i] = True, idx.position
        n = present.index(False) if False in present else len(keys)
        if not adopt:
            return where[:n]
        with self._lock:
            for key, pos in zip(keys[:n], where[:n], strict=True):
                idx = self.tiers[pos]
                e = idx.entries.get(key)
                missing = sum(1 << layer for layer in layers) & ~(e.layers if e else 0)
                if missing and key not in idx.evicting:
                    size = sum(self._layer_bytes[layer] for layer in _layers_of(missing))
                    entry = idx.add(key, missing, size, None)
                    idx.live_bytes += size
                    if entry.layers == self._all_mask:
                        self._mark_complete(key, pos)
        return where[:n]

    def _lookup_partial(self, keys: Sequence[Key], mask: int) -> list[int]:
        served: list[int] = []
        for key in keys:
            pos = self._serving_tier(key, mask)
            if pos is None:
                break
            served.append(pos)
        return served

    def _serving_tier(self, key: Key, mask: int) -> int | None:
        for idx in self.tiers:
            e = idx.entries.get(key)
            if e is not None and e.layers & mask == mask:
                return idx.position
        return None

    def _count_lookup(self, served: list[int], missing: int) -> None:
        below = missing
        for idx in reversed(self.tiers):
            n = served.count(idx.position) if len(self.tiers) > 1 else len(served)
            idx.counters.hits += n
            idx.counters.misses += below
            below += n

    def _mask(self, layers: Sequence[int] | Mapping[int, Any]) -> int:
        mask = 0
        for layer in layers:
            if not 0 <= layer < self.layout.num_layers:
                raise ValueError(f"layer {layer} out of range 0..{self.layout.num_layers - 1}")
            mask |= 1 << layer
        return mask

    def _mark_complete(self, key: Key, pos: int) -> None:
        cur = self._best.get(key)
        if cur is None or pos < cur:
            self._best[key] = pos

    def _refresh_best(self, key: Key) -> None:
        for idx in self.tiers:
            e = idx.entries.get(key)
            if e is not None and e.layers == self._all_mask:
                self._best[key] = idx.position
                return
        self._best.pop(key, None)

    # ------------------------------------------------------------------ store
    def store(self, keys: Sequence[Key], buffers: Buffers, parent: Key | None = None) -> Future[StoreResult]:
        """Store blocks asynchronously. ``buffers[layer][i]`` holds layer ``layer`` of ``keys[i]``.

        ``keys`` are consecutive blocks of one chain (``parent`` precedes ``keys[0]``).
        The caller must keep the buffers unchanged until the future completes. When the
        store queue is full the batch is dropped and counted; this never blocks.
        """
        self._check_open()
        mask = self._mask(buffers)
        self._check_sizes(keys, buffers)
        top = self.tiers[0]
        with self._lock:
            todo = []
            present = []
            for i, key in enumerate(keys):
                e = top.entries.get(key)
                if e is not None and e.layers & mask == mask:
                    top.eviction.access(key)
                    present.append(key)
                elif key not in top.evicting:
                    todo.append(i)
            result = StoreResult(present=len(keys) - len(todo))
            if not todo:
                return _done_future(result)
            cost = len(todo) * sum(self._layer_bytes[layer] for layer in buffers)
            cfg = self.config.engine
            if self._pending_stores >= cfg.max_pending_stores or self._pending_bytes + cost > cfg.max_pending_bytes:
                self._dropped_stores += 1
                self._dropped_blocks += len(todo)
                result.dropped = True
                return _done_future(result)
            self._pending_stores += 1
            self._pending_bytes += cost
            # the batch's blocks already in the top tier (and its parent) must survive the batch
            pinned = self._pin(top, present + ([parent] if parent is not None else []))
            parents = [keys[i - 1] if i > 0 else parent for i in todo]
            job = _WriteJob(
                [keys[i] for i in todo], parents, mask, [(layer, buffers[layer]) for layer in buffers], todo
            )
            for key in job.keys:
                self._inflight[key] = (mask, job.done)
            return self._pool.submit(self._run_store, job, result, cost, pinned)

    def store_sync(self, keys: Sequence[Key], buffers: Buffers, parent: Key | None = None) -> StoreResult:
        return self.store(keys, buffers, parent).result()

    def _check_sizes(self, keys: Sequence[Key], buffers: Buffers) -> None:
        for layer, bufs in buffers.items():
            want = self._layer_bytes[layer]
            if len(bufs) < len(keys):
                raise ValueError(f"layer {layer}: {len(bufs)} buffers for {len(keys)} keys")
            if not len(keys):
                continue
            got = nbytes(bufs[0])
            if got != want:
                raise ValueError(f"layer {layer}: buffer has {got} bytes, a layer-block is {want}")
            if not is_contiguous(bufs[0]):
                raise ValueError(f"layer {layer}: buffers must be contiguous")

    def _run_store(self, job: _WriteJob, result: StoreResult, cost: int, pinned: list[Pin]) -> StoreResult:
        try:
            written = self._write_into(self.tiers[0], job, source=None)
            result.stored = len(written)
            result.failed = len(job.keys) - len(written)
            if written:
                self._schedule_write_through(self.tiers[0], written, job)
            return result
        except Exception:  # a tier fault must never reach the caller as an exception
            log.exception("store failed")
            result.failed = len(job.keys)
            return result
        finally:
            with self._lock:
                self._unpin(pinned)
                for key in job.keys:
                    if self._inflight.get(key, (0, None))[1] is job.done:
                        del self._inflight[key]
                self._pending_stores -= 1
                self._pending_bytes -= cost
                self._notify_if_idle()
            job.done.set()

    # ------------------------------------------------------------------ writing into a tier
    def _write_into(self, idx: TierIndex, job: _WriteJob, source: TierIndex | None) -> list[int]:
        """Write ``job`` into ``idx`` (admission, make room, write, commit). Returns written job positions."""
        with idx.space_lock:
            with self._lock:
                positions = []
                for j, key in enumerate(job.keys):
                    e = idx.entries.get(key)
                    if e is not None and e.layers & job.mask == job.mask:
                        continue
                    if key in idx.evicting:
                        continue
                    if idx.admission.admit(key):
                        positions.append(j)
                    else:
                        idx.counters.not_admitted += 1
            written: list[int] = []
            per_key = sum(self._layer_bytes[layer] for layer, _ in job.layer_bufs)
            chunk = max(1, idx.tier.capacity // (2 * per_key))  # a batch larger than the tier streams through
            for start in range(0, len(positions), chunk):
                part = positions[start : start + chunk]
                sizes = [self._layer_bytes[layer] for _ in part for layer, _ in job.layer_bufs]
                if not self._make_room(idx, sizes):
                    with self._lock:
                        idx.counters.write_failures += len(part)
                    continue
                items = self._items(job, part, source)
                ok = self._safe_write(idx, [it for it in items if it[1] is not None])
                written.extend(self._commit_write(idx, job, part, items, ok))
            return written

    def _items(self, job: _WriteJob, positions: list[int], source: TierIndex | None) -> list[tuple[BlockId, Any]]:
        """Layer-major: one layer's blocks are adjacent, so tiers that pack records in order
        (nvme) serve a layer-by-layer load of many keys with a few large reads."""
        ids = [(job.keys[j], layer) for layer, _ in job.layer_bufs for j in positions]
        if source is None:
            bufs = [lb[job.src_index[j]] for _, lb in job.layer_bufs for j in positions]
        else:
            bufs = self._source_views(source, ids)
        return list(zip(ids, bufs, strict=True))

    def _source_views(self, source: TierIndex, ids: list[BlockId]) -> list[Any]:
        peek: Callable[[Sequence[BlockId]], list[Any]] | None = getattr(source.tier, "peek", None)
        if peek is not None:
            return peek(ids)
        bufs = [np.empty(self._layer_bytes[layer], dtype=np.uint8) for _, layer in ids]
        statuses = self._safe_read(source, list(zip(ids, bufs, strict=True)))
        return [b if s is ReadStatus.OK else None for b, s in zip(bufs, statuses, strict=True)]

    def _safe_write(self, idx: TierIndex, items: list[tuple[BlockId, Any]]) -> list[bool]:
        try:
            ok = idx.tier.write(items)
        except Exception as exc:
            log.warning("tier %s: write of %d layer-blocks failed: %s", idx.name, len(items), exc)
            with self._lock:
                idx.counters.io_errors += 1
            return [False] * len(items)
        with self._lock:
            n = sum(ok)
            idx.counters.bytes_written += sum(self._layer_bytes[it[0][1]] for it, k in zip(items, ok, strict=True) if k)
            idx.counters.layer_blocks_written += n
        return ok

    def _commit_write(
        self,
        idx: TierIndex,
        job: _WriteJob,
        positions: list[int],
        items: list[tuple[BlockId, Any]],
        ok: list[bool],
    ) -> list[int]:
        status = iter(ok)
        good: dict[BlockId, bool] = {it[0]: (next(status) if it[1] is not None else False) for it in items}
        written: list[int] = []
        partial: list[BlockId] = []
        with self._lock:
            for j in positions:
                key = job.keys[j]
                ids = [(key, layer) for layer, _ in job.layer_bufs]
                if all(good[b] for b in ids):
                    size = sum(self._layer_bytes[b[1]] for b in ids)
                    entry = idx.add(key, job.mask, size, job.parents[j])
                    idx.live_bytes += size
                    if entry.layers == self._all_mask:
                        self._mark_complete(key, idx.position)
                    written.append(j)
                else:
                    partial.extend(b for b in ids if good[b])
                    idx.counters.write_failures += 1
        if partial:
            self._safe_delete(idx, partial)
        return written

    def _safe_delete(self, idx: TierIndex, ids: list[BlockId]) -> None:
        try:
            idx.tier.delete(ids)
        except Exception as exc:
            log.warning("tier %s: delete failed: %s", idx.name, exc)
            with self._lock:
                idx.counters.io_errors += 1

    def _make_room(self, idx: TierIndex, sizes: list[int]) -> bool:
        """Evict (demoting where useful) until ``sizes`` fit. Caller holds ``idx.space_lock``."""
        need = sum(sizes)
        if need > idx.tier.capacity:
            return False
        for _ in range(10_000):
            with self._lock:
                try:
                    if idx.tier.has_room(sizes, idx.live_bytes):
                        return True
                except Exception as exc:
                    log.warning("tier %s: has_room failed: %s", idx.name, exc)
                    idx.counters.io_errors += 1
                    return False
                over = max(idx.live_bytes + need - idx.tier.capacity, need // 4, 1)
                victims = idx.pick_victims(over)
                if not victims:
                    return False
                for key, _entry in victims:
                    idx.pop(key)
                    idx.evicting.add(key)
                    self._refresh_best(key)
                    idx.counters.evictions += 1
            self._evict(idx, victims)
        return False

    def _evict(self, idx: TierIndex, victims: list[tuple[Key, Any]]) -> None:
        """Demote victims the next tier lacks (and admits), then delete them here.

        A fault while demoting loses the demotion (counted), never the space: the
        victims are deleted and their bytes released in any case.
        """
        nxt = self.tiers[idx.position + 1] if idx.position + 1 < len(self.tiers) else None
        try:
            if nxt is not None:
                self._demote(idx, nxt, victims)
        except Exception as exc:
            log.warning("tier %s: demoting %d blocks to %s failed: %s", idx.name, len(victims), nxt, exc)
            with self._lock:
                idx.counters.io_errors += 1
        finally:
            ids = [(k, layer) for k, e in victims for layer in _layers_of(e.layers)]
            self._safe_delete(idx, ids)
            with self._lock:
                for key, entry in victims:
                    idx.live_bytes -= entry.nbytes
                    idx.evicting.discard(key)

    def _demote(self, idx: TierIndex, nxt: TierIndex, victims: list[tuple[Key, Any]]) -> None:
        for group in _group_by_mask(victims):
            job = _WriteJob(
                [k for k, _ in group],
                [e.parent for _, e in group],
                group[0][1].layers,
                [(layer, None) for layer in _layers_of(group[0][1].layers)],
                list(range(len(group))),
            )
            moved = self._write_into(nxt, job, source=idx)
            with self._lock:
                idx.counters.demotions += len(moved)

    # ------------------------------------------------------------------ background movement
    def _schedule_write_through(self, idx: TierIndex, positions: list[int], job: _WriteJob) -> None:
        if idx.config.write != "write-through" or idx.position + 1 >= len(self.tiers):
            return
        keys = [job.keys[j] for j in positions]
        cost = len(keys) * sum(self._layer_bytes[layer] for layer, _ in job.layer_bufs)
        with self._lock:
            if self._background_bytes + cost > self.config.engine.max_background_bytes:
                return  # too far behind: the blocks will be demoted on eviction instead
            pinned = self._pin(idx, keys)
            self._background_bytes += cost
        sub = _WriteJob(
            [k for _, k, _ in pinned],
            [e.parent for _, _, e in pinned],
            job.mask,
            [(layer, None) for layer, _ in job.layer_bufs],
            list(range(len(pinned))),
        )
        self._pool.submit(self._run_copy, idx, self.tiers[idx.position + 1], sub, pinned, cost, False)

    def _run_copy(
        self, src: TierIndex, dst: TierIndex, job: _WriteJob, pinned: list[Pin], cost: int, promote: bool
    ) -> None:
        try:
            written = self._write_into(dst, job, source=src)
            if promote:
                with self._lock:
                    dst.counters.promotions += len(written)
            elif written:
                self._schedule_write_through(dst, written, job)
        except Exception:
            log.exception("background copy %s -> %s failed", src.name, dst.name)
        finally:
            with self._lock:
                self._unpin(pinned)
                self._background_bytes -= cost
                self._notify_if_idle()

    def _pin(self, idx: TierIndex, keys: Sequence[Key]) -> list[Pin]:
        """Lock held: pin the entries of ``keys`` that ``idx`` holds (they cannot be evicted)."""
        pinned: list[Pin] = []
        for key in keys:
            e = idx.entries.get(key)
            if e is not None:
                e.pins += 1
                pinned.append((idx, key, e))
        return pinned

    def _unpin(self, pinned: Sequence[Pin]) -> None:
        """Lock held: release pins; an entry forgotten while pinned is deleted now."""
        for idx, key, e in pinned:
            e.pins -= 1
            if e.pins == 0 and e.doomed:
                self._pool.submit(self._delete_entry, idx, key, e)

    # ------------------------------------------------------------------ load
    def _check_open(self) -> None:
        if self._closed:
            raise KVStrataError("the engine is closed")

    def load(self, keys: Sequence[Key], buffers: Buffers) -> LoadHandle:
        """Load blocks into caller buffers (``buffers[layer][i]`` for ``keys[i]``), layer by layer.

        Loads the longest restorable prefix of ``keys``; ``LoadResult.loaded_blocks``
        says how many blocks arrived intact. Corrupt or unreadable blocks are misses.
        Blocks of stores still queued are waited for, then loaded.
        """
        self._check_open()
        mask = self._mask(buffers)
        self._check_sizes(keys, buffers)
        layers = sorted(buffers)
        handle = LoadHandle(layers)
        with self._lock:
            waits = self._inflight_waits(keys, mask) if self._inflight else []
            plan = [] if waits else self._plan_load(keys, mask)
        if waits:
            self._load_pool.submit(self._deferred_load, waits, keys, buffers, mask, layers, handle)
        elif not plan:
            handle.future.set_result(LoadResult(len(keys), 0, []))
            handle._all_done()
        else:
            self._load_pool.submit(self._run_load, plan, buffers, layers, handle, len(keys))
        return handle

    def _plan_load(self, keys: Sequence[Key], mask: int) -> list[tuple[Key, TierIndex, Any]]:
        """Lock held: the serving tier of each block of the restorable prefix, pinned."""
        plan: list[tuple[Key, TierIndex, Any]] = []
        for key in keys:
            pos = self._serving_tier(key, mask)
            if pos is None:
                break
            idx = self.tiers[pos]
            e = idx.entries[key]
            e.pins += 1
            idx.eviction.access(key)
            plan.append((key, idx, e))
        return plan

    def _inflight_waits(self, keys: Sequence[Key], mask: int) -> list[threading.Event]:
        """Lock held: the queued stores the restorable prefix of ``keys`` depends on."""
        waits: dict[int, threading.Event] = {}
        for key in keys:
            if self._serving_tier(key, mask) is not None:
                continue
            pending = self._inflight.get(key)
            if pending is None or pending[0] & mask != mask:
                break
            waits[id(pending[1])] = pending[1]
        return list(waits.values())

    def _deferred_load(
        self,
        waits: list[threading.Event],
        keys: Sequence[Key],
        buffers: Buffers,
        mask: int,
        layers: list[int],
        handle: LoadHandle,
    ) -> None:
        try:
            for ev in waits:
                ev.wait(INFLIGHT_WAIT_S)  # a stuck store turns into a shorter prefix, not a hang
            with self._lock:
                plan = self._plan_load(keys, mask)
        except BaseException as exc:  # pragma: no cover - defensive: never leave a waiter hanging
            handle.future.set_exception(exc)
            handle._all_done()
            return
        if not plan:
            handle.future.set_result(LoadResult(len(keys), 0, []))
            handle._all_done()
            return
        self._run_load(plan, buffers, layers, handle, len(keys))

    def load_sync(self, keys: Sequence[Key], buffers: Buffers) -> LoadResult:
        return self.load(keys, buffers).result()

    def _run_load(
        self,
        plan: list[tuple[Key, TierIndex, Any]],
        buffers: Buffers,
        layers: list[int],
        handle: LoadHandle,
        requested: int,
    ) -> None:
        bad: dict[int, ReadStatus] = {}  # plan position -> first failure
        try:
            by_tier: dict[int, list[int]] = {}
            for i, (_, idx, _) in enumerate(plan):
                by_tier.setdefault(idx.position, []).append(i)
            for layer in layers:
                for pos, members in by_tier.items():
                    items = [((plan[i][0], layer), buffers[layer][i]) for i in members]
                    statuses = self._safe_read(self.tiers[pos], items)
                    for i, st in zip(members, statuses, strict=True):
                        if st is not ReadStatus.OK:
                            bad.setdefault(i, st)
                handle._layer_done(layer)
            result = self._finish_load(plan, layers, bad, requested)
            handle.future.set_result(result)
        except BaseException as exc:  # pragma: no cover - defensive: never leave a waiter hanging
            log.exception("load failed")
            with self._lock:
                self._unpin([(idx, k, e) for k, idx, e in plan])
            handle.future.set_exception(exc)
        finally:
            handle._all_done()

    def _safe_read(self, idx: TierIndex, items: list[tuple[BlockId, Any]]) -> list[ReadStatus]:
        try:
            statuses = idx.tier.read(items)
        except Exception as exc:
            log.warning("tier %s: read of %d layer-blocks failed: %s", idx.name, len(items), exc)
            statuses = [ReadStatus.ERROR] * len(items)
        with self._lock:
            nok = sum(1 for s in statuses if s is ReadStatus.OK)
            idx.counters.layer_blocks_read += nok
            idx.counters.bytes_read += sum(
                self._layer_bytes[it[0][1]] for it, s in zip(items, statuses, strict=True) if s is ReadStatus.OK
            )
            idx.counters.checksum_failures += sum(1 for s in statuses if s is ReadStatus.CORRUPT)
            idx.counters.io_errors += sum(1 for s in statuses if s is ReadStatus.ERROR)
        return statuses

    def _finish_load(
        self, plan: list[tuple[Key, TierIndex, Any]], layers: list[int], bad: dict[int, ReadStatus], requested: int
    ) -> LoadResult:
        first_bad = min(bad) if bad else len(plan)
        names = [idx.name for _, idx, _ in plan[:first_bad]]
        failed = [plan[i][0] for i in sorted(bad)]
        with self._lock:
            self._unpin([(idx, k, e) for k, idx, e in plan])
            for i in sorted(bad):
                self._forget(plan[i][1], plan[i][0])
        self._promote(plan[:first_bad], layers)
        return LoadResult(requested, first_bad, names, failed)

    def _forget(self, idx: TierIndex, key: Key) -> None:
        """Lock held: drop a block a tier failed to serve (quarantine corrupt/unreadable data).

        It leaves the index at once; its bytes are deleted when no transfer pins it any more,
        and until then the key cannot be written into this tier again.
        """
        entry = idx.entries.get(key)
        if entry is None or entry.doomed:
            return
        idx.pop(key)
        self._refresh_best(key)
        entry.doomed = True
        idx.evicting.add(key)
        if entry.pins == 0:
            self._pool.submit(self._delete_entry, idx, key, entry)

    def _delete_entry(self, idx: TierIndex, key: Key, entry: Any) -> None:
        self._safe_delete(idx, [(key, layer) for layer in _layers_of(entry.layers)])
        with self._lock:
            idx.live_bytes -= entry.nbytes
            idx.evicting.discard(key)

    def _promote(self, served: list[tuple[Key, TierIndex, Any]], layers: list[int]) -> None:
        by_src: dict[int, list[Key]] = {}
        for key, idx, _ in served:
            if idx.position > 0:
                by_src.setdefault(idx.position, []).append(key)
        for pos, keys in by_src.items():
            dst = next((t for t in self.tiers[:pos] if t.config.promote), None)
            if dst is None:
                continue
            src = self.tiers[pos]
            with self._lock:
                complete = [k for k in keys if k in src.entries and src.entries[k].layers == self._all_mask]
                pinned = self._pin(src, complete)
                if not pinned:
                    continue
                cost = sum(e.nbytes for _, _, e in pinned)
                if self._background_bytes + cost > self.config.engine.max_background_bytes:
                    self._unpin(pinned)
                    continue
                self._background_bytes += cost
            job = _WriteJob(
                [k for _, k, _ in pinned],
                [e.parent for _, _, e in pinned],
                self._all_mask,
                [(layer, None) for layer in range(self.layout.num_layers)],
                list(range(len(pinned))),
            )
            self._pool.submit(self._run_copy, src, dst, job, pinned, cost, True)

    # ------------------------------------------------------------------ introspection
    def contains(self, key: Key) -> dict[str, int]:
        """Layer masks per tier for one key (for tests and tools)."""
        with self._lock:
            return {idx.name: idx.entries[key].layers for idx in self.tiers if key in idx.entries}

    def stats(self) -> dict[str, Any]:
        """Per-tier capacity, usage and counters, plus engine-wide counters."""
        with self._lock:
            tiers = {}
            for idx in self.tiers:
                d: dict[str, Any] = {
                    "kind": idx.config.kind,
                    "capacity_bytes": idx.tier.capacity,
                    "used_bytes": self._used_bytes(idx),
                    "live_bytes": idx.live_bytes,
                    "blocks": len(idx.entries),
                    "pinned_blocks": sum(1 for e in idx.entries.values() if e.pins),
                }
                d.update(idx.counters.as_dict())
                tiers[idx.name] = d
            return {
                "tiers": tiers,
                "dropped_stores": self._dropped_stores,
                "dropped_blocks": self._dropped_blocks,
                "pending_stores": self._pending_stores,
                "pending_bytes": self._pending_bytes,
                "background_bytes": self._background_bytes,
                "namespace": self.namespace.fingerprint,
            }

    def _used_bytes(self, idx: TierIndex) -> int | None:
        try:
            return int(idx.tier.used_bytes)
        except Exception:  # a tier that is down must not break monitoring
            idx.counters.io_errors += 1
            return None

    def verify(self, repair: bool = False) -> list[dict[str, Any]]:
        """Verify every persistent tier (checksums, index/data consistency)."""
        self.flush()
        reports = []
        for idx in self.tiers:
            if idx.tier.capabilities.persistent:
                reports.append(idx.tier.verify(repair=repair).to_dict())
        return reports


@dataclass
class _WriteJob:
    """Blocks to write into one tier: keys, their chain parents, and where the bytes come from."""

    keys: list[Key]
    parents: list[Key | None]
    mask: int
    layer_bufs: list[tuple[int, Any]]  # (layer, caller buffers or None when copying from a tier)
    src_index: list[int]  # position of each key in the caller's buffers
    done: threading.Event = field(default_factory=threading.Event)  # set once the job has finished


def _layers_of(mask: int) -> list[int]:
    out = []
    layer = 0
    while mask:
        if mask & 1:
            out.append(layer)
        mask >>= 1
        layer += 1
    return out


def _group_by_mask(victims: list[tuple[Key, Any]]) -> list[list[tuple[Key, Any]]]:
    groups: dict[int, list[tuple[Key, Any]]] = {}
    for key, entry in victims:
        groups.setdefault(entry.layers, []).append((key, entry))
    return list(groups.values())


__all__ = ["Buffer", "Engine", "KVStrataError", "LoadHandle", "LoadResult", "LookupResult", "StoreResult"]
