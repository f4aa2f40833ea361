"""The weights identity: which weights a model's KV was computed with (no vLLM import).

kvstrata's namespace names a model by its served name and its KV shapes; a fine-tuned or
re-trained checkpoint served under the same name with the same architecture has the same
shapes, so without this its requests would restore the old checkpoint's KV. The identity is
computed once per process at start-up (cached by its inputs, so the scheduler and every worker
get the same one) and enters :class:`kvstrata.core.keys.Namespace` as ``weights``.

**What is digested** (BLAKE2b-128, tagged with a format version):

* vLLM's ``revision``, ``quantization`` and ``load_format`` (the same files quantized or loaded
  differently give other KV); not the tokenizer, which does not change the KV of given token ids;
* of the model directory's top level (what vLLM loads): ``config.json`` and the other
  architecture / quantization configs in :data:`CONFIG_NAMES`, every ``*.index.json``
  (the safetensors / bin index), and every weights file (:data:`WEIGHT_SUFFIXES`): its name,
  its size and a bounded sample of its bytes. A model given as a single file (GGUF) is that one
  weights file.

Paths and modification times never enter it: the same weights in another directory (fleets
keep them at different paths; a hub snapshot is a directory of links) give the same identity.

**Sampling.** A ``.safetensors`` file: its header (tensor names, dtypes, shapes, offsets: read
whole up to :data:`HEADER_CAP`) and :data:`SPANS` windows of at most :data:`SPAN` bytes in the
data region, one inside each tensor while there are at most :data:`SPANS` tensors (the other
windows at pseudo-random places), else inside :data:`SPANS` tensors chosen by a hash of their
names. Other weights files (``.bin``, ``.pt``, ``.gguf``, ...): a window at the start (the GGUF
header / pickle), one at the end (a zip's central directory) and the rest at pseudo-random
places. Window positions derive from the file's size and header, never from a random source,
so every process and host picks the same ones.

**Bound.** Per weights file at most ``8 + HEADER_CAP + SPANS * SPAN`` bytes are read
(1 MiB + 256 KiB + 8 with the defaults: about 0.6 % of a 200 MB file, 0.03 % of a 5 GB shard);
per config or index file at most :data:`CONFIG_CAP`. The cost is dominated by the
:data:`SPANS` seeks per file, not by the bytes. Measured on a 2-core VM: the 320 MB TTFT
benchmark model (``tests/vllm_e2e/models.py`` ``make_bench_model``, 75 tensors) 0.10 s with its
file evicted from the page cache, 3 ms warm; an 8 GiB shard with 4,096 tensors (sparse) 28 ms,
mostly parsing its 455 KiB header.

**What sampling cannot catch.** Two random initialisations, or any full fine-tune, change every
window and are always told apart. A safetensors file with at most :data:`SPANS` tensors has a
window in every tensor, so a change to a whole tensor (a merged LoRA, a re-trained head) is
caught; with ``T > SPANS`` tensors only :data:`SPANS` of them are looked at, so a change confined to
one tensor is caught with probability about ``SPANS / T``. In other files a change to a fraction
``f`` of the bytes is missed with probability about ``(1 - f) ** SPANS`` (5 % of the file: 4 %).
An edit of a few values anywhere is almost always missed. Checkpoints changed like that must be
named explicitly: ``weights_id`` (or ``model_id``) in ``kv_connector_extra_config``, changed
whenever the weights change.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger("vllm.kvstrata")

FORMAT = b"kvstrata-weights-v1"
SPAN = 4096  # bytes per sampled window
SPANS = 64  # windows per weights file
HEADER_CAP = 1 << 20  # bytes of a safetensors header read (longer ones: their first 1 MiB)
CONFIG_CAP = 16 << 20  # bytes of a config or index file read
CONFIG_NAMES = (
    "config.json",
    "params.json",  # Mistral-format checkpoints
    "quantize_config.json",  # GPTQ / AWQ
    "quant_config.json",
    "hf_quant_config.json",  # ModelOpt
)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".tensors")


@dataclass(frozen=True)
class WeightsIdentity:
    """The ``weights`` of a namespace and where it came from (for the start-up line)."""

    weights: str  # Namespace.weights: "<source>:<32 hex>", or "" (model_id: the operator vouches)
    source: str  # "digest", "weights_id", "model_id", "name-only" or "none"
    files: int = 0  # files digested
    bytes_read: int = 0

    @property
    def short(self) -> str:
        """``<kind>:<first 12 hex digits>``, or ``none``."""
        kind, _, digest = self.weights.partition(":")
        return f"{kind}:{digest[:12]}" if digest else "none"

    def describe(self) -> str:
        """The identity and where it came from, for the start-up line."""
        where = {
            "digest": f"digest of {self.files} file{'s' if self.files != 1 else ''}, {self.bytes_read} bytes read",
            "weights_id": "from weights_id",
            "model_id": "model_id given: no digest, the operator vouches for the weights",
            "name-only": "name-only fallback: no local weights files",
            "none": "not computed",
        }[self.source]
        return f"{self.short} ({where})"


NO_WEIGHTS = WeightsIdentity("", "none")


def _hex(*parts: bytes) -> str:
    h = hashlib.blake2b(FORMAT, digest_size=16)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def _vllm_facts(revision: str | None, quantization: str | None, load_format: str | None) -> bytes:
    return json.dumps(
        {"revision": revision, "quantization": quantization, "load_format": load_format}, sort_keys=True
    ).encode()


# -- reading -------------------------------------------------------------------------------


class _Reader:
    """One unbuffered file; counts the bytes it reads (nothing is read ahead)."""

    def __init__(self, path: Path) -> None:
        self.f: BinaryIO = open(path, "rb", buffering=0)  # noqa: SIM115  # closed by close()
        self.size = os.fstat(self.f.fileno()).st_size
        self.read_bytes = 0

    def read_at(self, offset: int, length: int) -> bytes:
        length = max(0, min(length, self.size - offset))
        self.f.seek(offset)
        out = bytearray()
        while len(out) < length:
            chunk = self.f.read(length - len(out))
            if not chunk:
                break
            out += chunk
        self.read_bytes += len(out)
        return bytes(out)

    def close(self) -> None:
        self.f.close()


def _pick(seed: bytes, i: int, n: int) -> int:
    """A position in ``[0, n)``, the same on every host for the same file."""
    if n <= 1:
        return 0
    h = hashlib.blake2b(seed + i.to_bytes(4, "little"), digest_size=8).digest()
    return int.from_bytes(h, "little") % n


def _safetensors_windows(header: bytes, data_start: int, size: int, seed: bytes) -> list[tuple[int, int]] | None:
    """Windows (offset, length) inside the tensors the header lists; None if it does not parse."""
    try:
        entries = json.loads(header)
        tensors = sorted(
            (name, data_start + int(v["data_offsets"][0]), data_start + int(v["data_offsets"][1]))
            for name, v in entries.items()
            if name != "__metadata__"
        )
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None
    tensors = [(n, b, e) for n, b, e in tensors if 0 <= b < e <= size]
    if len(tensors) > SPANS:  # a subset chosen by name, the same for files of the same layout
        tensors = sorted(tensors, key=lambda t: hashlib.blake2b(t[0].encode(), digest_size=8).digest())[:SPANS]
    windows = []
    for i, (_name, begin, end) in enumerate(tensors):
        length = min(SPAN, end - begin)
        windows.append((begin + _pick(seed, i, end - begin - length + 1), length))
    data = size - data_start
    for i in range(len(windows), SPANS):  # the rest anywhere in the data region
        length = min(SPAN, data)
        windows.append((data_start + _pick(seed, i, data - length + 1), length))
    return windows


def _plain_windows(size: int, seed: bytes) -> list[tuple[int, int]]:
    length = min(SPAN, size)
    windows = [(0, length), (size - length, length)]
    windows += [(_pick(seed, i, size - length + 1), length) for i in range(2, SPANS)]
    return windows


def digest_weights_file(path: Path) -> tuple[bytes, int]:
    """(digest, bytes read) of one weights file: name, size, header and sampled windows."""
    reader = _Reader(path)
    try:
        size = reader.size
        parts = [path.name.encode(), size.to_bytes(8, "little")]
        windows: list[tuple[int, int]] | None = None
        if path.suffix == ".safetensors" and size >= 8:
            (n,) = struct.unpack("<Q", reader.read_at(0, 8))
            header = reader.read_at(8, min(n, HEADER_CAP))
            parts += [n.to_bytes(8, "little"), header]
            seed = hashlib.blake2b(b"".join(parts), digest_size=16).digest()
            if n <= HEADER_CAP and 8 + n <= size:
                windows = _safetensors_windows(header, 8 + n, size, seed)
        else:
            seed = hashlib.blake2b(b"".join(parts), digest_size=16).digest()
        if windows is None:
            windows = _plain_windows(size, seed) if size else []
        for offset, length in windows:
            parts += [offset.to_bytes(8, "little"), reader.read_at(offset, length)]
        return bytes.fromhex(_hex(*parts)), reader.read_bytes
    finally:
        reader.close()


def _digest_small_file(path: Path) -> tuple[bytes, int]:
    reader = _Reader(path)
    try:
        data = reader.read_at(0, CONFIG_CAP)
        return bytes.fromhex(_hex(path.name.encode(), reader.size.to_bytes(8, "little"), data)), reader.read_bytes
    finally:
        reader.close()


def checkpoint_files(root: Path) -> tuple[list[Path], list[Path]]:
    """(config and index files, weights files) of a model directory or single weights file."""
    if root.is_file():
        return [], [root]
    configs, weights = [], []
    for p in sorted(root.iterdir(), key=lambda p: p.name):
        if p.name.startswith(".") or not p.is_file():
            continue
        if p.name in CONFIG_NAMES or p.name.endswith(".index.json"):
            configs.append(p)
        elif p.name.endswith(WEIGHT_SUFFIXES):
            weights.append(p)
    return configs, weights


def digest_checkpoint(root: Path, facts: bytes = b"") -> tuple[str, int, int]:
    """(hex digest, files digested, bytes read) of a local checkpoint; 0 files when it has no
    weights files (then the hex digest is meaningless)."""
    configs, weights = checkpoint_files(root)
    if not weights:
        return "", 0, 0
    parts, total = [facts], 0
    for p in configs:
        d, n = _digest_small_file(p)
        parts.append(b"c" + d)
        total += n
    for p in weights:
        d, n = digest_weights_file(p)
        parts.append(b"w" + d)
        total += n
    return _hex(*parts), len(configs) + len(weights), total


# -- the identity ----------------------------------------------------------------------------


def local_checkpoint(model: str, revision: str | None = None, download_dir: str | None = None) -> Path | None:
    """The local directory (or file) of ``model``: a path, else the snapshot of a Hugging Face
    hub id already in the cache (offline: ``local_files_only``); None when neither exists."""
    path = Path(os.path.expanduser(model))
    if path.exists():
        return path
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        found = snapshot_download(model, revision=revision, cache_dir=download_dir, local_files_only=True)
    except Exception:  # not cached, not a repo id, ...: no local copy
        return None
    return Path(found)


@functools.lru_cache(maxsize=16)
def weights_identity(
    model: str,
    *,
    revision: str | None = None,
    quantization: str | None = None,
    load_format: str | None = None,
    download_dir: str | None = None,
    weights_id: str | None = None,
) -> WeightsIdentity:
    """The identity of the weights vLLM serves as ``model`` (a path or hub id; for weights
    streamed from object storage, the original URI): once per process and set of inputs.

    ``weights_id`` (the operator's own version of the weights) replaces the file digest.
    Without local weights files the identity is the model's name and revision only, logged
    once as a warning: then the operator must name the weights (``weights_id``)."""
    facts = _vllm_facts(revision, quantization, load_format)
    if weights_id is not None:
        return WeightsIdentity("id:" + _hex(b"weights_id", weights_id.encode(), facts), "weights_id")
    root = local_checkpoint(model, revision, download_dir)
    why = "no local weights files"
    if root is not None:
        try:
            hexdigest, files, read = digest_checkpoint(root, facts)
        except OSError as exc:  # unreadable: the name, never a guess at the files
            why, files = f"its weights files could not be read ({exc})", 0
        if files:
            return WeightsIdentity("files:" + hexdigest, "digest", files, read)
    log.warning(
        "kvstrata: %s for model %r (revision %r); its KV is named by model name and revision only, "
        "so other weights served under that name would be given this KV: set "
        "kv_connector_extra_config.weights_id and change it whenever the weights change",
        why,
        model,
        revision,
    )
    return WeightsIdentity("name:" + _hex(b"name", model.encode(), facts), "name-only")
