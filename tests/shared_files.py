"""Files the tests read from ``../shared`` (beside the checkout): model configs, public traces.

A test that needs one is marked ``@pytest.mark.needs_shared("traces/x.jsonl", ...)`` (paths
relative to ``shared/``), or calls :func:`require_shared` where the need is found at run time.
When a file is missing the test fails with one line naming it if ``CI=true`` (CI must never
pass by skipping what it was meant to check), and skips with that line otherwise.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

#: ``shared/`` beside the checkout (``../shared`` from the repository root).
SHARED = Path(__file__).resolve().parents[2] / "shared"
TRACES = SHARED / "traces"
MODEL_CONFIGS = SHARED / "reference" / "model-configs"
MOONCAKE_CONVERSATION = TRACES / "mooncake_conversation_trace.jsonl"
MOONCAKE_SYNTHETIC = TRACES / "mooncake_synthetic_trace.jsonl"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def missing_shared(*rel: str | Path) -> Path | None:
    """The first of these paths (relative to ``shared/``, or absolute) that does not exist."""
    for r in rel:
        path = Path(r) if Path(r).is_absolute() else SHARED / r
        if not path.exists():
            return path
    return None


def require_shared(*rel: str | Path) -> None:
    """Fail (CI) or skip (elsewhere) unless every path exists; the message names the first missing."""
    path = missing_shared(*rel)
    if path is None:
        return
    msg = f"missing shared file {path} (../shared beside the checkout)"
    if in_ci():
        pytest.fail(f"{msg}; CI=true, so this fails instead of skipping", pytrace=False)
    pytest.skip(msg)
