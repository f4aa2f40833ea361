"""The tier-migration daemon (``kvstrata daemon``): one long-running process per node that keeps
the persistent tiers healthy while inference processes do only fast work.

It moves cold blocks down when a tier passes its high watermark (:mod:`.watermarks`), brings a
session's blocks back up when hinted (:mod:`.hints`, :mod:`.promote`), scrubs checksums within an
I/O budget (:mod:`.scrub`), compacts NVMe segments, runs the fs tier's TTL and garbage
collection, repairs after an unclean stop, holds the node's Mooncake pool segment, and serves
``/metrics``, ``/healthz``, ``/status`` and ``POST /prefetch`` (:mod:`.http`). The main loop is
:mod:`.service`; signals are :mod:`.control`; the state directory is :mod:`.state`.
"""

from __future__ import annotations

from .hints import append_hint, hint_slow_hits
from .state import DaemonError, state_dir_for

__all__ = ["DaemonError", "append_hint", "hint_slow_hits", "state_dir_for"]
