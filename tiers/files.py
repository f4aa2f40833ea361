"""Files and directories the local tiers create, with the modes their options name.

``file_mode`` (default ``0600``) and ``dir_mode`` (default ``0700``) apply whatever the
process's umask says: a file is created with ``os.open(..., mode)`` and then ``fchmod``-ed,
a directory with ``mkdir`` and then ``chmod``-ed. Only what a call creates is changed; files
and directories that exist already keep their modes (another user of a shared directory may
have chosen them).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from typing import Any

__all__ = [
    "DEFAULT_DIR_MODE",
    "DEFAULT_FILE_MODE",
    "chmod_new",
    "fsync_dir",
    "makedirs",
    "open_new",
    "parse_mode",
    "write_atomic",
]

DEFAULT_FILE_MODE = 0o600
DEFAULT_DIR_MODE = 0o700


def parse_mode(value: Any, field: str, need: int) -> int:
    """A permission mode from an int (``0o600``) or an octal string (``"0600"``, ``"600"``,
    ``"0o600"``); ``ValueError`` naming ``field`` unless it is within ``0..0o777`` and grants the
    owner the bits in ``need`` (a tier must read and write what it creates)."""
    if isinstance(value, bool):
        raise ValueError(f"{field} must be an octal mode such as '0600', got {value!r}")
    if isinstance(value, str):
        text = value.strip().lower().removeprefix("0o")
        if not text or any(c not in "01234567" for c in text):
            raise ValueError(f"{field} must be an octal mode such as '0600', got {value!r}")
        mode = int(text, 8)
    elif isinstance(value, int):
        mode = value
    else:
        raise ValueError(f"{field} must be an octal mode such as '0600', got {value!r}")
    if not 0 <= mode <= 0o777:
        raise ValueError(
            f"{field} {value!r} is not a permission mode (0..0o777); write octal as a string ('0600') or 0o600"
        )
    if mode & need != need:
        raise ValueError(f"{field} {oct(mode)} must give the owner {oct(need)} (the tier reads and writes its files)")
    return mode


def makedirs(path: str, mode: int, fsync: bool = False) -> None:
    """``os.makedirs(path, exist_ok=True)``, each directory it creates getting exactly ``mode``;
    with ``fsync``, the parent of each one it creates is fsynced, so the new entry survives a
    power loss (a file renamed into a directory whose own entry was lost is lost with it)."""
    path = os.path.abspath(path)
    missing: list[str] = []
    cur = path
    while not os.path.isdir(cur):
        missing.append(cur)
        parent = os.path.dirname(cur)
        if parent == cur:
            break
        cur = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, mode)
        except FileExistsError:
            if not os.path.isdir(directory):
                raise
            continue  # another process made it: its modes are its business
        os.chmod(directory, mode)
        if fsync:
            fsync_dir(os.path.dirname(directory))


def fsync_dir(directory: str) -> None:
    """Make the entries of ``directory`` durable (after a rename, create or unlink in it)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_new(path: str, flags: int, mode: int) -> int:
    """``os.open(path, flags | O_CREAT, mode)``, then ``fchmod`` to exactly ``mode`` (umask aside)."""
    fd = os.open(path, flags | os.O_CREAT, mode)
    try:
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def chmod_new(path: str, mode: int) -> None:
    """Give a file this process just created exactly ``mode`` (a missing file is left alone)."""
    with contextlib.suppress(FileNotFoundError):
        os.chmod(path, mode)


def write_atomic(path: str, data: bytes | memoryview, mode: int, fsync: bool = True, tmp: str | None = None) -> None:
    """Write ``path`` whole (temporary file ``tmp`` in its directory, then ``rename``), with ``mode``.

    With ``fsync`` the file is fsynced before the rename and its directory after it, so once this
    returns the new content survives a power loss (without the directory's fsync the rename
    itself may be lost: an acknowledged object or tombstone would vanish)."""
    tmp = tmp or f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = open_new(tmp, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        fsync_dir(os.path.dirname(os.path.abspath(path)))
