"""The kvstrata engine: lookup, store and load of per-layer KV blocks across tiers.

Data path::

    store ──> top tier ──write-through──> next tier ──> ... (admission per tier)
                  │ eviction: demote to the next tier if it lacks the block, else drop
    load  <── fastest tier holding every requested layer ──promotion──> upper tier

:class:`Engine` is a facade over rooms with one job each: the block index of each tier
(:mod:`~kvstrata.engine.index`, pure: entries, pins, live bytes, victims, snapshot budget), a
placement strategy chosen once (:mod:`~kvstrata.engine.placement` for uniform layouts,
:mod:`~kvstrata.engine.perlayer` for the per-layer-group policies of hybrid layouts), the mover
that owns the I/O threads (:mod:`~kvstrata.engine.mover`: writes, write-through, promotion,
queued demotion), adoption of blocks other processes wrote (:mod:`~kvstrata.engine.adopt`),
counters (:mod:`~kvstrata.engine.stats`) and results (:mod:`~kvstrata.engine.results`).

Everything that moves bytes runs on the engine's I/O threads; the caller gets futures. Index
state changes happen under one lock, and bytes move outside it between two phases (prepare:
pin/reserve; complete: commit or roll back), so a failed transfer leaves the index as it was and
pinned blocks are never evicted. Tier faults become misses and are counted; they are never
raised to the caller.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from kvstrata.config import KVStrataConfig, load_config
from kvstrata.core.buffers import Buffer, is_contiguous, nbytes, rows_fit
from kvstrata.core.keys import BlockHasher, Key, Namespace
from kvstrata.core.layout import KVLayout
from kvstrata.core.masks import MaskBytes
from kvstrata.engine.adopt import Adopter
from kvstrata.engine.chains import MAX_COLD_WALK, MAX_WANTED
from kvstrata.engine.index import SHED_SCAN
from kvstrata.engine.mover import Mover
from kvstrata.engine.perlayer import PerLayerPlacement
from kvstrata.engine.placement import INFLIGHT_WAIT_S, BlockPlacement
from kvstrata.engine.plans import LoadPlan
from kvstrata.engine.queue import StoreQueue, pending_budget
from kvstrata.engine.results import LoadHandle, LoadResult, LookupResult, StoreResult
from kvstrata.engine.slots import TierSlot, build_tiers, close_tiers
from kvstrata.engine.state import EngineState
from kvstrata.engine.stats import tier_stats
from kvstrata.errors import KVStrataError
from kvstrata.policies.layers import LayerPolicies
from kvstrata.tiers import Tier, TierContext

__all__ = [
    "INFLIGHT_WAIT_S",
    "MAX_COLD_WALK",
    "MAX_WANTED",
    "SHED_SCAN",
    "Buffer",
    "Buffers",
    "Engine",
    "KVStrataError",
    "LoadHandle",
    "LoadPlan",
    "LoadResult",
    "LookupResult",
    "StoreResult",
]

Buffers = Mapping[int, Any]  # layer -> sequence of per-key buffers, or an array indexed by key position


class Engine:
    """A tiered KV block store. Use as a context manager or call :meth:`close`.

    ``tiers``: tier objects to use instead of opening those the config describes (one per
    config tier, top first, e.g. :func:`~kvstrata.engine.slots.build_tiers` output with some
    wrapped); the engine closes them. Build them with :meth:`tier_context`."""

    def __init__(
        self,
        config: KVStrataConfig | Mapping[str, Any] | str | None = None,
        *,
        layout: KVLayout,
        namespace: Namespace | None = None,
        tenant_salt: str = "",
        layer_policies: LayerPolicies | None = None,
        tiers: Sequence[Tier] | None = None,
    ) -> None:
        self.config = load_config(config)
        self.layout = layout
        self.policies = layer_policies or LayerPolicies.resolve(
            layout, self.config.policies, tier_names=[t.name for t in self.config.tiers]
        )
        self.namespace = namespace or self.default_namespace(layout, tenant_salt)
        self.hasher = BlockHasher(self.namespace)
        self._closed = False
        opened = list(tiers) if tiers is not None else build_tiers(self.config, self.tier_context())
        if len(opened) != len(self.config.tiers):
            close_tiers(opened)
            raise ValueError(f"{len(opened)} tiers given for {len(self.config.tiers)} config tiers")
        per_layer = not self.policies.trivial  # per-layer policies change what is stored where
        mask_bytes = MaskBytes([spec.nbytes for spec in layout.layers])
        snap = self.policies.snapshot_mask if per_layer else 0
        self.tiers: list[TierSlot] = [
            TierSlot(pos, tc, tier, mask_bytes, snap)
            for pos, (tc, tier) in enumerate(zip(self.config.tiers, opened, strict=True))
        ]
        self._state = state = EngineState(self.config, layout, self.tiers, mask_bytes)
        try:
            for idx in self.tiers:
                self._rebuild(idx)
        except BaseException:
            close_tiers(opened)
            raise
        self._mover = Mover(state, self.config.engine.io_threads)
        adopter = Adopter(state)
        self._placement: BlockPlacement = (
            PerLayerPlacement(state, self._mover, adopter, self.policies)
            if per_layer
            else BlockPlacement(state, self._mover, adopter)
        )
        self._mover.placement = self._placement
        #: the store queue's byte budget (``max_pending_bytes``, resolved against the top tier)
        self.max_pending_bytes = pending_budget(self.config.engine.max_pending_bytes, self.tiers[0].tier.capacity)
        self._queue = StoreQueue(
            state, self.max_pending_bytes, self._mover.pool.submit, self._placement.write_job, self._mover.unpin
        )
        self._placement.queue = self._queue

    @staticmethod
    def default_namespace(layout: KVLayout, tenant_salt: str = "") -> Namespace:
        return Namespace(
            model=layout.model,
            kv_dtype=layout.layers[0].dtype,
            layout_fingerprint=layout.fingerprint(),
            block_size=layout.block_size,
            tenant_salt=tenant_salt,
        )

    def tier_context(self) -> TierContext:
        """What a tier built for this engine must be given (layout and namespace)."""
        return TierContext(self.layout, self.namespace)

    @classmethod
    def with_tiers(
        cls,
        config: KVStrataConfig | Mapping[str, Any] | str | None,
        *,
        layout: KVLayout,
        wrap: Mapping[int, Any] | None = None,
        tenant_salt: str = "",
        **kwargs: Any,
    ) -> Engine:
        """An engine over the config's tiers, with ``wrap[i](tier)`` in place of tier ``i``."""
        cfg = load_config(config)
        ns = kwargs.pop("namespace", None) or cls.default_namespace(layout, tenant_salt)
        tiers = build_tiers(cfg, TierContext(layout, ns))
        for i, fn in (wrap or {}).items():
            tiers[i] = fn(tiers[i])
        return cls(cfg, layout=layout, namespace=ns, tiers=tiers, **kwargs)

    def _rebuild(self, idx: TierSlot) -> None:
        for (key, layer), size in idx.tier.scan():
            if layer < self.layout.num_layers:
                self._state.record(idx, key, 1 << layer, None, nbytes=size)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Finish queued work and close every tier. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.flush()  # queued stores still schedule their write-through: let the chain finish first
        self._queue.close()
        self._mover.close()
        close_tiers([idx.tier for idx in self.tiers])

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued store, write-through and promotion has finished."""
        s = self._state
        with s.idle:
            return s.idle.wait_for(lambda: s.backlog.idle, timeout)

    def _check_open(self) -> None:
        if self._closed:
            raise KVStrataError("the engine is closed")

    # ------------------------------------------------------------------ lookup
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
        mask = self._state.all_mask if layers is None else self._state.mask(layers)
        return self._placement.lookup(keys, mask, count)

    def lookup_pinned(
        self, keys: Sequence[Key], layers: Sequence[int] | None = None, *, count: bool = True
    ) -> LookupResult:
        """:meth:`lookup`, with ``plan`` set: what a load of these keys reads, pinned until a
        :meth:`load` given it consumes it (or :meth:`release` gives it back)."""
        self._check_open()
        found = self.lookup(keys, layers, count=count)
        mask = self._state.all_mask if layers is None else self._state.mask(layers)
        with self._state.lock:
            plan = self._placement.plan(keys, mask)
        return LookupResult(found.num_blocks, found.tier_positions, found.tier_names, found.block_size, plan)

    def release(self, plan: LoadPlan) -> None:
        """Give back a pinned plan no load consumed (idempotent)."""
        with self._state.lock:
            self._placement.release(plan)

    def probe(self, keys: Sequence[Key], layers: Sequence[int]) -> LookupResult:
        """Longest prefix of ``keys`` the tiers shared between processes hold *now*, asking them
        directly (their own index, e.g. the NVMe tier's LMDB) and caching nothing: for a process
        that only answers lookups for others (vLLM's scheduler) and must not trust old answers."""
        self._check_open()
        s = self._state
        served = self._placement.adopter.adopt(keys, s.mask(layers), adopt=False) if s.shared else []
        return LookupResult(len(served), served, s.names, self.layout.block_size)

    # ------------------------------------------------------------------ store
    def store(
        self, keys: Sequence[Key], buffers: Buffers, parent: Key | None = None, *, first_block: int | None = None
    ) -> Future[StoreResult]:
        """Store blocks asynchronously. ``buffers[layer][i]`` holds layer ``layer`` of ``keys[i]``.

        ``keys`` are consecutive blocks of one chain (``parent`` precedes ``keys[0]``).
        The caller must keep the buffers unchanged until the future completes. This never
        blocks: a batch larger than the free queue budget (``max_pending_bytes``) is split and
        its longest prefix that fits is queued at once; the rest waits for the budget (at most
        ``store_wait_s`` after this call) or is dropped, counted per block
        (``StoreResult.dropped_blocks``, see :mod:`kvstrata.engine.queue`).

        Under per-layer policies the end of the store is a restore point (a turn end), and so
        are every ``checkpoint_every`` blocks when ``first_block`` (the position of ``keys[0]``
        in its chain) is given, and branch points seen by lookups (:meth:`restore_points`).
        Sliding layers keep only the blocks in the window before a restore point; state layers
        keep only snapshots at restore points: ``buffers[layer]`` of a state layer may be a
        mapping ``{i: snapshot after keys[i]}`` holding just those.
        """
        self._check_open()
        mask = self._state.mask(buffers)
        self._check_sizes(keys, buffers)
        return self._placement.store(keys, buffers, parent, mask, first_block)

    def store_sync(
        self, keys: Sequence[Key], buffers: Buffers, parent: Key | None = None, *, first_block: int | None = None
    ) -> StoreResult:
        return self.store(keys, buffers, parent, first_block=first_block).result()

    def _check_sizes(self, keys: Sequence[Key], buffers: Buffers) -> None:
        sizes = self._state.layer_bytes
        n = len(keys)
        for layer, bufs in buffers.items():
            want = sizes[layer]
            if rows_fit(bufs, n, want):  # usual: one array of rows, checked whole (no view per layer)
                continue
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

    # ------------------------------------------------------------------ load
    def load(
        self, keys: Sequence[Key], buffers: Buffers, *, plan: LoadPlan | None = None, layer_by_layer: bool = True
    ) -> LoadHandle:
        """Load blocks into caller buffers (``buffers[layer][i]`` for ``keys[i]``), layer by layer.

        Loads the longest restorable prefix of ``keys``; ``LoadResult.loaded_blocks``
        says how many blocks arrived intact. Corrupt or unreadable blocks are misses.
        Blocks of stores still queued are waited for, then loaded.

        Buffers for every layer ask for a restore: under per-layer policies only what a restore
        at the longest consistent prefix needs is read (:meth:`restore_needs`; e.g. sliding
        layers' window blocks, the state snapshot of the last block), reported in
        ``LoadResult.layer_blocks``; ``buffers[layer]`` may then be a mapping holding just those
        positions. A subset of the layers loads exactly those layers of each block.

        ``plan``: the pinned plan of :meth:`lookup_pinned` for the same keys and layers (the load
        then reads what it says, looking nothing up again). ``layer_by_layer=False``: the caller
        waits for the whole load (:meth:`LoadHandle.wait_layer` may then see several layers at
        once), so small layers are read several per tier call (:data:`~kvstrata.engine.placement.
        CALL_MIN_BYTES`): a load of 1 KiB layer-blocks spent as long calling as copying.

        The engine reads ``buffers`` until the handle's result is set, not only until the last
        layer is in place: blocks served below the top tier are promoted from them (when every
        layer of each was loaded) before the result, and the caller may reuse them after it.
        (Where another writer holds that tier's space, the promotion reads the lower tier in the
        background instead: the result never waits for a store.)
        """
        return self._load(keys, buffers, plan, layer_by_layer, waited=False)

    def load_sync(self, keys: Sequence[Key], buffers: Buffers) -> LoadResult:
        """:meth:`load`, waited for whole: no event per layer, and every layer read in one call
        per tier (an nvme read then keeps its queue full across layers: ~1.3x a layer-wise load).
        (Read on the load threads still: read on the calling thread, a store's I/O thread right
        before it ran ~1.5x longer on a busy 2-core machine.)"""
        return self._load(keys, buffers, None, False, waited=True).result()

    def _load(
        self, keys: Sequence[Key], buffers: Buffers, plan: LoadPlan | None, layer_by_layer: bool, waited: bool
    ) -> LoadHandle:
        self._check_open()
        mask = self._state.mask(buffers)
        self._check_sizes(keys, buffers)
        layers = sorted(buffers)
        if plan is not None and (plan.used or plan.mask != mask or plan.keys != list(keys)):
            raise ValueError("the plan was used already, or is for other keys or layers")
        handle = LoadHandle(layers, layer_by_layer, waited=waited)
        if plan is None:
            with self._state.lock:
                plan = self._placement.plan(keys, mask)
        self._placement.load(plan, buffers, layers, handle)
        return handle

    # ------------------------------------------------------------------ per-layer policies
    @property
    def hybrid(self) -> bool:
        """Per-layer policies change what is stored where (a hybrid layout under ``per-layer``)."""
        return self._placement.per_layer

    def restore_points(self, keys: Sequence[Key], first_block: int | None = None) -> list[int]:
        """Where a store of ``keys`` has restore points, as block counts ``r`` in ``1..len(keys)``
        (a restore after ``keys[r - 1]``): the end, every ``checkpoint_every`` blocks when
        ``first_block`` is known, and branch points lookups have seen. A caller that produces
        state snapshots itself passes the snapshot after ``keys[r - 1]`` for each of them."""
        with self._state.lock:
            wanted = self._placement.wanted
            return self.policies.restore_points(len(keys), first_block, lambda i: keys[i] in wanted)

    def restore_needs(self, n: int) -> dict[int, range]:
        """Per layer, the block positions a restore of ``n`` blocks reads (``load`` fills these)."""
        return self._placement.restore_needs(n)

    # ------------------------------------------------------------------ introspection
    def contains(self, key: Key) -> dict[str, int]:
        """Layer masks per tier for one key (for tests and tools)."""
        with self._state.lock:
            return {idx.name: idx.entries[key].layers for idx in self.tiers if key in idx.entries}

    def set_block_events(self, hook: Callable[[TierSlot, Key, bool], None] | None) -> None:
        """Call ``hook(tier, key, True)`` when a block enters a tier's index (stored, demoted,
        promoted or adopted there) and ``hook(tier, key, False)`` when it leaves (evicted,
        demoted, dropped, deleted); None turns it off. The hook runs under the engine's lock, on
        whichever thread changed the index: it must be cheap and never block (e.g. append to a
        bounded queue). Blocks indexed before the call (a persistent tier's rebuild) fire nothing."""
        for idx in self.tiers:
            idx.on_event = None if hook is None else functools.partial(hook, idx)

    def stats(self) -> dict[str, Any]:
        """Per-tier capacity, usage and counters, plus engine-wide counters."""
        s = self._state
        with s.lock:
            b = s.backlog
            return {
                "tiers": {idx.name: tier_stats(idx, self.hybrid) for idx in self.tiers},
                "dropped_stores": b.dropped_stores,
                "dropped_blocks": b.dropped_blocks,
                "pending_stores": b.pending_stores,
                "pending_bytes": b.pending_bytes,
                "waiting_stores": b.waiting_stores,
                "waiting_bytes": b.waiting_bytes,
                "max_pending_bytes": self.max_pending_bytes,
                "background_bytes": b.background_bytes,
                "namespace": self.namespace.fingerprint,
                "layer_policy": self.policies.mode,
            }

    def verify(self, repair: bool = False) -> list[dict[str, Any]]:
        """Verify every persistent tier (checksums, index/data consistency)."""
        self.flush()
        reports = []
        for idx in self.tiers:
            if idx.tier.capabilities.persistent:
                reports.append(idx.tier.verify(repair=repair).to_dict())
        return reports
