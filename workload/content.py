"""Deterministic block contents for replays and benchmarks.

Each layer-block's bytes are derived from its key and layer, different at every
8-byte position, so a replay can store real bytes and check every loaded byte
(a block loaded from the wrong key, layer or offset never matches).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from kvstrata.core.keys import Key

_PRIME = np.uint64(0x9E3779B97F4A7C15)
_LAYER_MIX = 0xD6E8FEB86659FD93


@lru_cache(maxsize=64)
def _ramp(words: int) -> np.ndarray:
    ramp = np.arange(1, words + 1, dtype=np.uint64) * _PRIME
    ramp.setflags(write=False)
    return ramp


def _seeds(keys: Sequence[Key], layer: int) -> np.ndarray:
    mix = (layer * _LAYER_MIX) & 0xFFFFFFFFFFFFFFFF
    raw = np.frombuffer(b"".join(k[:8] for k in keys), dtype="<u8") if keys else np.zeros(0, np.uint64)
    return raw ^ np.uint64(mix)


def block_contents(keys: Sequence[Key], layer: int, nbytes: int) -> np.ndarray:
    """Bytes of ``layer`` for every key: an array of shape ``[len(keys), nbytes]`` (uint8)."""
    words = -(-nbytes // 8)
    out = _ramp(words)[None, :] + _seeds(keys, layer)[:, None]
    return out.view(np.uint8)[:, :nbytes] if words * 8 != nbytes else out.view(np.uint8)


def count_mismatches(keys: Sequence[Key], layer: int, data: np.ndarray) -> int:
    """How many rows of ``data`` ([n, nbytes] uint8) differ from the expected contents."""
    if not len(keys):
        return 0
    expected = block_contents(keys, layer, data.shape[1])
    return int(np.count_nonzero((expected != data).any(axis=1)))
