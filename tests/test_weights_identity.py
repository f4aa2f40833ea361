"""The weights identity in the KV namespace: other weights under the same name never share KV,
the same weights at another path always do, reads per file are bounded.

Checkpoints here are real files in the formats vLLM loads (safetensors written byte for byte
from the format's spec, GGUF / .bin as opaque files); nothing is mocked but ``open``, wrapped to
count what is read."""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstrata.core.keys import Namespace
from kvstrata.core.layout import uniform_layout
from kvstrata.engine.verify import namespaces_under
from kvstrata.integrations.vllm import weights as w
from kvstrata.tiers import TIERS, TierContext

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 128}
PER_FILE_BOUND = 8 + w.HEADER_CAP + w.SPANS * w.SPAN


@pytest.fixture(autouse=True)
def fresh_cache() -> Iterator[None]:
    w.weights_identity.cache_clear()
    yield
    w.weights_identity.cache_clear()


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """The safetensors format: u64 header length, JSON header (offsets into the data), data."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, arr in tensors.items():
        header[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for arr in tensors.values():
            f.write(np.ascontiguousarray(arr, dtype="<f4").tobytes())


def random_tensors(seed: int, layers: int = 2, hidden: int = 64) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {"model.embed_tokens.weight": rng.standard_normal((128, hidden), dtype=np.float32)}
    for i in range(layers):
        for part in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"model.layers.{i}.self_attn.{part}.weight"] = rng.standard_normal((hidden, hidden), dtype=np.float32)
        out[f"model.layers.{i}.input_layernorm.weight"] = np.ones(hidden, dtype=np.float32)
    return out


def make_checkpoint(root: Path, seed: int, config: dict[str, Any] | None = None) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config or CONFIG, indent=2))
    write_safetensors(root / "model.safetensors", random_tensors(seed))
    return root


def identity(model: Path | str, **kw: Any) -> w.WeightsIdentity:
    return w.weights_identity(str(model), **kw)


class CountingOpen:
    """``open`` for the weights module: counts bytes read and the (offset, length) of reads."""

    def __init__(self) -> None:
        self.read: dict[str, int] = {}
        self.spans: dict[str, list[tuple[int, int]]] = {}

    def __call__(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        f = open(path, *args, **kwargs)  # noqa: SIM115  # the caller closes it
        name = str(path)
        self.read.setdefault(name, 0)
        spans = self.spans.setdefault(name, [])
        counter = self

        class Counted:
            def seek(self, pos: int, whence: int = 0) -> int:
                return f.seek(pos, whence)

            def read(self, n: int = -1) -> bytes:
                pos = f.tell()
                data = f.read(n)
                counter.read[name] += len(data)
                spans.append((pos, len(data)))
                return data

            def fileno(self) -> int:
                return f.fileno()

            def close(self) -> None:
                f.close()

        return Counted()


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> CountingOpen:
    opener = CountingOpen()
    monkeypatch.setattr(w, "open", opener, raising=False)
    return opener


# -- what the identity tells apart ----------------------------------------------------------


def test_same_config_other_random_weights_differ(tmp_path: Path) -> None:
    a = make_checkpoint(tmp_path / "a", seed=1)
    b = make_checkpoint(tmp_path / "b", seed=2)
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()
    # headers and sizes alone are identical for two inits of one architecture
    assert (a / "model.safetensors").stat().st_size == (b / "model.safetensors").stat().st_size
    ia, ib = identity(a), identity(b)
    assert ia.source == ib.source == "digest" and ia.files == 2
    assert ia.weights.startswith("files:") and ia.weights != ib.weights


def test_same_files_at_another_path_or_time_are_the_same(tmp_path: Path) -> None:
    a = make_checkpoint(tmp_path / "a", seed=1)
    copied = tmp_path / "elsewhere" / "deeper" / "copy"
    shutil.copytree(a, copied)
    os.utime(copied / "model.safetensors", (1_000_000, 1_000_000))  # other mtimes
    linked = tmp_path / "snapshot"  # a hub snapshot: links to blobs elsewhere
    linked.mkdir()
    for p in a.iterdir():
        (linked / p.name).symlink_to(p)
    assert identity(a).weights == identity(copied).weights == identity(linked).weights
    (copied / "generation_config.json").write_text("{}")  # not a weights file: ignored
    w.weights_identity.cache_clear()
    assert identity(copied).weights == identity(a).weights


def test_config_and_index_enter_it(tmp_path: Path) -> None:
    a = make_checkpoint(tmp_path / "a", seed=1)
    b = make_checkpoint(tmp_path / "b", seed=1, config={**CONFIG, "rope_theta": 1e6})
    assert identity(a).weights != identity(b).weights
    c = make_checkpoint(tmp_path / "c", seed=1)
    (c / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    assert identity(c).weights != identity(a).weights


def test_revision_quantization_and_load_format_change_it(tmp_path: Path) -> None:
    a = make_checkpoint(tmp_path / "a", seed=1)
    seen = {
        identity(a).weights,
        identity(a, revision="v2").weights,
        identity(a, quantization="fp8").weights,
        identity(a, load_format="dummy").weights,
    }
    assert len(seen) == 4
    assert identity(a, download_dir=str(tmp_path / "hf")).weights == identity(a).weights  # where, not what


def test_a_changed_tensor_deep_inside_is_caught_where_sampled_and_only_there(
    tmp_path: Path, counting: CountingOpen
) -> None:
    """200 tensors (more than SPANS): a change inside a sampled window is caught; the same change
    in bytes no window covers is not (what sampling cannot catch, see the module docstring)."""
    rng = np.random.default_rng(7)
    tensors = {f"layers.{i}.w": rng.standard_normal((32, 32), dtype=np.float32) for i in range(200)}
    a = tmp_path / "a"
    a.mkdir()
    (a / "config.json").write_text(json.dumps(CONFIG))
    write_safetensors(a / "model.safetensors", tensors)
    base = identity(a).weights
    data = (a / "model.safetensors").read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    start = 8 + header_len
    read = [(o, n) for o, n in counting.spans[str(a / "model.safetensors")] if o >= start and n > 0]
    assert len(read) == w.SPANS
    covered = np.zeros(len(data), dtype=bool)
    for o, n in read:
        covered[o : o + n] = True
    deep = start + (len(data) - start) * 3 // 4
    inside = next(o for o, _ in sorted(read) if o >= deep)  # a sampled window in the last quarter
    outside = next(i for i in range(deep, len(data)) if not covered[i])

    for pos, caught in ((inside + 1, True), (outside, False)):
        b = tmp_path / f"b{pos}"
        shutil.copytree(a, b)
        raw = bytearray(data)
        raw[pos] ^= 0x40
        (b / "model.safetensors").write_bytes(bytes(raw))
        w.weights_identity.cache_clear()
        assert (identity(b).weights != base) is caught, (pos, caught)


def test_every_tensor_of_a_small_file_is_sampled(tmp_path: Path) -> None:
    """At most SPANS tensors: a window in each, so re-training any one tensor is caught."""
    tensors = random_tensors(1)
    assert len(tensors) <= w.SPANS
    base = identity(make_checkpoint(tmp_path / "a", seed=1)).weights
    for i, name in enumerate(tensors):
        changed = dict(tensors)
        changed[name] = np.random.default_rng(100 + i).standard_normal(tensors[name].shape, dtype=np.float32)
        root = tmp_path / f"t{i}"
        root.mkdir()
        (root / "config.json").write_text(json.dumps(CONFIG, indent=2))
        write_safetensors(root / "model.safetensors", changed)
        assert identity(root).weights != base, name


def test_reads_per_file_are_bounded(tmp_path: Path, counting: CountingOpen) -> None:
    root = tmp_path / "big"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(CONFIG))
    # a 3 GiB sparse shard with 5,000 tensors and a 2 GiB .bin (sizes cost nothing to make)
    n, tsize = 5000, 600_000
    header = {
        f"t{i}": {"dtype": "F32", "shape": [tsize // 4], "data_offsets": [i * tsize, (i + 1) * tsize]} for i in range(n)
    }
    raw = json.dumps(header).encode()
    with open(root / "model-00001-of-00002.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + n * tsize)
    with open(root / "model-00002-of-00002.bin", "wb") as f:
        f.truncate(2 << 30)
    got = identity(root)
    assert got.source == "digest" and got.files == 3
    sizes = {str(p): p.stat().st_size for p in root.iterdir()}
    assert set(counting.read) == set(sizes)
    for name, n_read in counting.read.items():
        assert 0 < n_read <= PER_FILE_BOUND, (name, n_read)
        if sizes[name] > 1 << 30:
            assert n_read < sizes[name] / 2000  # a sample, not the file
    assert got.bytes_read == sum(counting.read.values())


def test_single_file_gguf_and_bin_checkpoints(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    body = rng.integers(0, 256, size=3 << 20, dtype=np.uint8).tobytes()
    a = tmp_path / "a" / "model-q4.gguf"
    a.parent.mkdir()
    a.write_bytes(b"GGUF" + body)
    copy = tmp_path / "b" / "model-q4.gguf"
    copy.parent.mkdir()
    shutil.copy(a, copy)
    other = tmp_path / "c" / "model-q4.gguf"
    other.parent.mkdir()
    other.write_bytes(b"GGUF" + rng.integers(0, 256, size=3 << 20, dtype=np.uint8).tobytes())
    ia = identity(a)
    assert ia.source == "digest" and ia.files == 1
    assert identity(copy).weights == ia.weights != identity(other).weights
    bins = []
    for seed in (1, 2):
        d = tmp_path / f"bin{seed}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(CONFIG))
        (d / "pytorch_model.bin").write_bytes(np.random.default_rng(seed).bytes(1 << 20))
        bins.append(identity(d))
    assert bins[0].source == "digest" and bins[0].weights != bins[1].weights


def test_weights_id_replaces_the_digest_without_reading(tmp_path: Path, counting: CountingOpen) -> None:
    a = make_checkpoint(tmp_path / "a", seed=1)
    b = make_checkpoint(tmp_path / "b", seed=2)
    ia, ib = identity(a, weights_id="ft-2026-11"), identity(b, weights_id="ft-2026-11")
    assert ia.source == "weights_id" and ia.weights == ib.weights and ia.weights.startswith("id:")
    assert identity(a, weights_id="ft-2026-12").weights != ia.weights
    assert identity(a, weights_id="ft-2026-11", quantization="fp8").weights != ia.weights
    assert counting.read == {}  # the operator vouches: nothing read


def test_no_local_weights_fall_back_to_name_and_revision_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING, logger="vllm.kvstrata")
    hub = "someorg/not-in-any-cache"
    first = w.weights_identity(hub, download_dir=str(tmp_path / "empty-cache"))
    again = w.weights_identity(hub, download_dir=str(tmp_path / "empty-cache"))
    assert first == again and first.source == "name-only" and first.weights.startswith("name:")
    warnings = [r for r in caplog.records if "no local weights files" in r.getMessage()]
    assert len(warnings) == 1 and hub in warnings[0].getMessage() and "weights_id" in warnings[0].getMessage()
    other_rev = w.weights_identity(hub, revision="v2", download_dir=str(tmp_path / "empty-cache"))
    assert other_rev.weights != first.weights
    configs_only = tmp_path / "configs-only"  # e.g. weights streamed from object storage
    configs_only.mkdir()
    (configs_only / "config.json").write_text(json.dumps(CONFIG))
    assert identity(configs_only).source == "name-only"
    unreadable = make_checkpoint(tmp_path / "unreadable", seed=1)

    def refuse(path: Any, *args: Any, **kwargs: Any) -> Any:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(w, "open", refuse, raising=False)  # root reads any file: refuse it here
    assert identity(unreadable).source == "name-only"
    assert any("could not be read" in r.getMessage() for r in caplog.records)


def test_hub_id_resolves_offline_to_the_cached_snapshot(tmp_path: Path) -> None:
    pytest.importorskip("huggingface_hub")
    src = make_checkpoint(tmp_path / "src", seed=5)
    cache = tmp_path / "hf-cache"
    repo = cache / "models--someorg--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for p in src.iterdir():  # the hub cache layout: snapshot files link to blobs
        blob = repo / "blobs" / p.name
        shutil.copy(p, blob)
        (snapshot / p.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    got = w.weights_identity("someorg/tiny", download_dir=str(cache))
    assert got.source == "digest" and got.files == 2
    assert got.weights == identity(src).weights  # the same files, wherever they are


def test_describe_names_the_identity_and_its_source(tmp_path: Path) -> None:
    got = identity(make_checkpoint(tmp_path / "a", seed=1))
    text = got.describe()
    assert text.startswith("files:" + got.weights.split(":")[1][:12]) and "digest of 2 files" in text
    assert "model_id" in w.WeightsIdentity("", "model_id").describe()
    assert "name-only" in w.weights_identity("x/y", download_dir=str(tmp_path)).describe()


# -- the namespace ---------------------------------------------------------------------------

NS = Namespace("team/llama", "bfloat16", "abcdef0123456789", 128, 1, 2, "tenant")


def test_namespace_without_weights_keeps_its_canonical_form_and_seed() -> None:
    # the values kvstrata wrote before the field existed: every existing key stays valid
    assert NS.canonical() == (
        '{"block_size":128,"kv_dtype":"bfloat16","layout_fingerprint":"abcdef0123456789",'
        '"model":"team/llama","tenant_salt":"tenant","tp_rank":1,"tp_size":2}'
    )
    assert NS.seed.hex() == "db820ca161b8b43ae92cf509d2194bb0"
    with_weights = Namespace(**{**NS.__dict__, "weights": "files:00ff"})
    assert '"weights":"files:00ff"' in with_weights.canonical()
    assert with_weights.seed != NS.seed and with_weights.fingerprint != NS.fingerprint


def test_namespace_round_trips_through_canonical_salt_and_meta(tmp_path: Path) -> None:
    ns = Namespace("m", "bfloat16", "0123456789abcdef", 16, weights="files:" + "ab" * 16)
    assert Namespace.from_canonical(ns.canonical()) == ns
    assert Namespace.from_canonical(NS.canonical()) == NS
    salted = ns.with_salt("tenant-b")
    assert (salted.weights, salted.tenant_salt, salted.model) == (ns.weights, "tenant-b", "m")
    layout = uniform_layout("m", num_layers=2, num_kv_heads=1, head_dim=8, block_size=16)
    cls = TIERS.get("nvme")
    opts = cls.Options.model_validate({"path": str(tmp_path / "nvme"), "direct_io": "off"})
    for namespace in (Namespace("m", "bfloat16", layout.fingerprint(), 16, weights=ns.weights), NS):
        cls("nvme", 1 << 24, opts, TierContext(layout, namespace)).close()
    found = {n.fingerprint: (d.name, n) for d, _layout, n in namespaces_under(str(tmp_path / "nvme"))}
    assert len(found) == 2
    for fingerprint, (directory, _namespace) in found.items():
        assert directory == fingerprint
    assert {n.weights for _d, n in found.values()} == {ns.weights, ""}
    # reopening from meta.json reaches the same directory (the fingerprint survives the trip)
    for _d, namespace in found.values():
        cls("nvme", 1 << 24, opts, TierContext(layout, namespace)).close()
    assert len(namespaces_under(str(tmp_path / "nvme"))) == 2
