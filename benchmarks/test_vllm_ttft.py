"""TTFT on a real vLLM (CPU build): recompute vs kvstrata from DRAM and NVMe vs vLLM's
``ExampleConnector``, and kvstrata's overhead on misses; see ``vllm_ttft.py`` (also a script:
``python benchmarks/vllm_ttft.py --context 16384 --json OUT``).

The context is ``$KVSTRATA_TTFT_CONTEXT`` tokens (default 4096, so that the six vLLM instances
fit in a few minutes on a small CPU machine). All figures go to ``benchmark.extra_info``; the
test checks that the restores really happened (full-prompt hits served by the expected tier),
not the speed targets, which depend on the machine (they are reported in ``targets``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_ttft

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

CONTEXT = int(os.environ.get("KVSTRATA_TTFT_CONTEXT", "4096"))


@pytest.fixture(scope="module")
def vllm_ready() -> None:
    reason = vllm_ttft.vllm_skip_reason()
    if reason is not None:
        pytest.skip(reason)


def test_vllm_ttft(benchmark: Any, vllm_ready: None, tmp_path: Path) -> None:
    figures = benchmark.pedantic(
        vllm_ttft.measure, args=(CONTEXT,), kwargs={"workdir": tmp_path}, rounds=1, iterations=1
    )
    benchmark.extra_info.update(figures)
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
