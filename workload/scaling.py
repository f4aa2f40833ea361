"""Scaling curves of ``kvstrata bench --scaling``: each figure against the size of its input.

* DRAM store and load bandwidth against the batch size (1 to 4,096 keys x 32 layers of 4 KiB)
  and against the layer-block size (1 KiB to 1 MiB; the keys of a batch shrink as the blocks grow,
  to keep it within a byte budget), each beside the best 2-thread copy of the same bytes
  (:func:`~kvstrata.workload.copy_bench.bench_dram`);
* hash + lookup time against the prompt length (1K to 1M tokens), uniform and per-layer paths;
* NVMe tier: ``contains`` (asks LMDB) and ``read`` time of a 256-block batch, and the memory per
  block of LMDB and of the tier's in-memory index, against the index size (10K to 10M
  layer-blocks). The index is synthesized: a few real records are written, then the index is
  filled directly in LMDB with entries that point at them (writing 10M records would take the
  benchmark an hour of disk), so reads fetch and verify real bytes;
* and, from ``kvstrata bench``, planner time against the trace length (synthetic agentic
  traces; the planner stands above this room).

Every curve says what shape it should have ("flat": a rate that does not depend on the size;
"linear": a time proportional to it) and its log-log slope over its last points, so a departure
shows as a number (0 is flat, 1 linear).
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvstrata.core.catalog import get_layout
from kvstrata.workload.benchkit import KiB, MiB, best, layout_for, llama8b_layout
from kvstrata.workload.copy_bench import bench_dram
from kvstrata.workload.lookup_bench import lookup_seconds

__all__ = ["Curve", "render_png", "run_scaling"]


@dataclass
class Curve:
    """One scaling curve: ``series`` of y values over ``x``, and the shape they should have."""

    name: str
    x_label: str
    x: list[float]
    y_label: str
    series: dict[str, list[float]]
    expect: str  # "flat" or "linear"
    log_x: bool = True
    points: list[dict[str, Any]] = field(default_factory=list)  # every figure measured at each x
    note: str = ""  # what departs from the expected shape, and why
    slopes: dict[str, float] = field(default_factory=dict)

    def fit(self, last: int = 3) -> None:
        """The log-log slope of each series over its last ``last`` points."""
        for name, ys in self.series.items():
            pts = [(math.log(x), math.log(y)) for x, y in zip(self.x, ys, strict=True) if x > 0 and y > 0][-last:]
            if len(pts) < 2:
                continue
            xs, vs = zip(*pts, strict=True)
            self.slopes[name] = float(np.polyfit(xs, vs, 1)[0])


# ---------------------------------------------------------------------------------------- DRAM
def dram_vs_batch(keys: list[int], layer_bytes: int, rounds: int) -> list[Curve]:
    rows = [bench_dram(keys=k, layer_bytes=layer_bytes, rounds=rounds) for k in keys]
    return _dram_curves(rows, [float(k) for k in keys], "keys per batch (x 32 layers)", f"{layer_bytes // KiB} KiB")


def dram_vs_block(sizes: list[int], budget: int, rounds: int, max_keys: int = 256) -> list[Curve]:
    rows = [bench_dram(keys=_keys_within(size, budget, max_keys), layer_bytes=size, rounds=rounds) for size in sizes]
    return _dram_curves(rows, [s / KiB for s in sizes], "layer-block size (KiB)", "by block size")


def _keys_within(layer_bytes: int, budget: int, max_keys: int) -> int:
    return max(1, min(max_keys, budget // (32 * layer_bytes)))


def _dram_curves(rows: list[dict[str, Any]], x: list[float], x_label: str, what: str) -> list[Curve]:
    out = []
    for op in ("store", "load"):
        series = {
            f"engine {op}": [r["gbps"][f"engine_{op}"]["median"] for r in rows],
            f"tier {op}": [r["gbps"][f"tier_{op}"]["median"] for r in rows],
            "best 2-thread copy": [r["best_2thread_gbps"]["median"] for r in rows],
        }
        points = [
            {
                "keys": r["keys"],
                "layer_bytes": r["layer_bytes"],
                "bytes": r["bytes"],
                f"engine_{op}_vs_2thread": r[f"engine_{op}_vs_2thread"]["median"],
                f"tier_{op}_vs_2thread": r[f"tier_{op}_vs_2thread"]["median"],
                f"engine_{op}_overhead_us": r[f"engine_{op}_overhead_us"]["median"],
                "bytes_ok": r["bytes_ok"],
            }
            for r in rows
        ]
        note = "small batches pay a fixed cost per batch (thread hand-offs, one index pass per layer)"
        out.append(Curve(f"DRAM {op} bandwidth ({what})", x_label, x, "GB/s", series, "flat", points=points, note=note))
    return out


# ---------------------------------------------------------------------------------------- lookup
def lookup_vs_prompt(tokens: list[int], repeats: int) -> Curve:
    rng = np.random.default_rng(5)
    layouts = (("uniform", llama8b_layout(), "uniform"), ("per-layer", get_layout("gpt-oss-20b"), "per-layer"))
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in layouts}
    for n in tokens:
        toks = rng.integers(0, 128000, size=n, dtype=np.uint32)
        for name, layout, policy in layouts:
            rows[name].append(lookup_seconds(layout, toks, repeats, policy))
    series = {f"{name} hash + lookup": [r["hash_and_lookup_ms"] for r in rs] for name, rs in rows.items()}
    series["uniform hash alone"] = [r["hash_ms"] for r in rows["uniform"]]
    points = [
        {"tokens": n, **{f"{name}_{k}": v for name, rs in rows.items() for k, v in rs[i].items() if k.endswith("_ms")}}
        for i, n in enumerate(tokens)
    ]
    x = [float(n) for n in tokens]
    note = "short prompts pay the fixed cost of a lookup call"
    return Curve(
        "hash + lookup time (prompt fully cached)", "prompt tokens", x, "ms", series, "linear", points=points, note=note
    )


# ---------------------------------------------------------------------------------------- NVMe
def nvme_vs_index(counts: list[int], directory: str | None, batch: int = 256) -> Curve:
    rows = [_nvme_point(n, directory, batch) for n in counts]
    series = {
        f"contains of {batch} (ms)": [r["contains_ms"] for r in rows],
        f"read of {batch} x 4 KiB (ms)": [r["read_ms"] for r in rows],
        "first read, index loaded (ms)": [r["first_read_ms"] for r in rows],
    }
    x = [float(n) for n in counts]
    return Curve(
        "NVMe lookup and read time against index size",
        "layer-blocks in the index",
        x,
        "ms",
        series,
        "flat",
        points=rows,
    )


def _nvme_point(n: int, directory: str | None, batch: int) -> dict[str, Any]:
    """One index size: a tier with ``n`` index entries (``REAL`` real records, the rest pointing
    at them), timed through the tier's own ``contains`` and ``read``."""
    from kvstrata.config import load_config
    from kvstrata.core.keys import Namespace
    from kvstrata.engine.slots import build_tiers, close_tiers
    from kvstrata.tiers import TierContext, indexed

    real = min(REAL, n)
    layout = layout_for(4 * KiB)
    ns = Namespace(layout.model, "bfloat16", layout.fingerprint(), layout.block_size)
    with tempfile.TemporaryDirectory(prefix="kvstrata-scaling-", dir=directory) as tmp:
        cfg = load_config({"tiers": [{"name": "nvme", "capacity": "1GiB", "path": tmp}]})
        data = np.random.default_rng(n).integers(0, 256, size=(real, 4 * KiB), dtype=np.uint8)
        ids = [(_synthetic_key(i), 0) for i in range(real)]
        opened = build_tiers(cfg, TierContext(layout, ns))
        try:
            tier = opened[0]
            if not all(tier.write(list(zip(ids, data, strict=True)))) or not indexed(tier):
                raise RuntimeError("the nvme tier refused the benchmark's records")
            locs = [loc for _, loc in sorted(tier.records(), key=lambda r: r[0][0])]
        finally:
            close_tiers(opened)
        index_path = next(str(p) for p in Path(tmp).rglob("index.lmdb"))
        synth_s = _synthesize(index_path, locs, real, n)
        lmdb_bytes = sum(f.stat().st_size for f in Path(index_path).glob("*.mdb"))
        want = [(_synthetic_key(i), i % 32 if i >= real else 0) for i in _spread(n, batch)]
        out = np.zeros((batch, 4 * KiB), np.uint8)
        (tier,) = build_tiers(cfg, TierContext(layout, ns))
        try:
            rss0 = _rss()
            t0 = time.perf_counter()
            first = tier.read(list(zip(want, out, strict=True)))
            first_s = time.perf_counter() - t0
            mirror = max(0, _rss() - rss0)
            ok = sum(st.value == "ok" for st in first)
            read_s = best(lambda: tier.read(list(zip(want, out, strict=True))), 5)
            contains_s = best(lambda: tier.contains(want), 5)
            t0 = time.perf_counter()
            scanned = sum(1 for _ in tier.scan())  # what an engine opening the tier reads (linear)
            scan_s = time.perf_counter() - t0
        finally:
            tier.close()
    return {
        "index_blocks": n,
        "real_records": real,
        "synthesize_s": synth_s,
        "lmdb_bytes_per_block": lmdb_bytes / n,
        "memory_bytes_per_block": mirror / n,
        "first_read_ms": first_s * 1e3,
        "read_ms": read_s * 1e3,
        "contains_ms": contains_s * 1e3,
        "scan_s": scan_s,
        "scan_us_per_block": scan_s / max(1, scanned) * 1e6,
        "read_ok": ok,
        "batch": batch,
    }


REAL = 1024  # real records behind a synthetic index (its entries point at them)


def _synthetic_key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _spread(n: int, batch: int) -> list[int]:
    """``batch`` entries spread over the whole index (``n`` entries), distinct."""
    return sorted({(i * n) // batch for i in range(batch)} | set(range(min(batch, n))))[:batch]


def _synthesize(index_path: str, locs: list[Any], real: int, n: int) -> float:
    """Add ``n - real`` entries to the index, entry ``i`` at layer ``i % 32`` pointing at real
    record ``i % real`` (same bytes, so they read back and verify). Returns the seconds it took."""
    from kvstrata.tiers.records import block_key
    from kvstrata.tiers.segments import SegmentIndex

    t0 = time.perf_counter()
    index = SegmentIndex(index_path, map_size=max(64 * MiB, n * 1024))
    try:
        chunk = 200_000
        for start in range(real, n, chunk):
            stop = min(n, start + chunk)
            index.put([(block_key((_synthetic_key(i), i % 32)), locs[i % real]) for i in range(start, stop)])
    finally:
        index.close()
    return time.perf_counter() - t0


def _rss() -> int:
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # pragma: no cover - not Linux
        return 0


# ---------------------------------------------------------------------------------------- all
def run_scaling(
    quick: bool = False, directory: str | None = None, more: Sequence[Callable[[bool], Curve]] = ()
) -> dict[str, Any]:
    """Every curve (``quick``: fewer, smaller points, for tests: shapes, not speeds); ``more``:
    curves of rooms above this one (the planner's, from ``kvstrata bench``), given ``quick``."""
    if quick:
        curves = [
            *dram_vs_batch([1, 16, 256], 4 * KiB, rounds=2),
            *dram_vs_block([KiB, 32 * KiB, MiB], 8 * MiB, rounds=2, max_keys=64),
            lookup_vs_prompt([1024, 8192, 65536], repeats=3),
            nvme_vs_index([2_000, 20_000], directory),
        ]
    else:
        curves = [
            *dram_vs_batch([1, 4, 16, 64, 256, 1024, 4096], 4 * KiB, rounds=5),
            *dram_vs_block([KiB, 4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB], 256 * MiB, rounds=5),
            lookup_vs_prompt([1024, 4096, 16384, 65536, 262144, 1048576], repeats=5),
            nvme_vs_index([10_000, 100_000, 1_000_000, 10_000_000], directory),
        ]
    curves += [make(quick) for make in more]
    for c in curves:
        c.fit()
    return {"quick": quick, "curves": [asdict(c) for c in curves]}


def render_png(result: dict[str, Any], path: str | Path) -> None:
    """All curves of :func:`run_scaling` in one PNG (needs matplotlib: ``pip install kvstrata[plot]``)."""
    from kvstrata.errors import KVStrataError

    try:
        import matplotlib
    except ImportError:
        raise KVStrataError("the scaling plot needs matplotlib (pip install 'kvstrata[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = result["curves"]
    cols = 2
    rows = -(-len(curves) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.6 * rows), dpi=110, squeeze=False)
    for ax, c in zip(axes.flat, curves, strict=False):
        for name, ys in c["series"].items():
            ax.plot(c["x"], ys, marker="o", markersize=3, label=name)
        if c["log_x"]:
            ax.set_xscale("log")
        if c["y_label"] in ("ms", "s"):  # times span decades
            ax.set_yscale("log")
        ax.set_title(f"{c['name']} (expect {c['expect']})", fontsize=9)
        ax.set_xlabel(c["x_label"], fontsize=8)
        ax.set_ylabel(c["y_label"], fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(curves) :]:
        ax.axis("off")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
