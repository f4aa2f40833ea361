"""The TTFT benchmark's foreign-CPU meter (``benchmarks/vllm_ttft.ForeignLoad``) tells its own
processes from others': a run forked from the e2e zygote keeps the zygote's command line, so the
benchmark's own vLLM processes must be recognised by descent, not only by their command line."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import vllm_ttft

SPIN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


def test_a_child_in_a_session_of_its_own_is_ours_without_the_marker(tmp_path: Path) -> None:
    # running before the meter starts, in a session of its own: what the meter counts as foreign
    other = subprocess.Popen([sys.executable, "-c", SPIN.format(s=1.0)], start_new_session=True)
    load = vllm_ttft.ForeignLoad(marker=str(tmp_path / "no-such-marker"), period=0.05).start()
    try:
        # started later, its own session, a command line that does not name the run: a zygote fork
        child = subprocess.Popen([sys.executable, "-c", SPIN.format(s=0.5)], start_new_session=True)
        deadline = time.monotonic() + 10
        while child.pid not in load._seen and time.monotonic() < deadline:
            time.sleep(0.02)
        child.wait(timeout=30)
        other.wait(timeout=30)
    finally:
        out = load.stop()
    assert child.pid in load._our_sids  # its session leader is the child itself
    assert other.pid not in load._our_sids
    assert out["foreign_cpu_s"] >= 0.3, out  # the other spinner's CPU is foreign
