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
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstrata.config import KVStrataConfig, TierConfig, resolve_auto_capacity
from kvstrata.core.keys import Namespace
from kvstrata.core.layout import KVLayout
from kvstrata.engine.verify import namespaces_under, parse_namespace, read_namespace
from kvstrata.errors import KVStrataError, LayoutMismatchError
from kvstrata.policies.layers import LayerPolicies
from kvstrata.tiers import TIERS, Tier, TierContext
from kvstrata.tiers.fs import FSOptions, FSTier

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


@dataclass(frozen=True)
class Broken:
    """Why a namespace's tier is out of service."""

    reason: str  # the exception, with its type
    path: str  # the namespace's directory or URL in that tier
    during: str  # "open" or "start-up check"
    at: float  # wall clock

    def to_dict(self) -> dict[str, Any]:
        return {"reason": self.reason, "path": self.path, "during": self.during, "at": self.at}


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


Unreadable = dict[str, dict[str, "Broken"]]  # fingerprint -> tier -> why its meta.json cannot be used


def discover(chain: list[TierPlan], local_only: bool = False, unreadable: Unreadable | None = None) -> dict[str, Found]:
    """Namespaces present in any persistent tier (``local_only``: only local directories), by
    fingerprint. Those whose meta.json cannot be used are logged (once) and, with ``unreadable``,
    collected there."""
    found: dict[str, Found] = {}
    for plan in chain:
        if local_only and getattr(plan.config.options, "url", None) is not None:
            continue

        def bad(fingerprint: str, where: str, why: str, tier: str = plan.name) -> None:
            if unreadable is not None:
                unreadable.setdefault(fingerprint, {})[tier] = Broken(why, where, "discovery", time.time())

        try:
            entries = _namespaces_of(plan.config, bad)
        except (OSError, ValueError, KeyError, TypeError, KVStrataError) as exc:
            log.warning("cannot list namespaces of tier %s: %s", plan.name, exc, extra={"tier": plan.name})
            continue
        for fingerprint, layout, namespace in entries:
            found.setdefault(fingerprint, Found(layout, namespace)).tiers.add(plan.name)
    return found


def _namespaces_of(tc: TierConfig, bad: Callable[[str, str, str], None]) -> list[tuple[str, KVLayout, Namespace]]:
    if isinstance(tc.options, FSOptions) and tc.options.path is None:
        return _fs_namespaces(tc, bad)
    path = getattr(tc.options, "path", None)
    if not path:
        return []
    good = [(d.name, layout, ns) for d, layout, ns in namespaces_under(path)]  # the others: warned there
    names = {name for name, _, _ in good}
    base = Path(os.path.expandvars(os.path.expanduser(path)))
    for meta in base.glob("*/meta.json") if base.is_dir() else ():
        if meta.parent.name not in names:
            try:
                read_namespace(meta.parent)
            except LayoutMismatchError as exc:
                bad(meta.parent.name, str(meta.parent), str(exc))
    return good


_WARNED: set[tuple[str, int]] = set()


def _fs_namespaces(tc: TierConfig, bad: Callable[[str, str, str], None]) -> list[tuple[str, KVLayout, Namespace]]:
    """The namespaces of an fs tier on an object store (listed within the tier's timeouts); one
    whose meta.json is damaged is skipped with a warning (once per content), not the whole tier."""
    assert isinstance(tc.options, FSOptions)
    out: list[tuple[str, KVLayout, Namespace]] = []
    for fingerprint, url, raw in FSTier.stored_namespaces(tc.options, f"fs tier {tc.name!r}", tc.options.timeout_s):
        try:
            layout, namespace = parse_namespace(raw, f"{url}/meta.json", fingerprint)  # a salted one: its digest only
        except LayoutMismatchError as exc:
            bad(fingerprint, url, str(exc))
            seen = (url, hash(raw))
            if seen not in _WARNED:
                _WARNED.add(seen)
                log.warning("skipped a namespace of tier %s: %s", tc.name, exc, extra={"tier": tc.name})
            continue
        out.append((fingerprint, layout, namespace))
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
        self._broken: dict[str, Broken] = {}  # tier -> why it could not be opened (until SIGHUP)
        self._closed = False

    @property
    def label(self) -> str:
        return f"{self.layout.model}/{self.fingerprint}"

    def mask(self, plan: TierPlan) -> int:
        """Layers this namespace may keep in ``plan``'s tier (per-layer policies)."""
        return self.policies.tier_mask(plan.name, plan.kind)

    def tier(self, plan: TierPlan, create: bool = False) -> Tier | None:
        """The open tier, opening it if the namespace is there (or ``create``); None when absent
        or broken: whatever opening it raises (a corrupt LMDB index, an unreadable meta.json, a
        store that refuses) marks this namespace's tier broken (:meth:`mark_broken`), and the
        daemon goes on serving the others."""
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
            except Exception as exc:  # any failure of one namespace's tier stays in that namespace
                self.mark_broken(plan, exc, "open")
                return None
            self._tiers[plan.name] = tier
            self.present.add(plan.name)
            return tier

    def where(self, plan: TierPlan) -> str:
        """The directory or URL of this namespace in ``plan``'s tier."""
        options = plan.config.options
        base = getattr(options, "url", None) or os.path.expandvars(os.path.expanduser(getattr(options, "path", "")))
        return f"{str(base).rstrip('/')}/{self.fingerprint}"

    def mark_broken(self, plan: TierPlan, exc: BaseException, during: str) -> None:
        """Stop using ``plan``'s tier of this namespace (closed if open) and say why, once: in
        the log (with its path and what to run), ``/status`` and ``kvstrata_daemon_broken_tiers``.
        Not retried until a SIGHUP (:meth:`retry_broken`) or a restart."""
        path = self.where(plan)
        reason = f"{type(exc).__name__}: {exc}"
        with self._mu:
            tier = self._tiers.pop(plan.name, None)
            self._broken[plan.name] = Broken(reason, path, during, time.time())
        if tier is not None:
            with contextlib.suppress(Exception):
                tier.close()
        log.error(
            "namespace %s: tier %s at %s is broken (%s failed: %s); the daemon serves the other namespaces. "
            "Check it with `kvstrata verify --repair`, or move %s aside, then send SIGHUP or restart",
            self.label,
            plan.name,
            path,
            during,
            reason,
            path,
            extra={"event": "namespace_broken", "tier": plan.name, "namespace": self.fingerprint, "path": path},
        )

    def retry_broken(self) -> None:
        """Forget the broken marks: the next use opens those tiers again (SIGHUP)."""
        with self._mu:
            self._broken.clear()

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

    def broken(self) -> dict[str, Broken]:
        """The tiers of this namespace that could not be opened (or verified), by name."""
        with self._mu:
            return dict(self._broken)

    def close(self) -> bool:
        """Close the open tiers; False when one failed to close (its state may need a check)."""
        with self.lock, self._mu:  # waits for a scrub batch in flight
            self._closed = True
            tiers, self._tiers = list(self._tiers.values()), {}
        ok = True
        for tier in tiers:
            try:
                tier.close()
            except Exception:  # best effort at shutdown; the daemon then stops uncleanly
                ok = False
                log.exception("closing tier %s of %s failed", tier.name, self.label)
        return ok
