"""Pinned plans a worker's socket lookup keeps for its load: kept only for a full hit, taken by
the load of exactly those keys and layers, replaced by a new lookup of the same keys, and given
back on expiry, over the cap and on close, so an abandoned lookup never leaves a block pinned."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvstrata.core.keys import Key
from kvstrata.core.layout import uniform_layout
from kvstrata.engine.engine import Engine
from kvstrata.integrations.vllm.held import HeldPlans

LAYOUT = uniform_layout("held", num_layers=2, num_kv_heads=1, head_dim=8, block_size=4)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def keys_of(n: int, seed: int) -> list[Key]:
    return [bytes(np.random.default_rng(seed * 1000 + i).integers(0, 256, 16, dtype=np.uint8)) for i in range(n)]


def pins(engine: Engine) -> int:
    return sum(e.pins for idx in engine.tiers for e in idx.entries.values())


@pytest.fixture
def engine() -> Iterator[Engine]:
    with Engine({"tiers": [{"name": "dram", "capacity": "4MiB"}]}, layout=LAYOUT) as eng:
        yield eng


def stored(engine: Engine, n: int, seed: int) -> list[Key]:
    keys = keys_of(n, seed)
    nb = LAYOUT.layer_nbytes(0)
    engine.store_sync(keys, {layer: np.zeros((n, nb), dtype=np.uint8) for layer in (0, 1)})
    return keys


def keep(held: HeldPlans, engine: Engine, keys: list[Key], layers: list[int]) -> None:
    found = engine.lookup_pinned(keys, layers, count=False)
    held.keep(keys, layers, found.plan, found.num_blocks)


def test_a_full_hit_is_kept_until_taken_a_partial_one_given_back(engine: Engine) -> None:
    held = HeldPlans(engine, clock=Clock())
    keys = stored(engine, 4, 1)
    keep(held, engine, keys + keys_of(2, 9), [0, 1])  # 4 of 6 found: no load is for exactly these keys
    assert len(held) == 0 and pins(engine) == 0
    keep(held, engine, keys, [1, 0])
    assert len(held) == 1 and pins(engine) == 4
    assert held.take(keys, [0]) is None and held.take(keys_of(3, 7), [0, 1]) is None  # other layers, other keys
    plan = held.take(keys, [0, 1])
    assert plan is not None and plan.keys == keys and len(held) == 0 and pins(engine) == 4
    nb = LAYOUT.layer_nbytes(0)
    res = engine.load(keys, {layer: np.ones((4, nb), dtype=np.uint8) for layer in (0, 1)}, plan=plan).result()
    assert res.loaded_blocks == 4 and pins(engine) == 0


def test_plans_expire_are_replaced_capped_and_closed(engine: Engine) -> None:
    clock = Clock()
    held = HeldPlans(engine, hold_s=5.0, max_plans=2, clock=clock)
    a, b, c = stored(engine, 3, 1), stored(engine, 3, 2), stored(engine, 3, 3)
    keep(held, engine, a, [0, 1])
    keep(held, engine, a, [0, 1])  # the scheduler asked again: the old plan goes back
    assert len(held) == 1 and max(e.pins for e in engine.tiers[0].entries.values()) == 1
    clock.now += 3
    keep(held, engine, b, [0, 1])
    keep(held, engine, c, [0, 1])  # over the cap: the oldest (a) goes back
    assert len(held) == 2 and pins(engine) == 6 and held.take(a, [0, 1]) is None
    clock.now += 3  # b and c are 3 s old, within hold_s
    held.sweep()
    assert len(held) == 2
    clock.now += 2.5  # past hold_s: an abandoned lookup (request aborted) releases its pins
    held.sweep()
    assert len(held) == 0 and pins(engine) == 0 and held.expired == 2
    keep(held, engine, a, [0])
    clock.now += 6
    assert held.take(a, [0]) is None and pins(engine) == 0  # expired: given back, not loaded
    keep(held, engine, b, [1])
    held.close()
    assert len(held) == 0 and pins(engine) == 0


def test_a_load_of_part_of_a_kept_plan_gives_it_back(engine: Engine) -> None:
    """The scheduler looks up from the first block but loads only what vLLM has not computed
    itself: such a load finds no plan for its keys, and the kept plan whose keys hold them as a run
    goes back at once (not ``hold_s`` later); other plans, and plans for other layers, stay."""
    held = HeldPlans(engine, clock=Clock())
    keys, other = stored(engine, 5, 1), stored(engine, 3, 2)
    keep(held, engine, keys, [0, 1])
    keep(held, engine, other, [0, 1])
    keep(held, engine, keys, [0])
    assert len(held) == 3 and pins(engine) == 5 * 2 + 3
    assert held.take(keys[2:4], [0, 1]) is None  # a run inside keys: that request loads now
    assert len(held) == 2 and held.superseded == 1 and pins(engine) == 5 + 3
    assert held.take([keys[1], keys[3]], [0]) is None  # not a run: nothing given back
    assert len(held) == 2
    assert held.take(keys[3:], [0]) is None
    assert len(held) == 1 and pins(engine) == 3
    plan = held.take(other, [1, 0])
    assert plan is not None
    engine.release(plan)
    assert pins(engine) == 0


def test_the_sweeper_expires_plans_without_any_step(engine: Engine) -> None:
    """An idle worker runs no steps (no poll, no load sweeps): the sweeper gives expired plans back."""
    import time

    from kvstrata.integrations.vllm.held import Sweeper

    clock = Clock()
    held = HeldPlans(engine, hold_s=5.0, clock=clock)
    keep(held, engine, stored(engine, 3, 1), [0, 1])
    sweeper = Sweeper(held, interval_s=0.02)
    try:
        time.sleep(0.1)
        assert len(held) == 1  # not expired yet
        clock.now += 6
        deadline = time.monotonic() + 10
        while len(held) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(held) == 0 and pins(engine) == 0 and held.expired == 1
    finally:
        sweeper.close()
