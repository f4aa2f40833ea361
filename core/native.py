"""Which code runs the hot loops: the C extension :mod:`kvstrata._native`, or pure Python.

The extension (``core/_native.c``, built by ``pip install -e .`` when a C compiler is there)
hashes the key chains (:mod:`kvstrata.core.keys`) and moves the host copies
(:mod:`kvstrata.core.hostcopy`) a batch per call, without a Python step per block. Both paths give
the same keys and the same bytes. ``KVSTRATA_NATIVE=0`` in the environment turns the extension
off (read once, at import); without it built, the Python code runs.
"""

from __future__ import annotations

import os
from types import ModuleType

__all__ = ["NATIVE", "native_path", "native_reason"]

ENV = "KVSTRATA_NATIVE"


def _load() -> tuple[ModuleType | None, str]:
    flag = os.environ.get(ENV, "").strip()
    if flag not in ("", "0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {flag!r}")
    if flag == "0":
        return None, f"{ENV}=0"
    try:
        from kvstrata import _native
    except ImportError as exc:
        return None, f"kvstrata._native is not built ({exc})"
    return _native, "kvstrata._native"


#: The extension module, or None when the pure-Python code runs. Read at call time
#: (``native.NATIVE``), so a test may switch it.
NATIVE, _REASON = _load()


def native_path() -> str:
    """``"native"`` or ``"python"``: the code that runs now."""
    return "native" if NATIVE is not None else "python"


def native_reason() -> str:
    """Why that path runs (``kvstrata bench`` prints it)."""
    if NATIVE is not None:
        return "kvstrata._native"
    return "switched off" if _REASON == "kvstrata._native" else _REASON
