"""The memory tiers' index: which arena slot holds each layer-block. Pure bookkeeping, no I/O.

One row per key (a Python dict finds a key's row), one column per layer, and three int64 arrays:
the slot's offset, its size (0: absent) and the generation of the write that filled it. A batch
of one layer for many keys is then one dict lookup per key and a few numpy operations, whatever
the number of layers; and the engine asks for the same keys layer after layer, so :meth:`find`
remembers the rows of the last few key lists it was given (until a key gets or loses a row).
Keeping a tuple per layer-block in a dict cost ~0.3-1 us each on a busy machine, nearly all of it
cache misses on the objects one lookup touches. Row 0 is never a key's: a key without a row
finds row 0, where every layer is absent, so lookups need no special case for misses.

Callers hold the tier's lock.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from kvstrata.core.keys import Key

__all__ = ["SlotTable"]

CACHED_KEY_LISTS = 8  # key lists whose rows :meth:`SlotTable.find` remembers
NO_ROW = 0


class SlotTable:
    """Rows of keys x columns of layers: offset, size and write generation of each layer-block's slot."""

    def __init__(self, layers: int) -> None:
        self._row_of: dict[Key, int] = {}
        # row -> its key (None: free), row 0 nobody's: a dict of ints, never tracked by the garbage
        # collector (a list always is, and each full collection walked every key of it)
        self._key_of: dict[int, Key | None] = {0: None}
        self._free_rows: list[int] = []
        self.epoch = 0  # changes whenever a key gets or loses its row
        self.off = np.full((64, max(1, layers)), -1, np.int64)
        self.size = np.zeros_like(self.off)
        self.gen = np.zeros_like(self.off)
        self._cache: dict[int, tuple[list[Key], int, np.ndarray]] = {}

    def __len__(self) -> int:
        return len(self._row_of)

    # ------------------------------------------------------------------ rows
    def find(self, keys: Sequence[Key]) -> np.ndarray:
        """The row of each key (:data:`NO_ROW` for none). Do not modify it: it may be remembered."""
        cacheable = type(keys) is list
        if cacheable:
            hit = self._cache.get(id(keys))
            if hit is not None and hit[1] == self.epoch and hit[0] == keys:  # compares pointers, mostly
                return hit[2]
        rows = np.fromiter(map(self._row_of.get, keys, itertools.repeat(NO_ROW)), np.int64, len(keys))
        if cacheable:
            if len(self._cache) >= CACHED_KEY_LISTS:
                self._cache.clear()
            self._cache[id(keys)] = (list(keys), self.epoch, rows)
        return rows

    def make(self, keys: Sequence[Key]) -> np.ndarray:
        """The row of each key, new rows for keys without one."""
        rows = self.find(keys)
        missing = np.flatnonzero(rows == NO_ROW)
        if not len(missing):
            return rows
        rows = rows.copy()
        row_of = self._row_of
        new = [keys[i] for i in missing.tolist()] if len(missing) < len(keys) else list(keys)
        if len(set(new)) == len(new):  # usual: distinct keys, their rows made in one go
            rows[missing] = self._new_rows(new)
        else:
            for i in missing.tolist():
                key = keys[i]
                row = row_of.get(key)  # the same key twice in one batch
                if row is None:
                    row = row_of[key] = self._new_row(key)
                rows[i] = row
        self.epoch += 1
        return rows

    def _new_rows(self, keys: list[Key]) -> list[int]:
        """Rows for distinct keys without one: freed rows first, then new ones."""
        free, key_of = self._free_rows, self._key_of
        reused = free[len(free) - min(len(keys), len(free)) :]
        del free[len(free) - len(reused) :]
        for row, key in zip(reused, keys, strict=False):
            key_of[row] = key
        start = len(key_of)
        key_of.update(zip(itertools.count(start), keys[len(reused) :]))
        if len(key_of) > len(self.off):
            self._grow(rows=max(2 * len(self.off), len(key_of)))
        rows = reused + list(range(start, len(key_of)))
        self._row_of.update(zip(keys, rows, strict=True))
        return rows

    def _new_row(self, key: Key) -> int:
        if self._free_rows:
            row = self._free_rows.pop()
            self._key_of[row] = key
            return row
        row = len(self._key_of)
        self._key_of[row] = key
        if row >= len(self.off):
            self._grow(rows=2 * len(self.off))
        return row

    def _grow(self, rows: int | None = None, layers: int | None = None) -> None:
        old_rows, old_layers = self.off.shape
        shape = (rows or old_rows, layers or old_layers)
        for name, fill in (("off", -1), ("size", 0), ("gen", 0)):
            arr = np.full(shape, fill, np.int64)
            arr[:old_rows, :old_layers] = getattr(self, name)
            setattr(self, name, arr)

    def layer(self, layer: int) -> int:
        """``layer``, with a column for it."""
        if layer >= self.off.shape[1]:
            self._grow(layers=layer + 1)
        return layer

    def prune(self, rows: np.ndarray) -> None:
        """Give up the rows among ``rows`` that hold no layer any more."""
        rows = np.unique(rows)
        rows = rows[rows != NO_ROW]
        if not len(rows):
            return
        empty = rows[(self.size[rows] == 0).all(axis=1)]
        if not len(empty):
            return
        key_of = self._key_of
        for row in empty.tolist():
            key = key_of[row]
            if key is None:  # given up already
                continue
            key_of[row] = None
            del self._row_of[key]
            self._free_rows.append(row)
        self.epoch += 1

    # ------------------------------------------------------------------ slots
    def column(self, arr: np.ndarray, rows: np.ndarray, layer: int, absent: int) -> np.ndarray:
        """``arr`` (``off``, ``size`` or ``gen``) at ``layer`` of each row (``absent`` for a layer
        without a column)."""
        if layer >= arr.shape[1]:
            return np.full(len(rows), absent, np.int64)
        return arr[rows, layer]

    def clear(self, rows: np.ndarray, layer: int) -> dict[int, np.ndarray]:
        """Mark ``layer`` absent in ``rows``; returns the slots it held, as offsets (int64) per size."""
        if layer >= self.off.shape[1]:
            return {}
        sizes = self.size[rows, layer]
        held = sizes > 0
        if not held.any():
            return {}
        rows, sizes = rows[held], sizes[held]
        if len(rows) > 1 and len(np.unique(rows)) != len(rows):  # a row twice: its slot once
            rows, first = np.unique(rows, return_index=True)
            sizes = sizes[first]
        offs = self.off[rows, layer]
        self.off[rows, layer] = -1
        self.size[rows, layer] = 0
        first_size = int(sizes[0])
        if (sizes == first_size).all():
            return {first_size: offs}
        return {int(s): offs[sizes == s] for s in np.unique(sizes)}

    def block(self, arr: np.ndarray, rows: np.ndarray, layers: np.ndarray) -> np.ndarray:
        """``arr`` (``off``, ``size`` or ``gen``) at every layer of ``layers`` (with columns) in every
        row of ``rows``: a ``[len(rows), len(layers)]`` copy."""
        return arr[_block(rows, layers)]

    def clear_square(self, rows: np.ndarray, layers: np.ndarray) -> dict[int, np.ndarray]:
        """:meth:`clear` of every layer of ``layers`` in every row of ``rows`` (distinct rows, layers
        with columns) in a few operations, whatever the number of layers."""
        block = _block(rows, layers)
        sizes = self.size[block]
        held = sizes > 0
        if held.all():  # usual: a delete of whole blocks (layer-major: slots a store took ascending)
            offs, sizes = self.off[block].T.ravel(), sizes.T.ravel()
            self.off[block] = -1
            self.size[block] = 0
        elif not held.any():  # usual: a store of new keys
            return {}
        else:
            at = np.nonzero(held)
            where = (rows[at[0]], layers[at[1]])
            offs, sizes = self.off[where], sizes[held]
            self.off[where] = -1
            self.size[where] = 0
        first_size = int(sizes[0])
        if (sizes == first_size).all():
            return {first_size: offs}
        return {int(s): offs[sizes == s] for s in np.unique(sizes)}

    def set_square(self, rows: np.ndarray, layers: np.ndarray, offsets: np.ndarray, size: int, gen: int) -> None:
        """Point layer ``layers[j]`` of row ``rows[i]`` at ``offsets[j, i]`` (distinct real rows)."""
        block = _block(rows, layers)
        self.off[block] = offsets.T
        self.size[block] = size
        self.gen[block] = gen

    def set(self, rows: np.ndarray, layer: int, offsets: np.ndarray, size: int, gen: int) -> None:
        """Point ``layer`` of ``rows`` at ``offsets`` (rows distinct and real, ``layer`` with a column)."""
        self.off[rows, layer] = offsets
        self.size[rows, layer] = size
        self.gen[rows, layer] = gen

    def unset(self, rows: np.ndarray, layer: int) -> None:
        """Mark ``layer`` absent in ``rows`` without returning its slots (their owner frees them)."""
        rows = rows[rows != NO_ROW]
        self.off[rows, layer] = -1
        self.size[rows, layer] = 0


def _block(rows: np.ndarray, layers: np.ndarray) -> tuple[np.ndarray, slice] | tuple[np.ndarray, ...]:
    """The index of the ``rows`` x ``layers`` block of a table array: rows gathered and the columns
    sliced where the layers are consecutive (every layer: the usual batch), ~4x faster than
    ``np.ix_``, which gathers both ways."""
    m = len(layers)
    first = int(layers[0]) if m else 0
    if m and int(layers[-1]) - first == m - 1 and (m == 1 or bool((np.diff(layers) == 1).all())):
        return rows, slice(first, first + m)
    return np.ix_(rows, layers)
