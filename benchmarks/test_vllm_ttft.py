"""TTFT on a real vLLM (CPU build): recompute vs kvstrata from DRAM and NVMe vs vLLM's
``ExampleConnector``, and kvstrata's overhead on misses; see ``vllm_ttft.py`` (also a script:
``python benchmarks/vllm_ttft.py --context 16384 --json OUT``).

The context is ``$KVSTRATA_TTFT_CONTEXT`` tokens (default 4096, so that the six vLLM instances
fit in a few minutes on a small CPU machine); the interleaved miss-overhead runs use
``$KVSTRATA_TTFT_MISS_CONTEXT`` tokens (default 2048) for ``$KVSTRATA_TTFT_MISS_ROUNDS`` rounds
(default 6). All figures go to ``benchmark.extra_info``; the test checks that the restores really
happened (full-prompt hits served by the expected tier), that every floor sample was a hit in
vLLM's own prefix cache, that the interleaved misses were cold and stored, and that the spreads
are well formed, not the speed targets, which depend on the machine (they are reported in
``targets``, with their verdicts).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_ttft

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

CONTEXT = int(os.environ.get("KVSTRATA_TTFT_CONTEXT", "4096"))
MISS_CONTEXT = int(os.environ.get("KVSTRATA_TTFT_MISS_CONTEXT", "2048"))
MISS_ROUNDS = int(os.environ.get("KVSTRATA_TTFT_MISS_ROUNDS", "6"))


@pytest.fixture(scope="module")
def vllm_ready() -> None:
    reason = vllm_ttft.vllm_skip_reason()
    if reason is not None:
        pytest.skip(reason)


def _spreads(obj: Any, path: str = "") -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Every spread (a dict with median/min/max/interval) inside ``obj``, with where it is."""
    if isinstance(obj, Mapping):
        if {"median", "min", "max", "interval", "n"} <= obj.keys():
            yield path, obj
            return
        for k, v in obj.items():
            yield from _spreads(v, f"{path}.{k}")


def assert_spread(where: str, s: Mapping[str, Any] | None, n: int | None = None) -> None:
    assert s is not None, f"{where}: no samples"
    lo, hi = s["interval"]
    assert s["min"] <= s["median"] <= s["max"], (where, s)
    assert s["min"] <= lo <= hi <= s["max"], (where, s)
    assert len(s["samples"]) == s["n"], (where, s)
    if n is not None:
        assert s["n"] == n, (where, s)


def test_vllm_ttft(benchmark: Any, vllm_ready: None, tmp_path: Path) -> None:
    figures = benchmark.pedantic(
        vllm_ttft.measure,
        args=(CONTEXT,),
        kwargs={"workdir": tmp_path, "miss_context": MISS_CONTEXT, "miss_rounds": MISS_ROUNDS},
        rounds=1,
        iterations=1,
    )
    benchmark.extra_info.update(figures)
    check_figures(figures, MISS_CONTEXT, MISS_ROUNDS)


def check_figures(figures: Mapping[str, Any], miss_context: int, miss_rounds: int) -> None:
    """What the test asserts about :func:`vllm_ttft.measure`'s figures (also usable on a saved
    ``--json`` output)."""
    checks = figures["checks"]
    # every instance, with or without a connector, computed with the same worker threads
    assert figures["fairness"]["same_threads_everywhere"], figures["fairness"]
    for name in ("kvstrata_dram", "kvstrata_nvme"):
        assert checks[name]["full"], (name, checks[name])
        assert checks[name]["served_by_expected_tier"], (name, checks[name])
        assert checks[name]["failed_loads"] == 0, (name, checks[name])
    assert checks["kvstrata_dram"]["local_prefix_cache_hits"] == 0  # vLLM's own cache was reset
    assert checks["example"]["full"], checks["example"]
    assert all(v is not None and v > 0 for v in figures["speedups"].values()), figures["speedups"]
    # the floor paired with every restore: the same prompt, a hit in vLLM's own prefix cache
    for name in ("kvstrata_dram_floor", "kvstrata_nvme_floor", "example_floor"):
        assert checks[name]["full"], (name, checks[name])
        assert checks[name]["local_prefix_cache_hits"] > 0, (name, checks[name])
    n = figures["samples"]
    over = figures["restore_over_floor_s"]
    for name in ("kvstrata_dram", "kvstrata_nvme", "example"):
        assert_spread(f"{name}.paired", over[name]["paired"], n)
        assert_spread(f"{name}.vs_no_connector_floor", over[name]["vs_no_connector_floor"], n)
    assert_spread("miss_sequential", figures["miss_sequential"]["overhead"], n)
    # the interleaved misses: cold on every instance, stored by kvstrata's, same threads everywhere
    il = figures["miss_interleaved"]
    assert il["context"] == miss_context and il["rounds"] == miss_rounds, il
    assert il["same_threads_everywhere"], il
    assert il["cached_tokens_max"] == 0, il["cached_tokens_max"]
    assert all(b > 0 for b in il["kvstrata_stored_blocks"]), il["kvstrata_stored_blocks"]
    assert_spread("miss_interleaved.overhead", il["overhead"], miss_rounds)
    assert_spread("miss_interleaved.null_a2_vs_a", il["null_a2_vs_a"], miss_rounds)
    # kvstrata's own time in vLLM's hooks on every cold turn: some, and a part of the turn's TTFT
    assert_spread("miss_interleaved.connector_hook_share", il["connector_hook_share"], miss_rounds)
    assert all(ms > 0 for ms in il["connector_hook_ms"]["samples"]), il["connector_hook_ms"]
    assert 0 < il["connector_hook_share"]["max"] < 1, il["connector_hook_share"]
    assert figures["miss_overhead_source"] == "miss_interleaved"
    assert figures["miss_overhead"] == il["overhead"]["median"]
    found = dict(_spreads(figures))
    assert len(found) >= 10, sorted(found)
    for where, s in found.items():
        assert_spread(where, s)
    targets = figures["targets"]
    for key in (
        "dram_over_floor_below_example",
        "miss_overhead_le_2pct",
        "miss_overhead_interval_le_2pct",
        "miss_hook_share_le_2pct",
    ):
        assert isinstance(targets[key], bool), (key, targets)
    assert "2%" in targets["miss_overhead_note"], targets["miss_overhead_note"]


def test_miss_only_without_rounds_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        vllm_ttft.main(["--miss-only", "--miss-rounds", "0"])
    assert exc.value.code == 2
    assert "--miss-only needs --miss-rounds above 0, not 0" in capsys.readouterr().err


def test_the_hook_share_target_takes_the_interval_upper_end() -> None:
    def il(lo: float, hi: float) -> dict[str, Any]:
        return {"connector_hook_share": {"median": (lo + hi) / 2, "interval": [lo, hi]}}

    assert vllm_ttft.hook_share_within(il(0.001, 0.019), 0.02) is True
    assert vllm_ttft.hook_share_within(il(0.001, 0.021), 0.02) is False  # the median alone would pass
    assert vllm_ttft.hook_share_within(None, 0.02) is None
    assert vllm_ttft.hook_share_within({"connector_hook_share": None}, 0.02) is None
