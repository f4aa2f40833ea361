"""What the daemon manages: the persistent tiers of the config, per namespace found on disk.

Every persistent tier keeps one directory per namespace (model, layout, tenant salt, ...) with
a ``meta.json`` describing it, so the daemon needs no layout: it finds the namespaces under the
NVMe paths and the ``fs`` URLs (again every ``rescan_interval_s``: a new model may start) and
opens each tier of each namespace with the layout it was written with. A namespace present in
only some tiers gets the others opened when a block must go there (a demotion into ``fs``, a
promotion into ``nvme``). DRAM/HBM tiers are private to each inference process and not the
daemon's business; a ``mooncake`` tier is held open separately (the node's pool segment).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstrata.config import KVStrataConfig, TierConfig, resolve_auto_capacity
from kvstrata.core.keys import Namespace
from kvstrata.core.layout import KVLayout
from kvstrata.engine.verify import namespaces_under
from kvstrata.errors import KVStrataError
from kvstrata.policies.layers import LayerPolicies
from kvstrata.tiers import TIERS, Tier, TierContext

log = logging.getLogger("kvstrata.daemon")


@dataclass(frozen=True)
class TierPlan:
    """A persistent tier of the config, as the daemon manages it (bytes resolved)."""

    config: TierConfig
    position: int  # in the persistent chain, top first
    capacity: int
    high: int  # bytes: above this the daemon demotes or drops ...
    low: int  # ... down to this

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def kind(self) -> str:
        return self.config.kind


def persistent_chain(config: KVStrataConfig) -> list[TierPlan]:
    """The config's persistent tiers (nvme, fs, ...), top first, with their watermarks in bytes."""
    chain: list[TierPlan] = []
    for tc in config.tiers:
        if not TIERS.get(tc.kind).capabilities.persistent:
            continue
        cap = resolve_auto_capacity(tc)
        marks = config.daemon.watermarks_of(tc.name)
        chain.append(TierPlan(tc, len(chain), cap, int(cap * marks.high), int(cap * marks.low)))
    return chain


@dataclass
class Found:
    layout: KVLayout
    namespace: Namespace
    tiers: set[str] = field(default_factory=set)  # tiers holding the namespace already


def local_fingerprints(chain: list[TierPlan]) -> set[str]:
    """Names of the namespace directories under the local tiers' paths (one ``scandir`` each)."""
    out: set[str] = set()
    for plan in chain:
        path = getattr(plan.config.options, "path", None)
        if path and getattr(plan.config.options, "url", None) is None:
            with contextlib.suppress(OSError), os.scandir(os.path.expandvars(os.path.expanduser(path))) as it:
                out.update(e.name for e in it if not e.name.startswith(".") and e.is_dir())
    return out


def discover(chain: list[TierPlan], local_only: bool = False) -> dict[str, Found]:
    """Namespaces present in any persistent tier (``local_only``: only local directories), by
    fingerprint (unreadable ones are logged)."""
    found: dict[str, Found] = {}
    for plan in chain:
        if local_only and getattr(plan.config.options, "url", None) is not None:
            continue
        try:
            entries = _namespaces_of(plan.config)
        except (OSError, ValueError, KeyError, TypeError, KVStrataError) as exc:
            log.warning("cannot list namespaces of tier %s: %s", plan.name, exc, extra={"tier": plan.name})
            continue
        for fingerprint, layout, namespace in entries:
            found.setdefault(fingerprint, Found(layout, namespace)).tiers.add(plan.name)
    return found


def _namespaces_of(tc: TierConfig) -> list[tuple[str, KVLayout, Namespace]]:
    url = getattr(tc.options, "url", None)
    if url is not None:
        return _fs_namespaces(url, getattr(tc.options, "storage_options", {}))
    path = getattr(tc.options, "path", None)
    if not path:
        return []
    return [(d.name, layout, ns) for d, layout, ns in namespaces_under(path)]


def _fs_namespaces(url: str, storage_options: dict[str, Any]) -> list[tuple[str, KVLayout, Namespace]]:
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **storage_options)
    out: list[tuple[str, KVLayout, Namespace]] = []
    for path in sorted(fs.glob(f"{root.rstrip('/')}/*/meta.json")):
        meta = json.loads(fs.cat_file(path))
        fingerprint = str(path).rstrip("/").split("/")[-2]
        namespace = Namespace.from_stored(meta["namespace"], fingerprint)  # a salted one: its digest only
        out.append((fingerprint, KVLayout.from_dict(meta["layout"]), namespace))
    return out


class ManagedNamespace:
    """The persistent tiers of one namespace, opened on demand, and its layer policies."""

    def __init__(self, fingerprint: str, found: Found, config: KVStrataConfig, chain: list[TierPlan]) -> None:
        self.fingerprint = fingerprint
        self.layout = found.layout
        self.namespace = found.namespace
        self.present = set(found.tiers)
        self.chain = chain
        self.policies = LayerPolicies.resolve(found.layout, config.policies, tier_names=[t.name for t in config.tiers])
        self.lock = threading.RLock()  # held by the scrubber per batch and by close()
        self._mu = threading.RLock()  # the open tiers
        self._tiers: dict[str, Tier] = {}
        self._broken: dict[str, str] = {}  # tier -> why it could not be opened (not retried)
        self._closed = False

    @property
    def label(self) -> str:
        return f"{self.layout.model}/{self.fingerprint}"

    def mask(self, plan: TierPlan) -> int:
        """Layers this namespace may keep in ``plan``'s tier (per-layer policies)."""
        return self.policies.tier_mask(plan.name, plan.kind)

    def tier(self, plan: TierPlan, create: bool = False) -> Tier | None:
        """The open tier, opening it if the namespace is there (or ``create``); None when absent
        or when it cannot be opened (logged once)."""
        with self._mu:
            if self._closed:
                return None
            tier = self._tiers.get(plan.name)
            if tier is not None or plan.name in self._broken:
                return tier
            if plan.name not in self.present and not create:
                return None
            try:
                tier = self._open(plan)
            except (KVStrataError, OSError, ValueError) as exc:
                self._broken[plan.name] = str(exc)
                log.error(
                    "cannot open tier %s of namespace %s: %s",
                    plan.name,
                    self.label,
                    exc,
                    extra={"event": "open_failed", "tier": plan.name, "namespace": self.fingerprint},
                )
                return None
            self._tiers[plan.name] = tier
            self.present.add(plan.name)
            return tier

    def _open(self, plan: TierPlan) -> Tier:
        cls = TIERS.get(plan.kind)
        options = plan.config.options
        if "gc_interval_s" in type(options).model_fields:  # fs: the daemon runs housekeeping itself
            options = options.model_copy(update={"gc_interval_s": 0.0})
        return cls(plan.name, plan.capacity, options, TierContext(self.layout, self.namespace))

    def wrap(self, plan: TierPlan, wrapper: Callable[[Tier], Tier]) -> Tier | None:
        """Replace the open tier of ``plan`` by ``wrapper(tier)`` (e.g. a fault-injecting wrapper
        from :mod:`kvstrata.tiers.wrappers`, as tests do); returns the new tier."""
        with self._mu:
            tier = self._tiers.get(plan.name)
            if tier is not None:
                tier = self._tiers[plan.name] = wrapper(tier)
            return tier

    def opened(self, plan: TierPlan) -> Tier | None:
        """The tier if it is open now (never opens one)."""
        with self._mu:
            return self._tiers.get(plan.name)

    def open_tiers(self) -> list[tuple[TierPlan, Tier]]:
        """The tiers open now, chain order."""
        with self._mu:
            return [(p, self._tiers[p.name]) for p in self.chain if p.name in self._tiers]

    def broken(self) -> dict[str, str]:
        with self._mu:
            return dict(self._broken)

    def close(self) -> None:
        with self.lock, self._mu:  # waits for a scrub batch in flight
            self._closed = True
            tiers, self._tiers = list(self._tiers.values()), {}
        for tier in tiers:
            try:
                tier.close()
            except Exception:  # pragma: no cover - best effort at shutdown
                log.exception("closing tier %s of %s failed", tier.name, self.label)
