"""The daemon's heap and the garbage collector.

Once the daemon serves, what start-up made (imports, the config, the opened tiers and their
indexes) lives as long as the process: :class:`FrozenHeap` moves it out of the collector's walk
(``gc.freeze()``), as vLLM freezes its workers' heap after start-up, so a full collection walks
only what was made since (~0 ms where it took 7-8 ms after start-up, during which the daemon's
moves and HTTP answers waited). A reload that reopens the namespaces freezes again, after handing
the frozen objects back first, so that the closed namespaces' objects can be collected.
"""

from __future__ import annotations

import gc
from typing import Any


class FrozenHeap:
    """Freezes the process's heap when told to (``run()``; tests driving the daemon in their own
    process never do, so their heap stays as it is)."""

    def __init__(self) -> None:
        self.frozen = False

    def freeze(self) -> None:
        gc.collect()
        gc.freeze()
        self.frozen = True

    def refreeze(self) -> None:
        """After a reload reopened the namespaces: the closed ones' objects may be cyclic garbage
        now, and a frozen object is never collected."""
        if self.frozen:
            gc.unfreeze()
            self.freeze()

    @staticmethod
    def status() -> dict[str, Any]:
        """``/status``'s ``gc``: objects frozen (out of the walk) and the passes per generation."""
        return {"frozen_objects": gc.get_freeze_count(), "collections": [g["collections"] for g in gc.get_stats()]}
