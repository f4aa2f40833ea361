"""The load balancers of ``kvstrata experiment serve``: HAProxy or nginx (Debian packages), in front
of the ``vllm serve`` instances on 127.0.0.1, per-request round-robin or session-sticky (a
consistent hash of the session header). Each config is generated, checked by the balancer itself
(``haproxy -c`` / ``nginx -t``), then run in the foreground in a process group of its own."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

from kvstrata.servers import LOOPBACK
from kvstrata.workload.serve_procs import (
    BALANCER_ROUTINGS,
    SESSION_HEADER,
    Proc,
    ServeExperimentError,
    haproxy_binary,
    haproxy_config,
    last_line,
    system_binary,
    wait_http,
)

__all__ = ["BALANCERS", "Balancer", "nginx_binary", "nginx_config"]

BALANCERS = ("haproxy", "nginx")
_TEMP_KINDS = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")  # nginx's temp paths (default: /var/lib/nginx)


def nginx_binary(given: str | None = None) -> str:
    return system_binary("nginx", given)


def nginx_config(port: int, backends: Sequence[int], routing: str, rundir: Path) -> str:
    """nginx config: one worker on 127.0.0.1:``port``, every path and temp file under ``rundir``
    (no root needed), responses streamed unbuffered, per-request round-robin or a consistent hash
    of the session header (sticky)."""
    if routing not in BALANCER_ROUTINGS:
        raise ValueError(f"unknown routing {routing!r}: use one of {', '.join(BALANCER_ROUTINGS)}")
    header = SESSION_HEADER.lower().replace("-", "_")
    balance = "" if routing == "round-robin" else f"        hash $http_{header} consistent;\n"
    servers = "".join(f"        server {LOOPBACK}:{p};\n" for p in backends)
    temp = "".join(f"    {kind}_temp_path {rundir / 'tmp' / kind};\n" for kind in _TEMP_KINDS)
    return (
        "daemon off;\nworker_processes 1;\n"
        f"pid {rundir / 'nginx.pid'};\n"
        f"error_log {rundir / 'nginx-error.log'} warn;\n"
        "events {\n    worker_connections 1024;\n}\n"
        "http {\n    access_log off;\n"
        f"{temp}"
        f"    upstream vllm {{\n{balance}{servers}        keepalive 64;\n    }}\n"
        f"    server {{\n        listen {LOOPBACK}:{port};\n"
        "        client_max_body_size 64m;\n"
        "        location / {\n"
        "            proxy_pass http://vllm;\n"
        "            proxy_http_version 1.1;\n"
        '            proxy_set_header Connection "";\n'
        "            proxy_buffering off;\n"
        "            proxy_request_buffering off;\n"
        "            proxy_read_timeout 900s;\n"
        "            proxy_send_timeout 900s;\n"
        "        }\n    }\n}\n"
    )


class Balancer:
    """A load balancer kind (``haproxy`` | ``nginx``) and its binary (found on PATH or /usr/sbin
    when not given); :meth:`start` runs one in front of backends."""

    def __init__(self, kind: str = "haproxy", binary: str | None = None) -> None:
        if kind not in BALANCERS:
            raise ValueError(f"unknown load balancer {kind!r}: use one of {', '.join(BALANCERS)}")
        self.kind = kind
        self.binary = haproxy_binary(binary) if kind == "haproxy" else nginx_binary(binary)

    def start(self, port: int, backends: Sequence[int], routing: str, rundir: Path, timeout: float = 30.0) -> Proc:
        """Write, check and start the balancer on 127.0.0.1:``port``; returns once it answers
        ``/health`` (from a backend). The caller stops it (``Proc.stop``)."""
        rundir.mkdir(parents=True, exist_ok=True)
        if self.kind == "haproxy":
            cfg = rundir / "haproxy.cfg"
            cfg.write_text(haproxy_config(port, backends, routing))
            check = [self.binary, "-c", "-q", "-f", str(cfg)]
            run = [self.binary, "-db", "-f", str(cfg)]
        else:
            cfg = rundir / "nginx.conf"
            for kind in _TEMP_KINDS:
                (rundir / "tmp" / kind).mkdir(parents=True, exist_ok=True)
            cfg.write_text(nginx_config(port, backends, routing, rundir))
            base = [self.binary, "-p", str(rundir), "-e", str(rundir / "nginx-error.log"), "-c", str(cfg)]
            check = [*base, "-t", "-q"]
            run = base
        done = subprocess.run(check, capture_output=True, text=True)
        if done.returncode != 0:
            raise ServeExperimentError(f"{self.kind} rejected {cfg}: {last_line(done.stderr or done.stdout)}")
        proc = Proc(self.kind, run, rundir / f"{self.kind}.log")
        try:
            wait_http(proc, f"http://{LOOPBACK}:{port}/health", timeout)
        except BaseException:
            proc.stop()
            raise
        return proc
