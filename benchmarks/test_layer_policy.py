"""Per-layer vs uniform layer policy at one DRAM + NVMe budget, on hybrid layouts.

``pytest benchmarks/test_layer_policy.py --benchmark-only -s`` prints both token hit rates;
the figure to compare is ``hit_rate_ratio`` (per-layer / uniform, measured in the same run),
stored in ``benchmark.extra_info``.
"""

from __future__ import annotations

import json

import pytest

from kvstrata.workload.layer_bench import bench_layer_policy

MiB = 1024**2


@pytest.mark.parametrize(
    ("model", "dram", "nvme"),
    [("tiny-swa", 2 * MiB, 6 * MiB), ("tiny-linear", 16 * MiB, 48 * MiB)],  # a third to a half of the working set
)
def test_per_layer_policy_hits_more_at_a_fixed_budget(benchmark, model, dram, nvme, tmp_path) -> None:  # type: ignore[no-untyped-def]
    kwargs = {"dram": dram, "nvme": nvme, "directory": str(tmp_path)}
    figures = benchmark.pedantic(bench_layer_policy, args=(model,), kwargs=kwargs, rounds=1, iterations=1)
    benchmark.extra_info.update(figures)
    print(json.dumps(figures, indent=1))
    assert figures["uniform"]["mismatched_loads"] == figures["per-layer"]["mismatched_loads"] == 0
    assert figures["per-layer"]["token_hit_rate"] > figures["uniform"]["token_hit_rate"]
    assert figures["hit_rate_ratio"] > 1.2
