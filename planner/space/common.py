"""What every space model shares: the :class:`Space` and :class:`RecordSpace` interfaces, the
layer-mask sizes of layer-record granularity, and :func:`space_model` (a tier kind's declared
``capabilities.space``)."""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata.planner.kinds import kind_capabilities
from kvstrata.tiers.base import SpaceModel
from kvstrata.tiers.segments import record_extent

__all__ = ["CHUNK_BYTES", "MaskSizes", "RecordSpace", "Space", "space_model"]

CHUNK_BYTES = 16 * 1024**2  # the nvme tier's staging chunk (kvstrata.tiers.nvme.options.CHUNK_BYTES)


class Space:
    """Physical space of one tier; the engine asks ``fits`` before writing ``n`` more blocks."""

    capacity: int | None = None

    def fits(self, live_blocks: int, n: int) -> bool:
        raise NotImplementedError

    def added(self, keys: Sequence[int]) -> None:
        """``keys`` were written (one write batch)."""

    def removed(self, keys: Sequence[int]) -> None:
        """``keys`` were deleted (one delete call)."""

    @property
    def physical_bytes(self) -> int | None:
        return None

    @property
    def physical_written(self) -> int | None:
        """Bytes written to the medium (padding and compaction included), where modelled."""
        return None

    def max_blocks(self) -> int | None:
        """Most blocks the tier can ever hold (``None``: no fixed bound)."""
        return None


def space_model(kind: str) -> SpaceModel:
    """How a tier of ``kind`` spends its capacity, as its class declares (``capabilities.space``).

    A kind whose class cannot be loaded here (planning for a machine with an optional
    dependency this one lacks) is modelled by its bytes."""
    caps = kind_capabilities(kind)
    return caps.space if caps is not None else "bytes"  # a kind without an importable class: its bytes


class MaskSizes:
    """Bytes and layers of a layer mask, cached (masks are unions of a few groups' masks)."""

    def __init__(self, layer_sizes: Sequence[int], rank_independent: int = 0) -> None:
        self.sizes = list(layer_sizes)
        self.extents = [record_extent(s) for s in self.sizes]
        self.rank_independent = rank_independent  # mask of layers stored once for all tp ranks
        self._layers: dict[int, tuple[int, ...]] = {}
        self._nbytes: dict[int, int] = {}
        self._extent: dict[int, int] = {}
        self._ri: dict[int, int] = {}

    def _fill(self, mask: int) -> None:
        layers = tuple(i for i in range(len(self.sizes)) if mask >> i & 1)
        self._layers[mask] = layers
        self._nbytes[mask] = sum(self.sizes[i] for i in layers)
        self._extent[mask] = sum(self.extents[i] for i in layers)
        self._ri[mask] = sum(self.sizes[i] for i in layers if self.rank_independent >> i & 1)

    def layers(self, mask: int) -> tuple[int, ...]:
        got = self._layers.get(mask)
        if got is None:
            self._fill(mask)
            got = self._layers[mask]
        return got

    def nbytes(self, mask: int) -> int:
        got = self._nbytes.get(mask)
        if got is None:
            self._fill(mask)
            got = self._nbytes[mask]
        return got

    def extent(self, mask: int) -> int:
        got = self._extent.get(mask)
        if got is None:
            self._fill(mask)
            got = self._extent[mask]
        return got

    def ri_bytes(self, mask: int) -> int:
        """Bytes of the rank-independent layers of ``mask``."""
        got = self._ri.get(mask)
        if got is None:
            self._fill(mask)
            got = self._ri[mask]
        return got


class RecordSpace(Space):
    """Physical space at layer-record granularity: what the engine's ``has_room(sizes, live_bytes)``
    answers for one write of the layer-blocks of ``masks`` (one mask per key)."""

    def fits_records(self, masks: Sequence[int], live_bytes: int) -> bool:
        raise NotImplementedError

    def add_records(self, items: Sequence[tuple[int, int]]) -> None:
        """One write batch: ``(key, layer mask)`` pairs (the engine writes them layer-major)."""

    def remove_records(self, items: Sequence[tuple[int, int]]) -> None:
        """One delete call: ``(key, layer mask)`` pairs."""
