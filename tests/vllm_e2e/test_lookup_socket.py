"""The scheduler -> worker lookup socket on a real vLLM (CPU build) with the worker in its own
process (``distributed_executor_backend="mp"``): the scheduler reads the secret the worker's
server made, so a prompt re-sent at once hits the worker's DRAM (no persistent tier: nothing
else could answer), and the socket's files are gone after shutdown."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from kvstrata.integrations.vllm.lookup import key_path, socket_dir

from . import sessions
from .sessions import BLOCK, counter


def test_the_worker_process_secret_reaches_the_scheduler(dram_only_run: dict[str, Any]) -> None:
    """``dram_only_run`` sends this test's prompt twice, then the DRAM re-send test's prompt
    twice (its half is checked there); the process facts below hold for the whole run."""
    prompt = sessions.LOOKUP_PROMPT
    run = sessions.part(dram_only_run, sessions.DRAM_ONLY_SPANS["lookup"])
    assert [t["prompt_len"] for t in run["turns"]] == [len(prompt)] * 2
    log = Path(run["log_path"]).read_text(errors="replace")
    pids = {
        role: {int(p) for p in re.findall(rf"pid=(\d+)\)[^\n]*kvstrata connector \({role}\)", log)}
        for role in ("scheduler", "worker")
    }
    assert len(pids["scheduler"]) == len(pids["worker"]) == 1, pids
    assert pids["scheduler"] != pids["worker"]  # two processes: the secret crossed between them
    first, second = run["turns"]
    assert first["num_cached_tokens"] == 0
    assert second["num_cached_tokens"] == ((len(prompt) - 1) // BLOCK) * BLOCK  # the worker answered
    assert counter(run, "vllm:kvstrata_loaded_blocks", 1) > 0
    assert counter(run, "vllm:prefix_cache_hits", 1) == 0
    assert first["output_ids"] == second["output_ids"]
    assert "worker lookup at" not in log and "dropped a connection" not in log
    (address,) = re.findall(r"lookup server for the scheduler at (\S+)", log)
    assert Path(address).parent == socket_dir()
    assert not os.path.lexists(address) and not os.path.lexists(key_path(address))  # removed at shutdown
