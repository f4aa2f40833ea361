"""The daemon's HTTP endpoints (bound to ``metrics_host``, 127.0.0.1 unless configured).

``GET /metrics``   Prometheus text format (:mod:`kvstrata.daemon.metrics`); no block keys in it
``GET /healthz``   200 ``{"status": "ok"}`` while serving; 503 while starting (start-up check
                   running) or draining (SIGTERM received); never needs the token
``GET /status``    what the daemon is doing, as JSON (``kvstrata status`` prints it)
``POST /prefetch`` a promotion hint ``{"ns": ..., "keys": [hex, ...], "t": unix time}``
                   (``Content-Type: application/json``); 202 once queued, 503 + ``Retry-After``
                   while the hint queue is full

What one caller can cost the daemon is bounded (README "Daemon API"):

* one request per connection (HTTP/1.0), received in full within ``request_timeout_s`` or
  dropped (408): the deadline covers the whole request, so a client trickling a byte at a time
  cannot hold a connection longer;
* at most ``max_connections`` connections are served at once, each on its own thread; one
  more is answered 503 at once by the accepting thread and closed (no thread for it);
* headers at most :data:`MAX_HEADER_BYTES` (431), a body only with ``Content-Length`` (411)
  and at most ``max_request_bytes`` (413, refused before it is read); at most
  :data:`PARSE_SLOTS` bodies are parsed at once;
* JSON nested at most :data:`~kvstrata.daemon.hints.MAX_JSON_DEPTH` deep, without NaN or
  Infinity (400), checked before the parser sees it;
* with a token (``auth = "token"``), ``/status`` and ``POST /prefetch`` (and ``/metrics`` with
  ``auth_metrics``) need ``Authorization: Bearer <token>`` (401 otherwise; compared in constant
  time), checked before a body is read.

Every answer is JSON (the library's own refusals too). A handler that raises answers 500 with a
request id and logs one line (with the traceback) naming it; refusals are counted in
``kvstrata_daemon_http_requests_total{code}`` / ``kvstrata_daemon_http_dropped_total{reason}``
and warned about at most once a minute per kind, never once per request.
"""

from __future__ import annotations

import contextlib
import hmac
import io
import ipaddress
import itertools
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NoReturn, Protocol

from prometheus_client import CONTENT_TYPE_LATEST

from kvstrata.config import DaemonConfig, KVStrataConfig

from .hints import loads_strict
from .metrics import DaemonMetrics
from .state import DaemonError, ensure_token, token_path

log = logging.getLogger("kvstrata.daemon.http")

MAX_HEADER_BYTES = 64 * 1024  # request line and headers
PARSE_SLOTS = 2  # bodies parsed at once (parsing is CPU-bound; more would only add memory)
LISTEN_BACKLOG = 128
LINGER_S = 1.0  # after refusing an unread body: how long its bytes are drained, so the client sees the answer
LINGER_BYTES = 4 * 1024**2
WARN_EVERY_S = 60.0
_READ_AHEAD = 8192  # the request reader's buffer

GET_PATHS = ("/metrics", "/healthz", "/status")
POST_PATHS = ("/prefetch",)


@dataclass(frozen=True)
class Limits:
    """What one request may cost (``[daemon]`` settings of the same names)."""

    max_request_bytes: int = 1024**2
    request_timeout_s: float = 5.0
    max_connections: int = 16

    @classmethod
    def of(cls, d: DaemonConfig, max_connections: int | None = None) -> Limits:
        return cls(d.max_request_bytes, d.request_timeout_s, max_connections or d.max_connections)


class Handlers(Protocol):
    def metrics_text(self) -> bytes: ...
    def health(self) -> tuple[int, dict[str, Any]]: ...
    def status(self) -> dict[str, Any]: ...
    def prefetch(self, body: Any) -> tuple[int, dict[str, Any]]: ...


def open_api(config: KVStrataConfig, state_dir: Path, handlers: Handlers, metrics: DaemonMetrics) -> DaemonHTTP:
    """The daemon's API as ``[daemon]`` configures it. With ``auth = "token"`` the token file is
    made first if there is none (``DaemonError``, exit status 2, naming it when it cannot be used)."""
    d = config.daemon
    token = None
    if d.auth == "token":
        path = token_path(config)
        if not d.token_file:
            state_dir.mkdir(parents=True, exist_ok=True)
        token = ensure_token(path)
        log.info("HTTP API needs the bearer token in %s", path, extra={"event": "auth", "token_file": str(path)})
    elif not _loopback(d.metrics_host):
        log.warning(
            'HTTP API on %s without auth: anyone who reaches the port can read /status and post hints (auth = "token")',
            d.metrics_host,
            extra={"event": "auth_off"},
        )
    return DaemonHTTP(
        d.metrics_host,
        d.metrics_port,
        handlers,
        limits=Limits.of(d),
        token=token,
        auth_metrics=d.auth_metrics,
        metrics=metrics,
    )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class DaemonHTTP:
    """The HTTP API on a thread of its own. ``limits`` may be replaced while it runs (SIGHUP);
    ``max_connections`` and the token are read once, at start."""

    def __init__(
        self,
        host: str,
        port: int,
        handlers: Handlers,
        *,
        limits: Limits | None = None,
        token: str | None = None,
        auth_metrics: bool = False,
        metrics: DaemonMetrics | None = None,
    ) -> None:
        self.handlers = handlers
        self.limits = limits or Limits()
        self.token = token.encode() if token else None
        self.open_paths = frozenset({"/healthz"} if auth_metrics else {"/healthz", "/metrics"})
        self.metrics = metrics or DaemonMetrics()
        self.parse_slots = threading.BoundedSemaphore(PARSE_SLOTS)
        self._ids = itertools.count(1)
        self._warned: dict[str, tuple[float, int]] = {}
        self._warn_lock = threading.Lock()
        try:
            self.server = _Server((host, port), _handler_class(self), self)
        except OSError as exc:
            raise DaemonError(f"cannot listen on {host}:{port} for /metrics: {exc.strerror or exc}") from None
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

    def next_id(self) -> int:
        return next(self._ids)

    def refused(self, kind: str, message: str, **extra: Any) -> None:
        """A refusal: counted by the caller; a warning at most once a minute per kind."""
        log.debug("http: %s", message, extra={"event": f"http_{kind}", **extra})
        now = time.monotonic()
        with self._warn_lock:
            last, count = self._warned.get(kind, (-WARN_EVERY_S, 0))
            count += 1
            if now - last < WARN_EVERY_S:
                self._warned[kind] = (last, count)
                return
            self._warned[kind] = (now, 0)
        log.warning(
            "http: %s (%d such in the last minute; warned at most once a minute)",
            message,
            count,
            extra={"event": f"http_{kind}", "count": count, **extra},
        )

    def dropped(self, reason: str, message: str) -> None:
        self.metrics.http_dropped.labels(reason).inc()
        self.refused(reason, message)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], http: DaemonHTTP) -> None:
        self.http = http
        self.max_connections = http.limits.max_connections
        self.slots = threading.BoundedSemaphore(self.max_connections)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        """One thread per connection, at most ``max_connections`` of them; one more is answered
        503 here, on the accepting thread, without reading it."""
        if not self.slots.acquire(blocking=False):
            self.http.dropped("busy", f"all {self.max_connections} connections (max_connections) busy: answered 503")
            _refuse_busy(request, self.max_connections)
            self.shutdown_request(request)
            return
        self.http.metrics.http_connections.inc()
        try:
            threading.Thread(
                target=self._serve_one, args=(request, client_address), name="kvstrata-http-conn", daemon=True
            ).start()
        except RuntimeError:  # cannot start a thread: refuse like a full house
            self._done(request)
            _refuse_busy(request, self.max_connections)

    def _serve_one(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self._done(request)

    def _done(self, request: Any) -> None:
        self.shutdown_request(request)
        self.http.metrics.http_connections.dec()
        self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """The last resort (the handler catches everything itself): one log line, no stderr dump."""
        self.http.metrics.errors.labels("http").inc()
        log.error("HTTP connection from %s failed", client_address, exc_info=True, extra={"event": "http_error"})


def _refuse_busy(request: socket.socket, max_connections: int) -> None:
    body = json.dumps(
        {"error": f"all {max_connections} connections (max_connections) are busy; retry shortly", "retry_after_s": 1}
    ).encode()
    head = (
        "HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
        f"Connection: close\r\nContent-Length: {len(body) + 1}\r\n\r\n"
    )
    with contextlib.suppress(OSError):
        request.setblocking(False)
        with contextlib.suppress(OSError):
            request.recv(65536)  # what it sent already: closing with unread bytes would reset the answer
        request.send(head.encode() + body + b"\n")


class _Deadline(Exception):
    """The request was not received in full within ``request_timeout_s``."""


class _TooMuch(Exception):
    """The request line and headers are over :data:`MAX_HEADER_BYTES`."""


class _ClientGone(Exception):
    """The client closed or reset the connection, or stopped reading the answer."""


class _RequestReader(io.RawIOBase):
    """The socket, read against one deadline for the whole request and a byte budget."""

    def __init__(self, sock: socket.socket, deadline: float, budget: int) -> None:
        self.sock = sock
        self.deadline = deadline
        self.budget = budget  # raised to admit a body once its Content-Length is accepted
        self.count = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        room = self.budget - self.count
        if room <= 0:
            raise _TooMuch
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise _Deadline
        self.sock.settimeout(left)
        try:
            n = self.sock.recv_into(buffer, min(len(buffer), room))
        except TimeoutError:
            raise _Deadline from None
        except OSError as exc:
            raise _ClientGone from exc
        self.count += n
        return n


class _Replied(Exception):
    """An answer was sent (a refusal); the handler is done."""


def _handler_class(http: DaemonHTTP) -> type[BaseHTTPRequestHandler]:
    handlers = http.handlers
    metrics = http.metrics

    class Handler(BaseHTTPRequestHandler):
        server_version = "kvstrata-daemon"
        sys_version = ""
        protocol_version = "HTTP/1.0"  # one request per connection: the deadline bounds a connection

        def setup(self) -> None:
            super().setup()
            self.limits = http.limits
            self.requestline, self.request_version, self.command, self.path = "", "HTTP/1.0", "", ""
            self.responded = False
            self.linger = False
            self.reader = _RequestReader(
                self.connection, time.monotonic() + self.limits.request_timeout_s, MAX_HEADER_BYTES + _READ_AHEAD
            )
            self.rfile.close()  # the plain socket file: replaced by the bounded reader
            self.rfile = io.BufferedReader(self.reader, _READ_AHEAD)

        def handle(self) -> None:
            self.close_connection = True
            try:
                self.handle_one_request()
            except _Deadline:
                metrics.http_dropped.labels("timeout").inc()
                limit = self.limits.request_timeout_s
                http.refused("timeout", f"a request was not received within request_timeout_s = {limit:g}")
                self._last_word(408, f"request not received within {self.limits.request_timeout_s:g} s")
            except _TooMuch:
                metrics.http_dropped.labels("headers_too_large").inc()
                self._last_word(431, f"request line and headers over {MAX_HEADER_BYTES} bytes")
                self.linger = True  # it may still be sending them
            except _ClientGone:
                metrics.http_dropped.labels("client_gone").inc()
            except Exception as exc:  # pragma: no cover - _dispatch answers its own failures
                self._internal(exc)
            finally:
                if self.linger:
                    self._drain()

        # ---------------------------------------------------------------- dispatch
        def do_GET(self) -> None:
            self._dispatch()

        def do_POST(self) -> None:
            self._dispatch()

        def _dispatch(self) -> None:
            path = self.path.split("?", 1)[0]
            try:
                if self.command == "POST":
                    self.linger = True  # until its body is read
                if self.command == "GET" and path not in GET_PATHS:
                    self._json(404, {"error": f"no such endpoint {path}; try /metrics, /healthz, /status"})
                elif self.command == "POST" and path not in POST_PATHS:
                    self._json(404, {"error": f"no such endpoint {path}; POST /prefetch"})
                elif self._authorized(path):
                    if path == "/metrics":
                        self._send(200, handlers.metrics_text(), CONTENT_TYPE_LATEST)
                    elif path == "/healthz":
                        self._json(*handlers.health())
                    elif path == "/status":
                        self._json(200, handlers.status())
                    else:
                        data = self._body()
                        with http.parse_slots:
                            try:
                                body = loads_strict(data)
                            except ValueError as exc:
                                self._refuse(400, f"bad JSON: {exc}", "bad_json")
                            code, reply = handlers.prefetch(body)
                        self._json(code, reply)
            except _Replied:
                pass
            except (_Deadline, _TooMuch, _ClientGone):
                raise
            except Exception as exc:
                self._internal(exc, path)

        def _authorized(self, path: str) -> bool:
            if http.token is None or path in http.open_paths:
                return True
            scheme, _, credential = self.headers.get("Authorization", "").strip().partition(" ")
            given = credential.strip().encode("latin-1", "replace")
            if scheme.lower() == "bearer" and hmac.compare_digest(given, http.token):
                return True
            why = "without a bearer token" if not credential else "with a wrong bearer token"
            self._refuse(
                401,
                f"{self.command} {path} needs `Authorization: Bearer <token>` (the daemon's token_file)",
                "unauthorized",
                log_message=f"{self.command} {path} {why} from {self.client_address[0]}: answered 401",
                headers={"WWW-Authenticate": 'Bearer realm="kvstrata-daemon"'},
            )

        def _body(self) -> bytes:
            """The POST body, within the limits (or a refusal)."""
            limit = self.limits.max_request_bytes
            ctype = self.headers.get("Content-Type", "")
            if ctype.split(";", 1)[0].strip().lower() != "application/json":
                self._refuse(415, f"POST {self.path} takes Content-Type: application/json, not {ctype[:60]!r}")
            if self.headers.get("Transfer-Encoding"):
                self._refuse(411, "send the body with a Content-Length (chunked bodies are not accepted)")
            lengths = self.headers.get_all("Content-Length") or []
            if not lengths:
                self._refuse(411, f"Content-Length required (a body of at most {limit} bytes)")
            text = lengths[0].strip()
            if len(set(lengths)) > 1 or not (text.isascii() and text.isdigit()) or len(text) > 18:
                self._refuse(400, f"bad Content-Length {', '.join(lengths)[:60]!r}")
            length = int(text)
            if length > limit:
                self._refuse(413, f"request body of {length} bytes is over max_request_bytes = {limit}", "too_large")
            if length == 0:
                self._refuse(400, "expected a JSON body")
            self.reader.budget = MAX_HEADER_BYTES + _READ_AHEAD + length
            data = self.rfile.read(length)
            if len(data) < length:
                raise _ClientGone
            self.linger = False
            return data

        # ---------------------------------------------------------------- answers
        def _refuse(
            self,
            code: int,
            message: str,
            kind: str = "refused",
            *,
            log_message: str | None = None,
            headers: dict[str, str] | None = None,
        ) -> NoReturn:
            http.refused(kind, log_message or f"{self.command} {self.path}: {code} {message}", code=code)
            self._json(code, {"error": message}, headers)
            raise _Replied

        def _internal(self, exc: BaseException, path: str | None = None) -> None:
            rid = http.next_id()
            metrics.errors.labels("http").inc()
            log.error(
                "%s %s failed (request %d): %s: %s",
                self.command,
                path or self.path,
                rid,
                type(exc).__name__,
                exc,
                exc_info=exc,
                extra={"event": "http_error", "request_id": rid, "method": self.command, "path": path or self.path},
            )
            if not self.responded:
                with contextlib.suppress(_ClientGone):
                    self._json(500, {"error": f"internal error (request {rid}); the daemon's log has the details"})

        def _last_word(self, code: int, message: str) -> None:
            """An answer to a request that cannot finish (best effort: the client may be gone)."""
            if self.responded:
                return
            with contextlib.suppress(_ClientGone, OSError):
                self.connection.settimeout(min(1.0, self.limits.request_timeout_s))
                self._json(code, {"error": message})

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            """The library's own refusals (bad request line, 414, 431, 501, ...): JSON too."""
            text = message or self.responses.get(code, ("error",))[0]
            if self.request_version == "HTTP/0.9":  # a request line it could not parse: answer with a status line
                self.request_version = "HTTP/1.0"
            metrics.http_dropped.labels("malformed").inc()
            http.refused("malformed", f"malformed request: {code} {text}", code=code)
            with contextlib.suppress(_ClientGone):
                self._json(code, {"error": text})

        def _json(self, code: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
            extra = dict(headers or {})
            if code == 503 and "retry_after_s" in body:
                extra["Retry-After"] = str(max(1, round(float(body["retry_after_s"]))))
            self._send(code, (json.dumps(body, default=str) + "\n").encode(), "application/json", extra)

        def _send(self, code: int, data: bytes, ctype: str, headers: dict[str, str] | None = None) -> None:
            try:
                self.connection.settimeout(self.limits.request_timeout_s)
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Connection", "close")
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)
            except OSError as exc:
                raise _ClientGone from exc
            self.responded = True
            metrics.http_requests.labels(str(code)).inc()

        def _drain(self) -> None:
            """Read (and drop) what the client still sends for a little while, so that closing
            with unread bytes does not reset the connection before it reads the answer."""
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_WR)
                end, got = time.monotonic() + LINGER_S, 0
                while got < LINGER_BYTES and (left := end - time.monotonic()) > 0:
                    self.connection.settimeout(left)
                    n = len(self.connection.recv(65536))
                    if not n:
                        break
                    got += n

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("http: " + format, *args)

    return Handler
