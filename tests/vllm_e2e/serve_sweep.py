"""What the ``kvstrata experiment serve`` end-to-end tests share: the tools' virtual environments
and the smallest agentic workload that still overflows two instances' KV caches."""

from __future__ import annotations

import os
from pathlib import Path

from kvstrata.workload import kv_router, serve, serve_procs

#: The tools' venvs: $KVSTRATA_AIPERF_VENV / $KVSTRATA_DYNAMO_VENV, else the command's defaults (made
#: on first use and kept). Read at import, before tests/conftest.py gives each test a private cache
#: directory and drops KVSTRATA* variables, so that each venv is made once per machine, not per run.
CLIENT_VENV = Path(os.environ.get("KVSTRATA_AIPERF_VENV") or serve.default_client_venv())
DYNAMO_VENV = Path(os.environ.get("KVSTRATA_DYNAMO_VENV") or kv_router.default_dynamo_venv())

#: 4 agentic sessions of 3 turns on instances of 7 KV blocks (768 tokens; the working set is ~3x that).
SMALL_SESSIONS = [
    "--sessions=4",
    "--turns=3",
    "--shared-tokens=256",
    "--first-turn-tokens=192",
    "--turn-tokens=64",
    "--output-tokens=8",
    "--think-time=0.2",
    "--max-model-len=768",
    "--kv-blocks=7",
]


def haproxy() -> str | None:
    try:
        return serve_procs.haproxy_binary()
    except serve_procs.ServeExperimentError:
        return None
