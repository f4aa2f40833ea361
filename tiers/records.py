"""Record helpers shared by the persistent and pooled tiers (``nvme``, ``fs``, ``mooncake``).

Everything here is part of on-disk / in-pool formats: changing a value changes the bytes
that existing data was written with.

* :data:`ALIGN` (4096): ``O_DIRECT`` granularity; the ``nvme`` tier's chunks, staging buffers
  and direct reads, the ``mooncake`` tier's staging slabs.
* :data:`RECORD_ALIGN` (64): records start at multiples of a cache line inside an ``nvme``
  chunk, an ``fs`` object and a ``mooncake`` object, so packing, checksumming and copying
  out of staging buffers run on aligned memory, and a record wastes at most 63 bytes (none
  for the usual layer-block sizes, which are multiples of 64).
* :data:`KEY_BYTES` (16): a block key; :func:`block_key` appends the layer (u16 big-endian).
* :data:`RECORD_HEADER` (64): the self-describing header of an ``nvme`` record (format 3),
  :func:`pack_header` / :func:`parse_header`::

      0   magic "KVSN" | header version u8 (1) | flags u8 (bit 0: keyed) | layer u16 | key (16 B)
      24  payload length u32 | back u32: the payload starts this many bytes before the header
      32  seal (24 B): xxh3_64 of the payload (u64) and 16 zero bytes; keyed (a tier with a
          secret): the key id (8 B) and the keyed BLAKE3 tag (16 B) of :mod:`kvstrata.tiers.auth`
      56  xxh3_64 of bytes 0-55

  (little-endian). It repeats what the index entry of the record says, so a lost or damaged
  index can be rebuilt from the records alone. The headers of a chunk's records lie together
  after its payloads, so the payloads are where they would be without headers (a layer-block
  of a multiple of 4096 bytes stays page-aligned); a record's *extent* (:func:`record_extent`)
  is its payload rounded up to :data:`RECORD_ALIGN` plus its header.
* :func:`checksum` / :func:`digest`: xxh3_64, the one checksum of every tier's records and
  headers written without a secret (with one, records carry keyed BLAKE3 tags instead, see
  :mod:`kvstrata.tiers.auth`).
* :func:`meta_document` / :func:`legacy_meta`: a tier's ``meta.json`` (the namespace as
  :meth:`~kvstrata.core.keys.Namespace.stored`, its salt a digest) and the one written before.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import xxhash

from kvstrata.core import native
from kvstrata.core.buffers import host_bytes, is_device, nbytes
from kvstrata.core.keys import Key, Namespace
from kvstrata.core.layout import KVLayout
from kvstrata.errors import LayoutMismatchError
from kvstrata.tiers.base import BlockId

ALIGN = 4096
RECORD_ALIGN = 64
KEY_BYTES = 16
BLOCK_KEY_BYTES = KEY_BYTES + 2  # key + layer, see block_key
RECORD_HEADER = 64  # an nvme record's header (one cache line, so the payload after it stays aligned)
HEADER_MAGIC = b"KVSN"
HEADER_VERSION = 1
HEADER_KEYED = 1  # header flag: the seal is a key id and a keyed tag, not an xxh3_64
SEAL_BYTES = 24  # a header's seal: xxh3_64 + zeros, or key id (8 B) + keyed BLAKE3 tag (16 B)
_HEADER = struct.Struct("<4sBBH16sII24s")  # a header's first 56 bytes; then their xxh3_64
_SUM = struct.Struct("<Q")
_CHECKSUM_SEAL = struct.Struct("<Q16x")

__all__ = [
    "ALIGN",
    "BLOCK_KEY_BYTES",
    "KEY_BYTES",
    "RECORD_ALIGN",
    "RECORD_HEADER",
    "RecordHeader",
    "align_down",
    "align_up",
    "block_key",
    "checksum",
    "digest",
    "key_or_none",
    "legacy_meta",
    "meta_document",
    "pack_header",
    "pack_headers_into",
    "parse_block_key",
    "parse_header",
    "payload_extent",
    "record_extent",
]


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def align_down(n: int, align: int = ALIGN) -> int:
    return n // align * align


def payload_extent(length: int) -> int:
    """Bytes ``length`` payload bytes occupy when records are packed at :data:`RECORD_ALIGN` (the
    whole extent of an ``nvme`` record of format 2, which had no header)."""
    return align_up(length, RECORD_ALIGN)


def record_extent(length: int) -> int:
    """Bytes an ``nvme`` record of ``length`` payload bytes occupies: its payload rounded up to
    :data:`RECORD_ALIGN` and its header."""
    return align_up(length, RECORD_ALIGN) + RECORD_HEADER


class RecordHeader(NamedTuple):
    """What a record's header says: its block key (key + layer, as :func:`block_key`), payload
    length, how many bytes before the header the payload starts, and its seal (``checksum``
    without a secret, else ``tag``: key id + keyed tag)."""

    bkey: bytes
    length: int
    back: int
    checksum: int
    tag: bytes


def pack_header(bkey: bytes, length: int, back: int, csum: int, tag: bytes) -> bytes:
    """The :data:`RECORD_HEADER` bytes of a record: block key ``bkey``, ``length`` payload bytes that
    start ``back`` bytes before the header, sealed by ``csum`` or, when ``tag`` is given, by it."""
    seal = tag if tag else _CHECKSUM_SEAL.pack(csum)
    layer = int.from_bytes(bkey[KEY_BYTES:], "big")
    flags = HEADER_KEYED if tag else 0
    head = _HEADER.pack(HEADER_MAGIC, HEADER_VERSION, flags, layer, bkey[:KEY_BYTES], length, back, seal)
    return head + _SUM.pack(xxhash.xxh3_64_intdigest(head))


def pack_headers_into(
    buf: np.ndarray,
    at: int,
    records: Sequence[tuple[bytes, int, int]],
    seals: Sequence[tuple[int, bytes]],
    base: int = 0,
) -> int:
    """Write the headers of ``records`` (block key, payload position, length) sealed by ``seals``
    (checksum, tag) one after another from position ``at``, with one copy into the uint8 array
    ``buf``, which holds the bytes from position ``base`` on (0: all of them); returns where they
    end."""
    if _pack_checksum_headers(buf, at, records, seals, base):
        return at + len(records) * RECORD_HEADER
    heads = b"".join(
        pack_header(k, n, at + i * RECORD_HEADER - pos, c, t)
        for i, ((k, pos, n), (c, t)) in enumerate(zip(records, seals, strict=True))
    )
    buf[at - base : at - base + len(heads)] = np.frombuffer(heads, np.uint8)
    return at + len(heads)


# A header as numpy sees it (see the module docstring); the seal's 16 zero bytes (40-55) unnamed.
_HEAD = np.dtype(
    {
        "names": ["magic", "version", "flags", "layer", "key", "length", "back", "csum", "sum"],
        "formats": ["V4", "u1", "u1", "<u2", "V16", "<u4", "<u4", "<u8", "<u8"],
        "offsets": [0, 4, 5, 6, 8, 24, 28, 32, 56],
        "itemsize": RECORD_HEADER,
    }
)
_BLOCK_KEY = np.dtype([("key", "V16"), ("layer", ">u2")])
_U32_MAX = (1 << 32) - 1


def _pack_checksum_headers(
    buf: np.ndarray, at: int, records: Sequence[tuple[bytes, int, int]], seals: Sequence[tuple[int, bytes]], base: int
) -> bool:
    """:func:`pack_headers_into` of records sealed by checksums (no tag) in a few array operations
    and one call of the extension that hashes every header (256 headers: ~0.05 ms, against
    ~0.7 ms one :func:`pack_header` at a time, on the path to a write's first ``pwrite``); the
    same bytes. False (nothing written) where it does not apply: no extension, a tag, a key that
    is not a block key, or a value a header cannot hold (the one-at-a-time path then says which)."""
    mod = native.NATIVE
    n = len(records)
    if mod is None or n == 0 or len(seals) != n or any(t for _, t in seals):
        return False
    keys = b"".join([k for k, _, _ in records])
    lengths = np.fromiter((m for _, _, m in records), np.int64, n)
    backs = at + np.arange(n, dtype=np.int64) * RECORD_HEADER - np.fromiter((p for _, p, _ in records), np.int64, n)
    if len(keys) != n * BLOCK_KEY_BYTES or lengths.min() < 0 or lengths.max() > _U32_MAX:
        return False
    if backs.min() < 0 or backs.max() > _U32_MAX:
        return False
    region = buf[at - base : at - base + n * RECORD_HEADER]
    if region.nbytes != n * RECORD_HEADER or region.dtype != np.uint8 or not region.flags.c_contiguous:
        return False
    block = np.frombuffer(keys, _BLOCK_KEY)
    head = region.view(_HEAD)
    region[:] = 0
    head["magic"] = np.frombuffer(HEADER_MAGIC, "V4")[0]
    head["version"] = HEADER_VERSION
    head["layer"] = block["layer"]
    head["key"] = block["key"]
    head["length"] = lengths
    head["back"] = backs
    head["csum"] = np.fromiter((c for c, _ in seals), np.uint64, n)
    addrs = np.uint64(region.ctypes.data) + np.arange(n, dtype=np.uint64) * np.uint64(RECORD_HEADER)
    sums = np.empty(n, np.uint64)
    mod.hash_at(addrs, np.full(n, _HEADER.size, np.int64), sums)
    head["sum"] = sums
    return True


def parse_header(buf: Any, at: int) -> RecordHeader | None:
    """The header at ``at`` of ``buf`` (a memoryview or bytes), or None when those bytes are not an
    intact header of this version (damaged, torn, padding, a payload)."""
    head = bytes(buf[at : at + RECORD_HEADER])
    if len(head) < RECORD_HEADER or head[:4] != HEADER_MAGIC:
        return None
    if _SUM.unpack_from(head, _HEADER.size)[0] != xxhash.xxh3_64_intdigest(head[: _HEADER.size]):
        return None
    _, version, flags, layer, key, length, back, seal = _HEADER.unpack_from(head)
    if version != HEADER_VERSION:
        return None
    bkey = key + layer.to_bytes(2, "big")
    if flags & HEADER_KEYED:
        return RecordHeader(bkey, length, back, 0, bytes(seal))
    return RecordHeader(bkey, length, back, _CHECKSUM_SEAL.unpack(seal)[0], b"")


def checksum(data: np.ndarray) -> int:
    """xxh3_64 of a contiguous uint8 array."""
    return xxhash.xxh3_64_intdigest(data.data)


def digest(data: Any) -> int:
    """xxh3_64 of bytes (or any contiguous buffer): headers and tombstones."""
    return xxhash.xxh3_64_intdigest(data)


def block_key(bid: BlockId) -> bytes:
    """The 18-byte index key of a layer-block; ``ValueError`` for a malformed id."""
    key, layer = bid
    layer = int(layer)
    if not isinstance(key, bytes) or len(key) != KEY_BYTES or not 0 <= layer < 1 << 16:
        raise ValueError(f"bad block id {bid!r}")
    return key + layer.to_bytes(2, "big")


def key_or_none(bid: BlockId) -> bytes | None:
    """:func:`block_key`, or ``None`` for a malformed id (a tier reports those as misses)."""
    try:
        return block_key(bid)
    except (ValueError, TypeError):
        return None


def parse_block_key(raw: bytes) -> BlockId:
    return Key(raw[:KEY_BYTES]), int.from_bytes(raw[KEY_BYTES:], "big")


def check_meta(raw: str | bytes, expected: dict[str, Any], version: int, where: str, hint: str = "") -> None:
    """Refuse a stored ``meta.json`` (read as ``raw`` from ``where``) that is not ``expected``:
    unreadable, another format version, or another layout/namespace. ``hint`` ends the format
    message (what the operator can do). Raises :class:`LayoutMismatchError`; a tier that
    serves data under a meta it cannot vouch for would feed wrong KV to a model."""
    try:
        stored = json.loads(raw)
    except ValueError as exc:
        raise LayoutMismatchError(f"{where}: unreadable ({exc}); refusing to serve its data") from exc
    found = stored.get("format") if isinstance(stored, dict) else None
    if found != version:
        raise LayoutMismatchError(
            f"{where}: on-disk format {found!r}, this engine reads format {version} only; "
            f"refusing to serve its data{hint}"
        )
    if stored != json.loads(json.dumps(expected)):
        raise LayoutMismatchError(f"{where}: stored layout/namespace differs from this engine's")


def meta_document(fmt: int, layout: KVLayout, namespace: Namespace, **extra: Any) -> dict[str, Any]:
    """A tier's ``meta.json``: format, layout and the namespace as stored (its salt as a digest only)."""
    return {"format": fmt, **extra, "layout": layout.to_dict(), "namespace": namespace.stored()}


def legacy_meta(raw: str | bytes, meta: dict[str, Any], namespace: Namespace) -> bool:
    """Whether ``raw`` is ``meta`` as written before salts were stored as digests (the salt in
    clear): a tier that finds one rewrites it, so the salt leaves the disk."""
    if not namespace.tenant_salt:
        return False
    try:
        stored = json.loads(raw)
    except ValueError:
        return False
    return bool(stored == json.loads(json.dumps({**meta, "namespace": namespace.canonical()})))


def acceptable_buffer(buf: Any, length: int) -> bool:
    """Whether ``buf`` is a contiguous buffer (host or device) of exactly ``length`` bytes: what a
    tier accepts as one layer-block to write or to read into."""
    if type(buf) is np.ndarray:  # usual: a row of the caller's array (no view, no torch check)
        return bool(buf.flags.c_contiguous) and buf.nbytes == length
    try:
        if is_device(buf):
            if not buf.is_contiguous():
                return False
        else:
            host_bytes(buf)  # raises ValueError for a non-contiguous buffer
        return nbytes(buf) == length
    except (AttributeError, TypeError, ValueError):
        return False
