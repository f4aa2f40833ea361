"""The processes of ``kvstrata experiment serve`` (:mod:`kvstrata.workload.serve`): started in
sessions of their own and stopped as groups, waited for over HTTP; HAProxy's binary and config;
aiperf's virtual environment (its pins conflict with vLLM's, so it gets one of its own)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from kvstrata.config import default_cache_dir
from kvstrata.errors import KVStrataError
from kvstrata.servers import LOOPBACK, stop_group

MODES = ("none", "kvstrata", "kvstrata+pool")
BALANCER_ROUTINGS = ("round-robin", "sticky")  # what HAProxy and nginx do
ROUTINGS = (*BALANCER_ROUTINGS, "kv-events")  # kv-events: Dynamo's KV indexer + a scorer (workload.kv_router)
SESSION_HEADER = "X-Session-ID"
AIPERF_VERSION = "0.13.0"
#: vLLM CPU's KV block size in tokens (its default).
BLOCK_TOKENS = 128

Progress = Callable[[str], None]


class ServeExperimentError(KVStrataError):
    """Something the serve experiment needs is missing or failed (one line, with what to do)."""


# ---------------------------------------------------------------- processes


class Proc:
    """A child process in its own session with its output in ``log``; ``stop`` ends its whole group."""

    def __init__(self, name: str, argv: Sequence[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as f:
            self.popen = subprocess.Popen(
                list(argv),
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, chars: int = 20000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, grace: float = 10.0) -> None:
        stop_group(self.popen, grace, kill_wait=5.0)


def http_get(url: str, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return str(r.read().decode())


def last_line(text: str) -> str:
    """The last error line of a log (else its last line), shortened."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "Error:" in line and "ModuleNotFoundError" not in line]
    ours = [line for line in errors if "kvstrata.errors." in line]  # the root cause, not vLLM's wrapper
    pick = ours[-1] if ours else errors[-1] if errors else (lines[-1] if lines else "no output")
    return pick[-300:]


def wait_http(proc: Proc, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise ServeExperimentError(
                f"{proc.name} exited with status {proc.popen.returncode} before answering {url}: "
                f"{last_line(proc.tail())} (log {proc.log})"
            )
        try:
            http_get(url)
            return
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    raise ServeExperimentError(f"{proc.name} did not answer {url} within {timeout:.0f} s (log {proc.log})")


# ---------------------------------------------------------------- the pieces


def system_binary(name: str, given: str | None = None) -> str:
    """``given``, else ``name`` on PATH or in /usr/sbin (Debian's packages put daemons there)."""
    sbin = f"/usr/sbin/{name}"
    path = given or shutil.which(name) or (sbin if os.access(sbin, os.X_OK) else None)
    if not path or not os.access(path, os.X_OK):
        raise ServeExperimentError(
            f"{name} not found{f' at {given}' if given else ''}: install it (apt-get install {name}, "
            f"or `make venv-vllm` as root) or pass --{name} PATH"
        )
    return path


def haproxy_binary(given: str | None = None) -> str:
    return system_binary("haproxy", given)


def haproxy_config(port: int, backends: Sequence[int], routing: str) -> str:
    """HAProxy config: HTTP mode on 127.0.0.1:``port``, per-request round-robin or a consistent hash
    of the session header (sticky)."""
    if routing not in BALANCER_ROUTINGS:
        raise ValueError(f"unknown routing {routing!r}: use one of {', '.join(BALANCER_ROUTINGS)}")
    balance = (
        "    balance roundrobin\n"
        if routing == "round-robin"
        else f"    balance hdr({SESSION_HEADER})\n    hash-type consistent\n"
    )
    servers = "".join(f"    server vllm{i} {LOOPBACK}:{p}\n" for i, p in enumerate(backends))
    return (
        "global\n    maxconn 512\n"
        "defaults\n    mode http\n    option http-no-delay\n"
        "    timeout connect 5s\n    timeout client 900s\n    timeout server 900s\n"
        f"frontend fleet\n    bind {LOOPBACK}:{port}\n    default_backend vllm\n"
        f"backend vllm\n{balance}{servers}"
    )


def default_client_venv() -> Path:
    return default_cache_dir() / "aiperf-venv"


STAMP = "kvstrata-installed.txt"  # in a tool's venv: the requirement installed there


def ensure_tool_venv(venv: Path, requirement: str, exe: str, progress: Progress, what: str) -> Path:
    """``venv``/bin/``exe`` with ``requirement`` installed, making the virtual environment (or
    installing into it) when it is missing or holds another version. Tools get venvs of their own:
    their pins conflict with vLLM's."""
    path = venv / "bin" / exe
    stamp = venv / STAMP
    if path.is_file() and stamp.is_file() and stamp.read_text().strip() == requirement:
        return path
    progress(f"installing {requirement} ({what}) into its own virtual environment {venv}")
    base = getattr(sys, "_base_executable", None) or shutil.which("python3") or sys.executable
    venv.parent.mkdir(parents=True, exist_ok=True)
    steps = [] if (venv / "bin" / "python").is_file() else [[base, "-m", "venv", str(venv)]]
    steps.append([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", requirement])
    for argv in steps:
        r = subprocess.run(argv, capture_output=True, text=True)
        if r.returncode != 0:
            raise ServeExperimentError(f"could not make {what}'s venv ({' '.join(argv)}): {r.stderr.strip()[-500:]}")
    if not path.is_file():
        raise ServeExperimentError(f"{requirement} was installed into {venv} but {path} does not exist")
    stamp.write_text(requirement + "\n")
    return path


def ensure_aiperf(venv: Path, progress: Progress) -> Path:
    """``venv``/bin/aiperf (``aiperf==AIPERF_VERSION``), made when missing."""
    return ensure_tool_venv(venv, f"aiperf=={AIPERF_VERSION}", "aiperf", progress, "aiperf")
