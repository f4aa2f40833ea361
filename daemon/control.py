"""Signals: SIGTERM/SIGINT drain and stop, SIGHUP reloads the config.

Handlers only set events; the main loop acts on them between steps (a move batch is at most
``move_batch`` bytes, so a stop waits for at most one batch). A stop also arms a watchdog: if
the loop has not finished draining after ``drain_timeout_s``, the process exits with status 3
(the tiers are crash-safe, so this loses nothing; the next start repairs).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType

log = logging.getLogger("kvstrata.daemon")

FORCED_EXIT = 3


class Control:
    def __init__(self, drain_timeout_s: float) -> None:
        self.stop = threading.Event()
        self.reload = threading.Event()
        self.wake = threading.Event()  # something to do now (a signal, an HTTP hint)
        self.drain_timeout_s = drain_timeout_s
        self._watchdog: threading.Timer | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        """Install the handlers (main thread only)."""
        for sig, handler in ((signal.SIGTERM, self._on_stop), (signal.SIGINT, self._on_stop)):
            self._previous[sig] = signal.signal(sig, handler)
        self._previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, self._on_hup)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()
        if self._watchdog is not None:
            self._watchdog.cancel()

    def request_stop(self, why: str = "requested") -> None:
        if self.stop.is_set():
            return
        log.info("stopping (%s): draining in-flight moves", why, extra={"event": "stopping", "why": why})
        self.stop.set()
        self.wake.set()
        self._watchdog = threading.Timer(self.drain_timeout_s, self._force_exit)
        self._watchdog.daemon = True
        self._watchdog.start()

    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        self.request_stop(signal.Signals(signum).name)

    def _on_hup(self, signum: int, frame: FrameType | None) -> None:
        self.reload.set()
        self.wake.set()

    def _force_exit(self) -> None:
        log.error(
            "drain did not finish within %.0f s: exiting now (the next start repairs)",
            self.drain_timeout_s,
            extra={"event": "forced_exit"},
        )
        logging.shutdown()
        os._exit(FORCED_EXIT)
