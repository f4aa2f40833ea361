"""Offline check of every persistent tier in a config, across all namespaces found on disk.

A persistent tier keeps one directory per namespace under its ``path`` with a
``meta.json`` (layout and namespace) beside the data; ``verify`` opens each of
them with the layout it was written with, so no layout has to be given. With
``repair``, an index that cannot be opened (or was lost) is first rebuilt from the
tier's records (:meth:`~kvstrata.tiers.base.Tier.rebuild_index`); without it, such an
index is a :class:`~kvstrata.errors.CorruptIndexError` that names it.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from kvstrata.config import KVStrataConfig, TierConfig, load_config, resolve_auto_capacity
from kvstrata.core.keys import Namespace
from kvstrata.core.layout import KVLayout
from kvstrata.errors import CorruptIndexError, KVStrataError, LayoutMismatchError
from kvstrata.tiers import TIERS, Tier, TierContext

log = logging.getLogger(__name__)


def read_namespace(directory: str | os.PathLike[str]) -> tuple[KVLayout, Namespace]:
    """The layout and namespace of one namespace directory, from its ``meta.json``.

    Raises :class:`~kvstrata.errors.LayoutMismatchError` naming the file when it is missing,
    unreadable or not what kvstrata writes."""
    meta_path = Path(directory) / "meta.json"
    try:
        raw = meta_path.read_bytes()
    except OSError as exc:
        raise LayoutMismatchError(
            f"{meta_path}: cannot read the namespace's meta.json: {exc.strerror or exc}"
        ) from None
    return parse_namespace(raw, str(meta_path), meta_path.parent.name)


def parse_namespace(raw: str | bytes, where: str, fingerprint: str) -> tuple[KVLayout, Namespace]:
    """The layout and namespace in the ``meta.json`` read from ``where`` (its directory is named
    ``fingerprint``); :class:`~kvstrata.errors.LayoutMismatchError` naming ``where`` if it is
    not what kvstrata writes."""
    try:
        meta = json.loads(raw)
        # the salt is kept as a digest: the directory name (the fingerprint) completes it
        namespace = Namespace.from_stored(meta["namespace"], fingerprint)
        return KVLayout.from_dict(meta["layout"]), namespace
    except RecursionError:
        raise LayoutMismatchError(f"{where}: not a namespace's meta.json (nested too deeply)") from None
    except (ValueError, KeyError, TypeError, AttributeError, KVStrataError) as exc:
        what = f"missing {exc}" if isinstance(exc, KeyError) else str(exc) or type(exc).__name__
        raise LayoutMismatchError(f"{where}: not a namespace's meta.json: {what}") from None


_WARNED: set[tuple[str, float]] = set()


def _warn_once(path: Path, message: str) -> None:
    """Warn about a bad file once per version of it (the daemon lists namespaces every few seconds)."""
    try:
        seen = (str(path), path.stat().st_mtime)
    except OSError:
        seen = (str(path), 0.0)
    if seen not in _WARNED:
        _WARNED.add(seen)
        log.warning("%s", message)


def namespaces_under(path: str) -> list[tuple[Path, KVLayout, Namespace]]:
    """Every namespace directory (with a readable meta.json) under a tier path; a directory whose
    meta.json is unreadable or malformed (a stray copy, a half-written one) is skipped with a
    warning."""
    base = Path(os.path.expandvars(os.path.expanduser(path)))
    found: list[tuple[Path, KVLayout, Namespace]] = []
    if not base.is_dir():
        return found
    for meta_path in sorted(base.glob("*/meta.json")):
        try:
            layout, namespace = read_namespace(meta_path.parent)
        except LayoutMismatchError as exc:
            _warn_once(meta_path, f"skipped a namespace directory: {exc}")
            continue
        found.append((meta_path.parent, layout, namespace))
    return found


_PSEUDO_FS = ("/proc", "/sys")  # kernel views: no tier can live under them


def unusable_tier_path(path: str) -> str | None:
    """Why a persistent tier's ``path`` cannot hold its data (a problem for ``verify``), or None:
    it does not exist, is not a directory, cannot be listed, or lies on ``/proc`` or ``/sys``."""
    base = Path(os.path.expandvars(os.path.expanduser(path)))
    try:
        st = base.stat()
    except FileNotFoundError:
        return f"tier path {str(base)!r} does not exist: nothing to check"
    except OSError as exc:
        return f"tier path {str(base)!r} cannot be read: {exc.strerror or exc}"
    if not base.is_dir():
        return f"tier path {str(base)!r} is not a directory"
    for pseudo in _PSEUDO_FS:
        try:
            if os.stat(pseudo).st_dev == st.st_dev:
                return f"tier path {str(base)!r} is on the kernel's {pseudo} filesystem, not storage"
        except OSError:
            continue
    try:
        with os.scandir(base) as entries:
            next(entries, None)
    except OSError as exc:
        return f"tier path {str(base)!r} cannot be listed: {exc.strerror or exc}"
    return None


def verify_config(
    config: KVStrataConfig | str | dict[str, Any] | None = None, *, repair: bool = False, rebuild: bool = False
) -> list[dict[str, Any]]:
    """Verify every namespace of every persistent tier. Returns one report dict per namespace.

    ``repair`` fixes what it finds, rebuilding indexes that cannot be opened or were lost
    (``rebuild``: every index, implies ``repair``); a rebuild's lines lead its namespace's problems."""
    cfg = load_config(config)
    repair = repair or rebuild
    reports: list[dict[str, Any]] = []
    for tc in cfg.tiers:
        cls = TIERS.get(tc.kind)
        path = getattr(tc.options, "path", None)
        if cls.capabilities.persistent and not path and getattr(tc.options, "url", None):
            reports += _verify_store(tc, cls, repair)  # an object store (fs on S3): contacted, never skipped
            continue
        if not cls.capabilities.persistent or not path:
            continue
        unusable = unusable_tier_path(path)
        if unusable is not None:  # nothing there can be checked: a problem, not an empty "ok"
            reports.append({"tier": tc.name, "namespace": "", "ok": False, "problems": [unusable]})
            continue
        for directory, layout, namespace in namespaces_under(path):
            context = TierContext(layout, namespace)
            try:  # a rebuild refused (the tier is in use) or failed is this namespace's problem
                rebuilt = cls.rebuild_index(tc.name, tc.options, context, force=rebuild) if repair else None
                tier = cls.open_to_verify(tc.name, resolve_auto_capacity(tc), tc.options, context, repair)
            except KVStrataError as exc:
                if isinstance(exc, CorruptIndexError) and not repair:
                    raise  # one clear error (`--repair` rebuilds it), not a table row
                reports.append({"tier": tc.name, "namespace": directory.name, "ok": False, "problems": [str(exc)]})
                continue
            try:
                report = tier.verify(repair=repair).to_dict()
            finally:
                tier.close()
            if rebuilt is not None:
                report["problems"] = rebuilt.problems + list(report["problems"])  # type: ignore[call-overload]
                report["rebuilt"] = rebuilt.to_dict()
            report.update({"namespace": directory.name, "model": layout.model, "path": str(directory)})
            reports.append(report)
    return reports


def _verify_store(tc: TierConfig, cls: type[Tier], repair: bool) -> list[dict[str, Any]]:
    """Verify every namespace of an fs tier on an object store: list them (bounded by the tier's
    timeouts), open each and read back every live record. A store that cannot be listed (nothing
    listening, no such bucket, refused credentials) is one report with the problem, not ok."""
    url = getattr(tc.options, "url", "")
    lister = getattr(cls, "stored_namespaces", None)  # FSTier.stored_namespaces
    try:
        if lister is None:
            raise KVStrataError(f"tier {tc.name!r} ({tc.kind}) at {url!r}: cannot list its namespaces to check them")
        found: list[tuple[str, str, bytes]] = lister(tc.options, f"fs tier {tc.name!r}")
    except KVStrataError as exc:
        return [{"tier": tc.name, "namespace": "", "path": url, "ok": False, "problems": [str(exc)]}]
    options = tc.options.model_copy(update={"gc_interval_s": 0.0})  # a check: no background housekeeping
    reports: list[dict[str, Any]] = []
    for fingerprint, where, raw in found:
        row: dict[str, Any] = {"namespace": fingerprint, "path": where}
        try:
            layout, namespace = parse_namespace(raw, f"{where}/meta.json", fingerprint)
            row["model"] = layout.model
            tier = cls(tc.name, resolve_auto_capacity(tc), options, TierContext(layout, namespace))
        except KVStrataError as exc:
            reports.append({"tier": tc.name, **row, "ok": False, "problems": [str(exc)]})
            continue
        try:
            report: dict[str, Any] = tier.verify(repair=repair).to_dict()
        except KVStrataError as exc:  # the store failed during the check
            report = {"tier": tc.name, "ok": False, "problems": [str(exc)]}
        finally:
            tier.close()
        reports.append({**report, **row})
    return reports
