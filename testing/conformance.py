"""The conformance suite every tier must pass (zarr's ``testing/store.py`` pattern), shipped in
the package so that a tier from another distribution can run it too.

A tier joins by subclassing :class:`TierConformance` in a pytest test module, naming the
registry kind it is registered under::

    # tests/test_my_tier.py
    from kvstrata.testing.conformance import TierConformance

    class TestMyTier(TierConformance):
        kind = "my-tier"

        def tier_options(self, root):      # optional: options of a tier with its own directory
            return {"path": str(root)}

and running ``pytest tests/test_my_tier.py``. The suite builds every tier through its
``factory`` fixture (a :class:`~kvstrata.testing.oracle.TierFactory`), which looks ``kind`` up
in :data:`kvstrata.tiers.TIERS`: a tier of another distribution is found through its entry
point, e.g. in that distribution's ``pyproject.toml``::

    [project.entry-points."kvstrata.tier"]
    my-tier = "my_package.tier:MyTier"

(or registered in a ``conftest.py`` with ``TIERS.register("my-tier", MyTier)``). Install
``kvstrata[testing]`` (pytest and Hypothesis) to use it.

Besides ``kind`` and :meth:`TierConformance.tier_options`, a subclass may override
:meth:`TierConformance.wrap` (wrapper tiers around the tier under test), ``requires`` (a
module whose absence skips the class) and ``known_bugs`` (test name -> reason, applied as
strict xfails so a fix shows up). The suite talks to the tier only through the
:class:`~kvstrata.tiers.base.Tier` interface and through an
:class:`~kvstrata.engine.engine.Engine` configured with that tier alone, so it holds for any
backend: memory, local disk, a memory pool, fsspec. Its stateful Hypothesis model is
:class:`~kvstrata.testing.stateful.EngineModel`; the oracle it checks against is
:mod:`kvstrata.testing.oracle`.
"""

from __future__ import annotations

import functools
import importlib
import random
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from kvstrata.core.buffers import row_addresses
from kvstrata.core.keys import Key
from kvstrata.core.layout import KVLayout
from kvstrata.engine.engine import Engine
from kvstrata.testing import oracle
from kvstrata.testing.oracle import (
    HookedBuffer,
    TierFactory,
    assert_read_back,
    block_bytes,
    chain_keys,
    empty_buffers,
    engine_layout,
    mismatches,
    raw_block_keys,
    read_back,
    source_buffers,
    tier_usage,
    to_bytes,
    write_items,
)
from kvstrata.testing.stateful import EngineModel
from kvstrata.tiers import BlockId, IdBatch, KeyGroup, ReadStatus, SpanBatch, SpanGroup, Tier, TierCapabilities
from kvstrata.tiers.wrappers import GateTier

MiB = 1024**2


def race(writers: Sequence[Callable[[], None]], read_once: Callable[[random.Random], None], errors: list[str]) -> None:
    """Run ``writers`` to their end while two reader threads call ``read_once`` over and over (each
    with its own seeded ``random.Random``); an exception in any thread is appended to ``errors``."""
    stop = threading.Event()

    def guarded(name: str, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except Exception as exc:  # pragma: no cover - reported by the caller's check of errors
                errors.append(f"{name}: {exc!r}")

        return run

    def reading(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            read_once(rng)

    started = [threading.Thread(target=guarded("writer", w)) for w in writers]
    readers = [threading.Thread(target=guarded("reader", functools.partial(reading, s))) for s in range(2)]
    for t in started + readers:
        t.start()
    for t in started:
        t.join(60)
    stop.set()
    for t in readers:
        t.join(60)


class TierConformance:
    """Tests every tier must pass. Subclasses set ``kind`` and may override ``tier_options``."""

    kind: ClassVar[str]
    requires: ClassVar[str | None] = None  # module that must import, else the class is skipped
    # Known bugs of this tier: test name -> reason. Applied as strict xfails, so a fix shows up.
    known_bugs: ClassVar[dict[str, str]] = {}
    # Whether the concurrency test also deletes blocks while others read them, and for how long.
    concurrent_deletes: ClassVar[bool] = True
    concurrent_rounds: ClassVar[int] = 400

    def tier_options(self, root: Path) -> dict[str, Any]:
        """Tier-specific options for a tier whose private directory is ``root``."""
        return {}

    def wrap(self, tier: Tier) -> Tier:
        """Wrapper tiers put around every tier under test (none by default)."""
        return tier

    # -- fixtures ------------------------------------------------------------------------
    @pytest.fixture(autouse=True)
    def _require(self) -> None:
        if self.requires is None:
            return
        try:
            importlib.import_module(self.requires)
        except ImportError as exc:
            pytest.skip(f"{self.kind} tier not available: {self.requires} does not import ({exc})")

    @pytest.fixture(autouse=True)
    def _known_bugs(self, request: pytest.FixtureRequest) -> None:
        reason = self.known_bugs.get(request.node.originalname)
        if reason:
            request.applymarker(pytest.mark.xfail(reason=reason, strict=True))

    @pytest.fixture
    def mixed_layout(self) -> KVLayout:
        """Three layers of three kinds and sizes (:func:`kvstrata.testing.oracle.mixed_layout`)."""
        return oracle.mixed_layout()

    @pytest.fixture
    def factory(self, tmp_path: Path, mixed_layout: KVLayout) -> Iterator[TierFactory]:
        f = TierFactory(self.kind, self.tier_options(tmp_path / "tier"), mixed_layout, self.wrap)
        yield f
        f.close_all()

    @pytest.fixture
    def make_tier(self, factory: TierFactory) -> Callable[[int], Tier]:
        return factory.make

    @pytest.fixture
    def reopen(self, factory: TierFactory) -> Callable[[Tier], Tier]:
        return factory.reopen

    @pytest.fixture
    def engine_for(self, tmp_path: Path) -> Iterator[Callable[..., Engine]]:
        """An engine whose only tier is this kind, with ``capacity`` bytes."""
        engines: list[Engine] = []

        def build(
            capacity: int, *, root: Path | None = None, io_threads: int = 2, outer: Callable[[Tier], Tier] | None = None
        ) -> Engine:
            """``outer``: a wrapper put around this kind's (wrapped) tier, e.g. a test's gate."""
            tier = {"name": self.kind, "kind": self.kind, "capacity": capacity}
            tier.update(self.tier_options(root or tmp_path / "engine-tier"))
            cfg = {"engine": {"io_threads": io_threads}, "tiers": [tier]}
            wrap = self.wrap if outer is None else (lambda t: outer(self.wrap(t)))
            eng = Engine.with_tiers(cfg, layout=engine_layout(), wrap={0: wrap})
            engines.append(eng)
            return eng

        yield build
        for eng in engines:
            eng.close()

    @staticmethod
    def all_ids(layout: KVLayout, keys: Sequence[Key]) -> list[BlockId]:
        return [(k, layer) for k in keys for layer in range(layout.num_layers)]

    # -- the interface ---------------------------------------------------------------------
    def test_capabilities_declared(self, make_tier: Callable[[int], Tier]) -> None:
        tier = make_tier(MiB)
        caps = tier.capabilities
        assert isinstance(caps, TierCapabilities)
        assert caps.alignment >= 1 and caps.alignment & (caps.alignment - 1) == 0  # a power of two
        assert tier.capacity == MiB
        assert tier.used_bytes == 0

    @pytest.mark.parametrize("kind", ["numpy", "torch"])
    def test_round_trip(self, make_tier: Callable[[int], Tier], mixed_layout: KVLayout, kind: str) -> None:
        tier = make_tier(MiB)
        ids = self.all_ids(mixed_layout, raw_block_keys(8))
        assert tier.write(write_items(mixed_layout, ids, kind)) == [True] * len(ids)
        assert_read_back(tier, mixed_layout, ids, kind)
        assert_read_back(tier, mixed_layout, ids[::-1], "numpy" if kind == "torch" else "torch")  # cross-kind

    def test_round_trip_in_separate_batches(self, make_tier: Callable[[int], Tier], mixed_layout: KVLayout) -> None:
        tier = make_tier(MiB)
        keys = raw_block_keys(6)
        for k in keys:  # one batch per block, then one read batch over all
            assert all(tier.write(write_items(mixed_layout, self.all_ids(mixed_layout, [k]))))
        assert_read_back(tier, mixed_layout, self.all_ids(mixed_layout, keys))

    def test_read_missing_is_missing(self, make_tier: Callable[[int], Tier], mixed_layout: KVLayout) -> None:
        tier = make_tier(MiB)
        present, absent = raw_block_keys(2)
        assert all(tier.write(write_items(mixed_layout, [(present, 0)])))
        statuses, _ = read_back(tier, mixed_layout, [(absent, 0), (present, 1), (present, 0)])
        assert statuses == [ReadStatus.MISSING, ReadStatus.MISSING, ReadStatus.OK]

    def test_delete_then_missing(self, make_tier: Callable[[int], Tier], mixed_layout: KVLayout) -> None:
        tier = make_tier(MiB)
        keys = raw_block_keys(4)
        ids = self.all_ids(mixed_layout, keys)
        assert all(tier.write(write_items(mixed_layout, ids)))
        gone = self.all_ids(mixed_layout, keys[:2])
        tier.delete([*gone, (raw_block_keys(1, seed=99)[0], 0)])  # unknown ids are ignored
        statuses, _ = read_back(tier, mixed_layout, gone)
        assert statuses == [ReadStatus.MISSING] * len(gone)
        assert_read_back(tier, mixed_layout, self.all_ids(mixed_layout, keys[2:]))
        tier.delete(gone)  # deleting twice is harmless

    def test_delete_everything_releases_space(self, make_tier: Callable[[int], Tier], mixed_layout: KVLayout) -> None:
        tier = make_tier(MiB)
        ids = self.all_ids(mixed_layout, raw_block_keys(16))
        assert all(tier.write(write_items(mixed_layout, ids)))
        assert tier.used_bytes >= sum(mixed_layout.layer_nbytes(layer) for _, layer in ids)
        tier.delete(ids)
        assert tier.used_bytes == 0

    def test_overwrite_same_id(self, make_tier: Callable[[int], Tier], mixed_layout: KVLayout) -> None:
        tier = make_tier(MiB)
        ids = self.all_ids(mixed_layout, raw_block_keys(3))
        assert all(tier.write(write_items(mixed_layout, ids, version=1)))
        assert all(tier.write(write_items(mixed_layout, ids[:4], version=2)))
        assert_read_back(tier, mixed_layout, ids[:4], version=2)
        assert_read_back(tier, mixed_layout, ids[4:], version=1)

    def test_has_room_rejects_what_cannot_fit(self, make_tier: Callable[[int], Tier]) -> None:
        cap = 256 * 1024
        tier = make_tier(cap)
        assert tier.has_room([4096], 0)
        assert not tier.has_room([cap + 1], 0)
        assert not tier.has_room([4096] * (cap // 4096 + 1), 0)

    def test_has_room_true_means_the_write_fits(self, make_tier: Callable[[int], Tier], mixed_layout: KVLayout) -> None:
        """Fill a tier block by block while ``has_room`` agrees: every write must succeed, within capacity."""
        cap = 96 * 1024
        tier = make_tier(cap)
        live = 0
        written: list[BlockId] = []
        for i, key in enumerate(raw_block_keys(2000)):
            layer = i % mixed_layout.num_layers
            size = mixed_layout.layer_nbytes(layer)
            if not tier.has_room([size], live):
                break
            assert tier.write(write_items(mixed_layout, [(key, layer)])) == [True], f"write {i} failed after has_room"
            written.append((key, layer))
            live += size
            assert tier.used_bytes <= cap
        else:
            pytest.fail("has_room never refused although far more than the capacity was offered")
        assert live <= cap
        assert len(written) >= cap // (4 * 4096)  # a tier may pad, but must hold a fair share of its capacity
        assert_read_back(tier, mixed_layout, written)

    def test_close_is_idempotent(self, make_tier: Callable[[int], Tier], mixed_layout: KVLayout) -> None:
        tier = make_tier(MiB)
        assert all(tier.write(write_items(mixed_layout, [(raw_block_keys(1)[0], 0)])))
        tier.close()
        tier.close()

    # -- host spans (capabilities.host_spans) ----------------------------------------------
    @staticmethod
    def span_batch(layout: KVLayout, keys: Sequence[Key], arrays: dict[int, np.ndarray], write: bool) -> SpanBatch:
        """One group per layer of ``arrays`` (``[len(keys), layer-block bytes]`` each), all sharing
        ``keys``: the batch the engine hands a ``host_spans`` tier."""
        groups = []
        for layer, arr in arrays.items():
            size = layout.layer_nbytes(layer)
            addresses = row_addresses(arr, range(len(keys)), size, write)
            assert addresses is not None
            groups.append(SpanGroup(layer, keys, addresses, size))
        return SpanBatch(groups)

    @staticmethod
    def block_rows(layout: KVLayout, keys: Sequence[Key], version: int = 0) -> dict[int, np.ndarray]:
        return {
            layer: np.stack([block_bytes(k, layer, layout.layer_nbytes(layer), version) for k in keys])
            for layer in range(layout.num_layers)
        }

    def test_host_spans_round_trip(self, make_tier: Callable[[int], Tier], mixed_layout: KVLayout) -> None:
        """A tier declaring ``host_spans`` stores a :class:`SpanBatch`, reads one back (in another
        key order), agrees with the item-by-item path, and deletes an :class:`IdBatch`."""
        tier = make_tier(4 * MiB)
        if not tier.capabilities.host_spans:
            pytest.skip(f"{self.kind} does not take host spans")
        layout = mixed_layout
        keys = raw_block_keys(12, seed=11)
        src = self.block_rows(layout, keys)
        assert tier.write(self.span_batch(layout, keys, src, write=False)) == [True] * (len(keys) * layout.num_layers)
        back = list(reversed(keys))
        dst = {layer: np.zeros_like(a) for layer, a in src.items()}
        statuses = tier.read(self.span_batch(layout, back, dst, write=True))
        assert statuses == [ReadStatus.OK] * (len(keys) * layout.num_layers)
        for layer in src:
            assert np.array_equal(dst[layer], src[layer][::-1]), f"wrong bytes in layer {layer}"
        assert_read_back(tier, layout, self.all_ids(layout, keys))  # the item-by-item path sees the same
        gone = keys[:5]
        tier.delete(IdBatch([KeyGroup(layer, gone) for layer in range(layout.num_layers)]))
        statuses, _ = read_back(tier, layout, self.all_ids(layout, gone))
        assert statuses == [ReadStatus.MISSING] * len(statuses)
        assert_read_back(tier, layout, self.all_ids(layout, keys[5:]))
        tier.delete(self.all_ids(layout, keys[5:]))
        assert tier.used_bytes == 0

    def test_host_spans_readers_see_whole_blocks(
        self, make_tier: Callable[[int], Tier], mixed_layout: KVLayout
    ) -> None:
        """A writer rewrites (two versions) and deletes blocks by span and id batches while readers
        read them by span batches: an OK read holds exactly one version of its own block."""
        tier = make_tier(4 * MiB)
        if not tier.capabilities.host_spans:
            pytest.skip(f"{self.kind} does not take host spans")
        layout = mixed_layout
        keys = raw_block_keys(16, seed=12)
        versions = [self.block_rows(layout, keys, v) for v in (1, 2)]
        errors: list[str] = []
        every_layer = range(layout.num_layers)

        def writer() -> None:
            rng = random.Random(5)
            for r in range(self.concurrent_rounds // 4):
                if not all(tier.write(self.span_batch(layout, keys, versions[r % 2], write=False))):
                    errors.append("a write failed")
                gone = rng.sample(keys, 4)
                tier.delete(IdBatch([KeyGroup(layer, gone) for layer in every_layer]))

        def read_once(rng: random.Random) -> None:
            picked = rng.sample(range(len(keys)), 6)
            dst = {layer: np.zeros((6, layout.layer_nbytes(layer)), np.uint8) for layer in every_layer}
            statuses = iter(tier.read(self.span_batch(layout, [keys[i] for i in picked], dst, write=True)))
            for layer in dst:
                for row, i in enumerate(picked):
                    st = next(statuses)
                    if st is ReadStatus.OK and not any(np.array_equal(dst[layer][row], v[layer][i]) for v in versions):
                        errors.append(f"torn or foreign bytes for layer {layer} of key {i}")
                    elif st not in (ReadStatus.OK, ReadStatus.MISSING):
                        errors.append(f"unexpected status {st}")

        race([writer], read_once, errors)
        assert errors == []

    # -- persistence ---------------------------------------------------------------------
    def _require_persistent(self, tier: Tier) -> None:
        if not tier.capabilities.persistent:
            pytest.skip(f"{self.kind} is not persistent")

    def test_restart_keeps_blocks(
        self, make_tier: Callable[[int], Tier], reopen: Callable[[Tier], Tier], mixed_layout: KVLayout
    ) -> None:
        tier = make_tier(MiB)
        self._require_persistent(tier)
        keys = raw_block_keys(6)
        ids = self.all_ids(mixed_layout, keys)
        assert all(tier.write(write_items(mixed_layout, ids)))
        tier.delete(self.all_ids(mixed_layout, keys[:1]))
        tier = reopen(tier)
        kept = self.all_ids(mixed_layout, keys[1:])
        found = dict(tier.scan())
        assert found == {bid: mixed_layout.layer_nbytes(bid[1]) for bid in kept}
        assert_read_back(tier, mixed_layout, kept)
        assert tier.verify().ok

    # -- concurrency -------------------------------------------------------------------------
    def test_concurrent_readers_and_writers(self, make_tier: Callable[[int], Tier], mixed_layout: KVLayout) -> None:
        """Writers rewrite and delete their own blocks while readers read everyone's: an OK read is exact."""
        tier = make_tier(4 * MiB)
        owned = [self.all_ids(mixed_layout, raw_block_keys(8, seed=w)) for w in range(2)]
        everything = [bid for ids in owned for bid in ids]
        errors: list[str] = []
        deletes, rounds = self.concurrent_deletes, self.concurrent_rounds

        def writer(ids: list[BlockId]) -> None:
            rng = random.Random(len(ids))
            for _ in range(rounds):
                if not all(tier.write(write_items(mixed_layout, ids))):
                    errors.append("a write failed")
                if deletes:
                    tier.delete(rng.sample(ids, 4))
            tier.write(write_items(mixed_layout, ids))

        def read_once(rng: random.Random) -> None:
            ids = rng.sample(everything, 6)
            statuses, bufs = read_back(tier, mixed_layout, ids)
            for (k, layer), status, buf in zip(ids, statuses, bufs, strict=True):
                expected = block_bytes(k, layer, mixed_layout.layer_nbytes(layer))
                if status is ReadStatus.OK and not np.array_equal(to_bytes(buf), expected):
                    errors.append(f"wrong bytes for layer {layer} of {k.hex()}")
                elif status not in (ReadStatus.OK, ReadStatus.MISSING):
                    errors.append(f"unexpected status {status}")

        race([functools.partial(writer, ids) for ids in owned], read_once, errors)
        assert errors == []
        assert_read_back(tier, mixed_layout, everything)

    def test_read_racing_delete_never_returns_other_bytes(
        self, make_tier: Callable[[int], Tier], mixed_layout: KVLayout
    ) -> None:
        """A delete plus a write of another block, landing inside a read, must not yield OK with foreign bytes.

        The destination buffer runs the interleaving when the tier first asks for its size,
        i.e. after the tier located the block and before (or while) it copies the bytes.
        """
        tier = make_tier(MiB)
        victim, other = raw_block_keys(2, seed=5)
        size = mixed_layout.layer_nbytes(0)
        assert all(tier.write(write_items(mixed_layout, [(victim, 0)])))

        def interleave() -> None:
            tier.delete([(victim, 0)])
            tier.write(write_items(mixed_layout, [(other, 0)]))

        dst = HookedBuffer(np.zeros(size, dtype=np.uint8), interleave)
        status = tier.read([((victim, 0), dst)])[0]
        assert dst.fired, "the tier never asked the destination buffer for its size"
        if status is ReadStatus.OK:
            assert np.array_equal(dst.data, block_bytes(victim, 0, size)), "OK, but with another block's bytes"
        else:
            assert status is ReadStatus.MISSING
        statuses, _ = read_back(tier, mixed_layout, [(victim, 0), (other, 0)])
        assert statuses == [ReadStatus.MISSING, ReadStatus.OK]

    # -- driven by an engine -------------------------------------------------------------------
    def test_engine_churn_respects_capacity(self, engine_for: Callable[..., Engine]) -> None:
        """Store ~5x the capacity through an engine: usage stays within capacity, loads are exact."""
        layout = engine_layout()
        cap = 16 * layout.block_nbytes
        engine = engine_for(cap)
        peak = [0, 0]
        done = threading.Event()

        def sample() -> None:  # usage between and during stores, not only after them
            while not done.is_set():
                used, live, _ = tier_usage(engine, self.kind)
                peak[0], peak[1] = max(peak[0], used), max(peak[1], live)
                time.sleep(0.0005)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            self._churn(engine, layout, cap)
        finally:
            done.set()
            sampler.join(30)
        assert peak[0] <= cap and peak[1] <= cap, f"peak used/live {peak} > capacity {cap}"
        assert engine.stats()["tiers"][self.kind]["evictions"] > 0

    def _churn(self, engine: Engine, layout: KVLayout, cap: int) -> None:
        rng = random.Random(7)
        chains = [chain_keys(layout, seed, rng.randint(1, 6)) for seed in range(30)]
        base = [i for i in range(3 * layout.block_size)]
        chains += [chain_keys(layout, 100 + s, 5, shared=base) for s in range(6)]  # shared 3-block prefix
        for i, keys in enumerate(chains):
            result = engine.store_sync(keys, source_buffers(layout, keys))
            assert result.stored + result.present == len(keys) and not result.failed and not result.dropped
            used, live, capacity = tier_usage(engine, self.kind)
            assert used <= cap and live <= cap and capacity == cap
            assert engine.lookup(keys).num_blocks == len(keys)  # what was just stored is found
            old = chains[rng.randrange(i + 1)]
            bufs = empty_buffers(layout, len(old))
            res = engine.load_sync(old, bufs)
            assert mismatches(layout, old, bufs, res.loaded_blocks) == []

    def test_engine_pinned_blocks_never_evicted(self, engine_for: Callable[..., Engine]) -> None:
        """A load held mid-read pins its blocks; stores that need the space evict others or fail."""
        layout = engine_layout()
        # room for the 4 pinned blocks and a store beside them where records cost more than their
        # bytes (nvme: a 64-byte header each, so a 4 KiB one takes two pages in a tiny segment)
        cap = 16 * layout.block_nbytes
        engine = engine_for(cap, io_threads=2, outer=GateTier)
        gate = engine.tiers[0].tier
        assert isinstance(gate, GateTier)
        pinned = chain_keys(layout, 1, 4)
        assert engine.store_sync(pinned, source_buffers(layout, pinned)).stored == 4
        gate.reads.clear()
        bufs = empty_buffers(layout, 4)
        handle = engine.load(pinned, bufs)
        try:
            for seed in range(2, 14):
                keys = chain_keys(layout, seed, 2)
                engine.store_sync(keys, source_buffers(layout, keys))
                assert all(engine.contains(k) == {self.kind: layout.all_layers_mask} for k in pinned)
                assert tier_usage(engine, self.kind)[0] <= cap
            assert not handle.done() and gate.waiting["read"] == 1
            assert engine.stats()["tiers"][self.kind]["pinned_blocks"] == 4
            assert engine.stats()["tiers"][self.kind]["evictions"] >= 8  # the churn really needed the space
        finally:
            gate.reads.set()
        result = handle.result(timeout=30)
        assert result.ok and mismatches(layout, pinned, bufs, 4) == []
        assert engine.stats()["tiers"][self.kind]["pinned_blocks"] == 0

    def test_engine_restart_finds_blocks(self, engine_for: Callable[..., Engine], tmp_path: Path) -> None:
        layout = engine_layout()
        root = tmp_path / "restart"
        engine = engine_for(64 * layout.block_nbytes, root=root)
        if not engine.tiers[0].tier.capabilities.persistent:
            pytest.skip(f"{self.kind} is not persistent")
        chains = [chain_keys(layout, seed, 3) for seed in range(4)]
        for keys in chains:
            assert engine.store_sync(keys, source_buffers(layout, keys)).stored == 3
        engine.close()
        engine = engine_for(64 * layout.block_nbytes, root=root)
        for keys in chains:
            assert engine.lookup(keys).num_blocks == 3
            bufs = empty_buffers(layout, 3)
            assert engine.load_sync(keys, bufs).ok
            assert mismatches(layout, keys, bufs, 3) == []
        assert all(r["ok"] for r in engine.verify())

    # -- a stateful model -------------------------------------------------------------------
    def test_engine_state_machine(self, tmp_path: Path) -> None:
        options, wrap, kind = self.tier_options, self.wrap, self.kind

        class Model(EngineModel):
            def __init__(self) -> None:
                super().__init__(kind, options(Path(tempfile.mkdtemp(dir=tmp_path))), wrap)

        run_state_machine_as_test(
            Model,
            settings=settings(
                max_examples=40,
                stateful_step_count=20,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
                database=None,
            ),
        )
