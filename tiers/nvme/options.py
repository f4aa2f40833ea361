"""Options and constants of the ``nvme`` tier, and the choices made once at open (``O_DIRECT``,
segment size, GPUDirect Storage)."""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Literal

from pydantic import Field

from kvstrata.errors import ConfigError
from kvstrata.tiers.auth import AuthOptions, ModeOptions
from kvstrata.tiers.base import TierOptions
from kvstrata.tiers.segments import ALIGN, probe_direct_io
from kvstrata.units import Size

MiB = 1024**2
GiB = 1024**3
CHUNK_BYTES = 16 * MiB  # staging buffer size: the most bytes one pwrite/pread moves
IO_DEPTH = 2  # chunk reads/writes in flight per call, so the disk never waits for the GIL
READ_GAP = 64 * 1024  # a read may span a hole this large to save a syscall
HEAD_ITEMS = 64  # the first part of a large read, on the disk before the rest is looked up (see read_cuts)
GRACE_S = 60.0  # unreferenced files younger than this may belong to a writer starting up
RESCAN_S = 1.0  # how often used_bytes re-reads segment sizes from disk
FRESH_S = 0.02  # a view this recent is trusted when it says the tier is full
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class NVMeOptions(AuthOptions, ModeOptions):
    """Options of the ``nvme`` tier (with the secret and file modes of :mod:`kvstrata.tiers.auth`)."""

    path: str  # directory; ``~`` and ``$VARS`` are expanded; data goes to <path>/<namespace fingerprint>/
    segment_size: Size = Field(256 * MiB, ge=ALIGN)  # a segment is sealed once this full (capped at capacity // 8)
    direct_io: Literal["auto", "on", "off"] = "auto"  # auto: O_DIRECT where the filesystem accepts it
    fsync: bool = True  # fdatasync segments before the index commit (off: faster, a power loss may lose acked data)
    compact_threshold: float = Field(0.5, ge=0.0, le=1.0)  # compact a sealed segment below this live fraction
    lmdb_map_size: Size = Field(64 * GiB, ge=MiB)  # LMDB address space (a file grows only as needed)


@functools.cache
def gds_available() -> bool:
    """kvikio importable and a CUDA device present (imports torch only if kvikio exists)."""
    if importlib.util.find_spec("kvikio") is None:
        return False
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a core dependency
        return False
    return bool(torch.cuda.is_available())


def _coerce_options(options: object) -> NVMeOptions:
    data = options.model_dump() if isinstance(options, TierOptions) else options
    return NVMeOptions.model_validate(data)


def _effective_segment_size(segment_size: int, capacity: int) -> int:
    cap = capacity // 8 if capacity > 0 else segment_size
    return max(ALIGN, min(segment_size, cap) // ALIGN * ALIGN)


def _choose_direct_io(directory: str, opts: NVMeOptions) -> bool:
    try:
        supported = probe_direct_io(directory, opts.file_mode)
    except OSError as exc:
        raise ConfigError(
            f"nvme tier path {directory!r} is not writable: {exc.strerror or exc}", field="path", value=opts.path
        ) from exc
    if opts.direct_io == "on" and not supported:
        raise ConfigError(f"O_DIRECT is not supported under {directory!r}", field="direct_io", value="on")
    return supported and opts.direct_io != "off"
