"""The start-up check: after an unclean stop (or with ``startup_check = "full"``), verify and
repair every open indexed tier of every namespace before the daemon serves.

A tier whose check fails with a tier fault (a store that does not answer) is reported and kept;
one whose check raises anything else (a corrupt LMDB page, a bug) is marked broken
(:meth:`~kvstrata.daemon.namespaces.ManagedNamespace.mark_broken`): the others are still served.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvstrata.errors import TierError
from kvstrata.tiers import indexed

from .metrics import DaemonMetrics
from .namespaces import ManagedNamespace

log = logging.getLogger("kvstrata.daemon")


def startup_check(namespaces: list[ManagedNamespace], metrics: DaemonMetrics, unclean: bool) -> dict[str, Any]:
    """Verify and repair; returns what ``/status`` shows under ``startup`` (with the reports)."""
    t0 = time.monotonic()
    reports: list[dict[str, Any]] = []
    for ns in namespaces:
        for plan, tier in ns.open_tiers():
            if not indexed(tier):
                continue
            try:
                verified = tier.verify(repair=True)
            except TierError as exc:
                report: dict[str, Any] = {"tier": plan.name, "ok": False, "problems": [str(exc)]}
                problems = 0
            except Exception as exc:  # this namespace's tier cannot be checked: out of service
                ns.mark_broken(plan, exc, "start-up check")
                report = {"tier": plan.name, "ok": False, "broken": True, "problems": [f"{type(exc).__name__}: {exc}"]}
                problems = 1
            else:
                report = verified.to_dict()
                problems = verified.bad_checksums + verified.missing_data
            report["namespace"] = ns.fingerprint
            reports.append(report)
            metrics.startup_problems.inc(problems)
    metrics.startup_repairs.inc()
    result = {"checked": True, "unclean_stop": unclean, "seconds": round(time.monotonic() - t0, 3), "reports": reports}
    log.info(
        "start-up check done: %d namespaces repaired",
        len(reports),
        extra={
            "event": "startup_check",
            "unclean_stop": unclean,
            "seconds": result["seconds"],
            "blocks_checked": sum(r.get("blocks_checked", 0) for r in reports),
            "bad_checksums": sum(r.get("bad_checksums", 0) for r in reports),
            "missing_data": sum(r.get("missing_data", 0) for r in reports),
        },
    )
    return result
