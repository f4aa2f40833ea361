"""A restore from NVMe into a fresh engine with a DRAM tier above it (promotion on).

    python benchmarks/promote_restore.py --dir /path/on/nvme [--keys 128] [--rounds 3] [--cold] [--compare]

Each round stores ``keys`` blocks of 32 layers x 64 KiB with one engine (DRAM write-through to
NVMe), closes it, opens a fresh engine on the same NVMe directory (a restarted instance: the
blocks are only on NVMe) and times ``load_sync`` of them (until the caller has its bytes) and the
load plus ``flush`` (until the promotion into DRAM is done too), and counts the bytes read from
NVMe per byte restored (2.0 when the promotion read the disk again, 1.0 when it came from the
load's buffers). The DRAM arena is faulted in before the load (``prefault``, as a pinned arena on
a GPU host always is) unless ``--cold``: then the promotion also pays the first touch of the
arena's pages. Prints one JSON object: per round, and medians.

``--compare``: each round restores twice, in turn (interleaved, so a noisy disk weighs on both
alike): with the promotion (the engine's default) and with DRAM's ``promote = false`` (the floor:
a restore that promotes nothing). Prints medians and ranges of each, and the load time with the
promotion over the floor's: what the copy up costs the restore (on this 2-core VM, 2026-12-08:
1.14-1.26x over two runs: 256 MiB in ~0.105-0.107 s against ~0.089-0.093 s).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvstrata.engine.engine import Engine
from kvstrata.workload.benchkit import batch, layout_for, salted_keys

MODES = {"promotion": True, "no-promotion": False}  # --compare: DRAM's ``promote`` in each


def _config(root: Path, total: int, prefault: bool, promote: bool = True) -> dict[str, Any]:
    return {
        "tiers": [
            {"name": "dram", "capacity": 2 * total, "prefault": prefault, "promote": promote},
            {"name": "nvme", "capacity": 4 * total, "path": str(root)},
        ]
    }


def one_round(root: Path, keys: int, seed: int, cold: bool, promote: bool = True) -> dict[str, float]:
    layout = layout_for(64 * 1024)
    src = batch(layout, keys, seed)
    total = sum(a.nbytes for a in src.values())
    shutil.rmtree(root, ignore_errors=True)
    with Engine(_config(root, total, prefault=False), layout=layout) as first:
        ks = salted_keys(first, keys, seed)
        if first.store_sync(ks, src).stored != keys:
            raise SystemExit("the store did not keep every block: give --dir more room")
        first.flush()
    with Engine(_config(root, total, prefault=not cold, promote=promote), layout=layout) as engine:
        if not cold:
            engine.tiers[0].tier._arena.wait_prefaulted(120)  # type: ignore[attr-defined]
        if engine.lookup(ks).tiers != ["nvme"] * keys:
            raise SystemExit("the fresh engine does not find every block on NVMe")
        dst = {layer: np.zeros_like(a) for layer, a in src.items()}
        t0 = time.perf_counter()
        result = engine.load_sync(ks, dst)
        t1 = time.perf_counter()
        engine.flush()
        t2 = time.perf_counter()
        if result.loaded_blocks != keys or any(not np.array_equal(dst[la], src[la]) for la in src):
            raise SystemExit("the restore lost or damaged blocks")
        tiers = engine.stats()["tiers"]
        return {
            "load_s": t1 - t0,
            "until_promoted_s": t2 - t0,
            "nvme_bytes_read_per_byte": tiers["nvme"]["bytes_read"] / total,
            "promoted_blocks": tiers["dram"]["promotions"],
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, help="directory on the NVMe device (default: a temporary one)")
    ap.add_argument("--keys", type=int, default=128, help="blocks restored (32 x 64 KiB each; default 128)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="do not fault the DRAM arena in before the load")
    ap.add_argument("--compare", action="store_true", help="interleave: with promotion, and without")
    args = ap.parse_args(argv)
    if args.keys < 1 or args.rounds < 1:
        ap.error(f"--keys and --rounds must be >= 1 (got {args.keys}, {args.rounds})")
    if args.compare:
        return _compare(args)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        rounds = [one_round(Path(tmp) / "nvme", args.keys, 7 + r, args.cold) for r in range(args.rounds)]
    out = {
        "keys": args.keys,
        "bytes": args.keys * 32 * 64 * 1024,
        "cold_arena": args.cold,
        "rounds": [{k: round(v, 4) for k, v in r.items()} for r in rounds],
        "median": {k: round(statistics.median(r[k] for r in rounds), 4) for k in rounds[0]},
    }
    print(json.dumps(out, indent=1))
    return 0


def _compare(args: argparse.Namespace) -> int:
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for r in range(args.rounds):
            for mode, promote in MODES.items():
                runs[mode].append(one_round(Path(tmp) / "nvme", args.keys, 7 + r, args.cold, promote))
    floor = statistics.median(r["load_s"] for r in runs["no-promotion"])
    out: dict[str, Any] = {"keys": args.keys, "bytes": args.keys * 32 * 64 * 1024, "rounds": args.rounds}
    for mode, rs in runs.items():
        loads = [r["load_s"] for r in rs]
        out[mode] = {
            "load_s_median": round(statistics.median(loads), 4),
            "load_s_range": [round(min(loads), 4), round(max(loads), 4)],
            "load_over_floor": round(statistics.median(loads) / floor, 3),
            "nvme_bytes_read_per_byte": statistics.median(r["nvme_bytes_read_per_byte"] for r in rs),
            "promoted_blocks": statistics.median(r["promoted_blocks"] for r in rs),
        }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
