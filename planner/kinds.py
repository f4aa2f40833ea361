"""What a tier kind can do, as its class declares it (:class:`~kvstrata.tiers.base.TierCapabilities`).

The planner decides from these flags, not from kind names. A kind whose class cannot be loaded
here (planning for a machine with an optional dependency this one lacks) has no capability set:
each caller states its fallback (:data:`~kvstrata.planner.spec.SHARED_KINDS`, space by bytes).
"""

from __future__ import annotations

from kvstrata.tiers import TIERS
from kvstrata.tiers.base import TierCapabilities

__all__ = ["in_device_memory", "kind_capabilities"]


def kind_capabilities(kind: str) -> TierCapabilities | None:
    """The capability set the tier class of ``kind`` declares (``None``: the class cannot be loaded)."""
    try:
        return TIERS.get(kind).capabilities
    except Exception:  # an unknown kind, or an optional dependency missing
        return None


def in_device_memory(kind: str) -> bool:
    """Whether a tier of ``kind`` keeps its bytes in accelerator memory (the ``hbm`` tier)."""
    caps = kind_capabilities(kind)
    return caps is not None and caps.device_memory
