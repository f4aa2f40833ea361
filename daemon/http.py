"""The daemon's HTTP endpoints (bound to ``metrics_host``, 127.0.0.1 unless configured).

``GET /metrics``   Prometheus text format (:mod:`kvstrata.daemon.metrics`)
``GET /healthz``   200 ``{"status": "ok"}`` while serving; 503 while starting (start-up check
                   running) or draining (SIGTERM received)
``GET /status``    what the daemon is doing, as JSON (``kvstrata status`` prints it)
``POST /prefetch`` a promotion hint ``{"ns": ..., "keys": [hex, ...]}``; 202 once queued
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST

from .state import DaemonError

log = logging.getLogger("kvstrata.daemon.http")

MAX_BODY = 64 * 1024**2


class Handlers(Protocol):
    def metrics_text(self) -> bytes: ...
    def health(self) -> tuple[int, dict[str, Any]]: ...
    def status(self) -> dict[str, Any]: ...
    def prefetch(self, body: Any) -> tuple[int, dict[str, Any]]: ...


class DaemonHTTP:
    def __init__(self, host: str, port: int, handlers: Handlers) -> None:
        self.handlers = handlers
        try:
            self.server = ThreadingHTTPServer((host, port), _handler_class(handlers))
        except OSError as exc:
            raise DaemonError(f"cannot listen on {host}:{port} for /metrics: {exc.strerror or exc}") from None
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, name="kvstrata-http", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        text = host.decode() if isinstance(host, bytes) else str(host)
        shown = f"[{text}]" if ":" in text else text
        return f"http://{shown}:{port}"

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _handler_class(handlers: Handlers) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "kvstrata-daemon"

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            try:
                if path == "/metrics":
                    self._send(200, handlers.metrics_text(), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    code, body = handlers.health()
                    self._json(code, body)
                elif path == "/status":
                    self._json(200, handlers.status())
                else:
                    self._json(404, {"error": f"no such endpoint {path}; try /metrics, /healthz, /status"})
            except Exception as exc:  # never kill the server thread
                log.exception("GET %s failed", path)
                self._json(500, {"error": str(exc)})

        def do_POST(self) -> None:
            path = self.path.split("?", 1)[0]
            if path != "/prefetch":
                self._json(404, {"error": f"no such endpoint {path}; POST /prefetch"})
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
                if not 0 < length <= MAX_BODY:
                    self._json(400, {"error": "expected a JSON body"})
                    return
                body = json.loads(self.rfile.read(length))
            except ValueError as exc:
                self._json(400, {"error": f"bad JSON: {exc}"})
                return
            code, reply = handlers.prefetch(body)
            self._json(code, reply)

        def _json(self, code: int, body: dict[str, Any]) -> None:
            self._send(code, (json.dumps(body, default=str) + "\n").encode(), "application/json")

        def _send(self, code: int, data: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("http: " + format, *args)

    return Handler
