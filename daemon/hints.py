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
  --url``): queued in a :class:`HintQueue` of at most ``hint_queue_keys`` keys (503 when full)
  and handled at the main loop's next turn.

Every hint, from either way in, is strict JSON (no NaN/Infinity, nesting at most
:data:`MAX_JSON_DEPTH`, at most :data:`MAX_JSON_CONTAINERS` arrays and objects), has at most
``max_hint_keys`` keys and a finite time ``t`` no further than ``hint_clock_skew_s`` ahead of
the daemon's clock (over HTTP: nor behind it); no hint shields blocks from demotion for longer
than ``hint_ttl_s`` from when the daemon reads it. The daemon reads at most
``MAX_HINT_READ`` (4 MiB) of the hint file per poll (of a bigger backlog: its newest lines).

:func:`hint_slow_hits` is the one-liner for an inference process: after a lookup, it hints the
prefix when some of its blocks were found only in a slow tier.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import re
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvstrata.config import DaemonConfig
from kvstrata.tiers import TIERS

log = logging.getLogger("kvstrata.daemon.hints")

HINTS_FILE = "hints.jsonl"
MAX_HINT_FILE = 1024**2  # the daemon empties the file once it has consumed this much
MAX_HINT_READ = 4 * 1024**2  # and reads at most this much of it per poll
MAX_JSON_DEPTH = 8  # a hint is {"keys": [...]}: depth 2
MAX_JSON_CONTAINERS = 64  # arrays and objects in one hint (it has 2)
MAX_NAMESPACE_CHARS = 128  # fingerprints are 16 hex digits
DEFAULT_MAX_KEYS = 16384
DEFAULT_SKEW_S = 3600.0


@dataclass(frozen=True)
class Hint:
    namespace: str  # namespace fingerprint (the directory name under the tier path)
    keys: tuple[bytes, ...]  # block keys, prefix order
    at: float  # unix time the hint was given
    source: str = "file"


class HintTooLarge(ValueError):
    """A hint over a configured size limit (HTTP 413)."""


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_OPEN = np.zeros(256, np.int8)
_OPEN[[ord("["), ord("{")]] = 1
_OPEN[[ord("]"), ord("}")]] = -1


def json_depth(data: bytes) -> int:
    """How deep ``data`` nests arrays and objects (brackets inside strings do not count)."""
    return json_shape(data)[0]


def json_shape(data: bytes) -> tuple[int, int]:
    """(nesting depth, number of arrays and objects) of ``data``, brackets inside strings not
    counted; linear time and no recursion, so it is safe to run before parsing untrusted bytes."""
    bare = _JSON_STRING.sub(b'""', data)
    if not bare:
        return 0, 0
    steps = _OPEN[np.frombuffer(bare, np.uint8)]
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0)), int(np.count_nonzero(steps > 0))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number here (only finite numbers are)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def loads_strict(data: bytes | str, max_depth: int = MAX_JSON_DEPTH, max_containers: int = MAX_JSON_CONTAINERS) -> Any:
    """``json.loads`` for untrusted input: ``ValueError`` (naming the problem) for JSON nested
    deeper than ``max_depth`` or with more than ``max_containers`` arrays and objects (a hint has
    two; thousands of empty ones would cost 20 times their bytes to parse), NaN/Infinity or a
    number too big for a float. What it parses costs at most about 8 times its size."""
    raw = data.encode() if isinstance(data, str) else data
    if raw.count(b"[") + raw.count(b"{") > min(max_depth, max_containers):  # else it cannot break either rule
        depth, containers = json_shape(raw)
        if depth > max_depth:
            raise ValueError(f"JSON nested {depth} levels deep (at most {max_depth})")
        if containers > max_containers:
            raise ValueError(f"JSON with {containers} arrays and objects (at most {max_containers})")
    try:
        return json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:  # pragma: no cover - json_depth bounds the nesting first
        raise ValueError(f"JSON nested too deep (at most {max_depth})") from None


def parse_hint(
    data: Any,
    source: str,
    now: float | None = None,
    *,
    max_keys: int = DEFAULT_MAX_KEYS,
    max_skew_s: float = DEFAULT_SKEW_S,
    reject_old: bool = False,
) -> Hint:
    """A hint from its JSON object; ``ValueError`` naming what is wrong (:class:`HintTooLarge`
    for more than ``max_keys`` keys). ``t`` (unix seconds, default now) must be finite and at
    most ``max_skew_s`` ahead of ``now``; with ``reject_old`` not more than that behind either
    (an old hint from the file is merely stale)."""
    now = time.time() if now is None else now
    if not isinstance(data, dict):
        raise ValueError("a hint is a JSON object with 'ns' (or 'namespace') and 'keys'")
    ns = data.get("ns", data.get("namespace"))
    keys = data.get("keys")
    if not isinstance(ns, str) or not ns:
        raise ValueError("hint: 'ns' must name a namespace fingerprint")
    if len(ns) > MAX_NAMESPACE_CHARS or not ns.isprintable():
        raise ValueError(f"hint: 'ns' is not a namespace fingerprint ({len(ns)} characters; at most 128 printable)")
    if not isinstance(keys, list):
        raise ValueError("hint: 'keys' must be a list of hex strings")
    if len(keys) > max_keys:
        raise HintTooLarge(f"hint has {len(keys)} keys; at most {max_keys} per hint (max_hint_keys)")
    if not all(isinstance(k, str) and len(k) == 32 for k in keys):
        if not all(isinstance(k, str) for k in keys):
            raise ValueError("hint: 'keys' must be a list of hex strings")
        raise ValueError("hint: every key must be 16 bytes (32 hex digits)")
    try:
        raw = tuple(bytes.fromhex(k) for k in keys)
    except ValueError:
        raise ValueError("hint: a key is not hex") from None
    if any(len(k) != 16 for k in raw):  # "0 1 2 ..." with spaces: fromhex skips them
        raise ValueError("hint: every key must be 16 bytes (32 hex digits)")
    return Hint(ns, raw, _hint_time(data.get("t"), now, max_skew_s, reject_old), source)


def _hint_time(at: Any, now: float, max_skew_s: float, reject_old: bool) -> float:
    if at is None:
        return now
    if isinstance(at, bool) or not isinstance(at, int | float):
        raise ValueError(f"hint: 't' must be a unix time in seconds, got {json.dumps(at)[:40]}")
    try:
        when = float(at)
    except OverflowError:
        when = math.inf
    if not math.isfinite(when):
        raise ValueError(f"hint: 't' = {str(at)[:40]} is not a finite unix time")
    if when > now + max_skew_s:
        raise ValueError(
            f"hint: 't' = {when:.3f} is {when - now:.0f} s ahead of the daemon's clock "
            f"(at most hint_clock_skew_s = {max_skew_s:g})"
        )
    if reject_old and when < now - max_skew_s:
        raise ValueError(
            f"hint: 't' = {when:.3f} is {now - when:.0f} s behind the daemon's clock "
            f"(at most hint_clock_skew_s = {max_skew_s:g})"
        )
    return when


class HintQueue:
    """Hints posted over HTTP, waiting for the main loop. Bounded: a hint costs its keys plus
    one, and :meth:`put` refuses a hint that would take the total over ``max_keys`` (about 57
    bytes of memory per queued key: the 16-byte key object and its slot)."""

    def __init__(self, max_keys: int) -> None:
        self.max_keys = max_keys
        self._lock = threading.Lock()
        self._hints: deque[Hint] = deque()
        self.keys = 0

    def put(self, hint: Hint) -> bool:
        cost = len(hint.keys) + 1
        with self._lock:
            if self.keys + cost > self.max_keys:
                return False
            self._hints.append(hint)
            self.keys += cost
            return True

    def accept(self, body: Any, d: DaemonConfig) -> tuple[int, dict[str, Any]]:
        """``POST /prefetch``: (HTTP status, answer) for a parsed JSON body: 202 once queued, 400 or
        413 (over ``max_hint_keys``) naming what is wrong, 503 while the queue is full."""
        try:
            hint = parse_hint(body, "http", max_keys=d.max_hint_keys, max_skew_s=d.hint_clock_skew_s, reject_old=True)
        except HintTooLarge as exc:
            return 413, {"error": str(exc)}
        except ValueError as exc:
            return 400, {"error": str(exc)}
        if not self.put(hint):
            return 503, {
                "error": f"the hint queue is full ({self.keys} of hint_queue_keys = {self.max_keys} keys "
                "waiting for the daemon); retry later",
                "retry_after_s": 1,
            }
        return 202, {"accepted": len(hint.keys)}

    def drain(self) -> list[Hint]:
        with self._lock:
            out = list(self._hints)
            self._hints.clear()
            self.keys = 0
            return out


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

    def __init__(self, state_dir: Path, max_bytes: int = MAX_HINT_FILE, max_read: int = MAX_HINT_READ) -> None:
        self.path = state_dir / HINTS_FILE
        self.max_bytes = max_bytes
        self.max_read = max_read
        self.offset = 0
        self.bad_lines = 0
        self.skipped_bytes = 0

    def poll(self, **limits: Any) -> list[Hint]:
        """Hints appended since the last poll (the file is emptied once it grew past ``max_bytes``);
        ``limits`` go to :func:`parse_hint`. Reads at most ``max_read`` bytes: of a bigger backlog
        only its newest whole lines (``skipped_bytes`` counts the rest)."""
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
            size = os.fstat(fd).st_size  # writers append under the lock: stable now
            start = max(self.offset, size - self.max_read)
            if start > self.offset:  # a backlog: its newest whole lines
                data = _read(fd, start - 1, size)
                cut = data.find(b"\n") + 1  # the byte before `start` ends a line: cut = 1
                self.skipped_bytes += start - 1 - self.offset + cut
                data = data[cut:]
            else:
                data = _read(fd, start, size)
            self.offset = size  # writers append whole lines under the lock: a tail without
            if self.offset >= self.max_bytes:  # a newline is a torn line of a writer that died
                os.ftruncate(fd, 0)
                self.offset = 0
        finally:
            os.close(fd)
        return self._parse(data, limits)

    def _parse(self, data: bytes, limits: dict[str, Any]) -> list[Hint]:
        hints: list[Hint] = []
        lines = data.split(b"\n")
        if lines and lines[-1]:
            self.bad_lines += 1  # torn
        bad: list[str] = []
        for line in lines[:-1]:
            if not line.strip():
                continue
            try:
                hints.append(parse_hint(loads_strict(line), "file", **limits))
            except ValueError as exc:
                self.bad_lines += 1
                bad.append(str(exc))
        if bad:  # one line per poll, however many bad lines
            log.warning(
                "skipped %d bad lines in %s (first: %s)",
                len(bad),
                self.path,
                bad[0],
                extra={"event": "bad_hints", "lines": len(bad)},
            )
        return hints


def _read(fd: int, start: int, end: int) -> bytes:
    chunks: list[bytes] = []
    while start < end:
        chunk = os.pread(fd, min(1 << 20, end - start), start)
        if not chunk:
            break
        chunks.append(chunk)
        start += len(chunk)
    return b"".join(chunks)
