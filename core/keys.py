"""Block keys: chained 128-bit xxhash prefix hashes, namespaced.

``key[0] = xxh3_128(namespace_seed || tokens[0:B])`` and
``key[i] = xxh3_128(key[i-1] || tokens[i*B:(i+1)*B])`` with token ids encoded as
little-endian uint32, so key ``i`` identifies tokens ``0 .. (i+1)*B`` and a child
key can be computed from its parent alone. The namespace seed digests everything
that changes the bytes of a block (model, KV dtype, layout fingerprint, block
size, tensor-parallel rank and size, tenant salt), so two namespaces never share
a key. Only full blocks get keys.

A block may carry *extras*: bytes naming inputs other than its token ids that change its KV
(a LoRA adapter, an image, prompt embeddings; see :func:`encode_extra_keys`). Such a block's key is
``xxh3_128(key[i-1] || tokens[i*B:(i+1)*B] || EXTRAS_TAG || extras)``; the input is longer than
any extras-free block's (whose token part has a fixed length), so a block with extras never
shares a key with the same tokens without them, and blocks without extras keep their keys.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np
import xxhash

from kvstrata.core import native

Key = bytes  # 16 bytes

_h128 = xxhash.xxh3_128_digest

EXTRAS_TAG = b"\x00kvstrata-extras-v1\x00"  # separates a block's token ids from its extras


@dataclass(frozen=True)
class Namespace:
    """Everything that changes the bytes stored under a key.

    ``weights`` names the model's weights (a digest of its checkpoint files, or an id the
    operator gives, e.g. ``kvstrata.integrations.vllm.weights``); empty when unknown. It enters
    :meth:`canonical` only when set, so every namespace without it keeps its seed and keys.
    """

    model: str
    kv_dtype: str
    layout_fingerprint: str
    block_size: int
    tp_rank: int = 0
    tp_size: int = 1
    tenant_salt: str = ""
    weights: str = ""

    def canonical(self) -> str:
        fields = asdict(self)
        if not self.weights:
            del fields["weights"]  # as before the field existed: same seeds, same keys
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_canonical(cls, text: str) -> Namespace:
        """The namespace :meth:`canonical` wrote (e.g. into a tier's ``meta.json``)."""
        return cls(**json.loads(text))

    @property
    def seed(self) -> Key:
        """The 16-byte digest that starts every chain of this namespace."""
        return _h128(b"kvstrata-ns-v1:" + self.canonical().encode())

    @property
    def fingerprint(self) -> str:
        return self.seed.hex()[:16]

    def with_salt(self, salt: str) -> Namespace:
        return replace(self, tenant_salt=salt)

    # -- what storage keeps (never the salt: see StoredNamespace) ------------------------------
    @property
    def salt_digest(self) -> str:
        """:func:`salt_digest` of ``tenant_salt`` ("" without one)."""
        return salt_digest(self.tenant_salt)

    def stored(self) -> str:
        """:meth:`canonical` as a tier's ``meta.json`` keeps it: ``tenant_salt`` replaced by
        ``tenant_salt_digest``, so neither the salt nor the seed can be read back from storage.
        The same as :meth:`canonical` for a namespace without a salt."""
        if not self.tenant_salt:
            return self.canonical()
        fields = json.loads(self.canonical())
        del fields["tenant_salt"]
        fields["tenant_salt_digest"] = self.salt_digest
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_stored(cls, text: str, fingerprint: str) -> Namespace:
        """The namespace of a ``meta.json`` that :meth:`stored` (or, before, :meth:`canonical`)
        wrote in directory ``fingerprint``: a :class:`StoredNamespace` when its salt is kept
        as a digest only."""
        fields = json.loads(text)
        digest = fields.pop("tenant_salt_digest", None)
        if digest is None:
            return cls(**fields)
        return StoredNamespace(**fields, known_salt_digest=str(digest), known_fingerprint=fingerprint)


def salt_digest(salt: str) -> str:
    """What storage keeps of a tenant salt: 128 bits of SHA-256 under a domain tag (hex; "" for
    no salt). One-way, but only as strong as the salt: a guessable salt is found by trying."""
    if not salt:
        return ""
    return hashlib.sha256(b"kvstrata-salt-v1:" + salt.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class StoredNamespace(Namespace):
    """A salted namespace read back from storage (e.g. by ``kvstrata verify`` or the daemon): its
    salt is unknown, so its seed is too (no keys can be computed), but its directory
    (``fingerprint``), ``salt_digest`` and :meth:`stored` form are known, which is all a tier
    needs to open, check and move its blocks."""

    known_salt_digest: str = ""
    known_fingerprint: str = ""

    def canonical(self) -> str:
        raise ValueError(f"namespace {self.known_fingerprint}: its tenant salt is not stored, only its digest")

    @property
    def seed(self) -> Key:
        raise ValueError(f"namespace {self.known_fingerprint}: its tenant salt is not stored, so its seed is unknown")

    @property
    def fingerprint(self) -> str:
        return self.known_fingerprint

    @property
    def salt_digest(self) -> str:
        return self.known_salt_digest

    def stored(self) -> str:
        fields = asdict(self)
        for name in ("known_salt_digest", "known_fingerprint", "tenant_salt"):
            del fields[name]
        if not self.weights:
            del fields["weights"]
        fields["tenant_salt_digest"] = self.known_salt_digest
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))

    def with_salt(self, salt: str) -> Namespace:
        fields = asdict(self)
        del fields["known_salt_digest"], fields["known_fingerprint"]
        return Namespace(**{**fields, "tenant_salt": salt})


def _as_uint32(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.dtype != np.uint32:
        if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
            raise ValueError("token ids must be in [0, 2**32)")
        arr = arr.astype(np.uint32)
    return np.ascontiguousarray(arr.astype("<u4", copy=False))


ROWS_AT_ONCE = 512  # token rows turned into bytes objects at a time (they stay in cache while hashed)


def _chained_keys(blocks: np.ndarray, parent: Key) -> list[Key]:
    """The chain over ``blocks`` (one void row per block, a C-contiguous array). In C when
    :mod:`kvstrata._native` is there (one call, the keys built there: ~30 ns a block of 16 tokens
    against ~100-160 ns); else rows made a chunk at a time: making all 65,536 rows of a 1M-token
    prompt first and hashing them after cost twice as much per block (the rows no longer in
    cache by the time they are hashed)."""
    ext = native.NATIVE
    if ext is not None:
        return ext.chain_xxh3_128(blocks.view(np.uint8), blocks.dtype.itemsize, parent)
    out: list[Key] = []
    for a in range(0, len(blocks), ROWS_AT_ONCE):
        out += _chain(blocks[a : a + ROWS_AT_ONCE].tolist(), parent)
        parent = out[-1]
    return out


def _chain(rows: Sequence[bytes], parent: Key) -> Iterator[Key]:
    """``key = xxh3_128(parent || row)``, each key the next one's parent. A generator: resuming
    one costs less than calling a function per block (~25% of hashing a 128K-token prompt)."""
    h = _h128
    for row in rows:
        parent = h(parent + row)
        yield parent


class BlockHasher:
    """Computes the chained keys of a namespace."""

    def __init__(self, namespace: Namespace) -> None:
        self.namespace = namespace
        self.block_size = namespace.block_size
        self._seed = namespace.seed

    def keys_for_tokens(
        self,
        tokens: Sequence[int] | np.ndarray,
        parent: Key | None = None,
        start_block: int = 0,
        extras: Mapping[int, bytes] | None = None,
    ) -> list[Key]:
        """Keys of every full block of ``tokens``.

        With ``parent`` (the key of the block before ``tokens[0]``) the chain
        continues from there; ``start_block`` skips blocks whose keys are known.
        ``extras`` maps a block index (counted from ``tokens[0]``, like ``start_block``) to
        the encoded extra keys of that block (see the module docstring); blocks it does not
        name, and every block when it is empty, get the keys they get without it.
        """
        if start_block and parent is None:
            raise ValueError("start_block > 0 needs the parent key (the key of block start_block - 1)")
        arr = _as_uint32(tokens)
        bs = self.block_size
        n = len(arr) // bs
        if start_block >= n:
            return []
        blocks = arr[start_block * bs : n * bs].view(np.dtype((np.void, bs * 4)))
        first = parent if parent is not None else self._seed
        if not extras or not any(start_block <= i < n for i in extras):
            return _chained_keys(blocks, first)
        rows = blocks.tolist()
        out: list[Key] = []
        prev = first
        for i, row in enumerate(rows, start_block):
            extra = extras.get(i)
            if extra is None:
                prev = _h128(prev + row)
            else:
                if not isinstance(extra, bytes):
                    raise TypeError(f"extras of block {i} must be bytes, got {type(extra).__name__}")
                prev = _h128(prev + row + EXTRAS_TAG + extra)
            out.append(prev)
        return out

    def keys_for_hash_ids(self, hash_ids: Sequence[int], parent: Key | None = None) -> list[Key]:
        """Keys for traces that name blocks by integer ids (e.g. the Mooncake traces)."""
        rows = [int(h).to_bytes(8, "little", signed=False) for h in hash_ids]
        first = parent if parent is not None else self._seed
        return list(itertools.accumulate(rows, lambda p, s: _h128(p + b"id" + s), initial=first))[1:]


class UnencodableExtraKey(TypeError):
    """An extra key holds a value :func:`encode_extra_keys` has no canonical bytes for."""


_LEN = struct.Struct("<Q")


def encode_extra_keys(value: object) -> bytes:
    """Canonical, deterministic bytes of an extra key: the same value gives the same bytes in
    every process and on every host, and different values (or types) different bytes.

    Type-tagged and length-prefixed: ``None``, ``bool``, ``int`` (any size), ``float`` (IEEE
    754 binary64), ``str`` (UTF-8), ``bytes`` / ``bytearray`` / ``memoryview``, and ``tuple`` /
    ``list`` of these (nested). Anything else raises :class:`UnencodableExtraKey` naming the
    type: no pickle, no ``repr`` of arbitrary objects (neither is stable across processes)."""
    out = bytearray()
    _encode(value, out, 0)
    return bytes(out)


def _encode(value: object, out: bytearray, depth: int) -> None:
    if depth > 32:
        raise UnencodableExtraKey("extra key nested more than 32 levels deep")
    if value is None:
        out += b"N"
    elif value is True or value is False:  # before int: bool is an int
        out += b"T" if value else b"F"
    elif isinstance(value, int):
        digits = str(int(value)).encode()
        out += b"I" + _LEN.pack(len(digits)) + digits
    elif isinstance(value, float):
        out += b"D" + struct.pack("<d", value)
    elif isinstance(value, str):
        try:
            data = value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise UnencodableExtraKey(f"extra key string is not valid UTF-8 ({exc})") from None
        out += b"S" + _LEN.pack(len(data)) + data
    elif isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        out += b"B" + _LEN.pack(len(data)) + data
    elif isinstance(value, tuple | list):
        out += (b"(" if isinstance(value, tuple) else b"[") + _LEN.pack(len(value))
        for item in value:
            _encode(item, out, depth + 1)
    else:
        raise UnencodableExtraKey(f"extra key of type {type(value).__module__}.{type(value).__qualname__}")
