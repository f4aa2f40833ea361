"""How layer-blocks lie in pool objects: spans of layers per object, and the self-checking
record (64-byte header, then the bytes) that every layer is stored as (see the package docstring).

A tier with a secret writes *keyed* records (format 2) instead::

    0    magic "KVMR", format u16 (2), layer u16, flags u16, reserved u16, length u32
    16   key id (8 B), zeros (8 B), key (16 B)
    48   keyed BLAKE3 tag (16 B) of the block id, the length, header bytes 0-47 and the bytes

so only holders of the secret can make a record that a keyed reader accepts, and a record is
bound to its namespace (through the key), key and layer.
"""

from __future__ import annotations

import hmac
import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from kvstrata.core.buffers import Buffer, copy_bytes
from kvstrata.core.layout import KVLayout
from kvstrata.tiers.auth import RecordKey, record_prefix
from kvstrata.tiers.records import RECORD_ALIGN, align_up, checksum, digest

MAGIC = b"KVMR"


FORMAT_VERSION = 1
KEYED_FORMAT = 2


RECORD_HEADER = 64


PRESENT = 1


_REC = struct.Struct("<4sHHHHI16s16sQ")  # a record header's first 56 bytes; then their xxh3_64


_SUM = struct.Struct("<Q")


_KREC = struct.Struct("<4sHHHHI8s8x16s")  # a keyed record header's first 48 bytes; then its tag (16 B)
_KIND = b"M"  # the kind byte of a pool record's tag (kvstrata.tiers.auth.record_prefix)


@dataclass(frozen=True)
class LayerSpan:
    """Consecutive layers of one group that share an object."""

    layers: tuple[int, ...]
    lengths: tuple[int, ...]
    offsets: tuple[int, ...]  # where each layer's record starts in the object
    size: int
    tag: str  # last part of the object name

    @property
    def overhead(self) -> int:
        return self.size - sum(self.lengths)


def _record_bytes(length: int) -> int:
    return RECORD_HEADER + align_up(length, RECORD_ALIGN)


def _make_span(layout: KVLayout, layers: list[int]) -> LayerSpan:
    lengths = tuple(layout.layer_nbytes(layer) for layer in layers)
    offsets, at = [], 0
    for n in lengths:
        offsets.append(at)
        at += _record_bytes(n)
    digest = xxhash.xxh32_hexdigest(",".join(map(str, layers)).encode())
    return LayerSpan(tuple(layers), lengths, tuple(offsets), at, f"{layers[0]}-{layers[-1]}-{digest}")


def plan_spans(layout: KVLayout, object_size: int) -> list[LayerSpan]:
    """Cut every layer group into spans of consecutive layers whose object fits ``object_size``."""
    spans: list[LayerSpan] = []
    for group in layout.groups:
        current: list[int] = []
        for layer in group.layers:
            if current and _make_span(layout, [*current, layer]).size > object_size:
                spans.append(_make_span(layout, current))
                current = []
            current.append(layer)
        if current:
            spans.append(_make_span(layout, current))
    return spans


def _tag(auth: RecordKey, head: bytes, layer: int, length: int, key: bytes, body: np.ndarray | None) -> bytes:
    prefix = record_prefix(_KIND, key + layer.to_bytes(2, "big"), length) + head
    return auth.mac(prefix, b"" if body is None else body)


def write_record(
    record: np.ndarray,
    layer: int,
    length: int,
    seed: bytes,
    key: bytes,
    data: Buffer | None,
    auth: RecordKey | None = None,
) -> None:
    """Fill one record's extent: the layer's ``length`` bytes from ``data`` (None: absent, zeros)
    and the header (keyed with ``auth``, which replaces ``seed``)."""
    body = record[RECORD_HEADER:]
    if auth is not None:
        if data is None:
            body[:] = 0
        else:
            copy_bytes(body[:length], data)
            body[length:] = 0
        flags = 0 if data is None else PRESENT
        head = _KREC.pack(MAGIC, KEYED_FORMAT, layer, flags, 0, length, auth.kid, key)
        tag = _tag(auth, head, layer, length, key, None if data is None else body[:length])
        record[:RECORD_HEADER] = np.frombuffer(head + tag, np.uint8)
        return
    if data is None:
        body[:] = 0
        flags, csum = 0, 0
    else:
        copy_bytes(body[:length], data)
        body[length:] = 0
        flags, csum = PRESENT, checksum(body[:length])
    head = _REC.pack(MAGIC, FORMAT_VERSION, layer, flags, 0, length, seed, key, csum)
    record[:RECORD_HEADER] = np.frombuffer(head + _SUM.pack(digest(head)), np.uint8)


def check_record(
    record: np.ndarray, layer: int, length: int, seed: bytes, key: bytes, auth: RecordKey | None = None
) -> bool | None:
    """True: an intact record of (namespace, key, layer) with its bytes; False: it says the layer
    is absent; None: not such a record (corrupt, torn, another key's or another format's; with
    ``auth``: also any record whose keyed tag does not verify, unkeyed ones included)."""
    if len(record) < RECORD_HEADER + length:
        return None
    if auth is not None:
        return _check_keyed(record, layer, length, key, auth)
    head = record[:RECORD_HEADER].tobytes()
    magic, fmt, got_layer, flags, _, got_length, got_seed, got_key, csum = _REC.unpack_from(head)
    if (magic, fmt, got_layer, got_length, got_seed, got_key) != (MAGIC, FORMAT_VERSION, layer, length, seed, key):
        return None
    if _SUM.unpack_from(head, 56)[0] != digest(head[:56]):
        return None
    if not flags & PRESENT:
        return False
    return True if checksum(record[RECORD_HEADER : RECORD_HEADER + length]) == csum else None


def _check_keyed(record: np.ndarray, layer: int, length: int, key: bytes, auth: RecordKey) -> bool | None:
    head = record[:RECORD_HEADER].tobytes()
    magic, fmt, got_layer, flags, _, got_length, kid, got_key = _KREC.unpack_from(head)
    if (magic, fmt, got_layer, got_length, kid, got_key) != (MAGIC, KEYED_FORMAT, layer, length, auth.kid, key):
        return None
    present = bool(flags & PRESENT)
    body = record[RECORD_HEADER : RECORD_HEADER + length] if present else None
    if not hmac.compare_digest(_tag(auth, head[: _KREC.size], layer, length, key, body), head[_KREC.size :]):
        return None
    return present
