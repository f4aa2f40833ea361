"""On-store format of the ``fs`` tier: object names, data objects and tombstones.

Layout under ``<url>/<namespace fingerprint>/``::

    meta.json                                  layout, namespace, format (checked at open)
    objects/<epoch>/<ts>-<writer>-<seq>.kvo    data objects: a header table, then records
    tombs/<epoch>/<ts>-<writer>-<seq>.kvt      tombstones: (object, block) pairs deleted
    quarantine/<ts>-<writer>-<seq>.kvo         objects that failed a checksum, moved aside

``ts`` is the writer's wall clock in milliseconds (12 hex digits), ``writer`` a random
id per tier instance and ``seq`` a counter, so names never collide and sort in
publication order; ``epoch`` is ``ts // 1000 // EPOCH_S`` (8 hex digits), so a refresh
lists only the few recent epoch directories instead of the whole namespace.

A *data object* is published with one atomic operation (a single PUT, or temp file +
rename) and never changes afterwards::

    header  magic "KVSFSOB1" | header_len u32 | count u32 | checksum u64 (xxh3_64 of the
            header with this field zeroed)
            count x (block key 16 B | layer u16 | offset u64 | length u32 | xxh3_64 u64)
            zero padding to header_len (a multiple of RECORD_ALIGN)
    records each at a RECORD_ALIGN-aligned offset, zero-padded between

The header alone tells what an object holds, so discovering another writer's object
costs one ranged GET of its first bytes. A *tombstone* lists, per object, the blocks
deleted from that object (a tombstone never touches another copy of the block in a
newer object); it has the same magic/checksum framing.
"""

from __future__ import annotations

import re
import struct
from typing import NamedTuple

from kvstrata.errors import KVStrataError
from kvstrata.tiers.records import BLOCK_KEY_BYTES, RECORD_ALIGN, align_up, digest

FORMAT_VERSION = 1
EPOCH_S = 60  # width of one epoch directory, seconds
HEAD_PROBE = 64 * 1024  # bytes fetched to read an unknown object's header (about 1700 entries)
META = "meta.json"
OBJECTS = "objects"
TOMBS = "tombs"
QUARANTINE = "quarantine"
OBJ_SUFFIX = ".kvo"
TOMB_SUFFIX = ".kvt"
TMP_SUFFIX = ".tmp"

_OBJ_MAGIC = b"KVSFSOB1"
_TOMB_MAGIC = b"KVSFSTB1"
_HEAD = struct.Struct("<8sIIQ")  # magic, header_len, count, checksum
_ENTRY = struct.Struct("<18sQIQ")  # block key (key + layer BE), offset, length, checksum
_TOMB_GROUP = struct.Struct("<HI")  # object stem length, block count
_STEM_RE = re.compile(r"^([0-9a-f]{12})-([0-9a-f]{4,32})-([0-9a-f]{8})$")


class FormatError(KVStrataError, ValueError):
    """Stored bytes are not a valid object header or tombstone (treated like a checksum failure)."""


class Rec(NamedTuple):
    """Where a layer-block lives inside its object."""

    offset: int
    length: int
    checksum: int

    @property
    def end(self) -> int:
        return self.offset + self.length


class Name(NamedTuple):
    """A parsed object or tombstone name; tuples of it sort in publication order."""

    ts_ms: int
    writer: str
    seq: int

    @property
    def stem(self) -> str:
        return f"{self.ts_ms:012x}-{self.writer}-{self.seq:08x}"

    @property
    def epoch(self) -> int:
        return epoch_of(self.ts_ms / 1000)

    def object_path(self) -> str:
        return f"{OBJECTS}/{self.epoch:08x}/{self.stem}{OBJ_SUFFIX}"

    def tomb_path(self) -> str:
        return f"{TOMBS}/{self.epoch:08x}/{self.stem}{TOMB_SUFFIX}"

    def quarantine_path(self) -> str:
        return f"{QUARANTINE}/{self.stem}{OBJ_SUFFIX}"


def epoch_of(wall_s: float) -> int:
    return int(wall_s // EPOCH_S)


def parse_name(rel: str, suffix: str) -> Name | None:
    """The name of ``<dir>/<epoch>/<stem><suffix>``; None for anything else (temp files, strays)."""
    base = rel.rsplit("/", 1)[-1]
    if not base.endswith(suffix):
        return None
    m = _STEM_RE.match(base[: -len(suffix)])
    if m is None:
        return None
    return Name(int(m.group(1), 16), m.group(2), int(m.group(3), 16))


# -- data objects -------------------------------------------------------------------------------


def header_size(count: int) -> int:
    return align_up(_HEAD.size + count * _ENTRY.size, RECORD_ALIGN)


def plan_object(lengths: list[int]) -> tuple[int, list[int]]:
    """(object size, record offsets) of an object holding records of ``lengths``, in order."""
    pos = header_size(len(lengths))
    offsets = []
    for n in lengths:
        offsets.append(pos)
        pos += align_up(n, RECORD_ALIGN)
    return pos, offsets


def split_batch(lengths: list[int], target: int) -> list[tuple[int, int]]:
    """Split records ``lengths`` into consecutive runs ``[lo, hi)`` whose objects stay within
    ``target`` bytes (a record too large for that gets an object of its own)."""
    runs: list[tuple[int, int]] = []
    lo = 0
    size = header_size(0)
    for i, n in enumerate(lengths):
        grow = _ENTRY.size + align_up(n, RECORD_ALIGN)
        if i > lo and size + grow > target:
            runs.append((lo, i))
            lo, size = i, header_size(0)
        size += grow
    if lo < len(lengths):
        runs.append((lo, len(lengths)))
    return runs


def batch_cost(lengths: list[int], target: int) -> int:
    """Bytes the objects of one write of ``lengths`` occupy (what ``write`` will publish)."""
    return sum(plan_object(lengths[lo:hi])[0] for lo, hi in split_batch(lengths, target))


def pack_header(entries: list[tuple[bytes, Rec]]) -> bytes:
    """The header of an object holding ``entries`` (block key, record), padded to its size."""
    size = header_size(len(entries))
    out = bytearray(size)
    for i, (bkey, rec) in enumerate(entries):
        _ENTRY.pack_into(out, _HEAD.size + i * _ENTRY.size, bkey, rec.offset, rec.length, rec.checksum)
    _HEAD.pack_into(out, 0, _OBJ_MAGIC, size, len(entries), 0)
    _HEAD.pack_into(out, 0, _OBJ_MAGIC, size, len(entries), digest(bytes(out)))
    return bytes(out)


def header_length(prefix: bytes) -> int:
    """Bytes of the header that starts ``prefix`` (at least its fixed part)."""
    if len(prefix) < _HEAD.size:
        raise FormatError(f"object too short for a header ({len(prefix)} bytes)")
    magic, size, count, _ = _HEAD.unpack_from(prefix)
    if magic != _OBJ_MAGIC or size != header_size(count):
        raise FormatError("not a kvstrata fs object (bad magic or header size)")
    return int(size)


def unpack_header(data: bytes, object_size: int) -> dict[bytes, Rec]:
    """Parse and check an object header (``data`` holds at least ``header_length`` bytes)."""
    size = header_length(data)
    if len(data) < size:
        raise FormatError(f"header needs {size} bytes, got {len(data)}")
    head = bytearray(data[:size])
    magic, _, count, stored = _HEAD.unpack_from(head)
    _HEAD.pack_into(head, 0, magic, size, count, 0)
    if digest(bytes(head)) != stored:
        raise FormatError("object header checksum mismatch")
    out: dict[bytes, Rec] = {}
    for i in range(count):
        bkey, offset, length, csum = _ENTRY.unpack_from(head, _HEAD.size + i * _ENTRY.size)
        if offset < size or offset + length > object_size:
            raise FormatError(f"record {i} at {offset}+{length} lies outside the object ({object_size} bytes)")
        out[bytes(bkey)] = Rec(offset, length, csum)
    return out


# -- tombstones -----------------------------------------------------------------------------------


def pack_tomb(groups: dict[str, list[bytes]]) -> bytes:
    """A tombstone: for each object stem, the block keys deleted from it."""
    body = bytearray()
    for stem, bkeys in groups.items():
        raw = stem.encode()
        body += _TOMB_GROUP.pack(len(raw), len(bkeys)) + raw + b"".join(bkeys)
    return _HEAD.pack(_TOMB_MAGIC, _HEAD.size + len(body), len(groups), digest(bytes(body))) + body


def unpack_tomb(data: bytes) -> dict[str, list[bytes]]:
    if len(data) < _HEAD.size:
        raise FormatError("tombstone too short")
    magic, size, count, csum = _HEAD.unpack_from(data)
    body = data[_HEAD.size : size]
    if magic != _TOMB_MAGIC or size != len(data) or digest(body) != csum:
        raise FormatError("tombstone damaged (bad magic, size or checksum)")
    out: dict[str, list[bytes]] = {}
    pos = 0
    for _ in range(count):
        n, m = _TOMB_GROUP.unpack_from(body, pos)
        pos += _TOMB_GROUP.size
        stem = body[pos : pos + n].decode()
        pos += n
        out[stem] = [body[pos + j * BLOCK_KEY_BYTES : pos + (j + 1) * BLOCK_KEY_BYTES] for j in range(m)]
        pos += m * BLOCK_KEY_BYTES
    return out
