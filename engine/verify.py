"""Offline check of every persistent tier in a config, across all namespaces found on disk.

A persistent tier keeps one directory per namespace under its ``path`` with a
``meta.json`` (layout and namespace) beside the data; ``verify`` opens each of
them with the layout it was written with, so no layout has to be given.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvstrata.config import KVStrataConfig, load_config, resolve_auto_capacity
from kvstrata.core.keys import Namespace
from kvstrata.core.layout import KVLayout
from kvstrata.errors import KVStrataError
from kvstrata.tiers import TIERS, TierContext


def namespaces_under(path: str) -> list[tuple[Path, KVLayout, Namespace]]:
    """Every namespace directory (with a readable meta.json) under a tier path."""
    base = Path(os.path.expandvars(os.path.expanduser(path)))
    found: list[tuple[Path, KVLayout, Namespace]] = []
    if not base.is_dir():
        return found
    for meta_path in sorted(base.glob("*/meta.json")):
        meta = json.loads(meta_path.read_text())
        layout = KVLayout.from_dict(meta["layout"])
        namespace = Namespace.from_stored(meta["namespace"], meta_path.parent.name)  # salt kept as a digest
        found.append((meta_path.parent, layout, namespace))
    return found


def verify_config(
    config: KVStrataConfig | str | dict[str, Any] | None = None, *, repair: bool = False
) -> list[dict[str, Any]]:
    """Verify every namespace of every persistent tier. Returns one report dict per namespace."""
    cfg = load_config(config)
    reports: list[dict[str, Any]] = []
    for tc in cfg.tiers:
        cls = TIERS.get(tc.kind)
        path = getattr(tc.options, "path", None)
        if not cls.capabilities.persistent or not path:
            continue
        for directory, layout, namespace in namespaces_under(path):
            try:
                tier = cls(tc.name, resolve_auto_capacity(tc), tc.options, TierContext(layout, namespace))
            except KVStrataError as exc:
                reports.append({"tier": tc.name, "namespace": directory.name, "ok": False, "problems": [str(exc)]})
                continue
            try:
                report = tier.verify(repair=repair).to_dict()
            finally:
                tier.close()
            report.update({"namespace": directory.name, "model": layout.model, "path": str(directory)})
            reports.append(report)
    return reports
