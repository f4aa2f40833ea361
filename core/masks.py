"""Layer masks: a set of layers as an int (bit ``l`` set: layer ``l``), and what they weigh.

The engine, its index and the planner's simulator all describe "which layers of a block" this
way; these helpers turn masks into layers, sizes and groups.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Protocol, TypeVar

__all__ = ["MaskBytes", "group_by_mask", "layers_of", "mask_of", "or_all"]


class _Layered(Protocol):
    @property
    def layers(self) -> int: ...


K = TypeVar("K")
E = TypeVar("E", bound=_Layered)


@lru_cache(maxsize=4096)
def layers_of(mask: int) -> tuple[int, ...]:
    """The layers of ``mask``, ascending."""
    out = []
    layer = 0
    while mask:
        if mask & 1:
            out.append(layer)
        mask >>= 1
        layer += 1
    return tuple(out)


def mask_of(layers: Iterable[int]) -> int:
    mask = 0
    for layer in layers:
        mask |= 1 << layer
    return mask


def or_all(masks: Iterable[int]) -> int:
    out = 0
    for m in masks:
        out |= m
    return out


def group_by_mask(items: Sequence[tuple[K, E]]) -> list[list[tuple[K, E]]]:
    """``(key, entry)`` pairs grouped by the entry's layer mask, in order of first appearance."""
    groups: dict[int, list[tuple[K, E]]] = {}
    for key, entry in items:
        groups.setdefault(entry.layers, []).append((key, entry))
    return list(groups.values())


class MaskBytes:
    """Bytes of a layer mask given each layer's layer-block size (cached per mask)."""

    def __init__(self, layer_sizes: Sequence[int]) -> None:
        self.sizes = tuple(layer_sizes)
        self._cache: dict[int, int] = {}

    def __call__(self, mask: int) -> int:
        got = self._cache.get(mask)
        if got is None:
            got = self._cache[mask] = sum(self.sizes[layer] for layer in layers_of(mask) if layer < len(self.sizes))
        return got
