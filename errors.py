"""The small exception tree of kvstrata.

Every error raised on purpose by kvstrata derives from :class:`KVStrataError`.
Leaves may also subclass a builtin so callers that already catch ``ValueError``
or ``OSError`` keep working.  Faults inside a cache tier are *not* raised into the
inference engine: the engine turns them into misses and counts them.
"""

from __future__ import annotations


class KVStrataError(Exception):
    """Base class of every error kvstrata raises on purpose."""


class ConfigError(KVStrataError, ValueError):
    """A configuration value is invalid. The message names the field and the value."""

    def __init__(self, message: str, *, field: str | None = None, value: object = None) -> None:
        super().__init__(message)
        self.field = field
        self.value = value


class UnknownNameError(ConfigError, KeyError):
    """A registry (tier, policy, model, ...) does not know a name."""

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return str(self.args[0]) if self.args else ""


class LayoutMismatchError(KVStrataError):
    """Stored data was written with another KV layout or namespace."""


class TierError(KVStrataError, OSError):
    """A tier failed to perform an operation (server down, disk full, I/O error)."""


class TraceFormatError(KVStrataError, ValueError):
    """A trace file is malformed. The message names the file and the line number."""


class CorruptIndexError(TierError):
    """A persistent tier's index cannot be opened or read (damaged, truncated, not an index).

    The message names the index and says how to rebuild it; ``path`` is the index and ``reason``
    what was wrong with it."""

    def __init__(self, message: str, *, path: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.path = path
        self.reason = reason
