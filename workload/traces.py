"""Request traces: the model, a synthetic agentic workload, and JSONL readers/writers.

A :class:`Request` says when it arrives, how long its prompt and output are, and how to
compute its block keys, in one of two ways:

* ``spans``: the prompt is a concatenation of deterministic synthetic token runs, each a
  :class:`Span` ``(seed, length)``. A span's tokens are ``length`` draws in ``[0, VOCAB_SIZE)``
  from ``numpy.random.PCG64(xxh3_64(seed))`` (see :func:`span_tokens`); equal seeds give equal
  tokens, and a shorter span is a prefix of a longer one with the same seed. Keys are the
  chained keys of those tokens at the hasher's block size, so any block size works.
* ``hash_ids`` (Mooncake FAST'25 traces): one integer per ``block_size`` (512) tokens, the last
  one possibly for a partial block; equal ids at equal positions mean a shared prefix. Keys
  come from :meth:`BlockHasher.keys_for_hash_ids` over the *full* blocks only, which requires
  the hasher's (that is, the engine layout's) block size to equal :attr:`Trace.block_size`.
  With any other block size the ids are expanded into synthetic tokens (id ``h`` becomes the
  512 tokens of span ``"mooncake/h"``) and keyed like ``spans`` traces: prefix sharing is kept
  but the keys differ from the hash-id keys.

kvstrata JSONL format (one JSON object per line, blank lines ignored)::

    {"kvstrata_trace": 1, "block_size": null, "generator": {"name": "agentic", ...}}   # optional header
    {"timestamp": 0.0, "session": "s3", "turn": 2, "input_length": 35896, "output_length": 900,
     "spans": [["0/sys", 20000], ["0/s3-u0", 10000], ["0/s3-o0", 900], ...], "output_span": ["0/s3-o2", 900]}

``timestamp`` is the arrival time in ms; ``session``, ``turn`` and ``output_span`` are
optional; a line may carry ``hash_ids`` instead of ``spans`` (then the header's ``block_size``,
default 512, is the trace block size). ``input_length`` must equal the sum of the span lengths.
The Mooncake format is lines of ``{"timestamp", "input_length", "output_length", "hash_ids"}``;
:func:`read_trace` tells the two apart by the first line.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from kvstrata.core.keys import BlockHasher, Key
from kvstrata.errors import ConfigError, TraceFormatError
from kvstrata.units import shown

__all__ = [
    "MOONCAKE_BLOCK_SIZE",
    "VOCAB_SIZE",
    "Request",
    "Span",
    "Trace",
    "agentic_header",
    "iter_trace",
    "read_trace",
    "scale_trace",
    "span_tokens",
    "synth_agentic",
    "write_jsonl",
]

VOCAB_SIZE = 32000
MOONCAKE_BLOCK_SIZE = 512
FORMAT_VERSION = 1
MAX_TOKENS = 1 << 24
"""The longest prompt, output or span a trace may give (16,777,216 tokens; a 10M-token context fits):
longer is a broken trace, not a request, and would take gigabytes to expand into tokens."""
MAX_REQUESTS = 1_000_000  # the most requests :func:`synth_agentic` makes (sessions x turns)
_MAX_HASH_ID = 1 << 64  # hash ids are unsigned 64-bit
_MAX_INT = 1 << 31  # any other integer field (a turn number)


@lru_cache(maxsize=1024)
def _span_stream(seed: str, length: int) -> np.ndarray:
    bg = np.random.PCG64(xxhash.xxh3_64_intdigest(seed.encode()))
    raw = bg.random_raw((length + 1) // 2).astype("<u8", copy=False)
    out = raw.view("<u4")[:length] % np.uint32(VOCAB_SIZE)
    out.flags.writeable = False
    return out


def span_tokens(seed: str, length: int) -> np.ndarray:
    """The ``length`` deterministic tokens (read-only ``uint32``) of span ``seed``."""
    if length <= 0:
        return np.zeros(0, dtype=np.uint32)
    # cache per seed at a rounded-up length, so prefixes of a long span share one draw
    cap = 1 << max(9, (length - 1).bit_length())
    return _span_stream(seed, cap)[:length]


@dataclass(frozen=True)
class Span:
    """A run of ``length`` deterministic synthetic tokens named by ``seed``."""

    seed: str
    length: int

    def tokens(self) -> np.ndarray:
        return span_tokens(self.seed, self.length)


@dataclass
class Request:
    """One request of a trace."""

    index: int
    timestamp_ms: float
    session: str | None
    input_length: int
    output_length: int
    hash_ids: list[int] | None = None
    spans: list[Span] | None = None
    turn: int | None = None
    output_span: Span | None = None
    hash_block_size: int | None = None  # tokens per hash id (512 for Mooncake)

    def __post_init__(self) -> None:
        if (self.hash_ids is None) == (self.spans is None):
            raise ConfigError("a request needs exactly one of hash_ids and spans", field="spans")
        if self.hash_ids is not None and self.hash_block_size is None:
            self.hash_block_size = MOONCAKE_BLOCK_SIZE

    # -- tokens ---------------------------------------------------------------------------------

    def prompt_tokens(self) -> np.ndarray:
        """The prompt as ``uint32`` token ids (synthetic, deterministic)."""
        if self.spans is not None:
            parts = [s.tokens() for s in self.spans if s.length > 0]
        else:
            assert self.hash_ids is not None and self.hash_block_size is not None
            bs = self.hash_block_size
            parts = [span_tokens(f"mooncake/{h}", bs) for h in self.hash_ids]
            missing = self.input_length - bs * len(self.hash_ids)
            if missing > 0:  # ids only for full blocks: the tail is unique to this request
                parts.append(span_tokens(f"mooncake-tail/{self.index}", missing))
        if not parts:
            return np.zeros(0, dtype=np.uint32)
        return np.concatenate(parts)[: self.input_length]

    def output_tokens(self) -> np.ndarray:
        """The tokens this request generates (its ``output_span``, else unique synthetic tokens)."""
        if self.output_span is not None:
            return self.output_span.tokens()[: self.output_length]
        return span_tokens(f"output/{self.session}/{self.turn}/{self.index}", self.output_length)

    # -- keys -----------------------------------------------------------------------------------

    def keys(self, hasher: BlockHasher, include_output: bool = False) -> list[Key]:
        """Chained keys of the full blocks of the prompt (and the output if ``include_output``)."""
        if self.hash_ids is not None and hasher.block_size == self.hash_block_size:
            n_full = self.input_length // hasher.block_size
            keys = hasher.keys_for_hash_ids(self.hash_ids[:n_full])
            if include_output and self.output_length:
                tail = np.concatenate([self.prompt_tokens()[n_full * hasher.block_size :], self.output_tokens()])
                keys += hasher.keys_for_tokens(tail, parent=keys[-1] if keys else None)
            return keys
        tokens = self.prompt_tokens()
        if include_output and self.output_length:
            tokens = np.concatenate([tokens, self.output_tokens()])
        return hasher.keys_for_tokens(tokens)

    # -- JSONL ----------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        ts = self.timestamp_ms
        d: dict[str, Any] = {"timestamp": int(ts) if float(ts).is_integer() else ts}
        if self.session is not None:
            d["session"] = self.session
        if self.turn is not None:
            d["turn"] = self.turn
        d["input_length"] = self.input_length
        d["output_length"] = self.output_length
        if self.spans is not None:
            d["spans"] = [[s.seed, s.length] for s in self.spans]
        if self.hash_ids is not None:
            d["hash_ids"] = list(self.hash_ids)
        if self.output_span is not None:
            d["output_span"] = [self.output_span.seed, self.output_span.length]
        return d


@dataclass
class Trace:
    """A list of requests in file order, with the trace's block size and format."""

    requests: list[Request]
    block_size: int | None = None  # tokens per hash id; None: keys use the layout's block size
    format: str = "kvstrata"  # "kvstrata" or "mooncake"
    header: dict[str, Any] = field(default_factory=dict)
    path: str | None = None

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    def __getitem__(self, i: int) -> Request:
        return self.requests[i]

    @property
    def duration_ms(self) -> float:
        if not self.requests:
            return 0.0
        ts = [r.timestamp_ms for r in self.requests]
        return max(ts) - min(ts)

    def limit(self, n: int) -> Trace:
        return scale_trace(self, limit=n)

    def time_scaled(self, factor: float) -> Trace:
        return scale_trace(self, time_scale=factor)


def scale_trace(trace: Trace, *, time_scale: float = 1.0, limit: int | None = None) -> Trace:
    """A copy of ``trace`` with the first ``limit`` requests and timestamps multiplied by ``time_scale``.

    ``time_scale=0.5`` replays twice as fast.
    """
    if not (isinstance(time_scale, (int, float)) and math.isfinite(time_scale) and time_scale >= 0):
        raise ConfigError(f"time_scale must be a finite number >= 0, got {time_scale!r}", field="time_scale")
    if limit is not None and limit < 0:
        raise ConfigError(f"limit must be >= 0, got {limit!r}", field="limit")
    reqs = trace.requests if limit is None else trace.requests[:limit]
    reqs = [replace(r, timestamp_ms=r.timestamp_ms * time_scale) if time_scale != 1.0 else r for r in reqs]
    return Trace(reqs, trace.block_size, trace.format, dict(trace.header), trace.path)


# ------------------------------------------------------------------------------------------------
# synthetic agentic workload


def synth_agentic(
    *,
    sessions: int = 8,
    turns: int = 30,
    shared_tokens: int = 20000,
    first_turn_tokens: int = 10000,
    turn_tokens: int = 2048,
    output_tokens: int = 900,
    turn_gap_ms: float = 30000.0,
    session_gap_ms: float | None = None,
    seed: int = 0,
    jitter: float = 0.1,
) -> list[Request]:
    """The agentic multi-turn workload of the vLLM x Mooncake study.

    Every session's prompt starts with the same shared system prompt (span ``"{seed}/sys"``,
    ``shared_tokens``), then its first user turn (``"{seed}/s{i}-u0"``, ``first_turn_tokens``);
    turn ``t`` appends the previous output (``"{seed}/s{i}-o{t-1}"``, ``output_tokens``) and
    new user tokens (``"{seed}/s{i}-u{t}"``, ``turn_tokens``), so turn ``t``'s prompt is
    ``shared + first + t * (output + turn)`` tokens and begins with turn ``t-1``'s prompt and
    output. Session ``i`` starts at ``i * session_gap_ms`` (default ``turn_gap_ms / sessions``)
    and turns follow every ``turn_gap_ms``; every start and gap is multiplied by a seeded
    factor in ``[1 - jitter, 1 + jitter]``. Requests are sorted by timestamp (ties: session,
    turn) and numbered in that order.
    """
    for name, value in (
        ("sessions", sessions),
        ("turns", turns),
        ("shared_tokens", shared_tokens),
        ("first_turn_tokens", first_turn_tokens),
        ("turn_tokens", turn_tokens),
        ("output_tokens", output_tokens),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{name} must be an integer >= 0, got {value!r}", field=name, value=value)
    if sessions * turns > MAX_REQUESTS:
        raise ConfigError(
            f"sessions x turns = {sessions:,} x {turns:,} requests is over the limit of {MAX_REQUESTS:,}",
            field="sessions",
            value=sessions,
        )
    longest = shared_tokens + first_turn_tokens + max(turns - 1, 0) * (output_tokens + turn_tokens)
    if longest > MAX_TOKENS or output_tokens > MAX_TOKENS:
        raise ConfigError(
            f"the last turn's prompt would be {longest:,} tokens, over the limit of {MAX_TOKENS:,} "
            f"(shared_tokens {shared_tokens}, first_turn_tokens {first_turn_tokens}, {turns} turns of "
            f"{turn_tokens} + {output_tokens} tokens)",
            field="turns",
            value=turns,
        )
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed must be an integer >= 0, got {seed!r}", field="seed", value=seed)
    for name, gap in (("turn_gap_ms", turn_gap_ms), ("session_gap_ms", session_gap_ms)):
        if gap is not None and not (isinstance(gap, int | float) and math.isfinite(gap)):
            raise ConfigError(f"{name} must be a finite number of ms, got {gap!r}", field=name, value=gap)
    if session_gap_ms is None:
        session_gap_ms = turn_gap_ms / max(sessions, 1)
    if turn_gap_ms < 0 or session_gap_ms < 0:
        raise ConfigError("turn_gap_ms and session_gap_ms must be >= 0", field="turn_gap_ms", value=turn_gap_ms)
    if not 0 <= jitter < 1:
        raise ConfigError(f"jitter must be in [0, 1), got {jitter!r}", field="jitter", value=jitter)

    rng = np.random.default_rng(seed)
    factors = 1.0 + jitter * rng.uniform(-1.0, 1.0, size=(sessions, turns + 1))
    pre = f"{seed}/"
    shared = [Span(pre + "sys", shared_tokens)] if shared_tokens else []
    rows: list[tuple[float, int, int, Request]] = []
    for s in range(sessions):
        sid = f"s{s}"
        t_ms = s * session_gap_ms * float(factors[s, 0])
        spans = [*shared]
        if first_turn_tokens:
            spans.append(Span(f"{pre}{sid}-u0", first_turn_tokens))
        for t in range(turns):
            if t > 0:
                t_ms += turn_gap_ms * float(factors[s, t])
                if output_tokens:
                    spans.append(Span(f"{pre}{sid}-o{t - 1}", output_tokens))
                if turn_tokens:
                    spans.append(Span(f"{pre}{sid}-u{t}", turn_tokens))
            req = Request(
                index=-1,
                timestamp_ms=round(t_ms, 3),
                session=sid,
                input_length=sum(sp.length for sp in spans),
                output_length=output_tokens,
                spans=list(spans),
                turn=t,
                output_span=Span(f"{pre}{sid}-o{t}", output_tokens),
            )
            rows.append((req.timestamp_ms, s, t, req))
    rows.sort(key=lambda row: row[:3])
    out = []
    for i, (*_, req) in enumerate(rows):
        req.index = i
        out.append(req)
    return out


def agentic_header(**params: Any) -> dict[str, Any]:
    """A header for :func:`write_jsonl` recording :func:`synth_agentic`'s parameters."""
    return {"kvstrata_trace": FORMAT_VERSION, "block_size": None, "generator": {"name": "agentic", **params}}


# ------------------------------------------------------------------------------------------------
# writing


def write_jsonl(
    path: str | Path,
    requests: Iterable[Request],
    header: Mapping[str, Any] | None = None,
) -> None:
    """Write ``requests`` in the kvstrata JSONL format, with a header line.

    ``header`` is merged into ``{"kvstrata_trace": 1, "block_size": ...}``; the block size
    defaults to the requests' ``hash_block_size`` (hash-id requests) or null.
    """
    reqs = list(requests)
    sizes = {r.hash_block_size for r in reqs if r.hash_ids is not None and r.hash_block_size is not None}
    if len(sizes) > 1:
        raise ConfigError(f"requests have different hash block sizes {sorted(sizes)}", field="block_size")
    inferred = sizes.pop() if sizes else None
    head: dict[str, Any] = {"kvstrata_trace": FORMAT_VERSION, "block_size": inferred}
    for k, v in (header or {}).items():
        if k == "block_size":
            if v is None:
                continue
            if inferred is not None and v != inferred:
                raise ConfigError(
                    f"header block_size {v!r} differs from the requests' hash block size {inferred}",
                    field="block_size",
                    value=v,
                )
        head[k] = v
    head["kvstrata_trace"] = FORMAT_VERSION
    p = Path(path)
    with p.open("w", encoding="utf-8") as f:
        f.write(json.dumps(head, separators=(",", ":")) + "\n")
        for r in reqs:
            f.write(json.dumps(r.to_json(), separators=(",", ":")) + "\n")


# ------------------------------------------------------------------------------------------------
# reading


class _LineError(Exception):
    pass


def _int(d: Mapping[str, Any], key: str, *, required: bool = True, limit: int = MAX_TOKENS) -> int | None:
    if key not in d or d[key] is None:
        if required:
            raise _LineError(f"missing {key!r}")
        return None
    v = d[key]
    if type(v) is not int:
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise _LineError(f"{key!r} must be an integer, got {shown(v)}")
    if v < 0:
        raise _LineError(f"{key!r} must be >= 0, got {shown(v)}")
    if v > limit:
        raise _LineError(f"{key!r} is {shown(v)}, over the limit of {limit:,}")
    return v


def _span(v: Any, what: str) -> Span:
    if not isinstance(v, list) or len(v) != 2 or not isinstance(v[0], str) or type(v[1]) is not int or v[1] < 0:
        raise _LineError(f"{what} must be [seed: str, length: int >= 0], got {shown(v)}")
    if v[1] > MAX_TOKENS:
        raise _LineError(f"{what} has length {shown(v[1])}, over the limit of {MAX_TOKENS:,} tokens")
    return Span(v[0], v[1])


def _parse_request(d: Any, index: int, block_size: int | None) -> Request:
    if not isinstance(d, dict):
        raise _LineError(f"expected a JSON object, got {type(d).__name__}")
    ts = d.get("timestamp")
    if ts is None:
        raise _LineError("missing 'timestamp'")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
        raise _LineError(f"'timestamp' must be a finite number >= 0 (ms), got {shown(ts)}")
    input_length = _int(d, "input_length")
    output_length = _int(d, "output_length")
    assert input_length is not None and output_length is not None
    session = d.get("session")
    if session is not None and not isinstance(session, (str, int)):
        raise _LineError(f"'session' must be a string, got {shown(session)}")
    turn = _int(d, "turn", required=False, limit=_MAX_INT)

    hash_ids = spans = None
    if "spans" in d:
        raw = d["spans"]
        if not isinstance(raw, list):
            raise _LineError(f"'spans' must be a list, got {type(raw).__name__}")
        spans = [_span(v, f"spans[{i}]") for i, v in enumerate(raw)]
        total = sum(s.length for s in spans)
        if total != input_length:
            raise _LineError(f"'input_length' is {input_length} but the spans add up to {total}")
    elif "hash_ids" in d:
        ids = d["hash_ids"]
        if not isinstance(ids, list):
            raise _LineError(f"'hash_ids' must be a list of integers, got {type(ids).__name__}")
        for i, h in enumerate(ids):
            if type(h) is not int or not 0 <= h < _MAX_HASH_ID:
                raise _LineError(f"'hash_ids'[{i}] is {shown(h)}: hash ids are integers in 0 .. 2**64-1")
        bs = block_size or MOONCAKE_BLOCK_SIZE
        if not input_length // bs <= len(ids) <= -(-input_length // bs):
            raise _LineError(
                f"{len(ids)} hash_ids do not fit 'input_length' {input_length} at block size {bs} "
                f"(expected {input_length // bs} to {-(-input_length // bs)})"
            )
        hash_ids = ids
    else:
        raise _LineError("needs 'spans' or 'hash_ids'")
    output_span = _span(d["output_span"], "'output_span'") if d.get("output_span") is not None else None
    return Request(
        index=index,
        timestamp_ms=float(ts),
        session=None if session is None else str(session),
        input_length=input_length,
        output_length=output_length,
        hash_ids=hash_ids,
        spans=spans,
        turn=turn,
        output_span=output_span,
        hash_block_size=(block_size or MOONCAKE_BLOCK_SIZE) if hash_ids is not None else None,
    )


class _Reader:
    """Parses a trace file lazily; ``header``/``format``/``block_size`` are known after ``open``."""

    def __init__(self, path: str | Path, limit: int | None = None) -> None:
        self.path = Path(path)
        self.limit = limit
        self.header: dict[str, Any] = {}
        self.format = "kvstrata"
        self.block_size: int | None = None
        self._pending: list[tuple[int, Any]] = []
        self._lines: Iterator[tuple[int, bytes]] = iter(())
        self._file: Any = None

    def _fail(self, lineno: int, msg: str) -> TraceFormatError:
        return TraceFormatError(f"{self.path}:{lineno}: {msg}")

    def _decode(self, lineno: int, line: bytes) -> Any:
        try:
            return json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise self._fail(lineno, f"not valid JSON: {exc}") from None
        except ValueError as exc:  # an integer of over 4,300 digits
            raise self._fail(lineno, f"not a trace line: {exc}") from None
        except RecursionError:
            raise self._fail(lineno, "not a trace line: JSON nested too deeply") from None

    def open(self) -> None:
        if self.limit is not None and self.limit < 0:
            raise ConfigError(f"limit must be >= 0, got {self.limit!r}", field="limit")
        try:
            self._file = self.path.open("rb")
        except OSError as exc:
            raise TraceFormatError(f"{self.path}: cannot read trace: {exc.strerror or exc}") from None
        self._lines = ((i, line) for i, line in enumerate(self._file, 1) if line.strip())
        first = next(self._lines, None)
        if first is None:
            self.close()
            raise TraceFormatError(f"{self.path}: empty trace (no requests)")
        lineno, line = first
        obj = self._decode(lineno, line)
        if isinstance(obj, dict) and "kvstrata_trace" in obj:
            version = obj["kvstrata_trace"]
            if version != FORMAT_VERSION:
                raise self._fail(lineno, f"unsupported kvstrata_trace version {shown(version)}")
            bs = obj.get("block_size")
            if bs is not None and (type(bs) is not int or not 0 < bs <= MAX_TOKENS):
                raise self._fail(
                    lineno, f"'block_size' must be null or an integer in 1 .. {MAX_TOKENS:,}, got {shown(bs)}"
                )
            self.header = obj
            self.block_size = bs
        else:
            self._pending.append((lineno, obj))
            if isinstance(obj, dict) and "hash_ids" in obj and "spans" not in obj:
                self.format = "mooncake"
                self.block_size = MOONCAKE_BLOCK_SIZE

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __iter__(self) -> Iterator[Request]:
        try:
            index = 0
            pending = iter(self._pending)
            decoded = ((n, self._decode(n, line)) for n, line in self._lines)
            if self.limit == 0:
                return
            for source in (pending, decoded):
                for lineno, obj in source:
                    try:
                        req = _parse_request(obj, index, self.block_size)
                    except _LineError as exc:
                        raise self._fail(lineno, str(exc)) from None
                    if req.hash_ids is not None and self.block_size is None:
                        self.block_size = req.hash_block_size
                    yield req
                    index += 1
                    if self.limit is not None and index >= self.limit:
                        return  # before the next line is read
            if index == 0:
                raise TraceFormatError(f"{self.path}: empty trace (no requests)")
        finally:
            self.close()


def iter_trace(path: str | Path, *, limit: int | None = None) -> Iterator[Request]:
    """Stream the requests of a trace file (either format)."""
    reader = _Reader(path, limit)
    reader.open()
    return iter(reader)


def read_trace(path: str | Path, *, limit: int | None = None) -> Trace:
    """Read a kvstrata JSONL or Mooncake FAST'25 trace (format detected from the first line).

    ``limit`` keeps the first ``limit`` requests. Malformed input raises
    :class:`~kvstrata.errors.TraceFormatError` naming ``FILE:LINE``.
    """
    reader = _Reader(path, limit)
    reader.open()
    requests = list(reader)
    return Trace(requests, reader.block_size, reader.format, reader.header, str(reader.path))
