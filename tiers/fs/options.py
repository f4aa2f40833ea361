"""Options of the ``fs`` tier and the constants its parts share."""

from __future__ import annotations

import re
from typing import Any

import fsspec
from pydantic import Field, field_validator

from kvstrata.tiers.auth import AuthOptions, ModeOptions
from kvstrata.tiers.base import TierOptions
from kvstrata.units import parse_size

MiB = 1024**2
SKEW_S = 30.0  # clock difference between nodes that incremental refreshes tolerate
MAX_EPOCHS = 8  # an incremental refresh spanning more epoch directories lists everything instead
READ_GAP = 256 * 1024  # one ranged GET may span a hole this large to save a request
MAX_READ = 16 * MiB  # the most bytes one ranged GET asks for (unless one record is larger)
LOW_WATERMARK = 0.9  # an over-full namespace is expired down to this fraction of capacity
_DURATION_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(ms|s|m|h|d)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(value: object) -> float:
    """Seconds from a number or a string like ``"500ms"``, ``"30s"``, ``"5m"``, ``"24h"``, ``"7d"``."""
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION_RE.match(value)):
        seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    else:
        raise ValueError(f"not a duration: {value!r} (expected seconds or e.g. '500ms', '30s', '5m', '24h')")
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"duration must be a finite number of seconds >= 0: {value!r}")
    return seconds


class FSOptions(AuthOptions, ModeOptions):
    """Options of the ``fs`` tier (durations in seconds, or strings such as ``"30s"``), with the
    secret and the file modes of :mod:`kvstrata.tiers.auth` (modes apply to ``file://`` paths)."""

    url: str  # fsspec URL: file:///mnt/shared/kv, s3://bucket/prefix, memory://name
    storage_options: dict[str, Any] = Field(default_factory=dict)  # passed to the fsspec filesystem
    object_size: int = 4 * MiB  # target size of one data object
    timeout_s: float = Field(10.0, gt=0)  # bound on every remote call
    open_timeout_s: float = Field(30.0, gt=0)  # bound on the calls made while opening (first contact can be slow)
    retry_after_s: float = Field(2.0, ge=0)  # after a fault, calls fail at once for this long
    retries: int = Field(2, ge=1, le=10)  # attempts per call inside s3fs/botocore
    refresh_s: float = Field(1.0, ge=0)  # blocks others publish are seen within this (0: every miss lists)
    full_refresh_s: float = Field(60.0, gt=0)  # list the whole namespace this often
    gc_grace_s: float = Field(120.0, ge=0)  # dead objects are deleted this long after they died
    gc_interval_s: float = Field(10.0, ge=0)  # background housekeeping period (0: only maintain() calls)
    ttl_s: float | None = Field(None, gt=0)  # objects older than this expire (None: never)
    compact_threshold: float = Field(0.5, ge=0.0, le=1.0)  # rewrite live objects filled below this
    max_concurrency: int = Field(8, ge=1, le=256)  # remote calls in flight per tier
    fsync: bool = True  # file:// only: fsync each object before renaming it into place

    @field_validator("url")
    @classmethod
    def _known_url(cls, value: str) -> str:
        return check_url(value)

    @field_validator("object_size", mode="before")
    @classmethod
    def _size(cls, value: object) -> int:
        size = parse_size(value)
        if not 64 * 1024 <= size <= 5 * 1024**3:
            raise ValueError(f"object_size must be between 64KiB and 5GiB, got {value!r}")
        return size

    @field_validator(
        "timeout_s",
        "open_timeout_s",
        "retry_after_s",
        "refresh_s",
        "full_refresh_s",
        "gc_grace_s",
        "gc_interval_s",
        mode="before",
    )
    @classmethod
    def _duration(cls, value: object) -> float:
        return parse_duration(value)

    @field_validator("ttl_s", mode="before")
    @classmethod
    def _ttl(cls, value: object) -> float | None:
        return None if value is None else parse_duration(value)

    @property
    def path(self) -> str | None:
        """The local directory of a ``file://`` URL (so ``capacity = "auto"`` sizes from its disk)."""
        protocol, rest = fsspec.core.split_protocol(self.url)
        return rest if protocol in (None, "file", "local") else None


def check_url(url: str) -> str:
    """``url`` if fsspec can open it; a ``ValueError`` naming it (and a package to install) if not."""
    protocol, rest = fsspec.core.split_protocol(url)
    if not rest.strip("/"):
        raise ValueError(f"url {url!r} names no directory or bucket")
    if protocol is None:
        return url
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as exc:
        raise ValueError(f"url {url!r}: protocol {protocol!r} needs a package that is not installed ({exc})") from exc
    except ValueError:
        raise ValueError(f"url {url!r}: unknown protocol {protocol!r}") from None
    return url


def _as_dict(options: object) -> Any:
    return options.model_dump() if isinstance(options, TierOptions) else options
