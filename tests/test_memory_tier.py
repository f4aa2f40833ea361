"""The memory tiers against a plain dict of what was written: span batches and item lists,
rewrites, a key twice in one batch, deletes by id batch and by list, a full arena."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvstrata.core.buffers import row_addresses
from kvstrata.core.keys import Key, Namespace
from kvstrata.core.layout import uniform_layout
from kvstrata.tiers import IdBatch, KeyGroup, ReadStatus, SpanBatch, SpanGroup, TierContext
from kvstrata.tiers.memory import DRAMTier, HBMTier, MemoryOptions

LAYOUT = uniform_layout("t", num_layers=4, num_kv_heads=1, head_dim=4, block_size=4)
SIZE = LAYOUT.layer_nbytes(0)


def _batch(keys: list[Key], arrays: dict[int, np.ndarray], write: bool) -> SpanBatch:
    rows = range(len(keys))
    return SpanBatch(
        [SpanGroup(layer, keys, row_addresses(a, rows, SIZE, write) or [], SIZE) for layer, a in arrays.items()]
    )


@pytest.mark.parametrize("spans", [True, False])
@pytest.mark.parametrize("cls", [DRAMTier, HBMTier])
def test_a_memory_tier_holds_exactly_what_was_written(cls: type, spans: bool) -> None:
    rng = random.Random(7)
    gen = np.random.default_rng(7)
    keys = [i.to_bytes(16, "big") for i in range(150)]
    tier = cls(
        "t", SIZE * 200, MemoryOptions(pin_memory="off"), TierContext(LAYOUT, Namespace("m", "bfloat16", "f", 4))
    )
    model: dict[tuple[Key, int], np.ndarray] = {}
    for _ in range(400):
        op = rng.random()
        ks = rng.sample(keys, rng.randint(1, 40))
        layers = rng.sample(range(4), rng.randint(1, 4))
        if op < 0.45:
            if spans and rng.random() < 0.2:
                ks.append(ks[0])  # twice in one batch: the last copy stays
            data = {layer: gen.integers(0, 256, (len(ks), SIZE), np.uint8) for layer in layers}
            items = (
                _batch(ks, data, False)
                if spans
                else [((k, layer), data[layer][i]) for layer in layers for i, k in enumerate(ks)]
            )
            ok, now = iter(tier.write(items)), set()
            for layer in layers:
                for i, k in enumerate(ks):
                    if next(ok):
                        model[(k, layer)] = data[layer][i].copy()
                        now.add((k, layer))
                    elif (k, layer) not in now:  # a rewrite that found no room loses the block
                        model.pop((k, layer), None)
        elif op < 0.65:
            tier.delete(
                IdBatch([KeyGroup(layer, ks) for layer in layers])
                if spans
                else [(k, layer) for k in ks for layer in layers]
            )
            for k in ks:
                for layer in layers:
                    model.pop((k, layer), None)
        else:
            out = {layer: np.zeros((len(ks), SIZE), np.uint8) for layer in layers}
            items = (
                _batch(ks, out, True)
                if spans
                else [((k, layer), out[layer][i]) for layer in layers for i, k in enumerate(ks)]
            )
            got = iter(tier.read(items))
            for layer in layers:
                for i, k in enumerate(ks):
                    status = next(got)
                    if (k, layer) in model:
                        assert status is ReadStatus.OK
                        assert np.array_equal(out[layer][i], model[(k, layer)])
                    else:
                        assert status is ReadStatus.MISSING
        assert tier.used_bytes == len(model) * SIZE
    tier.delete([bid for bid in model])
    assert tier.used_bytes == 0
    tier.close()


def test_a_read_while_a_write_is_copied_in_misses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A write publishes its slots before its copy finishes (the index work overlaps the copy);
    a read landing in between must report the blocks missing, never the slots' old bytes."""
    from kvstrata.tiers import memory

    tier = DRAMTier(
        "t", SIZE * 64, MemoryOptions(pin_memory="off"), TierContext(LAYOUT, Namespace("m", "bf16", "f", 4))
    )
    keys = [i.to_bytes(16, "big") for i in range(4)]
    old = {layer: np.full((4, SIZE), 1, np.uint8) for layer in range(2)}
    new = {layer: np.full((4, SIZE), 2, np.uint8) for layer in range(2)}
    assert all(tier.write(_batch(keys, old, False)))
    seen: list[list[ReadStatus]] = []
    started: list[object] = []
    out = {layer: np.zeros((4, SIZE), np.uint8) for layer in range(2)}
    real_copy = memory.Copy

    class ReadFirst(real_copy):  # type: ignore[misc,valid-type]
        def finish(self) -> None:
            if not started:  # the write's copy, before it runs: read the blocks being written
                started.append(self)
                seen.append(tier.read(_batch(keys, out, True)))
            super().finish()

    monkeypatch.setattr(memory, "Copy", ReadFirst)
    assert all(tier.write(_batch(keys, new, False)))
    assert seen == [[ReadStatus.MISSING] * 8]
    monkeypatch.setattr(memory, "Copy", real_copy)
    assert tier.read(_batch(keys, out, True)) == [ReadStatus.OK] * 8
    assert all(np.array_equal(out[layer], new[layer]) for layer in out)
    tier.close()
