"""Eviction and admission policies, registered by name.

Eviction policies only pick victims; the engine's tier index owns pins, sizes and
free space. Admission policies decide whether a block may enter a tier at all
(CacheLib separates "should this go to NVMe" from "what leaves DRAM").

=================  ===========================================================
eviction           cost per access / insert / removal
=================  ===========================================================
``lru``            O(1) / O(1) / O(1): one ordered-dict move per access
``prefix-aware``   O(1) / O(1) / O(1): LRU among chain tails (blocks with no
                   cached child) first, so a parent never leaves before its children
=================  ===========================================================

=================  ===========================================================
admission
=================  ===========================================================
``all``            admit every block
``second-touch``   admit a block the second time it is offered (bounded ghost set)
=================  ===========================================================

Per-layer-group policies for hybrid models (what each layer group keeps, which tiers it
may occupy, its eviction priority, and what a restore needs) are in
:mod:`kvstrata.policies.layers` (:class:`~kvstrata.policies.layers.LayerPolicies`).
"""

from __future__ import annotations

from typing import Any

from kvstrata.policies.admission import AdmissionPolicy, AdmitAll, SecondTouch
from kvstrata.policies.eviction import EvictionPolicy, LRUPolicy, PrefixAwarePolicy
from kvstrata.policies.layers import LayerGroupPolicy, LayerPolicies
from kvstrata.registry import Registry

# The policy classes are generic over the key type: each user fixes it on the instance it makes
# (the engine ``bytes``, the planner ``int``), so the registries hold them with ``Any`` keys.
EVICTION: Registry[EvictionPolicy[Any]] = Registry("eviction")
EVICTION.register("lru", LRUPolicy)
EVICTION.register("prefix-aware", PrefixAwarePolicy)

ADMISSION: Registry[AdmissionPolicy[Any]] = Registry("admission")
ADMISSION.register("all", AdmitAll)
ADMISSION.register("second-touch", SecondTouch)

__all__ = [
    "ADMISSION",
    "EVICTION",
    "AdmissionPolicy",
    "AdmitAll",
    "EvictionPolicy",
    "LRUPolicy",
    "LayerGroupPolicy",
    "LayerPolicies",
    "PrefixAwarePolicy",
    "SecondTouch",
]
