"""The ``mooncake`` tier's public face: :class:`MooncakeTier` (see the package docstring)."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import xxhash

from kvstrata.core.buffers import Buffer, nbytes
from kvstrata.errors import TierError
from kvstrata.tiers.auth import record_key
from kvstrata.tiers.base import BlockId, ReadStatus, Tier, TierCapabilities, TierContext, TierOptions
from kvstrata.tiers.mooncake.format import (
    RECORD_HEADER,
    LayerSpan,
    _record_bytes,
    check_record,
    plan_spans,
    write_record,
)
from kvstrata.tiers.mooncake.link import GONE, INVALID_PARAMS, close_link, master_fault, open_link
from kvstrata.tiers.mooncake.objects import Obj, Ranges, _add, _batches, _codes, _copy_out, _offsets, _set
from kvstrata.tiers.mooncake.options import SLABS, MooncakeOptions, _coerce_options
from kvstrata.tiers.mooncake.staging import Slab, Staging, Unavailable
from kvstrata.tiers.records import KEY_BYTES, RECORD_ALIGN, acceptable_buffer

log = logging.getLogger("kvstrata.tiers.mooncake")


class MooncakeTier(Tier):
    """Cluster-wide DRAM pool on Mooncake Store; see the module docstring for the design.

    ``checksum_failures`` counts layer-blocks reported ``CORRUPT``; ``faults`` counts
    operations answered with misses because the pool could not be used.

    With a secret (``secret_file`` / ``secret_env`` / ``secret``, :mod:`kvstrata.tiers.auth`) the
    tier writes keyed records under ``<prefix>/k<key id>/<key>/<span>`` (the namespace seed is
    then in no object name); a record whose keyed check fails twice is ``CORRUPT``, counted in
    ``auth_failures``, and its object is removed from the pool (a forged object must not keep
    its name: the first writer of a name wins). Objects of clients without the secret live
    under other names: never read here.
    """

    capabilities = TierCapabilities(
        persistent=False, shared=True, checksums=True, alignment=RECORD_ALIGN, connection=True
    )
    Options = MooncakeOptions

    def __init__(self, name: str, capacity: int, options: TierOptions, context: TierContext) -> None:
        opts = options if isinstance(options, MooncakeOptions) else _coerce_options(options)
        super().__init__(name, capacity, opts, context)
        self.opts = opts
        self.checksum_failures = 0
        self.auth_failures = 0
        self.faults = 0
        self._auth = record_key(opts, context.namespace, "mooncake", name, f"master {opts.master_address}")
        if self._auth is None:
            self._seed = context.namespace.seed
            self._base = f"{opts.prefix}/{self._seed.hex()}/"
        else:  # keyed: the key id names the namespace; its seed stays out of the pool's names
            self._seed = bytes(16)
            self._base = f"{opts.prefix}/k{self._auth.kid.hex()}/"
        self._spans = plan_spans(context.layout, opts.object_size)
        self._where = {layer: (c, s) for c in self._spans for s, layer in enumerate(c.layers)}
        # what one layer-block costs at most beyond its bytes (record header, padding) in a full object
        self._overhead = max(math.ceil(c.overhead / len(c.layers)) for c in self._spans)
        largest = max(c.size for c in self._spans)
        self._staging = Staging(max(opts.staging_size, largest), max(opts.staging_size // SLABS, largest))
        self._lock = threading.Lock()  # the space account
        self._merge_lock = threading.Lock()  # read-modify-write of objects written or deleted in part
        self._objects: dict[str, int] = {}  # objects this tier put and did not delete -> size
        # Writes and deletes of this process, started or ended (``_mutations``) and running now
        # (``_mutating``), under ``_lock``: a read that fails its checks twice while one ran beside
        # it read an object being rewritten, not a damaged one (MISSING, not CORRUPT).
        self._mutations = 0
        self._mutating = 0
        self._used = 0
        self._closed = False
        self._link = open_link(opts)
        try:
            self._link.attach(self._staging.arena)
            self._link.start(opts.setup_timeout_s)
        except BaseException:
            close_link(self._link)
            raise

    @property
    def connected(self) -> bool:
        """Whether the tier has a client now (it may still find the master unreachable)."""
        return self._link.connected

    def _fault(self) -> None:
        with self._lock:
            self.faults += 1

    def object_key(self, bid: BlockId) -> str | None:
        """The pool key of the object that holds ``bid`` (back-door access for tests and tools)."""
        where = self._locate(bid)
        return None if where is None else where[0]

    # -- bytes ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def _mutation(self) -> Iterator[None]:
        with self._lock:
            self._mutating += 1
            self._mutations += 1
        try:
            yield
        finally:
            with self._lock:
                self._mutating -= 1
                self._mutations += 1

    def _mutated_since(self, mark: int) -> bool:
        """Whether a write or delete of this process ran at any time since ``mark`` (``_mutations``)."""
        with self._lock:
            return self._mutating > 0 or self._mutations != mark

    def write(self, items: Sequence[tuple[BlockId, Buffer]]) -> list[bool]:
        self._check_open()
        with self._mutation():
            return self._write(items)

    def _write(self, items: Sequence[tuple[BlockId, Buffer]]) -> list[bool]:
        ok = [False] * len(items)
        objs: dict[str, Obj] = {}
        for i, (bid, buf) in enumerate(items):
            where = self._locate(bid)
            if where is not None and acceptable_buffer(buf, where[1].lengths[where[2]]):
                _add(objs, where, bid[0], i)
        whole = [o for o in objs.values() if o.whole]
        part = [o for o in objs.values() if not o.whole]
        self._store(whole, items, ok, merge=False)
        if part:
            with self._merge_lock:
                self._store(part, items, ok, merge=True)
        return ok

    def read(self, items: Sequence[tuple[BlockId, Buffer]]) -> list[ReadStatus]:
        self._check_open()
        out = [ReadStatus.MISSING] * len(items)
        objs: dict[str, Obj] = {}
        for i, (bid, dst) in enumerate(items):
            where = self._locate(bid)
            if where is not None and nbytes(dst) == where[1].lengths[where[2]]:
                _add(objs, where, bid[0], i)
        dsts = [dst for _, dst in items]
        with self._lock:
            mark = self._mutations if self._mutating == 0 else -1  # -1: one runs beside this read
        again = self._fetch(list(objs.values()), dsts, out)
        failed: list[str] = []
        if again:  # a rewrite or an eviction racing the read tears it: look once more
            first = {obj.name: obj.seen for obj in again}
            for obj in self._fetch(again, dsts, out):
                if obj.seen != first[obj.name] or self._mutated_since(mark):  # changing under us, not corrupt
                    _set(out, obj, ReadStatus.MISSING)
                    continue
                _set(out, obj, ReadStatus.CORRUPT)
                failed.append(obj.name)
                with self._lock:
                    if self._auth is None:
                        self.checksum_failures += sum(map(len, obj.slots.values()))
                    else:
                        self.auth_failures += sum(map(len, obj.slots.values()))
                log.warning("mooncake tier %s: object %s failed its checks twice", self.name, obj.name)
            if failed and self._auth is not None:  # forged (or damaged): free its name for genuine writers
                log.warning("mooncake tier %s: removing %d objects that fail their keyed check", self.name, len(failed))
                self._forget(failed)
                self._remove(failed)
        return out

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "checksum_failures": self.checksum_failures,
                "auth_failures": self.auth_failures,
                "faults": self.faults,
                "used_bytes": self._used,
            }

    def delete(self, ids: Sequence[BlockId]) -> None:
        self._check_open()
        with self._mutation():
            self._delete(ids)

    def _delete(self, ids: Sequence[BlockId]) -> None:
        objs: dict[str, Obj] = {}
        for i, bid in enumerate(ids):
            where = self._locate(bid)
            if where is not None:
                _add(objs, where, bid[0], i)
        whole = [o.name for o in objs.values() if o.whole]
        part = [o for o in objs.values() if not o.whole]
        if whole:
            self._forget(whole)  # released whatever the pool answers: a restarted master lost them anyway
            self._remove(whole)
        if part:
            with self._merge_lock:
                self._drop_layers(part)

    def contains(self, ids: Sequence[BlockId]) -> list[bool]:
        self._check_open()
        names = [self._locate(bid) for bid in ids]
        unique = list(dict.fromkeys(w[0] for w in names if w is not None))
        if not unique:
            return [False] * len(ids)
        try:
            codes = _codes(
                self._link.call(lambda store: store.batch_is_exist(unique), self.opts.timeout_s), len(unique)
            )
        except Unavailable:
            self._fault()
            return [False] * len(ids)
        self._link.check(codes)
        present = {name for name, code in zip(unique, codes, strict=True) if code == 1}
        return [w is not None and w[0] in present for w in names]

    # -- space ---------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def has_room(self, sizes: Sequence[int], live_bytes: int) -> bool:
        need = sum(sizes)
        if live_bytes + need > self.capacity:
            return False
        with self._lock:
            return self._used + need + self._overhead * len(sizes) <= self.capacity

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # calls that outlived their deadline may still move bytes of the arena: unregister it only
        # once they ended; else it stays registered (and alive) until the client closes
        if self._staging.wait_idle(self.opts.timeout_s):
            self._link.detach(self._staging.arena)
        close_link(self._link)

    # -- planning ----------------------------------------------------------------------------
    def _locate(self, bid: BlockId) -> tuple[str, LayerSpan, int] | None:
        try:
            key, layer = bid
            where = self._where.get(int(layer))
        except (TypeError, ValueError):
            return None
        if where is None or not isinstance(key, bytes) or len(key) != KEY_BYTES:
            return None
        span, slot = where
        return f"{self._base}{key.hex()}/{span.tag}", span, slot

    # -- reading -------------------------------------------------------------------------------
    def _fetch(self, objs: list[Obj], dsts: list[Buffer], out: list[ReadStatus]) -> list[Obj]:
        """Read ``objs`` into ``dsts``, setting ``out``; returns the parts that failed their checks."""
        bad: list[Obj] = []
        for batch in _batches(objs, Obj.read_bytes, self._staging.slab_size):
            try:
                bad += self._fetch_batch(batch, dsts, out)
            except Unavailable:
                self._fault()
                for obj in batch:
                    _set(out, obj, ReadStatus.ERROR)
        return bad

    def _fetch_batch(self, batch: list[Obj], dsts: list[Buffer], out: list[ReadStatus]) -> list[Obj]:
        plans: list[Ranges] = []
        at = 0
        for obj in batch:
            plans.append(Ranges.plan(obj, at))
            at = plans[-1].end
        names = [obj.name for obj in batch]
        dst = [p.dst for p in plans]
        src = [p.src for p in plans]
        sizes = [p.sizes for p in plans]
        with self._staging.slab(self.opts.timeout_s) as slab:
            ptr = slab.ptr

            def op(store: Any) -> list[list[int]]:
                return store.get_into_ranges([ptr], [names], [dst], [src], [sizes])[0]

            results = _codes(self._link.call(op, self.opts.timeout_s, slab), len(batch))
            self._link.check([c for codes in results for c in codes])
            bad: list[Obj] = []
            for obj, codes, plan in zip(batch, results, plans, strict=True):
                failed = self._deliver(obj, codes, plan, slab, dsts, out)
                if failed is not None:
                    bad.append(failed)
            return bad

    def _deliver(
        self, obj: Obj, codes: list[int], plan: Ranges, slab: Slab, dsts: list[Buffer], out: list[ReadStatus]
    ) -> Obj | None:
        """Check one object's records in the slab and copy the good layers out.

        Returns the part that failed its checks, with a digest of what was read (``seen``)."""
        error = next((c for c in codes if c < 0), None)
        if error is not None:
            if error in GONE:
                _set(out, obj, ReadStatus.MISSING)
                return None
            if error != INVALID_PARAMS:  # a fault; INVALID_PARAMS: the object is not one of ours
                _set(out, obj, ReadStatus.ERROR)
                return None
            return replace(obj, seen=error)
        if list(codes) != plan.sizes:
            return replace(obj, seen=hash(tuple(codes)))
        failed: dict[int, list[int]] = {}
        digest = xxhash.xxh3_64()
        for s, at in plan.records:
            positions = obj.slots[s]
            n = obj.span.lengths[s]
            record = slab.view(at, RECORD_HEADER + n)
            good = check_record(record, obj.span.layers[s], n, self._seed, obj.key, self._auth)
            if good is None:
                failed[s] = positions
                digest.update(record.data)
                continue
            status = _copy_out(dsts, positions, record[RECORD_HEADER:]) if good else ReadStatus.MISSING
            for i in positions:
                out[i] = status
        return replace(obj, slots=failed, seen=digest.intdigest()) if failed else None

    # -- writing -------------------------------------------------------------------------------
    def _store(self, objs: list[Obj], items: Sequence[tuple[BlockId, Buffer]], ok: list[bool], merge: bool) -> None:
        for batch in _batches(self._reserve(objs), lambda o: o.span.size, self._staging.slab_size):
            try:
                done = self._store_batch(batch, items, merge)
            except Unavailable:
                self._fault()
                done = [False] * len(batch)
            for obj, good in zip(batch, done, strict=True):
                if good:
                    for positions in obj.slots.values():
                        for i in positions:
                            ok[i] = True
                else:  # never put, or removed to be replaced: not ours any more
                    self._forget([obj.name])

    def _store_batch(self, batch: list[Obj], items: Sequence[tuple[BlockId, Buffer]], merge: bool) -> list[bool]:
        offsets = _offsets([obj.span.size for obj in batch])
        with self._staging.slab(self.opts.timeout_s) as slab:
            present: list[list[bool] | None]
            if merge:
                present, replacing = self._load(batch, offsets, slab)
            else:  # objects this tier put before are replaced; others are new (or another writer's)
                present, replacing = [None] * len(batch), [not obj.reserved for obj in batch]
            for obj, at, found in zip(batch, offsets, present, strict=True):
                self._pack(obj, slab.view(at, obj.span.size), found, items)
            codes = self._put(batch, offsets, slab, replacing)
        return [code == 0 for code in codes]

    def _pack(
        self, obj: Obj, view: np.ndarray, present: list[bool] | None, items: Sequence[tuple[BlockId, Buffer]]
    ) -> None:
        """Lay out ``obj`` in ``view``: the batch's layers, over the ``present`` records of an
        existing object loaded there (the others become absent records)."""
        span = obj.span
        for s, (layer, n, at) in enumerate(zip(span.layers, span.lengths, span.offsets, strict=True)):
            positions = obj.slots.get(s)
            if positions is not None:  # the last write of a layer in the batch wins
                data = items[positions[-1]][1]
            elif present is not None and present[s]:
                continue
            else:
                data = None
            write_record(view[at : at + _record_bytes(n)], layer, n, self._seed, obj.key, data, self._auth)

    def _load(self, batch: list[Obj], offsets: list[int], slab: Slab) -> tuple[list[list[bool] | None], list[bool]]:
        """Read whole existing objects into their places in ``slab``: which of their records are
        intact and present (None: no object of ours there), and whether each exists."""
        names = [obj.name for obj in batch]
        ptrs = [slab.ptr + at for at in offsets]
        sizes = [obj.span.size for obj in batch]
        codes = _codes(
            self._link.call(lambda store: store.batch_get_into(names, ptrs, sizes), self.opts.timeout_s, slab),
            len(batch),
        )
        self._link.check(codes)
        if any(master_fault(c) for c in codes):
            raise Unavailable("master unreachable")
        present: list[list[bool] | None] = []
        for obj, at, code in zip(batch, offsets, codes, strict=True):
            if code != obj.span.size:
                present.append(None)
                continue
            span, view = obj.span, slab.view(at, obj.span.size)
            present.append(
                [
                    check_record(view[off : off + _record_bytes(n)], layer, n, self._seed, obj.key, self._auth) is True
                    for layer, n, off in zip(span.layers, span.lengths, span.offsets, strict=True)
                ]
            )
        return present, [code not in GONE for code in codes]

    def _put(self, batch: list[Obj], offsets: list[int], slab: Slab, replace: list[bool]) -> list[int]:
        """Put objects from ``slab``; those flagged ``replace`` are removed first.

        Not ``upsert``: two clients upserting one key at once leak pool space in Mooncake
        0.3.13 (and most such upserts fail), while racing put/remove pairs do not. A put of a
        name that exists keeps the object there (the first writer wins)."""
        names = [obj.name for obj in batch]
        ptrs = [slab.ptr + at for at in offsets]
        sizes = [obj.span.size for obj in batch]
        stale = [name for name, r in zip(names, replace, strict=True) if r]

        def op(store: Any) -> list[int]:
            if stale:
                store.batch_remove(stale, True)
            return list(store.batch_put_from(names, ptrs, sizes))

        codes = _codes(self._link.call(op, self.opts.timeout_s, slab), len(batch))
        self._link.check(codes)
        return codes

    # -- deleting -------------------------------------------------------------------------------
    def _remove(self, names: list[str]) -> None:
        try:
            codes = self._link.call(lambda store: store.batch_remove(names, True), self.opts.timeout_s)
        except Unavailable:
            self._fault()
            return
        self._link.check(codes)

    def _drop_layers(self, objs: list[Obj]) -> None:
        """Clear some layers of objects (merge lock held); objects left with none are removed."""
        for batch in _batches(objs, lambda o: o.span.size, self._staging.slab_size):
            offsets = _offsets([obj.span.size for obj in batch])
            try:
                with self._staging.slab(self.opts.timeout_s) as slab:
                    present, _ = self._load(batch, offsets, slab)
                    keep, gone = self._clear_slots(batch, offsets, present, slab)
                    if keep:
                        self._put([batch[k] for k in keep], [offsets[k] for k in keep], slab, [True] * len(keep))
            except Unavailable:
                self._fault()
                continue
            if gone:
                self._forget([o.name for o in gone])
                self._remove([o.name for o in gone])

    def _clear_slots(
        self, batch: list[Obj], offsets: list[int], present: list[list[bool] | None], slab: Slab
    ) -> tuple[list[int], list[Obj]]:
        """Make the batch's layers absent in the loaded objects; returns (positions to rewrite, objects to remove)."""
        keep: list[int] = []
        gone: list[Obj] = []
        for k, (obj, at, found) in enumerate(zip(batch, offsets, present, strict=True)):
            left = [] if found is None else [s for s, p in enumerate(found) if p and s not in obj.slots]
            if not left:  # absent, not ours, or nothing else in it: remove it
                gone.append(obj)
                continue
            keeping = [s in left for s in range(len(obj.span.layers))]
            self._pack(replace(obj, slots={}), slab.view(at, obj.span.size), keeping, [])
            keep.append(k)
        return keep, gone

    # -- the space account ------------------------------------------------------------------------
    def _reserve(self, objs: list[Obj]) -> list[Obj]:
        """Add new objects to the account while they fit ``capacity``; returns those that do."""
        fit: list[Obj] = []
        with self._lock:
            for obj in objs:
                if obj.name not in self._objects:
                    if self._used + obj.span.size > self.capacity:
                        continue
                    self._objects[obj.name] = obj.span.size
                    self._used += obj.span.size
                    obj.reserved = True
                fit.append(obj)
        return fit

    def _forget(self, names: list[str]) -> None:
        with self._lock:
            for name in names:
                self._used -= self._objects.pop(name, 0)

    def _check_open(self) -> None:
        if self._closed:
            raise TierError(f"mooncake tier {self.name!r} (master {self.opts.master_address}) is closed")
