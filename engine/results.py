"""What the engine hands back: lookup, store and load results, and the handle of a load in flight."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstrata.core.keys import Key

if TYPE_CHECKING:
    from kvstrata.engine.plans import LoadPlan

__all__ = ["LoadHandle", "LoadResult", "LookupResult", "StoreResult", "done_future"]


@dataclass(frozen=True)
class LookupResult:
    """How much of a prefix can be restored, and from where.

    ``plan``: set by :meth:`Engine.lookup_pinned` only, the pinned plan a following
    :meth:`Engine.load` consumes (it then looks nothing up again)."""

    num_blocks: int
    tier_positions: list[int]  # position (0 = top) of the tier serving each restorable block
    tier_names: tuple[str, ...]
    block_size: int
    plan: LoadPlan | None = field(default=None, compare=False, repr=False)

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
    dropped: bool = False  # some blocks (a tail of the batch, or all) were dropped: queue budget
    dropped_blocks: int = 0  # how many


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
    """An in-flight load. ``wait_layer(l)`` returns once layer ``l`` is in the buffers.

    ``layer_by_layer``: each layer is signalled as soon as it is in place; without it (a caller
    that waits for the whole load) small layers may be read several per tier call. ``waited``:
    the caller waits for the whole load and nobody for a layer (``Engine.load_sync``): no event
    per layer, and a ``host_spans`` tier reads every layer in one call."""

    def __init__(self, layers: Sequence[int], layer_by_layer: bool = True, waited: bool = False) -> None:
        self.layer_by_layer = layer_by_layer and not waited
        self.waited = waited
        self.future: Future[LoadResult] = Future()
        self._events = {layer: _DONE if waited else threading.Event() for layer in layers}
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
        if not self.waited:
            self._events[layer].set()

    def _all_done(self) -> None:
        if not self.waited:
            for ev in self._events.values():
                ev.set()

    def finish(self, result: LoadResult) -> None:
        """Set the result and release every layer waiter."""
        self.future.set_result(result)
        self._all_done()

    def fail(self, exc: BaseException) -> None:
        self.future.set_exception(exc)
        self._all_done()

    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        return self._events[layer].wait(timeout)

    def result(self, timeout: float | None = None) -> LoadResult:
        return self.future.result(timeout)

    def done(self) -> bool:
        return self.future.done()


_DONE = threading.Event()  # every layer of a waited load: in place once anyone can ask
_DONE.set()


def done_future(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut
