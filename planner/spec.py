"""What the planner simulates: tiers (from a config file or the ``--tiers`` shorthand) and engine limits.

A :class:`PlanTier` is a :class:`~kvstrata.config.TierConfig` reduced to what decides hits
and bytes: kind, capacity (``None``: unbounded), policies, write mode, promotion, and
whether several instances share it. Kinds the engine does not ship yet (``mooncake``,
``fs``) are accepted here, so a plan can size them before they exist.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from kvstrata.config import KVStrataConfig, TierConfig, parse_tiers_shorthand, resolve_auto_capacity
from kvstrata.engine.queue import pending_budget
from kvstrata.errors import ConfigError
from kvstrata.planner.kinds import in_device_memory, kind_capabilities
from kvstrata.planner.space import space_model
from kvstrata.policies import ADMISSION, EVICTION
from kvstrata.units import parse_size

__all__ = ["SHARED_KINDS", "EngineLimits", "PlanTier", "tiers_from_config", "tiers_from_text"]

# What a tier can do comes from its class (``capabilities``: shared, space model); these names
# only stand in where the class cannot be loaded here (an optional dependency missing).
#: kinds shared by every instance unless a tier says ``private``
SHARED_KINDS = frozenset({"mooncake", "fs"})
#: kinds the planner knows without an engine tier class (planning only)
PLANNING_KINDS = frozenset({"hbm", "dram", "nvme", "mooncake", "fs"})

DEFAULT_SEGMENT_SIZE = 256 * 1024**2
DEFAULT_COMPACT_THRESHOLD = 0.5


@dataclass(frozen=True)
class EngineLimits:
    """The engine settings that change which blocks move (see ``[engine]`` in the config)."""

    # the store queue's budget: a store batch larger than this is written in parts of at most
    # this many bytes, prefix first ("auto": resolved against the top tier like the engine does)
    max_pending_bytes: int | str = "auto"
    max_background_bytes: int = 1024**3  # write-through / promotion copies larger than this are skipped

    @classmethod
    def from_config(cls, config: KVStrataConfig) -> EngineLimits:
        return cls(config.engine.max_pending_bytes, config.engine.max_background_bytes)

    def resolved(self, top_capacity: int | None) -> EngineLimits:
        """These limits with ``max_pending_bytes`` in bytes, for a top tier of ``top_capacity``."""
        return replace(self, max_pending_bytes=pending_budget(self.max_pending_bytes, top_capacity))

    @property
    def pending_bytes(self) -> int:
        """``max_pending_bytes`` of resolved limits."""
        if not isinstance(self.max_pending_bytes, int):
            raise TypeError("EngineLimits.max_pending_bytes is not resolved; call resolved(top_capacity)")
        return self.max_pending_bytes


@dataclass(frozen=True)
class PlanTier:
    """One tier as the planner sees it."""

    name: str
    kind: str
    capacity: int | None  # bytes; None: unbounded
    eviction: str = "prefix-aware"
    admission: str = "all"
    write: str = "write-through"
    promote: bool = True
    shared: bool = False  # one tier for all instances (else one per instance)
    segment_size: int = DEFAULT_SEGMENT_SIZE  # nvme: segment files
    compact_threshold: float = DEFAULT_COMPACT_THRESHOLD  # nvme: compaction trigger

    def with_capacity(self, capacity: int | None) -> PlanTier:
        return replace(self, capacity=capacity)

    @property
    def is_ssd(self) -> bool:
        """Segment files on a local disk (``capabilities.space == "segments"``)."""
        return space_model(self.kind) == "segments"


def _check_names(tiers: list[PlanTier]) -> list[PlanTier]:
    seen: set[str] = set()
    for t in tiers:
        if t.name in seen:
            raise ConfigError(f"duplicate tier name {t.name!r}", field="tiers", value=t.name)
        seen.add(t.name)
        EVICTION.get(t.eviction)
        ADMISSION.get(t.admission)
    if not tiers:
        raise ConfigError("a plan needs at least one tier", field="tiers")
    return tiers


def tiers_from_config(config: KVStrataConfig, shared: Iterable[str] = ()) -> list[PlanTier]:
    """Plan tiers from a validated config (``capacity = "auto"`` is resolved on this machine)."""
    names = set(shared)
    out = []
    for tc in config.tiers:
        out.append(_from_tier_config(tc, tc.name in names or _shared_kind(tc.kind)))
    unknown = names - {t.name for t in out}
    if unknown:
        raise ConfigError(f"--shared: no tier named {sorted(unknown)[0]!r}", field="shared", value=sorted(unknown))
    return _check_names(out)


def _shared_kind(kind: str) -> bool:
    """Whether instances share a tier of this kind (its class says so, as ``kvstrata replay`` asks)."""
    caps = kind_capabilities(kind)
    return bool(caps.shared) if caps is not None else kind in SHARED_KINDS  # no importable class: the name


def _from_tier_config(tc: TierConfig, shared: bool) -> PlanTier:
    opts = tc.options
    return PlanTier(
        name=tc.name,
        kind=tc.kind,
        capacity=resolve_auto_capacity(tc),
        eviction=tc.eviction,
        admission=tc.admission,
        write=tc.write,
        promote=tc.promote,
        shared=shared,
        segment_size=int(getattr(opts, "segment_size", DEFAULT_SEGMENT_SIZE)),
        compact_threshold=float(getattr(opts, "compact_threshold", DEFAULT_COMPACT_THRESHOLD)),
    )


def tiers_from_text(text: str, shared: Iterable[str] = ()) -> list[PlanTier]:
    """Plan tiers from the ``--tiers`` shorthand (``inf`` allowed; kinds ``mooncake``/``fs`` too)."""
    names = set(shared)
    out = []
    for raw in parse_tiers_shorthand(text):
        out.append(_from_shorthand(raw, names))
    unknown = names - {t.name for t in out}
    if unknown:
        raise ConfigError(f"--shared: no tier named {sorted(unknown)[0]!r}", field="shared", value=sorted(unknown))
    return _check_names(out)


def _from_shorthand(raw: dict[str, Any], shared_names: set[str]) -> PlanTier:
    name = str(raw["name"])
    kind = str(raw.get("kind", name))
    if kind not in PLANNING_KINDS:
        from kvstrata.tiers import TIERS

        TIERS.get(kind)  # a registered third-party tier is fine; anything else: a clear error
    try:
        segment_size = parse_size(raw.get("segment_size", DEFAULT_SEGMENT_SIZE))
        threshold = float(raw.get("compact_threshold", DEFAULT_COMPACT_THRESHOLD))
        if not 0 <= threshold <= 1:  # NaN too
            raise ValueError(f"compact_threshold must be in 0..1, got {threshold!r}")
    except ValueError as exc:
        raise ConfigError(f"--tiers: tier {name!r}: {exc}", field="tiers", value=name) from None
    shared = raw.get("shared")
    return PlanTier(
        name=name,
        kind=kind,
        capacity=raw["capacity"],
        eviction=str(raw.get("eviction", "prefix-aware")),
        admission=str(raw.get("admission", "all")),
        write=str(raw.get("write", "write-through")),
        promote=bool(raw.get("promote", not in_device_memory(kind))),
        shared=bool(shared) if shared is not None else (name in shared_names or _shared_kind(kind)),
        segment_size=segment_size,
        compact_threshold=threshold,
    )
