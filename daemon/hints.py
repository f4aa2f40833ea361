"""Promotion hints: "these blocks belong to a session that is active again".

An inference process (or an operator, ``kvstrata prefetch``) tells the node's daemon which
blocks it will want soon; the daemon copies those that sit only in a slow tier (the shared
``fs`` tier) back into the top persistent tier (NVMe) before the next turn asks for them.
DRAM is private to each process, so NVMe is the fastest tier the daemon can fill for everyone.

Two ways in, both process-safe and usable while the daemon is down or restarting:

* the hint file ``<state_dir>/hints.jsonl``: :func:`append_hint` appends one JSON line
  ``{"ns": <namespace fingerprint>, "keys": [<32 hex digits>, ...], "t": <unix time>}`` with
  ``O_APPEND`` under an exclusive ``flock``; the daemon tails it (every ``hint_poll_s``) under
  the same lock, and empties it once it has read more than 1 MiB. A line torn by a writer that
  died mid-write is skipped. Hints older than ``hint_ttl_s`` are ignored;
* ``POST /prefetch`` to the daemon's HTTP port with the same JSON object (``kvstrata prefetch
  --url``): handled at once.

:func:`hint_slow_hits` is the one-liner for an inference process: after a lookup, it hints the
prefix when some of its blocks were found only in a slow tier.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstrata.tiers import TIERS

log = logging.getLogger("kvstrata.daemon.hints")

HINTS_FILE = "hints.jsonl"
MAX_HINT_FILE = 1024**2  # the daemon empties the file once it has consumed this much


@dataclass(frozen=True)
class Hint:
    namespace: str  # namespace fingerprint (the directory name under the tier path)
    keys: tuple[bytes, ...]  # block keys, prefix order
    at: float  # unix time the hint was given
    source: str = "file"


def parse_hint(data: Any, source: str, now: float | None = None) -> Hint:
    """A hint from its JSON object; ``ValueError`` naming what is wrong."""
    if not isinstance(data, dict):
        raise ValueError("a hint is a JSON object with 'ns' (or 'namespace') and 'keys'")
    ns = data.get("ns", data.get("namespace"))
    keys = data.get("keys")
    if not isinstance(ns, str) or not ns:
        raise ValueError("hint: 'ns' must name a namespace fingerprint")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise ValueError("hint: 'keys' must be a list of hex strings")
    try:
        raw = tuple(bytes.fromhex(k) for k in keys)
    except ValueError:
        raise ValueError("hint: a key is not hex") from None
    if any(len(k) != 16 for k in raw):
        raise ValueError("hint: every key must be 16 bytes (32 hex digits)")
    at = data.get("t")
    when = float(at) if isinstance(at, int | float) else (time.time() if now is None else now)
    return Hint(ns, raw, when, source)


def hint_line(namespace: str, keys: Sequence[bytes], now: float | None = None) -> bytes:
    data = {"ns": namespace, "keys": [bytes(k).hex() for k in keys], "t": time.time() if now is None else now}
    return (json.dumps(data, separators=(",", ":")) + "\n").encode()


def append_hint(state_dir: str | os.PathLike[str], namespace: str, keys: Sequence[bytes]) -> None:
    """Append one hint to ``<state_dir>/hints.jsonl`` (creating it); safe from many processes."""
    if not keys:
        return
    path = Path(state_dir) / HINTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    data = memoryview(hint_line(namespace, keys))
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        while data:
            data = data[os.write(fd, data) :]
    finally:
        os.close(fd)  # releases the lock


def hint_slow_hits(engine: Any, keys: Sequence[bytes], result: Any, state_dir: str | os.PathLike[str]) -> bool:
    """After ``result = engine.lookup(keys)``: hint the found prefix to the daemon when some of
    its blocks come from a slow tier: a shared one (``capabilities.shared``: a pool or a shared
    filesystem; the node's own hbm/dram/nvme are what a hint would promote into). Returns
    whether a hint was written."""
    fast = {t.name for t in engine.config.tiers if not _shared(t.kind)}
    if not any(name not in fast for name in result.tiers):
        return False
    append_hint(state_dir, engine.namespace.fingerprint, list(keys[: result.num_blocks]))
    return True


def _shared(kind: str) -> bool:
    return TIERS.get(kind).capabilities.shared


class HintReader:
    """The daemon's tail of the hint file."""

    def __init__(self, state_dir: Path, max_bytes: int = MAX_HINT_FILE) -> None:
        self.path = state_dir / HINTS_FILE
        self.max_bytes = max_bytes
        self.offset = 0
        self.bad_lines = 0

    def poll(self) -> list[Hint]:
        """Hints appended since the last poll (the file is emptied once it grew past ``max_bytes``)."""
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            self.offset = 0
            return []
        if size == self.offset:
            return []
        if size < self.offset:  # emptied by another reader: start over
            self.offset = 0
        fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            data = _read_from(fd, self.offset)
            self.offset += len(data)  # writers append whole lines under the lock: a tail without
            if self.offset >= self.max_bytes:  # a newline is a torn line of a writer that died
                os.ftruncate(fd, 0)
                self.offset = 0
        finally:
            os.close(fd)
        return self._parse(data)

    def _parse(self, data: bytes) -> list[Hint]:
        hints: list[Hint] = []
        lines = data.split(b"\n")
        if lines and lines[-1]:
            self.bad_lines += 1  # torn
        for line in lines[:-1]:
            if not line.strip():
                continue
            try:
                hints.append(parse_hint(json.loads(line), "file"))
            except ValueError as exc:
                self.bad_lines += 1
                log.warning("skipping a bad line in %s: %s", self.path, exc)
        return hints


def _read_from(fd: int, offset: int) -> bytes:
    chunks: list[bytes] = []
    while True:
        chunk = os.pread(fd, 1 << 20, offset)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        offset += len(chunk)
