"""Benchmark: token hit rate of the per-layer and the uniform policy at one DRAM + NVMe budget.

Both runs replay the same agentic trace through the real engine (DRAM tier over a real NVMe
tier in a scratch directory), storing and checking real bytes; only ``layer_policy`` differs.
On a hybrid layout the per-layer policy stores a fraction of the bytes, so more of the working
set fits the same budget and more prefixes are restorable.
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

from kvstrata.core.catalog import get_layout
from kvstrata.workload.replay import replay_trace
from kvstrata.workload.traces import Trace, synth_agentic

__all__ = ["bench_layer_policy"]


def bench_layer_policy(
    model: str = "tiny-swa",
    *,
    dram: int = 2 * 1024**2,
    nvme: int = 6 * 1024**2,
    sessions: int = 4,
    turns: int = 8,
    directory: str | None = None,
) -> dict[str, Any]:
    """Replay a scaled-down agentic trace (``sessions`` x ``turns``; 4K shared tokens, 2K first
    turn, 1K + 300 a turn) with each policy at ``dram`` + ``nvme`` bytes; returns both reports'
    hit rates and bytes, and ``hit_rate_ratio`` = per-layer / uniform."""
    reqs = synth_agentic(
        sessions=sessions, turns=turns, shared_tokens=4000, first_turn_tokens=2000, turn_tokens=1024, output_tokens=300
    )
    layout = get_layout(model)
    out: dict[str, Any] = {"model": model, "dram_bytes": dram, "nvme_bytes": nvme, "requests": len(reqs)}
    for policy in ("uniform", "per-layer"):
        with tempfile.TemporaryDirectory(prefix="kvstrata-layer-bench-", dir=directory) as tmp:
            cfg = {
                "tiers": [
                    {"name": "dram", "capacity": dram},
                    {"name": "nvme", "capacity": nvme, "path": tmp, "direct_io": "off", "fsync": False},
                ]
            }
            t0 = time.perf_counter()
            rep = replay_trace(Trace(reqs), layout, cfg, layer_policy=policy).to_dict()
        out[policy] = {
            "token_hit_rate": rep["token_hit_rate"],
            "per_tier_hit_rate": rep["per_tier_hit_rate"],
            "bytes_written": rep["bytes_written"]["total"],
            "bytes_stored": rep["bytes_stored"]["total"],
            "mismatched_loads": rep["mismatched_loads"],
            "elapsed_s": round(time.perf_counter() - t0, 3),
        }
    base = out["uniform"]["token_hit_rate"]
    out["hit_rate_ratio"] = out["per-layer"]["token_hit_rate"] / base if base else float("inf")
    return out
