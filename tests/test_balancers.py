"""The serve experiment's load balancers, for real: HAProxy and nginx (when installed) in front of
two small HTTP backends on 127.0.0.1. Round-robin spreads requests over both; sticky sends every
request of a session to one backend and different sessions to both; a streamed response passes
through as it is produced (its first chunk arrives long before its last is sent)."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvstrata.servers import LOOPBACK, free_ports
from kvstrata.workload.balancers import BALANCERS, Balancer, nginx_config
from kvstrata.workload.serve_procs import SESSION_HEADER, ServeExperimentError

CHUNK_PAUSE_S = 0.4


def _installed(kind: str) -> bool:
    try:
        Balancer(kind)
    except ServeExperimentError:
        return False
    return True


class _Backend(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go in two writes: no delayed-ACK stalls
    name = "?"

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        if self.path == "/stream":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(3):
                data = f"{self.name}:{i}\n".encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()
                time.sleep(CHUNK_PAUSE_S)
            self.wfile.write(b"0\r\n\r\n")
            return
        body = json.dumps({"backend": self.name, "session": self.headers.get(SESSION_HEADER)}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def backends() -> Iterator[list[int]]:
    servers = []
    ports = free_ports(2)
    for i, port in enumerate(ports):
        handler = type(f"Backend{i}", (_Backend,), {"name": f"b{i}"})
        srv = ThreadingHTTPServer((LOOPBACK, port), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
    yield ports
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def _get(port: int, path: str, session: str | None = None) -> dict[str, str]:
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=30)  # a new connection each time, as aiperf's streams
    try:
        conn.request("GET", path, headers={SESSION_HEADER: session} if session else {})
        resp = conn.getresponse()
        assert resp.status == 200, resp.status
        return dict(json.loads(resp.read()))
    finally:
        conn.close()


@pytest.mark.parametrize("kind", BALANCERS)
def test_round_robin_and_sticky_through_a_real_balancer(kind: str, backends: list[int], tmp_path: Path) -> None:
    if not _installed(kind):
        pytest.skip(f"{kind} is not installed (apt-get install {kind}, or `make venv-vllm` as root)")
    lb = Balancer(kind)
    for routing in ("round-robin", "sticky"):
        port = free_ports(1)[0]
        proc = lb.start(port, backends, routing, tmp_path / f"{kind}-{routing}")
        try:
            if routing == "round-robin":
                seen = Counter(_get(port, "/v1/models")["backend"] for _ in range(20))
                assert set(seen) == {"b0", "b1"} and min(seen.values()) >= 5, seen
            else:
                where = {}
                for s in range(16):
                    got = {_get(port, "/v1/models", f"session-{s}")["backend"] for _ in range(4)}
                    assert len(got) == 1, f"session-{s} went to {got}"
                    where[s] = got.pop()
                assert set(where.values()) == {"b0", "b1"}, where
                assert _get(port, "/v1/models", "session-3")["session"] == "session-3"  # the header reaches vLLM
            conn = http.client.HTTPConnection(LOOPBACK, port, timeout=30)
            t0 = time.monotonic()
            conn.request("GET", "/stream")
            resp = conn.getresponse()
            first = resp.readline()
            t_first = time.monotonic() - t0
            rest = resp.read()
            t_all = time.monotonic() - t0
            conn.close()
            assert first.endswith(b":0\n") and rest.count(b"\n") == 2
            assert t_all >= 2 * CHUNK_PAUSE_S and t_first < t_all - CHUNK_PAUSE_S, (t_first, t_all)
        finally:
            proc.stop()
        assert not proc.alive()


def test_a_bad_balancer_kind_or_routing_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'traefik'"):
        Balancer("traefik")
    with pytest.raises(ValueError, match="'random'"):
        nginx_config(8000, [8001], "random", tmp_path)
    with pytest.raises(ServeExperimentError, match="/no/such/nginx"):
        Balancer("nginx", "/no/such/nginx")
