"""Structured logs of the daemon: one JSON object per line on stderr.

Every record has ``ts`` (UTC, ISO 8601), ``level``, ``logger`` and ``msg``; fields passed with
``extra={...}`` (``event``, ``namespace``, ``tier``, counts, bytes, seconds) become keys of their
own, so a log shipper can filter on them without parsing messages::

    {"ts": "2026-12-01T10:00:00.123+00:00", "level": "info", "logger": "kvstrata.daemon",
     "msg": "demoted 412 blocks", "event": "demote", "tier": "nvme", "blocks": 412, ...}
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, TextIO

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line (extra fields included)."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                data[key] = value
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str)


def setup_logging(level: str = "info", fmt: str = "json", stream: TextIO | None = None) -> logging.Handler:
    """Send every ``kvstrata.*`` logger to ``stream`` (stderr) as JSON lines (or plain text);
    returns the handler (call again to change level or format: the old handler is replaced)."""
    root = logging.getLogger("kvstrata")
    for old in [h for h in root.handlers if getattr(h, "_kvstrata_daemon", False)]:
        root.removeHandler(old)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler._kvstrata_daemon = True  # type: ignore[attr-defined]
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(level.upper())
    root.propagate = False
    return handler
