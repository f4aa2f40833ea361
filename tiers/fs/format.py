"""On-store format of the ``fs`` tier: object names, data objects and tombstones.

Layout under ``<url>/<namespace fingerprint>/``::

    meta.json                                  layout, namespace (salt as a digest), format
    objects/<epoch>/<ts>-<writer>-<seq>.kvo    data objects: a header table, then records
    tombs/<epoch>/<ts>-<writer>-<seq>.kvt      tombstones: (object, block) pairs deleted
    quarantine/<ts>-<writer>-<seq>.kvo         objects that failed a checksum, moved aside
    k<key id>/objects/..., k<key id>/tombs/..., k<key id>/quarantine/...
                                               the same, written by tiers with a secret

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

An object made by *compaction* (the live records of one sparse object, rewritten) has the
magic ``KVSFSOL1`` (keyed ``KVSFSOL2``) and, after the entries, its *lineage*: ``count u16``
then per replaced object ``length u8 | stem`` (the object it was compacted from first, then
that one's lineage; at most ``MAX_LINEAGE``). Its records are the same copies as the
replaced object's, so a tombstone naming a replaced object applies to it too: a node that
deletes a block from the old object while another compacts it still deletes the block.
A reader older than this format quarantines such objects (a miss, never wrong bytes).

Keyed format (a tier with a secret, :mod:`kvstrata.tiers.auth`; its own area
``k<key id>/``, so tiers without the secret never see these objects nor it theirs)::

    header  magic "KVSFSOB2" | header_len u32 | count u32 | key id 8 B | tag 16 B
            count x (block key 18 B | offset u64 | length u32 | record tag 16 B)
    tombstone  magic "KVSFSTB2" | size u32 | count u32 | tag 16 B | body as above

A record tag is the keyed BLAKE3 of (block key, length, bytes); the header tag covers the
header (its tag field zeroed) and the object's name, a tombstone's its body and its name. So
nobody without the secret can publish an object or tombstone that a keyed reader accepts, nor
replay one under another name or a record under another block id: a header that fails is
quarantined at discovery (it never displaces a genuine copy), a record that fails on read is
``CORRUPT`` and its object quarantined. An unkeyed object in a keyed area fails the same way.
"""

from __future__ import annotations

import re
import struct
from typing import NamedTuple

import numpy as np

from kvstrata.errors import KVStrataError
from kvstrata.tiers.auth import MAC_BYTES, RecordKey, record_prefix
from kvstrata.tiers.records import BLOCK_KEY_BYTES, RECORD_ALIGN, align_up, checksum, digest

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
_KOBJ_MAGIC = b"KVSFSOB2"  # keyed (see the module docstring)
_KTOMB_MAGIC = b"KVSFSTB2"
_KHEAD = struct.Struct("<8sII8s16s")  # magic, header_len, count, key id, header tag
_KENTRY = struct.Struct("<18sQI16s")  # block key, offset, length, record tag
_KTOMB = struct.Struct("<8sII16s")  # magic, size, count, tombstone tag
_LOBJ_MAGIC = b"KVSFSOL1"  # an object made by compaction: the header names the objects it replaces
_KLOBJ_MAGIC = b"KVSFSOL2"  # the same, keyed
_LINEAGE_COUNT = struct.Struct("<H")
MAX_LINEAGE = 8  # ancestors a compacted object names (the newest first)
_MAX_LINEAGE_BYTES = _LINEAGE_COUNT.size + MAX_LINEAGE * (1 + 12 + 1 + 32 + 1 + 8)
_RECORD, _HEADER, _TOMBSTONE = b"F", b"H", b"T"  # kinds of tags (kvstrata.tiers.auth.record_prefix)
_TOMB_GROUP = struct.Struct("<HI")  # object stem length, block count
_STEM_RE = re.compile(r"^([0-9a-f]{12})-([0-9a-f]{4,32})-([0-9a-f]{8})$")


class FormatError(KVStrataError, ValueError):
    """Stored bytes are not a valid object header or tombstone (treated like a checksum failure)."""


class Rec(NamedTuple):
    """Where a layer-block lives inside its object; ``checksum`` (xxh3_64) in an unkeyed object,
    ``tag`` (keyed BLAKE3) in a keyed one."""

    offset: int
    length: int
    checksum: int
    tag: bytes = b""

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

    def object_path(self, area: str = "") -> str:
        """Relative path of the object in ``area`` ("" or ``k<key id>/``)."""
        return f"{area}{OBJECTS}/{self.epoch:08x}/{self.stem}{OBJ_SUFFIX}"

    def tomb_path(self, area: str = "") -> str:
        return f"{area}{TOMBS}/{self.epoch:08x}/{self.stem}{TOMB_SUFFIX}"

    def quarantine_path(self, area: str = "") -> str:
        return f"{area}{QUARANTINE}/{self.stem}{OBJ_SUFFIX}"


def key_area(key: RecordKey | None) -> str:
    """The directory prefix of a tier's objects: "" without a secret, ``k<key id>/`` with one."""
    return "" if key is None else f"k{key.kid.hex()}/"


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


def header_size(count: int, keyed: bool = False, lineage: tuple[str, ...] = ()) -> int:
    return align_up(_entries_end(count, keyed) + _lineage_bytes(lineage), RECORD_ALIGN)


def _entries_end(count: int, keyed: bool) -> int:
    return (_KHEAD.size + count * _KENTRY.size) if keyed else (_HEAD.size + count * _ENTRY.size)


def _lineage_bytes(lineage: tuple[str, ...]) -> int:
    return _LINEAGE_COUNT.size + sum(1 + len(stem) for stem in lineage) if lineage else 0


def plan_object(lengths: list[int], keyed: bool = False, lineage: tuple[str, ...] = ()) -> tuple[int, list[int]]:
    """(object size, record offsets) of an object holding records of ``lengths``, in order
    (``lineage``: the stems of the objects a compacted one replaces, see :func:`pack_header`)."""
    pos = header_size(len(lengths), keyed, lineage)
    offsets = []
    for n in lengths:
        offsets.append(pos)
        pos += align_up(n, RECORD_ALIGN)
    return pos, offsets


def split_batch(lengths: list[int], target: int, keyed: bool = False) -> list[tuple[int, int]]:
    """Split records ``lengths`` into consecutive runs ``[lo, hi)`` whose objects stay within
    ``target`` bytes (a record too large for that gets an object of its own)."""
    runs: list[tuple[int, int]] = []
    lo = 0
    size = header_size(0, keyed)
    entry = _KENTRY.size if keyed else _ENTRY.size
    for i, n in enumerate(lengths):
        grow = entry + align_up(n, RECORD_ALIGN)
        if i > lo and size + grow > target:
            runs.append((lo, i))
            lo, size = i, header_size(0, keyed)
        size += grow
    if lo < len(lengths):
        runs.append((lo, len(lengths)))
    return runs


def batch_cost(lengths: list[int], target: int, keyed: bool = False) -> int:
    """Bytes the objects of one write of ``lengths`` occupy (what ``write`` will publish)."""
    return sum(plan_object(lengths[lo:hi], keyed)[0] for lo, hi in split_batch(lengths, target, keyed))


def _named(kind: bytes, stem: str) -> bytes:
    raw = stem.encode()
    return kind + len(raw).to_bytes(2, "little") + raw


def record_tag(key: RecordKey, bkey: bytes, data: np.ndarray) -> bytes:
    """The keyed tag of one record's bytes, bound to its block key and length."""
    return key.mac(record_prefix(_RECORD, bkey, len(data)), data)


def record_intact(key: RecordKey | None, bkey: bytes, rec: Rec, data: np.ndarray) -> bool:
    """Whether ``data`` are the bytes of ``rec`` (``key``: the tier's record key, None without a secret)."""
    if len(data) != rec.length:
        return False
    if key is None:
        return checksum(data) == rec.checksum
    return key.check(rec.tag, record_prefix(_RECORD, bkey, rec.length), data)


class Header(NamedTuple):
    """A parsed object header: its records and, for an object made by compaction, the stems of
    the objects it replaces (newest first): a tombstone naming one of those applies to it too."""

    recs: dict[bytes, Rec]
    lineage: tuple[str, ...] = ()


def pack_header(
    entries: list[tuple[bytes, Rec]], key: RecordKey | None = None, stem: str = "", lineage: tuple[str, ...] = ()
) -> bytes:
    """The header of an object holding ``entries`` (block key, record), padded to its size;
    with ``key``, the keyed header of the object named ``stem`` (records carry their tags).

    ``lineage`` (compaction): after the entries, ``count u16`` then per stem ``length u8 | ascii``,
    under the magic ``KVSFSOL1`` (keyed ``KVSFSOL2``), covered by the header's checksum or tag."""
    if len(lineage) > MAX_LINEAGE or any(_STEM_RE.fullmatch(s) is None for s in lineage):
        raise ValueError(f"bad lineage {lineage!r} (at most {MAX_LINEAGE} object stems)")
    keyed = key is not None
    size = header_size(len(entries), keyed, lineage)
    out = bytearray(size)
    for i, (bkey, rec) in enumerate(entries):
        if keyed:
            _KENTRY.pack_into(out, _KHEAD.size + i * _KENTRY.size, bkey, rec.offset, rec.length, rec.tag)
        else:
            _ENTRY.pack_into(out, _HEAD.size + i * _ENTRY.size, bkey, rec.offset, rec.length, rec.checksum)
    if lineage:
        pos = _entries_end(len(entries), keyed)
        _LINEAGE_COUNT.pack_into(out, pos, len(lineage))
        pos += _LINEAGE_COUNT.size
        for ancestor in lineage:
            raw = ancestor.encode()
            out[pos : pos + 1 + len(raw)] = bytes([len(raw)]) + raw
            pos += 1 + len(raw)
    if key is not None:
        magic = _KLOBJ_MAGIC if lineage else _KOBJ_MAGIC
        _KHEAD.pack_into(out, 0, magic, size, len(entries), key.kid, bytes(MAC_BYTES))
        _KHEAD.pack_into(out, 0, magic, size, len(entries), key.kid, key.mac(_named(_HEADER, stem), out))
    else:
        magic = _LOBJ_MAGIC if lineage else _OBJ_MAGIC
        _HEAD.pack_into(out, 0, magic, size, len(entries), 0)
        _HEAD.pack_into(out, 0, magic, size, len(entries), digest(bytes(out)))
    return bytes(out)


def header_length(prefix: bytes, keyed: bool = False) -> int:
    """Bytes of the header that starts ``prefix`` (at least its fixed part); ``keyed``: a keyed
    tier's header (an unkeyed one is refused, see the module docstring)."""
    head = _KHEAD if keyed else _HEAD
    if len(prefix) < head.size:
        raise FormatError(f"object too short for a header ({len(prefix)} bytes)")
    magic, size, count = struct.unpack_from("<8sII", prefix)
    if keyed and magic in (_OBJ_MAGIC, _LOBJ_MAGIC):
        raise FormatError("object written without the secret (unauthenticated) in a keyed area")
    plain, compacted = (_KOBJ_MAGIC, _KLOBJ_MAGIC) if keyed else (_OBJ_MAGIC, _LOBJ_MAGIC)
    if magic == plain and size == header_size(count, keyed):
        return int(size)
    low = _entries_end(count, keyed) + _LINEAGE_COUNT.size
    high = align_up(low + _MAX_LINEAGE_BYTES, RECORD_ALIGN)
    if magic == compacted and size % RECORD_ALIGN == 0 and low <= size <= high:
        return int(size)
    raise FormatError("not a kvstrata fs object (bad magic or header size)")


def unpack_header(data: bytes, object_size: int, key: RecordKey | None = None, stem: str = "") -> dict[bytes, Rec]:
    """The records of an object header (see :func:`read_header`)."""
    return read_header(data, object_size, key, stem).recs


def read_header(data: bytes, object_size: int, key: RecordKey | None = None, stem: str = "") -> Header:
    """Parse and check an object header (``data`` holds at least ``header_length`` bytes); with
    ``key``, a keyed header of the object named ``stem`` whose tag must verify."""
    keyed = key is not None
    size = header_length(data, keyed)
    if len(data) < size:
        raise FormatError(f"header needs {size} bytes, got {len(data)}")
    head = bytearray(data[:size])
    if key is not None:
        magic, _, count, kid, tag = _KHEAD.unpack_from(head)
        if kid != key.kid:
            raise FormatError(f"object keyed with key id {kid.hex()} in the area of key id {key.kid.hex()}")
        _KHEAD.pack_into(head, 0, magic, size, count, kid, bytes(MAC_BYTES))
        if not key.check(tag, _named(_HEADER, stem), head):
            raise FormatError("object header fails its keyed check (not written with this secret, or renamed)")
    else:
        magic, _, count, stored = _HEAD.unpack_from(head)
        _HEAD.pack_into(head, 0, magic, size, count, 0)
        if digest(bytes(head)) != stored:
            raise FormatError("object header checksum mismatch")
    out: dict[bytes, Rec] = {}
    for i in range(count):
        if key is not None:
            bkey, offset, length, rtag = _KENTRY.unpack_from(head, _KHEAD.size + i * _KENTRY.size)
            rec = Rec(offset, length, 0, bytes(rtag))
        else:
            bkey, offset, length, csum = _ENTRY.unpack_from(head, _HEAD.size + i * _ENTRY.size)
            rec = Rec(offset, length, csum)
        if offset < size or offset + length > object_size:
            raise FormatError(f"record {i} at {offset}+{length} lies outside the object ({object_size} bytes)")
        out[bytes(bkey)] = rec
    lineage = _read_lineage(head, _entries_end(count, keyed)) if magic in (_LOBJ_MAGIC, _KLOBJ_MAGIC) else ()
    if size != header_size(count, keyed, lineage):
        raise FormatError("object header size does not match its lineage")
    return Header(out, lineage)


def _read_lineage(head: bytearray, pos: int) -> tuple[str, ...]:
    (n,) = _LINEAGE_COUNT.unpack_from(head, pos)
    pos += _LINEAGE_COUNT.size
    if not 0 < n <= MAX_LINEAGE:
        raise FormatError(f"object header names {n} replaced objects (1..{MAX_LINEAGE})")
    stems = []
    for _ in range(n):
        length = head[pos] if pos < len(head) else 0
        stem = bytes(head[pos + 1 : pos + 1 + length]).decode("ascii", "replace")
        if _STEM_RE.fullmatch(stem) is None:
            raise FormatError("object header names a replaced object that is not an object name")
        stems.append(stem)
        pos += 1 + length
    return tuple(stems)


# -- tombstones -----------------------------------------------------------------------------------


def pack_tomb(groups: dict[str, list[bytes]], key: RecordKey | None = None, name: str = "") -> bytes:
    """A tombstone: for each object stem, the block keys deleted from it (with ``key``: keyed,
    bound to its own stem ``name``)."""
    body = bytearray()
    for stem, bkeys in groups.items():
        raw = stem.encode()
        body += _TOMB_GROUP.pack(len(raw), len(bkeys)) + raw + b"".join(bkeys)
    if key is not None:
        return _KTOMB.pack(
            _KTOMB_MAGIC, _KTOMB.size + len(body), len(groups), key.mac(_named(_TOMBSTONE, name), body)
        ) + (body)
    return _HEAD.pack(_TOMB_MAGIC, _HEAD.size + len(body), len(groups), digest(bytes(body))) + body


def unpack_tomb(data: bytes, key: RecordKey | None = None, name: str = "") -> dict[str, list[bytes]]:
    if key is not None:
        if len(data) < _KTOMB.size:
            raise FormatError("tombstone too short")
        magic, size, count, tag = _KTOMB.unpack_from(data)
        body = data[_KTOMB.size : size]
        if magic != _KTOMB_MAGIC or size != len(data) or not key.check(tag, _named(_TOMBSTONE, name), body):
            raise FormatError("tombstone fails its keyed check (not written with this secret, or renamed)")
    else:
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
