"""The daemon's state directory: a lock, a state file, the hint file and the quarantine log.

``<state_dir>`` (``[daemon] state_dir``; default ``<path of the first nvme tier>/.kvstrata-daemon``,
beside the namespace directories, which it never collides with because it holds no
``meta.json``) contains:

``daemon.lock``
    ``flock``-ed by the running daemon for its whole life: one daemon per state directory.
``daemon.json``
    ``{"pid", "state", "url", "started", "clean"}``, replaced atomically. A daemon that finds
    ``clean: false`` left by a predecessor (kill -9, power loss) knows the stop was unclean
    and verifies and repairs the tiers before it serves (``startup_check = "auto"``).
    ``kvstrata status`` reads ``url`` from it.
``hints.jsonl``
    promotion hints appended by inference processes or ``kvstrata prefetch``
    (see :mod:`kvstrata.daemon.hints`).
``quarantine.jsonl``
    one line per bad block the scrubber took out of service (the tier already stopped serving
    it; this is the operator's record).
``api-token``
    with ``auth = "token"`` (and no ``token_file``): the bearer token of the HTTP API, mode 0600,
    made at the first start (:func:`ensure_token`); clients read it (:func:`read_token`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import stat
import time
from pathlib import Path
from typing import Any

from kvstrata.config import KVStrataConfig, default_cache_dir
from kvstrata.errors import KVStrataError

STATE_FILE = "daemon.json"
LOCK_FILE = "daemon.lock"
QUARANTINE_FILE = "quarantine.jsonl"
STATE_SUBDIR = ".kvstrata-daemon"
TOKEN_FILE = "api-token"
MIN_TOKEN_CHARS = 16


class DaemonError(KVStrataError):
    """The daemon cannot start or a client cannot reach it (the message says why)."""


def state_dir_for(config: KVStrataConfig) -> Path:
    """Where the daemon of ``config`` keeps its state (and where hints go)."""
    if config.daemon.state_dir:
        return Path(os.path.expandvars(os.path.expanduser(config.daemon.state_dir)))
    for tier in config.tiers:
        if tier.kind == "nvme":
            base = getattr(tier.options, "path", None)
            if base:
                return Path(os.path.expandvars(os.path.expanduser(base))) / STATE_SUBDIR
    return default_cache_dir() / "daemon"


def token_path(config: KVStrataConfig) -> Path:
    """The bearer token file of the daemon of ``config`` (``[daemon] token_file``, else in its state dir)."""
    if config.daemon.token_file:
        return Path(os.path.expandvars(os.path.expanduser(config.daemon.token_file)))
    return state_dir_for(config) / TOKEN_FILE


def ensure_token(path: Path) -> str:
    """The daemon's token: read from ``path``, or made there (32 random bytes, mode 0600) when it
    does not exist yet. ``DaemonError`` when it cannot be made, or is readable by others."""
    if not path.exists():
        token = secrets.token_urlsafe(32)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, (token + "\n").encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            with contextlib.suppress(FileExistsError):  # made meanwhile: read that one
                os.link(tmp, path)  # atomic create-if-absent: never a half-written token file
        except OSError as exc:
            raise DaemonError(f"cannot create the API token file {path}: {exc.strerror or exc}") from None
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return read_token(path, check_mode=True)


def read_token(path: Path, check_mode: bool = False) -> str:
    """The bearer token in ``path`` (``DaemonError`` naming the file when it cannot be used).

    ``check_mode`` (the daemon): refuse a file that others than its owner and group can read, or
    that its group can write (0600 is made; 0640 shares it with a group of clients)."""
    try:
        if check_mode:
            mode = stat.S_IMODE(os.stat(path).st_mode)
            if mode & 0o027:
                raise DaemonError(
                    f"API token file {path} has mode {mode:04o}: others can read or change it; "
                    f"chmod 600 {path} (or 640 to share it with a group of clients)"
                )
        text = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise DaemonError(f"no API token file {path} (auth = 'token': the daemon makes it when it starts)") from None
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise DaemonError(f"cannot read the daemon's API token file {path}: {why}") from None
    if len(text) < MIN_TOKEN_CHARS or any(c.isspace() or not (c.isascii() and c.isprintable()) for c in text):
        raise DaemonError(
            f"API token file {path}: the token must be one line of at least {MIN_TOKEN_CHARS} printable "
            "ASCII characters"
        )
    return text


def read_state(state_dir: Path) -> dict[str, Any] | None:
    """The state file's content, or None when there is none (or it is unreadable)."""
    try:
        data = json.loads((state_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class StateDir:
    """The running daemon's hold on its state directory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock_fd = -1
        self.previous: dict[str, Any] | None = None
        self.started = time.time()

    def acquire(self) -> bool:
        """Take the lock; returns whether the previous daemon stopped uncleanly.

        ``DaemonError`` when another daemon holds the directory or it cannot be created."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise DaemonError(f"daemon state directory {self.path}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            prev = read_state(self.path) or {}
            raise DaemonError(
                f"another kvstrata daemon (pid {prev.get('pid', '?')}) is running on {self.path}"
            ) from None
        self._lock_fd = fd
        self.previous = read_state(self.path)
        return self.previous is not None and not self.previous.get("clean", True)

    def write(self, state: str, url: str | None, clean: bool = False, **extra: Any) -> None:
        data = {"pid": os.getpid(), "state": state, "url": url, "started": self.started, "clean": clean, **extra}
        tmp = self.path / f".{STATE_FILE}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, self.path / STATE_FILE)

    def quarantine(self, entries: list[dict[str, Any]]) -> None:
        """Append entries to the quarantine log (best effort)."""
        if not entries:
            return
        with contextlib.suppress(OSError):
            self.path.mkdir(parents=True, exist_ok=True)
            with open(self.path / QUARANTINE_FILE, "a", encoding="utf-8") as f:
                f.writelines(json.dumps(entry, default=str) + "\n" for entry in entries)

    def release(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
