"""The daemon's HTTP API under hostile or broken clients, against the real server on 127.0.0.1
(a free port; in-process, so memory, threads and the hint queue can be looked at; the last test
runs ``kvstrata daemon`` as a process with a token and the CLI as its client).

Bounded requests (413/411, keys per hint, a full hint queue answers 503), read deadlines and a
connection cap (half-sent requests cannot hold threads), strict JSON (depth, NaN/Infinity),
hint times near the daemon's clock, ``Content-Type: application/json`` (415), every handler
failure a JSON 500 plus one log line, and the optional bearer token (401).
"""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_daemon_support import DaemonProcess, config_dict, kvstrata, store_chains, wait_for, write_config

from kvstrata.core.catalog import get_layout
from kvstrata.daemon.client import fetch_status, post_prefetch, token_for
from kvstrata.daemon.hints import HINTS_FILE, json_depth, loads_strict
from kvstrata.daemon.logs import setup_logging
from kvstrata.daemon.service import Daemon
from kvstrata.daemon.state import TOKEN_FILE, DaemonError

MiB = 1024**2
KEY = "ab" * 16


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def settings(tmp: Path, **daemon: Any) -> dict[str, Any]:
    return {
        "tiers": [{"name": "nvme", "capacity": "4MiB", "path": str(tmp / "nvme"), "direct_io": "off"}],
        "daemon": {"metrics_port": 0, "scrub_bytes_per_s": 0, **daemon},
    }


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """Start a daemon (state dir locked, namespaces opened, HTTP served) with these settings."""
    made: list[Daemon] = []

    def start(cfg: dict[str, Any] | None = None, **daemon: Any) -> Daemon:
        d = Daemon(cfg or settings(tmp_path, **daemon))
        made.append(d)
        d.state.acquire()
        d.open()
        try:
            d.start_http()
        except DaemonError:
            d.close()
            raise
        return d

    yield start
    for d in made:
        d.close()


def port(d: Daemon) -> int:
    assert d.http is not None
    return int(d.http.server.server_address[1])


def call(
    d: Daemon, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any], dict[str, str]]:
    """One request through http.client; (status, JSON answer, headers)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json"} if data is not None else {}
    hdrs.update(headers or {})
    conn = http.client.HTTPConnection("127.0.0.1", port(d), timeout=30)
    try:
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        raw = resp.read()
        head = {k.lower(): v for k, v in resp.getheaders()}
        answer = json.loads(raw) if head.get("content-type") == "application/json" else {"text": raw.decode()}
        return resp.status, answer, head
    finally:
        conn.close()


def raw(d: Daemon, data: bytes, timeout: float = 30) -> tuple[int, dict[str, Any]]:
    """Send bytes as they are, then read the answer until the server closes."""
    with socket.create_connection(("127.0.0.1", port(d)), timeout=timeout) as s:
        s.sendall(data)
        return parse_answer(read_all(s))


def read_all(s: socket.socket) -> bytes:
    chunks = []
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def parse_answer(data: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1."), data[:200]
    assert b"Content-Type: application/json" in head, head
    return int(head.split()[1]), json.loads(body)


def post_head(length: int, ctype: str = "application/json", extra: str = "") -> bytes:
    return (
        f"POST /prefetch HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\nContent-Length: {length}\r\n{extra}\r\n"
    ).encode()


def hint(n: int = 1, ns: str = "0123456789abcdef", **extra: Any) -> dict[str, Any]:
    return {"ns": ns, "keys": [f"{i:032x}" for i in range(n)], **extra}


def metric(d: Daemon, name: str, **labels: str) -> float:
    return d.metrics.total(name, **labels)


@pytest.fixture
def json_log() -> Iterator[io.StringIO]:
    """The daemon's JSON log lines, captured (the ``kvstrata`` logger restored afterwards)."""
    root = logging.getLogger("kvstrata")
    before = (list(root.handlers), root.level, root.propagate)
    buf = io.StringIO()
    setup_logging("info", "json", buf)
    yield buf
    root.handlers[:], root.level, root.propagate = before


# --------------------------------------------------------------------------- bounded requests
def test_oversize_body_is_refused_before_it_is_read(serve: Callable[..., Daemon]) -> None:
    d = serve()
    start = rss()
    chunk = b"[" + b"0," * 32767
    for _ in range(20):  # the audit: 20 bodies of 7.9 MiB grew the daemon by 537 MiB
        code, answer = raw(d, post_head(int(7.9 * MiB)) + chunk)
        assert code == 413 and "max_request_bytes = 1048576" in answer["error"], answer
    grown = rss() - start
    assert grown < 32 * MiB, f"the daemon grew by {grown / MiB:.0f} MiB"
    print(f"20 bodies of 7.9 MiB refused: RSS {grown / MiB:+.1f} MiB")
    assert d._posted.keys == 0 and metric(d, "kvstrata_daemon_http_requests_total", code="413") == 20

    # a client that sends the whole body at once still reads the 413 (the rest is drained, not kept)
    with socket.create_connection(("127.0.0.1", port(d)), timeout=30) as s:
        body = b" " * (8 * MiB)

        def send() -> None:
            with contextlib.suppress(OSError):  # the server closes once it has answered
                s.sendall(post_head(len(body)) + body)

        sender = threading.Thread(target=send)
        sender.start()
        code, answer = parse_answer(read_all(s))
        sender.join(30)
    assert code == 413
    assert rss() - start < 48 * MiB

    # the limit is configurable, and a body within it is read
    assert call(d, "POST", "/prefetch", hint(2))[0] == 202


def test_content_length_is_required_and_checked(serve: Callable[..., Daemon]) -> None:
    d = serve(max_request_bytes="4KiB")
    head = b"POST /prefetch HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    code, answer = raw(d, head + b"\r\n" + json.dumps(hint()).encode())
    assert code == 411 and "Content-Length required" in answer["error"]
    code, answer = raw(d, head + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
    assert code == 411 and "chunked" in answer["error"]
    assert raw(d, head + b"Content-Length: -5\r\n\r\n")[0] == 400
    assert raw(d, head + "Content-Length: ²\r\n\r\n".encode("latin-1"))[0] == 400  # a digit, but not an ASCII one
    assert raw(d, head + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\n")[0] == 400
    code, answer = raw(d, post_head(5000))
    assert code == 413 and "5000 bytes is over max_request_bytes = 4096" in answer["error"]
    assert call(d, "POST", "/prefetch", hint(10))[0] == 202
    assert raw(d, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (200 * 1024) + b"\r\n\r\n")[0] == 431
    many = b"".join(b"X-H%d: %s\r\n" % (i, b"a" * 30_000) for i in range(4))  # lines fine, 120 KB in all
    code, answer = raw(d, b"GET /healthz HTTP/1.1\r\n" + many + b"\r\n")
    assert code == 431 and "headers over 65536 bytes" in answer["error"]
    code, answer = raw(d, b"NONSENSE\r\n\r\n")
    assert code == 400 and "error" in answer  # the library's own refusals are JSON too


def test_too_many_keys_in_a_hint(serve: Callable[..., Daemon]) -> None:
    d = serve(max_hint_keys=100)
    code, answer, _ = call(d, "POST", "/prefetch", hint(101))
    assert code == 413 and answer["error"] == "hint has 101 keys; at most 100 per hint (max_hint_keys)"
    assert d._posted.keys == 0
    assert call(d, "POST", "/prefetch", hint(100))[:2] == (202, {"accepted": 100})
    code, answer, _ = call(d, "POST", "/prefetch", {"ns": "x" * 200, "keys": []})
    assert code == 400 and "namespace" in answer["error"]


def test_full_hint_queue_answers_503_and_memory_stays_bounded(serve: Callable[..., Daemon]) -> None:
    d = serve(max_hint_keys=100, hint_queue_keys=250)
    assert call(d, "POST", "/prefetch", hint(100))[0] == 202  # a hint costs its keys + 1
    assert call(d, "POST", "/prefetch", hint(100))[0] == 202
    code, answer, head = call(d, "POST", "/prefetch", hint(100))
    assert code == 503 and head["retry-after"] == "1" and answer["retry_after_s"] == 1
    assert "hint_queue_keys = 250" in answer["error"] and "202 of" in answer["error"]
    assert call(d, "POST", "/prefetch", hint(40))[0] == 202  # what still fits is taken
    assert d._posted.keys == 243 and metric(d, "kvstrata_daemon_hint_queue_keys") == 243
    assert metric(d, "kvstrata_daemon_hints_total", result="queue_full") == 1
    assert d.serve_hints() == 3  # the main loop drains it (unknown namespace: counted, not kept)
    assert d._posted.keys == 0 and call(d, "POST", "/prefetch", hint(100))[0] == 202


def test_queue_of_big_hints_stays_within_its_bound(serve: Callable[..., Daemon]) -> None:
    d = serve()  # defaults: 16384 keys per hint (0.55 MiB of JSON), 131072 queued keys (about 7.5 MiB)
    body = json.dumps(hint(16384)).encode()
    start = rss()
    codes = [call(d, "POST", "/prefetch", body)[0] for _ in range(30)]
    assert codes.count(202) == 7 and codes.count(503) == 23, codes
    assert d._posted.keys <= 131072
    grown = rss() - start
    assert grown < 64 * MiB, f"grew {grown / MiB:.0f} MiB"
    print(f"30 hints of 16384 keys: 7 queued, 23 answered 503; RSS {grown / MiB:+.1f} MiB")


# --------------------------------------------------------------------------- slow clients
def test_half_sent_requests_hold_neither_threads_nor_the_server(serve: Callable[..., Daemon]) -> None:
    d = serve(max_connections=8, request_timeout_s=1.0)
    before = threading.active_count()
    pieces = [b"", b"POST /prefetch HTTP/1.1\r\nContent-Le", post_head(100) + b'{"ns": "x",']
    socks = []
    peak = 0
    try:
        for i in range(300):
            s = socket.create_connection(("127.0.0.1", port(d)), timeout=30)
            s.sendall(pieces[i % 3])
            socks.append(s)
            peak = max(peak, threading.active_count())
        t0 = time.monotonic()
        got = None
        while got is None and time.monotonic() - t0 < 30:
            peak = max(peak, threading.active_count())
            try:
                code, answer, _ = call(d, "GET", "/healthz")
            except (ConnectionError, http.client.HTTPException):
                continue
            if code == 200:
                got = time.monotonic() - t0
            else:
                assert code == 503 and "max_connections" in answer["error"]
                time.sleep(0.05)
        assert got is not None, "a well-formed request never got through"
        assert got < 1.0 + 10, got  # the half-sent ones are dropped after request_timeout_s
        assert peak <= before + 8 + 1, (before, peak)  # one thread per served connection, 8 at most
        assert metric(d, "kvstrata_daemon_http_dropped_total", reason="busy") >= 250
        wait_for(lambda: metric(d, "kvstrata_daemon_http_dropped_total", reason="timeout") >= 8, 10, "timeouts")
    finally:
        for s in socks:
            s.close()
    print(f"300 half-sent connections: threads {before} -> at most {peak}; a good request got through in {got:.2f}s")


def test_a_trickling_client_is_cut_at_the_deadline(serve: Callable[..., Daemon]) -> None:
    d = serve(request_timeout_s=1.0)
    with socket.create_connection(("127.0.0.1", port(d)), timeout=30) as s:
        t0 = time.monotonic()
        request = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000
        try:
            for byte in request:  # each byte well within the timeout; the whole request is not
                s.sendall(bytes([byte]))
                time.sleep(0.1)
        except OSError:
            pass
        answer = read_all(s)
        cut = time.monotonic() - t0
    assert b" 408 " in answer.split(b"\r\n", 1)[0], answer[:100]
    assert cut < 10, cut
    assert metric(d, "kvstrata_daemon_http_dropped_total", reason="timeout") == 1


# --------------------------------------------------------------------------- strict JSON and hint times
def test_deep_json_is_refused_before_parsing(serve: Callable[..., Daemon]) -> None:
    d = serve()
    for body in (b"[" * 200_000 + b"]" * 200_000, b'{"ns": "x", "keys": ' + b"[" * 50_000, b"{" * 9 + b"}" * 9):
        code, answer, _ = call(d, "POST", "/prefetch", body)
        assert code == 400 and "nested" in answer["error"], answer
    assert call(d, "GET", "/healthz")[0] == 200  # and the server still answers
    code, answer, _ = call(d, "POST", "/prefetch", {"ns": "[[[[[[[[[[{{{{{{{{{{", "keys": [KEY]})
    assert code == 202  # brackets inside strings do not nest
    code, answer, _ = call(d, "POST", "/prefetch", b"[" + b"[]," * 100_000 + b"[]]")  # flat, but 100,001 lists
    assert code == 400 and "JSON with 100002 arrays and objects (at most 64)" in answer["error"]
    assert json_depth(b'[{"a": "]]]]"}, [[]]]') == 3
    with pytest.raises(ValueError, match="nested 9 levels deep"):
        loads_strict(b"[" * 9 + b"]" * 9)
    assert loads_strict(b'{"a": [1, {"b": "[[[[[[[[[["}], "c": 2.5}') == {"a": [1, {"b": "[[[[[[[[[["}], "c": 2.5}


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b'{"ns": "x", "keys": [], "t": Infinity}', "Infinity is not a number here"),
        (b'{"ns": "x", "keys": [], "t": -Infinity}', "-Infinity is not a number here"),
        (b'{"ns": "x", "keys": [], "t": NaN}', "NaN is not a number here"),
        (b'{"ns": "x", "keys": [], "t": 1e999}', "number 1e999 is out of range"),
        (b'{"ns": "x", "keys": [], "t": "soon"}', "'t' must be a unix time in seconds, got \"soon\""),
        (b'{"ns": "x", "keys": [], "t": true}', "'t' must be a unix time in seconds, got true"),
        (b'{"ns": "x", "keys": [], "t": 99999999999}', "s ahead of the daemon's clock (at most hint_clock_skew_s"),
    ],
)
def test_non_finite_and_far_hint_times_are_refused(serve: Callable[..., Daemon], body: bytes, needle: str) -> None:
    d = serve()
    code, answer, _ = call(d, "POST", "/prefetch", body)
    assert code == 400 and needle in answer["error"], answer
    assert d._posted.keys == 0


def test_hint_times_stay_near_the_daemons_clock(tmp_path: Path, serve: Callable[..., Daemon]) -> None:
    layout = get_layout("tiny")
    cfg = settings(tmp_path, hint_ttl_s=600, hint_clock_skew_s=3600)
    (keys,) = store_chains(cfg, layout, chains=1, blocks=2)
    d = serve(cfg)
    fp = next(iter(d.namespaces))
    now = time.time()
    code, answer, _ = call(d, "POST", "/prefetch", {"ns": fp, "keys": [keys[0].hex()], "t": now + 7200})
    assert code == 400 and "t' = " in answer["error"] and "7200 s ahead" in answer["error"]
    code, answer, _ = call(d, "POST", "/prefetch", {"ns": fp, "keys": [keys[0].hex()], "t": now - 7200})
    assert code == 400 and "7200 s behind" in answer["error"]
    assert call(d, "POST", "/prefetch", {"ns": fp, "keys": [k.hex() for k in keys], "t": now + 3000})[0] == 202
    d.serve_hints()
    until = max(d.shields.until(fp, k) for k in keys)
    assert until <= time.time() + 600 + 1  # a hint "from the future" protects no longer than hint_ttl_s
    assert d.is_protected(fp, keys[0]) and metric(d, "kvstrata_daemon_protected_keys") == 2

    # the hint file holds the same rules: a line from the far future, or with Infinity, is skipped
    lines = [
        json.dumps({"ns": fp, "keys": [keys[1].hex()], "t": now + 10**6}),
        json.dumps({"ns": fp, "keys": []})[:-1] + ', "t": Infinity}',
        json.dumps({"ns": fp, "keys": [keys[1].hex()]}),
    ]
    (d.state.path / HINTS_FILE).write_text("\n".join(lines) + "\n")
    bad = d.hints.bad_lines
    assert d.serve_hints() == 1 and d.hints.bad_lines == bad + 2


def test_protection_is_capped(tmp_path: Path, serve: Callable[..., Daemon]) -> None:
    layout = get_layout("tiny")
    cfg = settings(tmp_path, max_protected_keys=4)
    (keys,) = store_chains(cfg, layout, chains=1, blocks=6)
    d = serve(cfg)
    fp = next(iter(d.namespaces))
    assert call(d, "POST", "/prefetch", {"ns": fp, "keys": [k.hex() for k in keys]})[0] == 202
    d.serve_hints()
    assert len(d.shields) == 4 and metric(d, "kvstrata_daemon_protection_evicted_total") == 2
    assert not d.is_protected(fp, keys[0]) and d.is_protected(fp, keys[5])  # the oldest went first


def test_the_hint_file_is_read_in_bounded_parts(tmp_path: Path, serve: Callable[..., Daemon]) -> None:
    d = serve()
    d.hints.max_read = 64 * 1024
    line = json.dumps(hint(8)) + "\n"
    (d.state.path / HINTS_FILE).write_text(line * 2000)  # ~0.6 MiB backlog
    got = d.hints.poll()
    assert 0 < len(got) <= 64 * 1024 // len(line) and d.hints.bad_lines == 0  # its newest whole lines
    assert d.hints.skipped_bytes == (2000 - len(got)) * len(line)


# --------------------------------------------------------------------------- content type, errors
@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", ""])
def test_post_needs_json_content_type(serve: Callable[..., Daemon], ctype: str) -> None:
    d = serve()
    code, answer, _ = call(d, "POST", "/prefetch", json.dumps(hint()).encode(), {"Content-Type": ctype})
    assert code == 415 and "Content-Type: application/json" in answer["error"]
    assert d._posted.keys == 0
    code, _, _ = call(d, "POST", "/prefetch", hint(), {"Content-Type": "application/json; charset=utf-8"})
    assert code == 202


def test_a_browser_preflight_gets_no_cors_grant(serve: Callable[..., Daemon]) -> None:
    d = serve()
    code, answer, head = call(d, "OPTIONS", "/prefetch", headers={"Origin": "http://evil.example"})
    assert code == 501 and "access-control-allow-origin" not in head and "error" in answer


def test_handler_exception_is_a_500_and_one_log_line(
    serve: Callable[..., Daemon], json_log: io.StringIO, capfd: pytest.CaptureFixture[str]
) -> None:
    d = serve()

    def boom() -> dict[str, Any]:
        raise RuntimeError("status exploded")

    d.status = boom  # type: ignore[method-assign]
    mark = len(json_log.getvalue().splitlines())
    code, answer, _ = call(d, "GET", "/status")
    assert code == 500 and "internal error (request 1)" in answer["error"]
    assert "exploded" not in answer["error"]  # the details go to the log, not to the client
    lines = [json.loads(x) for x in json_log.getvalue().splitlines()[mark:]]
    errors = [e for e in lines if e.get("event") == "http_error"]
    assert len(errors) == 1, lines
    (e,) = errors
    assert e["level"] == "error" and e["request_id"] == 1 and e["path"] == "/status"
    assert "RuntimeError: status exploded" in e["exc"]
    assert metric(d, "kvstrata_daemon_errors_total", where="http") == 1

    d.prefetch = lambda body: 1 / 0  # type: ignore[method-assign, assignment, misc, return-value]
    code, answer, _ = call(d, "POST", "/prefetch", hint())
    assert code == 500 and "request 2" in answer["error"]
    assert call(d, "GET", "/healthz")[0] == 200  # the server answers on
    assert "Traceback" not in capfd.readouterr().err  # nothing dumped to stderr per request


# --------------------------------------------------------------------------- the token
def test_bearer_token(tmp_path: Path, serve: Callable[..., Daemon]) -> None:
    d = serve(auth="token")
    path = d.state.path / TOKEN_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    token = path.read_text().strip()
    assert len(token) >= 32
    good = {"Authorization": f"Bearer {token}"}
    for headers in ({}, {"Authorization": "Bearer wrong-token-of-some-length"}, {"Authorization": token}):
        code, answer, head = call(d, "GET", "/status", headers=headers)
        assert code == 401 and head["www-authenticate"].startswith("Bearer") and "token" in answer["error"]
        assert call(d, "POST", "/prefetch", hint(), headers)[0] == 401
    code, _ = raw(d, post_head(int(7.9 * MiB)))  # checked before the body: 401, not 413
    assert code == 401
    assert call(d, "GET", "/status", headers=good)[0] == 200
    assert call(d, "POST", "/prefetch", hint(ns="a" * 16), good)[0] == 202
    assert call(d, "GET", "/healthz")[0] == 200  # liveness probes need no token
    code, metrics, _ = call(d, "GET", "/metrics")
    assert code == 200 and f"{0:032x}" not in metrics["text"]  # no block keys in /metrics
    assert metric(d, "kvstrata_daemon_http_requests_total", code="401") == 7

    # the client side: the token is read from the config's token file
    cfg = d.config
    assert token_for(cfg) == token
    assert fetch_status(d.http.url, token=token_for(cfg))["state"] == "running"  # type: ignore[union-attr]
    assert post_prefetch(d.http.url, "b" * 16, [bytes(16)], token=token)["accepted"] == 1  # type: ignore[union-attr]
    with pytest.raises(DaemonError, match="HTTP 401, the daemon wants its API token"):
        fetch_status(d.http.url)  # type: ignore[union-attr]
    d.close()

    d2 = serve(auth="token", auth_metrics=True)  # the same file is used again
    assert call(d2, "GET", "/status", headers=good)[0] == 200
    assert call(d2, "GET", "/metrics")[0] == 401 and call(d2, "GET", "/metrics", headers=good)[0] == 200
    d2.close()

    os.chmod(path, 0o644)
    with pytest.raises(DaemonError, match=r"has mode 0644: others can read or change it; chmod 600"):
        serve(auth="token")
    other = tmp_path / "token"
    other.write_text("short\n")
    other.chmod(0o600)
    with pytest.raises(DaemonError, match="at least 16 printable ASCII characters"):
        serve(auth="token", token_file=str(other))


def test_limits_follow_a_reload(tmp_path: Path, serve: Callable[..., Daemon], json_log: io.StringIO) -> None:
    cfg_path = write_config(tmp_path / "kv.toml", tmp_path, max_request_bytes="4KiB", max_connections=4)
    d = serve(str(cfg_path))
    assert raw(d, post_head(5000))[0] == 413
    cfg_path.write_text(
        cfg_path.read_text().replace('"4KiB"', '"8KiB"').replace("max_connections = 4", "max_connections = 8")
    )
    assert d.reload()
    assert d.http is not None and d.http.limits.max_request_bytes == 8192 and d.http.limits.max_connections == 4
    body = json.dumps(hint(170)).encode()
    assert 4096 < len(body) < 8192 and call(d, "POST", "/prefetch", body)[0] == 202
    assert "daemon.max_connections changed: takes effect at the next start" in json_log.getvalue()


@pytest.mark.slow
def test_daemon_process_with_a_token_and_the_cli(tmp_path: Path) -> None:
    cfg_path = write_config(tmp_path / "kv.toml", tmp_path, auth="token", max_hint_keys=4)
    layout = get_layout("tiny")
    store_chains(config_dict(tmp_path), layout, chains=1, blocks=4, seed=3)
    d = DaemonProcess(cfg_path, tmp_path).start()
    try:
        url = d.wait_ready()
        assert d.get("/status")[0] == 401 and d.get("/healthz")[0] == 200
        res = kvstrata("status", "--config", str(cfg_path), "--json", "-")
        assert res.returncode == 0 and json.loads(res.stdout)["state"] == "running", res.stderr
        fp = json.loads(res.stdout)["namespaces"][0]["namespace"]
        res = kvstrata("prefetch", "--config", str(cfg_path), "--namespace", fp, "--url", url, "00" * 16)
        assert res.returncode == 0, res.stderr
        res = kvstrata("prefetch", "--config", str(cfg_path), "--namespace", fp, "--url", url, *["00" * 16] * 5)
        assert res.returncode != 0 and "at most 4 per hint (max_hint_keys)" in " ".join(res.stderr.split())
        res = kvstrata("status", "--url", url)  # no config: no token
        assert res.returncode != 0 and "HTTP 401" in res.stderr and "Traceback" not in res.stderr, res.stderr
        rc, _ = d.stop()
        assert rc == 0
    finally:
        d.kill()
    events = d.events()
    assert any(e.get("event") == "auth" for e in events)
    assert not any(e.get("event") == "http_error" for e in events)
