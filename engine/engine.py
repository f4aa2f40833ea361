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

Hybrid layouts (sliding-window, linear-attention state, MLA) follow the per-layer-group
policies of :mod:`kvstrata.policies.layers`: ``store`` keeps of each layer only what a restore
needs (window blocks before restore points, state snapshots at restore points), each group
lives only in the tiers it may occupy, and ``lookup``/``load`` of every layer restore the
longest prefix at which every group is consistent. Uniform layouts (and ``layer_policy =
"uniform"``) take the plain path: every layer of every block, with a dict fast path for lookups.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

from kvstrata.config import KVStrataConfig, load_config, resolve_auto_capacity
from kvstrata.core.buffers import Buffer, is_contiguous, nbytes
from kvstrata.core.keys import BlockHasher, Key, Namespace
from kvstrata.core.layout import KVLayout
from kvstrata.engine.index import Entry, TierIndex
from kvstrata.errors import KVStrataError
from kvstrata.policies import ADMISSION, EVICTION
from kvstrata.policies.layers import LayerPolicies
from kvstrata.tiers import TIERS, BlockId, ReadStatus, TierContext

log = logging.getLogger("kvstrata.engine")

#: Longest a load waits for a queued store of a block it needs (then loads what is there).
INFLIGHT_WAIT_S = 30.0
#: Branch points remembered for restore points (keys after which a restore would have paid).
MAX_WANTED = 65536
#: Most descendants one broken chain marks as cold at once.
MAX_COLD_WALK = 100_000
#: Eviction candidates a tier looks at for low-priority layers to shed before whole blocks leave.
SHED_SCAN = 256

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
    # a restore under per-layer policies: per layer, the block positions written into the caller's
    # buffers (``Engine.restore_needs(loaded_blocks)``); None: every layer of blocks 0..loaded_blocks
    layer_blocks: dict[int, range] | None = None

    @property
    def ok(self) -> bool:
        return self.loaded_blocks == self.requested


class LoadHandle:
    """An in-flight load. ``wait_layer(l)`` returns once layer ``l`` is in the buffers."""

    def __init__(self, layers: Sequence[int]) -> None:
        self.future: Future[LoadResult] = Future()
        self._events = {layer: threading.Event() for layer in layers}
        self.started = time.perf_counter()
        self.finished: float | None = None  # perf_counter() when the result was set
        self.future.add_done_callback(self._stamp)

    def _stamp(self, _future: Future[LoadResult]) -> None:
        self.finished = time.perf_counter()

    @property
    def elapsed_s(self) -> float | None:
        """Seconds from issue to result (None while in flight)."""
        return None if self.finished is None else self.finished - self.started

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
        layer_policies: LayerPolicies | None = None,
    ) -> None:
        self.config = load_config(config)
        self.layout = layout
        self.policies = layer_policies or LayerPolicies.resolve(
            layout, self.config.policies, tier_names=[t.name for t in self.config.tiers]
        )
        self._hybrid = not self.policies.trivial  # per-layer policies change what is stored where
        self._shedding = len({g.priority for g in self.policies.groups}) > 1  # victims shed layers by priority
        self._tier_masks = [self.policies.tier_mask(t.name, t.kind) for t in self.config.tiers]
        self._wanted: OrderedDict[Key, None] = OrderedDict()  # branch points: restore points that would pay
        self._children: dict[Key, set[Key]] = {}  # chain links of hybrid layouts (broken-chain eviction)
        self._snap_pos: dict[Key, int] = {}  # key -> block count its state snapshot restores (snapshot value)
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
            if self._hybrid:
                idx.snap_mask = self.policies.snapshot_mask
                idx.layer_sizes = tuple(spec.nbytes for spec in self.layout.layers)
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

        Every layer (the default) asks for a *restore*: under per-layer policies, the longest
        prefix at which every group is consistent (full/MLA layers hold every block, sliding
        layers the window before it, state layers a snapshot at it); a block's tier is then the
        slowest tier it needs. A subset of the layers asks for exactly those layers of each block.
        Blocks of stores still queued count as held by the top tier (a load waits for them).
        ``count=False`` leaves the hit/miss counters alone (a scheduler asking on a worker's behalf).
        """
        full = layers is None or self._mask(layers) == self._all_mask
        if full and self._hybrid:
            return self._lookup_restore(keys, count)
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
        layers = list(_layers_of(mask))
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
    def store(
        self, keys: Sequence[Key], buffers: Buffers, parent: Key | None = None, *, first_block: int | None = None
    ) -> Future[StoreResult]:
        """Store blocks asynchronously. ``buffers[layer][i]`` holds layer ``layer`` of ``keys[i]``.

        ``keys`` are consecutive blocks of one chain (``parent`` precedes ``keys[0]``).
        The caller must keep the buffers unchanged until the future completes. When the
        store queue is full the batch is dropped and counted; this never blocks.

        Under per-layer policies the end of the store is a restore point (a turn end), and so
        are every ``checkpoint_every`` blocks when ``first_block`` (the position of ``keys[0]``
        in its chain) is given, and branch points seen by lookups (:meth:`restore_points`).
        Sliding layers keep only the blocks in the window before a restore point; state layers
        keep only snapshots at restore points: ``buffers[layer]`` of a state layer may be a
        mapping ``{i: snapshot after keys[i]}`` holding just those.
        """
        self._check_open()
        mask = self._mask(buffers)
        self._check_sizes(keys, buffers)
        if self._hybrid:
            return self._store_hybrid(keys, buffers, parent, mask, first_block)
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

    def store_sync(
        self, keys: Sequence[Key], buffers: Buffers, parent: Key | None = None, *, first_block: int | None = None
    ) -> StoreResult:
        return self.store(keys, buffers, parent, first_block=first_block).result()

    def _check_sizes(self, keys: Sequence[Key], buffers: Buffers) -> None:
        for layer, bufs in buffers.items():
            want = self._layer_bytes[layer]
            if isinstance(bufs, Mapping):  # sparse: {key position: buffer}
                if any(not 0 <= int(i) < len(keys) for i in bufs):
                    raise ValueError(f"layer {layer}: buffer positions must be in 0..{len(keys) - 1}")
                if not bufs:
                    continue
                first = next(iter(bufs.values()))
            elif len(bufs) < len(keys):
                raise ValueError(f"layer {layer}: {len(bufs)} buffers for {len(keys)} keys")
            elif not len(keys):
                continue
            else:
                first = bufs[0]
            got = nbytes(first)
            if got != want:
                raise ValueError(f"layer {layer}: buffer has {got} bytes, a layer-block is {want}")
            if not is_contiguous(first):
                raise ValueError(f"layer {layer}: buffers must be contiguous")

    def _run_store(self, job: _WriteJob, result: StoreResult, cost: int, pinned: list[Pin]) -> StoreResult:
        try:
            written = self._write_into(self.tiers[0], job, source=None)
            if written:
                self._schedule_write_through(self.tiers[0], written, job)
            if self._hybrid:  # layers the top tier may not hold go straight to the first tier that may
                written = sorted(set(written) | self._write_below_top(job))
            result.stored = len(written)
            result.failed = len(job.keys) - len(written)
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
            if self._hybrid:
                todo = self._admit_hybrid(idx, job)
            else:
                with self._lock:
                    todo = []
                    for j, key in enumerate(job.keys):
                        e = idx.entries.get(key)
                        if e is not None and e.layers & job.mask == job.mask:
                            continue
                        if key in idx.evicting:
                            continue
                        if idx.admission.admit(key):
                            todo.append((j, job.mask))
                        else:
                            idx.counters.not_admitted += 1
            written: list[int] = []
            if self._hybrid:
                per_key = max((self._mask_bytes(m) for _, m in todo), default=1) or 1
            else:
                job_layers = [layer for layer, _ in job.layer_bufs]
                per_key = sum(self._layer_bytes[layer] for layer in job_layers) or 1
            chunk = max(1, idx.tier.capacity // (2 * per_key))  # a batch larger than the tier streams through
            for start in range(0, len(todo), chunk):
                part = todo[start : start + chunk]
                if self._hybrid:
                    sizes = [self._layer_bytes[layer] for _, m in part for layer in _layers_of(m)]
                else:
                    sizes = [self._layer_bytes[layer] for _ in part for layer in job_layers]
                if not self._make_room(idx, sizes):
                    with self._lock:
                        idx.counters.write_failures += len(part)
                    continue
                items = self._items(job, part, source)
                ok = self._safe_write(idx, [it for it in items if it[1] is not None])
                written.extend(self._commit_write(idx, job, part, items, ok))
            return written

    def _items(
        self, job: _WriteJob, part: list[tuple[int, int]], source: TierIndex | None
    ) -> list[tuple[BlockId, Any]]:
        """Layer-major: one layer's blocks are adjacent, so tiers that pack records in order
        (nvme) serve a layer-by-layer load of many keys with a few large reads. ``part``:
        (job position, layer mask to write) pairs."""
        if job.masks is None and not self._hybrid:  # every key writes every layer of the job
            positions = [j for j, _ in part]
            ids = [(job.keys[j], layer) for layer, _ in job.layer_bufs for j in positions]
            if source is None:
                bufs = [lb[job.src_index[j]] for _, lb in job.layer_bufs for j in positions]
                return list(zip(ids, bufs, strict=True))
        else:
            pairs = [(layer, lb, j) for layer, lb in job.layer_bufs for j, m in part if m >> layer & 1]
            ids = [(job.keys[j], layer) for layer, _, j in pairs]
            if source is None:
                bufs = [lb[job.src_index[j]] for _, lb, j in pairs]
                return list(zip(ids, bufs, strict=True))
        return list(zip(ids, self._source_views(source, ids), strict=True))

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
        part: list[tuple[int, int]],
        items: list[tuple[BlockId, Any]],
        ok: list[bool],
    ) -> list[int]:
        status = iter(ok)
        good: dict[BlockId, bool] = {it[0]: (next(status) if it[1] is not None else False) for it in items}
        written: list[int] = []
        partial: list[BlockId] = []
        with self._lock:
            for j, m in part:
                key = job.keys[j]
                ids = [(key, layer) for layer in _layers_of(m)]
                if all(good[b] for b in ids):
                    size = sum(self._layer_bytes[b[1]] for b in ids)
                    entry = idx.add(key, m, size, job.parents[j], job.position_of(j))
                    idx.live_bytes += size
                    if entry.layers == self._all_mask:
                        self._mark_complete(key, idx.position)
                    if self._hybrid:
                        self._note_block(key, job.parents[j], m & idx.snap_mask, job.position_of(j))
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
                victims = self._pick_victims(idx, over) if self._hybrid else idx.pick_victims(over)
                if not victims:
                    return False
                for key, entry in victims:
                    if idx.entries.get(key) is entry:
                        idx.pop(key)
                    else:  # a victim that sheds only its lowest-priority layers stays in the tier
                        idx.shed(key, entry.layers)
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
            if self._hybrid:
                self._after_drop(victims)

    def _demote(self, idx: TierIndex, nxt: TierIndex, victims: list[tuple[Key, Any]]) -> None:
        for group in _group_by_mask(victims):
            job = _WriteJob(
                [k for k, _ in group],
                [e.parent for _, e in group],
                group[0][1].layers,
                [(layer, None) for layer in _layers_of(group[0][1].layers)],
                list(range(len(group))),
                positions=[self._snap_pos.get(k, 0) for k, _ in group] if self._hybrid else None,
            )
            moved = self._write_into(nxt, job, source=idx)
            with self._lock:
                idx.counters.demotions += len(moved)

    # ------------------------------------------------------------------ background movement
    def _schedule_write_through(self, idx: TierIndex, positions: list[int], job: _WriteJob) -> None:
        if idx.config.write != "write-through" or idx.position + 1 >= len(self.tiers):
            return
        if self._hybrid:
            self._write_through_hybrid(idx, positions, job)
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

        Buffers for every layer ask for a restore: under per-layer policies only what a restore
        at the longest consistent prefix needs is read (:meth:`restore_needs`; e.g. sliding
        layers' window blocks, the state snapshot of the last block), reported in
        ``LoadResult.layer_blocks``; ``buffers[layer]`` may then be a mapping holding just those
        positions. A subset of the layers loads exactly those layers of each block.
        """
        self._check_open()
        mask = self._mask(buffers)
        self._check_sizes(keys, buffers)
        layers = sorted(buffers)
        if self._hybrid and mask == self._all_mask:
            return self._load_restore(keys, buffers, layers)
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
        if self._hybrid:
            self._after_drop([(key, entry)])

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
                complete = [
                    k for k in keys if k in src.entries and (self._hybrid or src.entries[k].layers == self._all_mask)
                ]
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
            if self._hybrid:  # a hybrid block moves up with what its tier holds of it
                job.masks = [e.layers for _, _, e in pinned]
                job.positions = [self._snap_pos.get(k, 0) for _, k, _ in pinned]
            self._pool.submit(self._run_copy, src, dst, job, pinned, cost, True)

    # ------------------------------------------------------------------ per-layer policies (hybrid layouts)
    @property
    def hybrid(self) -> bool:
        """Per-layer policies change what is stored where (a hybrid layout under ``per-layer``)."""
        return self._hybrid

    def restore_points(self, keys: Sequence[Key], first_block: int | None = None) -> list[int]:
        """Where a store of ``keys`` has restore points, as block counts ``r`` in ``1..len(keys)``
        (a restore after ``keys[r - 1]``): the end, every ``checkpoint_every`` blocks when
        ``first_block`` is known, and branch points lookups have seen. A caller that produces
        state snapshots itself passes the snapshot after ``keys[r - 1]`` for each of them."""
        with self._lock:
            wanted = self._wanted
            return self.policies.restore_points(len(keys), first_block, lambda i: keys[i] in wanted)

    def restore_needs(self, n: int) -> dict[int, range]:
        """Per layer, the block positions a restore of ``n`` blocks reads (``load`` fills these)."""
        if not self._hybrid:
            return {layer: range(n) for layer in range(self.layout.num_layers)}
        return self.policies.needed(n)

    def _mask_bytes(self, mask: int) -> int:
        return sum(self._layer_bytes[layer] for layer in _layers_of(mask))

    def _provided(self, count: int, buffers: Buffers) -> list[int]:
        """Per key position, the layers the caller gave a buffer for."""
        dense = 0
        masks = [0] * count
        for layer, bufs in buffers.items():
            if isinstance(bufs, Mapping):
                for i in bufs:
                    masks[int(i)] |= 1 << layer
            else:
                dense |= 1 << layer
        return [m | dense for m in masks]

    def _store_hybrid(
        self, keys: Sequence[Key], buffers: Buffers, parent: Key | None, mask: int, first_block: int | None
    ) -> Future[StoreResult]:
        provided = self._provided(len(keys), buffers)
        with self._lock:
            points = self.policies.restore_points(len(keys), first_block, lambda i: keys[i] in self._wanted)
            keep = self.policies.keep_masks(len(keys), points)
            todo: list[int] = []
            masks: list[int] = []
            for i, key in enumerate(keys):
                missing = self._missing(key, keep[i] & provided[i])
                if missing:
                    todo.append(i)
                    masks.append(missing)
                elif key in self.tiers[0].entries:
                    self.tiers[0].eviction.access(key)
            result = StoreResult(present=len(keys) - len(todo))
            if not todo:
                return _done_future(result)
            cost = sum(self._mask_bytes(m) for m in masks)
            cfg = self.config.engine
            if self._pending_stores >= cfg.max_pending_stores or self._pending_bytes + cost > cfg.max_pending_bytes:
                self._dropped_stores += 1
                self._dropped_blocks += len(todo)
                result.dropped = True
                return _done_future(result)
            self._pending_stores += 1
            self._pending_bytes += cost
            present = [k for k in keys if k in self.tiers[0].entries]
            pinned = self._pin(self.tiers[0], present + ([parent] if parent is not None else []))
            base = first_block if first_block is not None else 0
            job = _WriteJob(
                [keys[i] for i in todo],
                [keys[i - 1] if i > 0 else parent for i in todo],
                mask,
                [(layer, buffers[layer]) for layer in sorted(buffers)],
                todo,
                masks=masks,
                positions=[base + i + 1 for i in todo],
            )
            for key, m in zip(job.keys, masks, strict=True):
                self._inflight[key] = (m, job.done)
            return self._pool.submit(self._run_store, job, result, cost, pinned)

    def _missing(self, key: Key, want: int) -> int:
        """Lock held: the layers of ``want`` that the tier each layer goes to first does not hold."""
        missing = 0
        for idx, tmask in zip(self.tiers, self._tier_masks, strict=True):
            part = want & tmask
            if part:
                e = idx.entries.get(key)
                missing |= part & ~(e.layers if e is not None else 0)
                want &= ~tmask
            if not want:
                break
        return missing

    def _write_below_top(self, job: _WriteJob) -> set[int]:
        """Write the layers the top tier may not hold into the first tier that may (caller's buffers)."""
        rest = [m & ~self._tier_masks[0] for m in job.masks or ()]
        written: set[int] = set()
        for idx, tmask in zip(self.tiers[1:], self._tier_masks[1:], strict=True):
            if not any(rest):
                break
            sub = _WriteJob(job.keys, job.parents, job.mask, job.layer_bufs, job.src_index, masks=list(rest))
            sub.positions = job.positions
            got = self._write_into(idx, sub, source=None)
            if got:
                self._schedule_write_through(idx, got, sub)
            written.update(got)
            rest = [m & ~tmask for m in rest]
        return written

    def _admit_hybrid(self, idx: TierIndex, job: _WriteJob) -> list[tuple[int, int]]:
        """Caller holds ``idx.space_lock``: (job position, layers to write) of the blocks ``idx``
        takes: layers it may hold and lacks, admitted, with state snapshots within its budget."""
        tmask = self._tier_masks[idx.position]
        todo: list[tuple[int, int]] = []
        shed: list[tuple[Key, Entry]] = []
        reserved = 0
        with self._lock:
            for j, key in enumerate(job.keys):
                want = job.mask_of(j) & tmask
                if not want or key in idx.evicting:
                    continue
                e = idx.entries.get(key)
                if e is not None:
                    want &= ~e.layers
                if not want:
                    continue
                if not idx.admission.admit(key):
                    idx.counters.not_admitted += 1
                    continue
                if want & idx.snap_mask:
                    size = idx.snap_nbytes(want)
                    if self._snapshot_room(idx, key, size + reserved, job.position_of(j), shed):
                        reserved += size
                    else:
                        idx.counters.snapshots_not_admitted += 1
                        want &= ~idx.snap_mask
                if want:
                    todo.append((j, want))
        if shed:
            self._evict(idx, shed)
        return todo

    def _snapshot_room(self, idx: TierIndex, key: Key, size: int, position: int, shed: list[tuple[Key, Entry]]) -> bool:
        """Lock held: make ``size`` more snapshot bytes fit the tier's snapshot budget by dropping
        snapshots that restore shorter prefixes than ``position`` (value: prefill saved per byte)."""
        budget = self.policies.checkpoint_budget * idx.tier.capacity
        while idx.snapshot_bytes + size > budget:
            victims = (k for k in idx.snapshots if k != key and k not in idx.evicting and not idx.entries[k].pins)
            victim = min(victims, key=idx.snapshots.__getitem__, default=None)
            if victim is None or idx.snapshots[victim] >= position:
                return False
            layers = idx.entries[victim].layers & idx.snap_mask
            part = Entry(layers, idx.shed(victim, layers), idx.entries[victim].parent)
            idx.evicting.add(victim)
            idx.counters.snapshots_dropped += 1
            idx.counters.evictions += 1
            shed.append((victim, part))
        return True

    def _write_through_hybrid(self, idx: TierIndex, positions: list[int], job: _WriteJob) -> None:
        nxt_mask = self._tier_masks[idx.position + 1]
        with self._lock:
            picked = []
            for j in positions:
                e = idx.entries.get(job.keys[j])
                m = job.mask_of(j) & nxt_mask & (e.layers if e is not None else 0)
                if m:
                    picked.append((j, m))
            cost = sum(self._mask_bytes(m) for _, m in picked)
            if not picked or self._background_bytes + cost > self.config.engine.max_background_bytes:
                return  # nothing the next tier takes, or too far behind (demotion on eviction instead)
            pinned = self._pin(idx, [job.keys[j] for j, _ in picked])
            self._background_bytes += cost
        by_key = {job.keys[j]: (m, job.position_of(j)) for j, m in picked}
        sub = _WriteJob(
            [k for _, k, _ in pinned],
            [e.parent for _, _, e in pinned],
            job.mask,
            [(layer, None) for layer in _layers_of(job.mask)],
            list(range(len(pinned))),
            masks=[by_key[k][0] for _, k, _ in pinned],
            positions=[by_key[k][1] for _, k, _ in pinned],
        )
        self._pool.submit(self._run_copy, idx, self.tiers[idx.position + 1], sub, pinned, cost, False)

    def _pick_victims(self, idx: TierIndex, need_bytes: int) -> list[tuple[Key, Entry]]:
        """Lock held: victims in policy order. With group priorities, the first ``SHED_SCAN``
        candidates shed only the layers of their lowest-priority groups (a detached entry
        describes the part that leaves); whole blocks leave only when that is not enough."""
        out: list[tuple[Key, Entry]] = []
        got = 0
        taken: set[Key] = set()
        if self._shedding:
            for key in itertools.islice(idx.eviction.victims(), SHED_SCAN):
                e = idx.entries.get(key)
                if e is None or e.pins or key in idx.evicting:
                    continue
                low = self._lowest_priority(e.layers)
                if low != e.layers:
                    part = Entry(low, self._mask_bytes(low), e.parent)
                    out.append((key, part))
                    taken.add(key)
                    got += part.nbytes
                    if got >= need_bytes:
                        return out
        for key in idx.eviction.victims():
            e = idx.entries.get(key)
            if e is None or e.pins or key in idx.evicting or key in taken:
                continue
            out.append((key, e))
            got += e.nbytes
            if got >= need_bytes:
                break
        return out

    def _lowest_priority(self, layers: int) -> int:
        present = [g for g in self.policies.groups if g.mask & layers]
        if len({g.priority for g in present}) <= 1:
            return layers
        low = min(g.priority for g in present)
        return sum(g.mask & layers for g in present if g.priority == low)

    def _note_block(self, key: Key, parent: Key | None, snap: int, position: int) -> None:
        """Lock held: remember a committed block's chain link and its snapshot's position."""
        if parent is not None:
            self._children.setdefault(parent, set()).add(key)
        if snap:
            self._snap_pos[key] = max(position, self._snap_pos.get(key, 0))

    def _held(self, key: Key) -> int:
        """Lock held: every layer of ``key`` some tier holds."""
        held = 0
        for idx in self.tiers:
            e = idx.entries.get(key)
            if e is not None:
                held |= e.layers
        return held

    def _after_drop(self, victims: Sequence[tuple[Key, Any]]) -> None:
        """A block whose full-attention layers no tier holds any more breaks its chain: every later
        block (and state snapshot) of that chain is useless until it is stored again, so they
        become the first victims of their tiers."""
        prefix = self.policies.prefix_mask
        with self._lock:
            for key, part in victims:
                held = self._held(key)
                if not held:
                    self._snap_pos.pop(key, None)
                    siblings = self._children.get(part.parent) if part.parent is not None else None
                    if siblings is not None:
                        siblings.discard(key)
                        if not siblings:
                            del self._children[part.parent]
                if part.layers & prefix and held & prefix != prefix:
                    self._cool_descendants(key)
                if not held:
                    self._children.pop(key, None)

    def _cool_descendants(self, key: Key) -> None:
        stack = list(self._children.get(key, ()))
        seen: set[Key] = set()
        while stack and len(seen) < MAX_COLD_WALK:
            k = stack.pop()
            if k in seen:
                continue
            seen.add(k)
            for idx in self.tiers:
                if k in idx.entries:
                    idx.eviction.cold(k)
            stack.extend(self._children.get(k, ()))

    # -- restore lookups
    def _held_masks(self, keys: Sequence[Key]) -> list[list[int]]:
        """Lock held: per tier, the layer mask it holds of each key (0: none)."""
        out = []
        for idx in self.tiers:
            get = idx.entries.get
            out.append([e.layers if (e := get(k)) is not None else 0 for k in keys])
        return out

    def _avail(self, keys: Sequence[Key], inflight: bool = True, per_tier: list[list[int]] | None = None) -> list[int]:
        """Lock held: per key, the layers held by any tier (and queued stores), up to the first key
        lacking a full-attention layer (no restore reaches past it)."""
        per_tier = self._held_masks(keys) if per_tier is None else per_tier
        if len(per_tier) == 1:
            avail = per_tier[0]
        elif len(per_tier) == 2:
            avail = [a | b for a, b in zip(*per_tier, strict=True)]
        else:
            avail = list(map(_or_all, zip(*per_tier, strict=True)))
        if inflight and self._inflight:
            pending = self._inflight
            avail = [a | p[0] if (p := pending.get(k)) is not None else a for k, a in zip(keys, avail, strict=True)]
        prefix = self.policies.prefix_mask
        for i, a in enumerate(avail):
            if a & prefix != prefix:
                return avail[:i]
        return avail

    def _serving(self, key: Key, need: int) -> int | None:
        """Lock held: the slowest of the fastest tiers holding each layer of ``need`` (queued stores
        count as the top tier), or None when some layer is nowhere."""
        pending = self._inflight.get(key)
        left = need & ~pending[0] if pending is not None else need
        pos = 0
        for idx in self.tiers:
            if not left:
                break
            e = idx.entries.get(key)
            if e is not None and e.layers & left:
                left &= ~e.layers
                pos = idx.position
        return pos if not left else None

    def _lookup_restore(self, keys: Sequence[Key], count: bool) -> LookupResult:
        with self._lock:
            per_tier = self._held_masks(keys)
            avail = self._avail(keys, per_tier=per_tier)
            if len(avail) == len(keys) or not self._shared_tiers:
                return self._restore_result(keys, per_tier, avail, count)
        self._adopt_hybrid(keys, len(avail))  # tiers shared with other processes may hold more
        with self._lock:
            per_tier = self._held_masks(keys)
            return self._restore_result(keys, per_tier, self._avail(keys, per_tier=per_tier), count)

    def _restore_result(
        self, keys: Sequence[Key], per_tier: list[list[int]], avail: list[int], count: bool
    ) -> LookupResult:
        """Lock held: the longest consistent prefix, and the tier each of its blocks needs."""
        n = self.policies.restorable(avail)
        if n < len(avail):  # full-attention blocks reach further: a restore point there would pay
            self._wanted[keys[len(avail) - 1]] = None
            if len(self._wanted) > MAX_WANTED:
                self._wanted.popitem(last=False)
        need = self.policies.needed_masks(n)
        served = [
            0 if t & m == m else (self._serving(k, m) or 0) for k, t, m in zip(keys, per_tier[0], need, strict=False)
        ]
        if count:
            self._count_lookup(served, len(keys) - n)
        return LookupResult(n, served, self._tier_names, self.layout.block_size)

    def _adopt_hybrid(self, keys: Sequence[Key], start: int) -> None:
        """Adopt what tiers shared with other processes hold of ``keys[start:]``, 1, 4, 16, ... keys
        at a time, until a key lacks a full-attention layer there (see :meth:`_adopt`)."""
        prefix = self.policies.prefix_mask
        step = 1
        while start < len(keys):
            chunk = keys[start : start + step]
            found = [0] * len(chunk)
            for idx in reversed(self._shared_tiers):
                layers = _layers_of(self._tier_masks[idx.position])
                ids = [(key, layer) for key in chunk for layer in layers]
                try:
                    got = idx.tier.contains(ids) if ids else None
                except Exception as exc:
                    log.warning("tier %s: contains() failed: %s", idx.name, exc)
                    continue
                if got is None:
                    continue
                for i, key in enumerate(chunk):
                    have = sum(1 << layer for layer, ok in zip(layers, got[i * len(layers) :], strict=False) if ok)
                    self._adopt_layers(idx, key, have)
                    found[i] |= have
            done = next((i for i, f in enumerate(found) if f & prefix != prefix), None)
            if done is not None:
                return
            start, step = start + step, min(step * 4, 256)

    def _adopt_layers(self, idx: TierIndex, key: Key, layers: int) -> None:
        with self._lock:
            e = idx.entries.get(key)
            missing = layers & ~(e.layers if e is not None else 0)
            if missing and key not in idx.evicting:
                size = self._mask_bytes(missing)
                idx.add(key, missing, size, None)
                idx.live_bytes += size

    # -- restore loads
    def _load_restore(self, keys: Sequence[Key], buffers: Buffers, layers: list[int]) -> LoadHandle:
        handle = LoadHandle(layers)
        with self._lock:
            waits = list({id(p[1]): p[1] for k in keys if (p := self._inflight.get(k)) is not None}.values())
            plan = None if waits else self._plan_restore(keys)
        if waits:
            self._load_pool.submit(self._deferred_restore, waits, keys, buffers, layers, handle)
        elif plan is None or not plan.n:
            self._finish_empty(handle, len(keys))
        else:
            self._load_pool.submit(self._run_restore, plan, buffers, layers, handle, len(keys))
        return handle

    def _finish_empty(self, handle: LoadHandle, requested: int) -> None:
        handle.future.set_result(LoadResult(requested, 0, [], layer_blocks={}))
        handle._all_done()

    def _deferred_restore(
        self, waits: list[threading.Event], keys: Sequence[Key], buffers: Buffers, layers: list[int], handle: LoadHandle
    ) -> None:
        try:
            for ev in waits:
                ev.wait(INFLIGHT_WAIT_S)
            with self._lock:
                plan = self._plan_restore(keys)
        except BaseException as exc:  # pragma: no cover - defensive: never leave a waiter hanging
            handle.future.set_exception(exc)
            handle._all_done()
            return
        if not plan.n:
            self._finish_empty(handle, len(keys))
            return
        self._run_restore(plan, buffers, layers, handle, len(keys))

    def _plan_restore(self, keys: Sequence[Key]) -> _RestorePlan:
        """Lock held: the longest consistent prefix and, per block, which layers come from which
        tier (the fastest holder of each), pinned."""
        avail = self._avail(keys, inflight=False)
        n = self.policies.restorable(avail)
        need = self.policies.needed_masks(n)
        parts: list[list[tuple[TierIndex, Entry, int]]] = []
        for key, m in zip(keys[:n], need, strict=True):
            left, mine = m, []
            for idx in self.tiers:
                e = idx.entries.get(key)
                if e is not None and e.layers & left:
                    mine.append((idx, e, e.layers & left))
                    left &= ~e.layers
                    e.pins += 1
                    idx.eviction.access(key)
                if not left:
                    break
            parts.append(mine)
        return _RestorePlan(list(keys[:n]), n, need, parts)

    def _run_restore(
        self, plan: _RestorePlan, buffers: Buffers, layers: list[int], handle: LoadHandle, requested: int
    ) -> None:
        failed: dict[int, int] = {}  # block -> layers that did not arrive intact
        bad: list[tuple[TierIndex, Key]] = []
        try:
            for layer in layers:
                bit = 1 << layer
                by_tier: dict[int, list[int]] = {}
                for i, mine in enumerate(plan.parts):
                    for idx, _, m in mine:
                        if m & bit:
                            by_tier.setdefault(idx.position, []).append(i)
                for pos, members in by_tier.items():
                    items = [((plan.keys[i], layer), buffers[layer][i]) for i in members]
                    for i, st in zip(members, self._safe_read(self.tiers[pos], items), strict=True):
                        if st is not ReadStatus.OK:
                            failed[i] = failed.get(i, 0) | bit
                            bad.append((self.tiers[pos], plan.keys[i]))
                handle._layer_done(layer)
            handle.future.set_result(self._finish_restore(plan, failed, bad, requested))
        except BaseException as exc:  # pragma: no cover - defensive: never leave a waiter hanging
            log.exception("load failed")
            with self._lock:
                self._unpin([(idx, k, e) for k, mine in zip(plan.keys, plan.parts, strict=True) for idx, e, _ in mine])
            handle.future.set_exception(exc)
        finally:
            handle._all_done()

    def _finish_restore(
        self, plan: _RestorePlan, failed: dict[int, int], bad: list[tuple[TierIndex, Key]], requested: int
    ) -> LoadResult:
        ok = [m & ~failed.get(i, 0) for i, m in enumerate(plan.need)]
        n = self.policies.restorable(ok) if failed else plan.n
        tiers = [max((idx.position for idx, _, _ in mine), default=0) for mine in plan.parts[:n]]
        with self._lock:
            self._unpin([(idx, k, e) for k, mine in zip(plan.keys, plan.parts, strict=True) for idx, e, _ in mine])
            for idx, key in bad:
                self._forget(idx, key)
        served = [(k, idx, e) for k, mine in zip(plan.keys[:n], plan.parts[:n], strict=True) for idx, e, _ in mine]
        self._promote(served, [])
        names = [self._tier_names[p] for p in tiers]
        failed_keys = [plan.keys[i] for i in sorted(failed)]
        return LoadResult(requested, n, names, failed_keys, layer_blocks=self.policies.needed(n))

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
                if self._hybrid:
                    d["snapshot_bytes"] = idx.snapshot_bytes
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
                "layer_policy": self.policies.mode,
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
    masks: list[int] | None = None  # per-key layer masks (per-layer policies); None: ``mask`` for every key
    positions: list[int] | None = None  # per key, the block count a state snapshot after it restores

    def mask_of(self, j: int) -> int:
        return self.mask if self.masks is None else self.masks[j]

    def position_of(self, j: int) -> int:
        return 0 if self.positions is None else self.positions[j]


def _or_all(masks: Sequence[int]) -> int:
    out = 0
    for m in masks:
        out |= m
    return out


@lru_cache(maxsize=4096)
def _layers_of(mask: int) -> tuple[int, ...]:
    out = []
    layer = 0
    while mask:
        if mask & 1:
            out.append(layer)
        mask >>= 1
        layer += 1
    return tuple(out)


@dataclass
class _RestorePlan:
    """A restore of ``n`` blocks: what each block needs and where each part of it is read from."""

    keys: list[Key]
    n: int
    need: list[int]  # per block, the layers the restore needs
    parts: list[list[tuple[TierIndex, Entry, int]]]  # per block: (tier, pinned entry, layers read there)


def _group_by_mask(victims: list[tuple[Key, Any]]) -> list[list[tuple[Key, Any]]]:
    groups: dict[int, list[tuple[Key, Any]]] = {}
    for key, entry in victims:
        groups.setdefault(entry.layers, []).append((key, entry))
    return list(groups.values())


__all__ = ["Buffer", "Engine", "KVStrataError", "LoadHandle", "LoadResult", "LookupResult", "StoreResult"]
