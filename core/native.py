"""Which code runs the hot loops: the C extension :mod:`kvstrata._native`, or pure Python.

The extension (``core/_native.c``, built by ``pip install -e .`` when a C compiler is there)
hashes the key chains (:mod:`kvstrata.core.keys`) and moves the host copies
(:mod:`kvstrata.core.hostcopy`) a batch per call, without a Python step per block. Both paths give
the same keys and the same bytes. ``KVSTRATA_NATIVE=0`` in the environment turns the extension
off (read once, at import); without it built, the Python code runs.

It also keeps the engine's key -> fastest-tier map (:func:`key_index`: a ``KeyTable``, probed in C
without a Python hash per key, or a dict).
"""

from __future__ import annotations

import collections
import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Protocol, TypeVar

__all__ = ["NATIVE", "KeyIndex", "key_index", "native_path", "native_reason", "set_many", "untracked"]

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


class KeyIndex(Protocol):
    """What the engine needs of its key -> tier-position map (a dict, or the extension's
    ``KeyTable``: the same semantics, 16-byte keys probed in C, values ints 0..2**31-1)."""

    def get(self, key: bytes, /) -> int | None: ...
    def pop(self, key: bytes, default: None, /) -> int | None: ...
    def __setitem__(self, key: bytes, value: int, /) -> None: ...
    def __contains__(self, key: object, /) -> bool: ...
    def __len__(self) -> int: ...


def key_index() -> KeyIndex:
    """An empty key -> int map: the extension's ``KeyTable`` where it runs, else a dict."""
    return NATIVE.KeyTable() if NATIVE is not None else {}


def set_many(index: KeyIndex, keys: Sequence[bytes], value: int) -> None:
    """``index[k] = value`` for each of ``keys`` (one C call on a ``KeyTable``)."""
    fill = getattr(index, "set_many", None)
    if fill is not None:
        fill(keys, value)
    else:
        for key in keys:
            index[key] = value


D = TypeVar("D", bound=dict[Any, Any] | tuple[Any, ...])


def untracked(obj: D) -> D:
    """``obj`` (a tuple, a dict or an OrderedDict), left out of the garbage collector's passes when
    it holds only objects the collector never tracks (bytes, ints, None); a dict is tracked again
    when anything else goes in. Without the extension, ``obj`` as it is."""
    if NATIVE is not None:
        NATIVE.untrack_atoms(obj)
    return obj


def untrack_each(objs: Sequence[D]) -> None:
    """:func:`untracked` of each of ``objs`` (a write's 4,096 tuples) without a Python call each."""
    if NATIVE is not None:
        collections.deque(map(NATIVE.untrack_atoms, objs), maxlen=0)
