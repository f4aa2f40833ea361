"""What kvstrata's benchmarks share: layouts, batches, and timing that holds up on a noisy machine.

Every figure is a ratio against a baseline measured in the same run. :func:`interleaved` runs
each candidate once per round, in an order that rotates from round to round, so load from the
rest of the machine falls on every candidate alike; :func:`spread` reports the median and the
range of the rounds, and :func:`ratio` the median and range of the per-round ratios.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvstrata.core.layout import KVLayout, uniform_layout

if TYPE_CHECKING:
    from kvstrata.core.keys import Key
    from kvstrata.engine.engine import Engine

__all__ = [
    "GB",
    "KiB",
    "MiB",
    "batch",
    "best",
    "collector_ms",
    "fastest",
    "frozen_heap",
    "gbps",
    "interleaved",
    "layout_for",
    "llama8b_layout",
    "loadavg",
    "placed",
    "ratio",
    "spread",
    "timed",
]

GB = 1e9
KiB = 1024
MiB = 1024**2
PAGE = 4096
MALLOC_INTO_PAGE = 16
"""Where the benchmarks' caller arrays start: 16 bytes into a page, as malloc places a large numpy
array (an mmap'd chunk after its header). Fixed, so that every run copies between the same
alignments: a copy whose destination lies 1-31 bytes past its source modulo a page is a slow case
of glibc's memcpy on AMD (kvstrata's own copies go around it), and where a smaller array landed in
the heap decided whether a run met it."""


def llama8b_layout() -> KVLayout:
    return uniform_layout("llama-3-8b", num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)


def layout_for(layer_bytes: int, num_layers: int = 32) -> KVLayout:
    """A uniform bf16 layout of 16-token blocks whose layer-blocks are ``layer_bytes`` (a multiple
    of 1 KiB); 64 KiB is the Llama-3-8B-like layout of :func:`llama8b_layout`."""
    per_head_dim = 2 * 16 * 2  # K and V, 16 tokens, bf16
    if layer_bytes % (per_head_dim * 16) or layer_bytes <= 0:
        raise ValueError(f"layer-block size {layer_bytes} is not a positive multiple of 1 KiB")
    units = layer_bytes // per_head_dim
    heads = max(1, units // 128)
    return uniform_layout(
        f"bench-{layer_bytes // KiB}k", num_layers=num_layers, num_kv_heads=heads, head_dim=units // heads
    )


def placed(shape: tuple[int, ...], into_page: int = MALLOC_INTO_PAGE) -> np.ndarray:
    """A zeroed uint8 array of ``shape`` that starts ``into_page`` bytes into a page."""
    n = int(np.prod(shape))
    raw = np.zeros(n + 2 * PAGE, np.uint8)
    skip = -int(raw.ctypes.data) % PAGE + into_page
    return raw[skip : skip + n].reshape(shape)


def batch(layout: KVLayout, keys: int, seed: int) -> dict[int, np.ndarray]:
    """Random bytes for ``keys`` blocks: per layer, one ``[keys, layer-block bytes]`` array
    (:func:`placed`: 16 bytes into a page)."""
    rng = np.random.default_rng(seed)
    out = {}
    for layer in range(layout.num_layers):
        shape = (keys, layout.layer_nbytes(layer))
        out[layer] = arr = placed(shape)
        arr[...] = rng.integers(0, 256, size=shape, dtype=np.uint8)
    return out


def salted_keys(engine: Engine, n: int, salt: int) -> list[Key]:
    """``n`` chained block keys of a synthetic prompt, distinct for every ``salt``."""
    tokens = np.arange(n * engine.layout.block_size, dtype=np.uint32) + np.uint32(salt * 7919)
    return engine.keys_for_tokens(tokens)


def best(fn: Callable[[], object], repeats: int) -> float:
    """The shortest of ``repeats`` runs of ``fn``, in seconds."""
    shortest = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        shortest = min(shortest, time.perf_counter() - t0)
    return shortest


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class _CollectorClock:
    """Seconds the garbage collector ran (any thread), from ``gc.callbacks``."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: Mapping[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """What was allocated so far (imports, the bench's own set-up) moves out of the collector's
    walk for the duration, as vLLM freezes its workers' start-up heap (``gc.freeze()``) and the
    daemon its own: a full collection then walks only what the measured code keeps alive."""
    frozen_before = gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        if not frozen_before:  # a caller's own frozen heap stays frozen (it cannot be told apart)
            gc.unfreeze()


def interleaved(
    candidates: Mapping[str, Callable[[], object]],
    rounds: int,
    setup: Mapping[str, Callable[[], object]] | None = None,
    collector: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Seconds of each candidate in each of ``rounds`` rounds; every round runs each candidate once,
    starting one further along the list than the round before. ``setup``: what runs, untimed,
    right before a candidate (removing what the last write left, dropping the page cache).
    The rounds run in a :func:`frozen_heap`; ``collector``, when given, is filled with the seconds
    the garbage collector ran during each candidate's rounds (part of their times)."""
    names = list(candidates)
    before = setup or {}
    out: dict[str, list[float]] = {name: [] for name in names}
    clock = _CollectorClock()
    gc.callbacks.append(clock)
    try:
        with frozen_heap():
            for r in range(rounds):
                shift = r % len(names) if names else 0
                for name in names[shift:] + names[:shift]:
                    if name in before:
                        before[name]()
                    start = clock.seconds
                    out[name].append(timed(candidates[name]))
                    if collector is not None:
                        collector.setdefault(name, []).append(clock.seconds - start)
    finally:
        gc.callbacks.remove(clock)
    return out


def spread(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """Median, least and greatest of ``values`` (times ``scale``)."""
    return {
        "median": statistics.median(values) * scale,
        "min": min(values) * scale,
        "max": max(values) * scale,
    }


def collector_ms(gc_s: Mapping[str, Sequence[float]]) -> dict[str, dict[str, float]]:
    """Milliseconds the garbage collector ran inside each candidate's calls (median and range), from
    :func:`interleaved`'s ``collector`` (the heap before the rounds frozen, as in vLLM's workers)."""
    return {name: spread(t, 1e3) for name, t in gc_s.items()}


def ratio(baseline: Sequence[float], candidate: Sequence[float]) -> dict[str, float]:
    """Per-round ``baseline / candidate`` of two time series (above 1: the candidate is faster)."""
    return spread([b / c for b, c in zip(baseline, candidate, strict=True)])


def gbps(nbytes: int, seconds: Sequence[float]) -> dict[str, float]:
    """Bandwidth in GB/s of moving ``nbytes`` in each of ``seconds`` (median and range)."""
    rates = [nbytes / s / GB for s in seconds]
    return spread(rates)


def loadavg() -> float:
    """The machine's 1-minute load average (0 where unknown): how noisy a run's figures are."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def fastest(*series: Sequence[float]) -> list[float]:
    """Per round, the fastest of several candidates for the same job (a "best plain copy")."""
    return [min(values) for values in zip(*series, strict=True)]
