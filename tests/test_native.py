"""The C extension kvstrata._native against the code it replaces: XXH3-128 bit-exact with the
``xxhash`` package at every input length path, the chained keys equal on both paths, the batched
copies exact, the lookup helpers with the Python code's semantics, and the KVSTRATA_NATIVE switch."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash
from conftest import BUILT

from kvstrata.core import hostcopy, native
from kvstrata.core.catalog import get_layout
from kvstrata.core.keys import BlockHasher, Namespace
from kvstrata.engine.engine import Engine
from kvstrata.engine.perlayer import prefix_run
from kvstrata.workload.benchkit import placed
from kvstrata.workload.lookup_bench import populate_index

needs_native = pytest.mark.skipif(BUILT is None, reason=f"kvstrata._native is off: {native.native_reason()}")
ROOT = Path(__file__).resolve().parent.parent


def _chain_py(parent: bytes, rows: list[bytes]) -> list[bytes]:
    out = []
    for row in rows:
        parent = xxhash.xxh3_128_digest(parent + row)
        out.append(parent)
    return out


# ---------------------------------------------------------------------------------- XXH3-128
@needs_native
def test_xxh3_128_is_bit_exact_for_every_length_up_to_4200() -> None:
    assert BUILT is not None
    rng = random.Random(16)
    data = rng.randbytes(4300)
    bad = [n for n in range(4201) if BUILT.xxh3_128_digest(data[:n]) != xxhash.xxh3_128_digest(data[:n])]
    assert not bad, f"lengths whose digest differs: {bad[:20]}"
    for n in (0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1024, 1025, 2048):  # other contents too
        for _ in range(20):
            d = rng.randbytes(n)
            assert BUILT.xxh3_128_digest(d) == xxhash.xxh3_128_digest(d), n


@needs_native
@pytest.mark.parametrize("n", [64 * 1024 + 16, 1024 * 1024 + 16, 100_003, 16 * 1024, 16 * 1024 + 1, 3 * 1024 - 1])
def test_xxh3_128_of_large_inputs(n: int) -> None:
    assert BUILT is not None
    d = random.Random(n).randbytes(n)
    assert BUILT.xxh3_128_digest(d) == xxhash.xxh3_128_digest(d)
    assert BUILT.chain_xxh3_128(d[16:], n - 16, d[:16]) == [xxhash.xxh3_128_digest(d)]


@needs_native
def test_chain_is_bit_exact_for_every_total_length_up_to_4200() -> None:
    """``parent (16 bytes) || row``: every total length 17..4,200, three rows each, random parents."""
    assert BUILT is not None
    rng = random.Random(7)
    for row_len in range(1, 4200 - 16 + 1):
        parent = rng.randbytes(16)
        rows = [rng.randbytes(row_len) for _ in range(3)]
        got = BUILT.chain_xxh3_128(b"".join(rows), row_len, parent)
        assert got == _chain_py(parent, rows), f"row length {row_len}"


@needs_native
def test_chain_takes_buffers_and_refuses_bad_input() -> None:
    assert BUILT is not None
    parent = bytes(range(16))
    rows = np.arange(64, dtype=np.uint32)  # any contiguous buffer
    assert BUILT.chain_xxh3_128(rows, 16, parent) == _chain_py(
        parent, [rows.tobytes()[i : i + 16] for i in range(0, 256, 16)]
    )
    assert BUILT.chain_xxh3_128(b"", 16, parent) == []
    with pytest.raises(ValueError, match="parent must be 16 bytes, got 15"):
        BUILT.chain_xxh3_128(b"x" * 16, 16, parent[:15])
    with pytest.raises(ValueError, match="row_len must be positive, got 0"):
        BUILT.chain_xxh3_128(b"x" * 16, 0, parent)
    with pytest.raises(ValueError, match="17 bytes is not a whole number of 16-byte rows"):
        BUILT.chain_xxh3_128(b"x" * 17, 16, parent)
    with pytest.raises(ValueError, match="not C-contiguous"):
        BUILT.chain_xxh3_128(np.arange(8, dtype=np.uint32)[::2], 4, parent)  # not contiguous


# ------------------------------------------------------------------ keys on both paths
NS = Namespace(model="m", kv_dtype="bfloat16", layout_fingerprint="0123456789abcdef", block_size=16)


def _keys_on(path: object, ns: Namespace, tokens: np.ndarray, **kw: object) -> list[bytes]:
    saved = native.NATIVE
    native.NATIVE = path  # type: ignore[assignment]
    try:
        return BlockHasher(ns).keys_for_tokens(tokens, **kw)  # type: ignore[arg-type]
    finally:
        native.NATIVE = saved


@needs_native
@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 5, 7, 8, 16, 28, 29, 30, 31, 32, 56, 57, 64, 100, 256, 1000, 1024])
def test_keys_are_the_same_on_both_paths(block_size: int) -> None:
    ns = Namespace("m", "bfloat16", "0123456789abcdef", block_size)
    rng = np.random.default_rng(block_size)
    tokens = rng.integers(0, 2**32, size=block_size * 9 + block_size // 2, dtype=np.uint64).astype(np.uint32)
    parent = bytes(rng.integers(0, 256, 16, dtype=np.uint8))
    for kw in ({}, {"parent": parent}, {"parent": parent, "start_block": 3}, {"parent": parent, "start_block": 9}):
        native_keys = _keys_on(BUILT, ns, tokens, **kw)
        assert native_keys == _keys_on(None, ns, tokens, **kw), kw
    rows = [tokens[i * block_size : (i + 1) * block_size].astype("<u4").tobytes() for i in range(9)]
    assert _keys_on(BUILT, ns, tokens) == _chain_py(ns.seed, rows)  # the documented chain
    extras = {2: b"lora-7", 5: b"image"}
    assert _keys_on(BUILT, ns, tokens, extras=extras) == _keys_on(None, ns, tokens, extras=extras)
    assert _keys_on(BUILT, ns, tokens, extras=extras)[:2] == _keys_on(BUILT, ns, tokens)[:2]


@needs_native
def test_keys_of_a_long_prompt_are_the_same_on_both_paths() -> None:
    tokens = np.random.default_rng(3).integers(0, 128000, size=131072 + 5, dtype=np.uint32)
    assert _keys_on(BUILT, NS, tokens) == _keys_on(None, NS, tokens)  # 8,192 blocks; the Python path in chunks


@needs_native
def test_key_table_behaves_as_a_dict_under_random_operations() -> None:
    """KeyTable (the engine's key -> tier map) against a dict, through inserts, overwrites,
    deletes (tombstones), bulk sets, growth and shrinking, with 16-byte keys and others."""
    assert BUILT is not None
    rng = random.Random(11)
    pool: list[object] = [rng.randbytes(16) for _ in range(4000)]
    pool += [b"", b"short", b"x" * 17, bytearray(b"y" * 16).decode(), 7, (1, 2)]
    table, model = BUILT.KeyTable(), {}
    for step in range(60_000):
        key, op = rng.choice(pool), rng.random()
        if op < 0.45:
            table[key] = model[key] = rng.randrange(6)
        elif op < 0.65:
            assert table.pop(key, None) == model.pop(key, None)
        elif op < 0.7:
            keys, value = rng.sample(pool, 40), rng.randrange(3)
            table.set_many(keys, value)
            model.update(dict.fromkeys(keys, value))
        elif op < 0.72 and key in model:
            del table[key]
            del model[key]
        else:
            assert table.get(key) == model.get(key)
            assert (key in table) == (key in model)
        if step % 6000 == 0:
            assert len(table) == len(model)
            assert sorted(map(repr, table.items())) == sorted(map(repr, model.items()))
            assert sorted(map(repr, table)) == sorted(map(repr, model))
    for key in list(model):  # every key out: the table empties, and refills
        assert table.pop(key) == model.pop(key)
    assert len(table) == 0 and table.get(pool[0]) is None
    table.set_many(pool[:100], 1)
    assert BUILT.prefix_values(table, pool[:100] + pool[200:]) == [1] * 100


@needs_native
def test_key_table_names_bad_values_and_keys() -> None:
    assert BUILT is not None
    table = BUILT.KeyTable()
    with pytest.raises(ValueError, match=r"0\.\.2\*\*31-1, got -1"):
        table[b"k" * 16] = -1
    with pytest.raises(ValueError, match="got 2147483648"):
        table.set_many([b"k" * 16], 2**31)
    with pytest.raises(TypeError, match="must be an int, got 'x'"):
        table[b"k" * 16] = "x"
    with pytest.raises(TypeError, match="unhashable"):
        table[[1]] = 1
    with pytest.raises(KeyError):
        table.pop(b"z" * 16)
    with pytest.raises(KeyError):
        del table[b"z" * 16]
    with pytest.raises(TypeError, match="dict or a KeyTable, got list"):
        BUILT.prefix_values([], [b"k" * 16])
    assert len(table) == 0  # nothing half-done


@needs_native
def test_the_engine_keeps_its_tier_map_in_a_key_table_and_looks_up_the_same_with_a_dict() -> None:
    keys = BlockHasher(NS).keys_for_tokens(np.arange(16 * 64, dtype=np.uint32))
    cfg = {"tiers": [{"name": "dram", "capacity": "64MiB"}]}
    found = []
    for index in ("table", "dict"):
        with Engine(cfg, layout=get_layout("llama-3-8b")) as engine:
            if index == "dict":
                engine._state.best = {}
            assert type(engine._state.best).__name__ == ("KeyTable" if index == "table" else "dict")
            populate_index(engine, keys[:40])
            engine._state.best.pop(keys[10], None)  # a hole: the prefix ends there
            found.append(engine.lookup(keys).tier_positions)
    assert found[0] == found[1] == [0] * 10


# ------------------------------------------------------------------ the KVSTRATA_NATIVE switch
def _path_in_subprocess(value: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTRATA")}
    if value is not None:
        env["KVSTRATA_NATIVE"] = value
    code = "from kvstrata.core import native; print(native.native_path(), native.native_reason())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_kvstrata_native_0_turns_the_extension_off() -> None:
    done = _path_in_subprocess("0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["python", "KVSTRATA_NATIVE=0"]


@needs_native
def test_the_extension_runs_by_default_where_it_is_built() -> None:
    for value in (None, "1"):
        done = _path_in_subprocess(value)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["native", "kvstrata._native"]


def test_a_bad_kvstrata_native_value_is_named() -> None:
    done = _path_in_subprocess("yes")
    assert done.returncode != 0
    assert "KVSTRATA_NATIVE must be 0 or 1, got 'yes'" in done.stderr


def test_the_code_path_fixture_switches_the_path(code_path: str) -> None:
    assert native.native_path() == code_path
    assert (native.NATIVE is None) == (code_path == "python")


# ------------------------------------------------------------------ batched copies
def _runs(rng: np.random.Generator, dst: np.ndarray, src: np.ndarray, n: int) -> list[tuple[int, int, int]]:
    """``n`` non-overlapping runs of 0..300 bytes at shuffled places of ``src`` and ``dst``."""
    sizes = rng.integers(0, 300, n).tolist()
    sizes[::17] = [0] * len(sizes[::17])  # zero-size runs among them
    slots = [300 * i for i in range(n)]
    d_slots, s_slots = rng.permutation(slots).tolist(), rng.permutation(slots).tolist()
    d0, s0 = int(dst.ctypes.data), int(src.ctypes.data)
    return [(d0 + d, s0 + s, k) for d, s, k in zip(d_slots, s_slots, sizes, strict=True)]


def _expected(dst: np.ndarray, src: np.ndarray, runs: list[tuple[int, int, int]]) -> np.ndarray:
    want = dst.copy()
    d0, s0 = int(dst.ctypes.data), int(src.ctypes.data)
    for d, s, k in runs:
        want[d - d0 : d - d0 + k] = src[s - s0 : s - s0 + k]
    return want


@pytest.mark.parametrize("parallel", [False, True])
def test_many_small_runs_land_exactly(code_path: str, parallel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if parallel:  # the threads' pieces: every run its own piece, several threads
        monkeypatch.setattr(hostcopy, "_CPUS", 8)
        monkeypatch.setattr(hostcopy, "PARALLEL_MIN_BYTES", 1)
        monkeypatch.setattr(hostcopy, "PIECE_MIN_BYTES", 64)
    rng = np.random.default_rng(5)
    n = 3000
    src = rng.integers(0, 256, 300 * n, dtype=np.uint8)
    dst = rng.integers(0, 256, 300 * n, dtype=np.uint8)
    runs = _runs(rng, dst, src, n)
    want = _expected(dst, src, runs)
    hostcopy.move_runs(runs)
    assert np.array_equal(dst, want)
    hostcopy.move_runs([])  # nothing to copy
    hostcopy.move_runs([(int(dst.ctypes.data), int(src.ctypes.data), 0)])  # a zero-size run
    assert np.array_equal(dst, want)
    # numpy integer sizes (summed or indexed out of int64 arrays, as the DRAM tier's writes
    # have them): copied like ints, as ctypes.memmove takes them
    np_runs = [(d, s, np.int64(k)) for d, s, k in _runs(rng, dst, src, 64)]
    want = _expected(dst, src, [(int(d), int(s), int(k)) for d, s, k in np_runs])
    hostcopy.move_runs(np_runs)  # type: ignore[arg-type]
    assert np.array_equal(dst, want)


@needs_native
def test_memmove_runs_takes_a_slice_and_names_bad_runs() -> None:
    assert BUILT is not None
    src = np.arange(100, dtype=np.uint8)
    dst = np.zeros(100, dtype=np.uint8)
    s0, d0 = int(src.ctypes.data), int(dst.ctypes.data)
    runs = [(d0, s0, 10), (d0 + 10, s0 + 50, 10), (d0 + 20, s0 + 90, 10)]
    BUILT.memmove_runs(runs, 1, 2)
    assert not dst[:10].any() and dst[10:20].tolist() == list(range(50, 60)) and not dst[20:].any()
    BUILT.memmove_runs(runs, 2)
    assert dst[20:30].tolist() == list(range(90, 100))
    BUILT.memmove_runs(runs, 5, 9)  # past the end: nothing
    with pytest.raises(ValueError, match="run 1 must be a"):
        BUILT.memmove_runs([(d0, s0, 1), (d0, s0)])
    with pytest.raises(ValueError, match="run 0: size -1 is not a size"):
        BUILT.memmove_runs([(d0, s0, -1)])
    with pytest.raises(ValueError, match="run 0: destination 'x' is not an address"):
        BUILT.memmove_runs([("x", s0, 1)])
    with pytest.raises(TypeError):
        BUILT.memmove_runs(5)


@needs_native
def test_memmove_arrays() -> None:
    assert BUILT is not None
    rng = np.random.default_rng(9)
    src = rng.integers(0, 256, 300 * 500, dtype=np.uint8)
    dst = np.zeros(300 * 500, dtype=np.uint8)
    runs = _runs(rng, dst, src, 500)
    want = _expected(dst, src, runs)
    d, s, k = (np.array(col, dtype=np.int64) for col in zip(*runs, strict=True))
    BUILT.memmove_arrays(d, s, k)
    assert np.array_equal(dst, want)
    BUILT.memmove_arrays(*(np.zeros(0, np.int64),) * 3)
    with pytest.raises(ValueError, match="2 destinations, 1 sources and 1 sizes"):
        BUILT.memmove_arrays(d[:2], s[:1], k[:1])
    with pytest.raises(ValueError, match="size -4 of copy 0 is negative"):
        BUILT.memmove_arrays(d[:1], s[:1], np.array([-4], np.int64))
    with pytest.raises(TypeError, match="sizes must be a contiguous int64 array"):
        BUILT.memmove_arrays(d, s, k.astype(np.int32))


# the sizes glibc copies with rep movsb (2 KiB up to a core's L2 cache) and either side of them;
# from 32 KiB up the copies stream (non-temporal stores)
ALIAS_SIZES = [64, 2048, 2049, 4096 + 13, 32 * 1024 - 1, 32 * 1024, 65536 + 7, 300_000, 4 << 20]


@needs_native
@pytest.mark.parametrize("into_page", [0, 1, 8, 16, 31, 32, 4080])
@pytest.mark.parametrize("call", ["runs", "arrays"])
def test_copies_to_a_destination_just_past_its_source_modulo_a_page_are_exact(into_page: int, call: str) -> None:
    """Loads from page-aligned slots into arrays that start a few bytes into a page go around
    glibc's slow rep movsb, and large copies stream (see move_bytes in _native.c): every byte
    lands, at every size and alignment, and the bytes either side of each copy stay as they were."""
    assert BUILT is not None
    rng = np.random.default_rng(into_page)
    total = sum(ALIAS_SIZES) + 64 * len(ALIAS_SIZES)
    src = placed((total,), 0)
    src[:] = rng.integers(0, 256, total, dtype=np.uint8)
    dst = placed((total,), into_page)
    dst[:] = 7
    runs, want, at = [], np.full(total, 7, np.uint8), 0
    for n in ALIAS_SIZES:
        runs.append((int(dst.ctypes.data) + at, int(src.ctypes.data) + at, n))
        want[at : at + n] = src[at : at + n]
        at += n + 64  # a gap between copies: bytes that must stay
    if call == "runs":
        BUILT.memmove_runs(runs)
    else:
        BUILT.memmove_arrays(*(np.array(col, dtype=np.int64) for col in zip(*runs, strict=True)))
    assert np.array_equal(dst, want)


@needs_native
@pytest.mark.parametrize("n", [4096 + 13, 300_000])
def test_an_overlapping_copy_just_past_its_source_keeps_memmove_semantics(n: int) -> None:
    """The 64-byte loop copies forward; a destination 16 bytes past an overlapping source must
    still get the source's bytes as they were before the copy (memmove), not its own output."""
    assert BUILT is not None
    buf = placed((n + 16,), 0)
    buf[:] = np.random.default_rng(n).integers(0, 256, n + 16, dtype=np.uint8)
    want = buf[:n].copy()
    base = int(buf.ctypes.data)
    BUILT.memmove_runs([(base + 16, base, n)])
    assert np.array_equal(buf[16:], want)


# ------------------------------------------------------------------ lookup helpers
@needs_native
@needs_native
def test_buffer_spans_reads_addresses_through_the_buffer_protocol() -> None:
    import torch

    assert BUILT is not None
    arr = np.zeros((4, 16), np.uint8)
    flat = np.zeros(8)
    frozen = arr.copy()
    frozen.flags.writeable = False
    objs = [arr, arr[:, ::2], flat, frozen, "text", b"ab", torch.zeros(2, 2)]
    assert (
        BUILT.buffer_spans(objs, True)
        == [(int(arr.ctypes.data), 64, 4), None, (int(flat.ctypes.data), 64, -1)] + [None] * 4
    )  # strided, read-only for write, no buffer at all (str, torch): None
    assert BUILT.buffer_spans([frozen], False) == [(int(frozen.ctypes.data), 64, 4)]  # read-only is fine to read
    span = BUILT.buffer_spans([b"ab"], False)[0]
    assert span is not None and span[1:] == (2, -1)
    with pytest.raises(TypeError, match="sequence of buffers"):
        BUILT.buffer_spans(5, False)


def test_lookup_helpers_keep_the_python_semantics() -> None:
    assert BUILT is not None

    class E:
        __slots__ = ("layers",)

        def __init__(self, layers: int) -> None:
            self.layers = layers

    keys = [bytes([i]) * 16 for i in range(10)]
    held = {k: i for i, k in enumerate(keys[:6])}
    assert BUILT.prefix_values(held, keys) == list(range(6))
    assert BUILT.prefix_values(held, keys[:3]) == [0, 1, 2]
    assert BUILT.prefix_values(held, []) == []
    assert BUILT.prefix_values({**held, keys[2]: None}, keys) == [0, 1]  # as ``dict.get``: None ends it
    assert BUILT.prefix_values(held, keys[7:] + keys[:2]) == []
    entries = {k: E(i) for i, k in enumerate(keys) if i % 3}
    want = [entries[k].layers if k in entries else 0 for k in keys]
    assert BUILT.attr_values(entries, keys, "layers", 0) == want
    with pytest.raises(AttributeError):
        BUILT.attr_values(entries, keys, "nbytes", 0)
    masks = [0b111, 0b1111, 2**70 + 0b111, -1, 0b101, 0b111]  # wide and negative ints as Python's &
    assert BUILT.prefix_run(masks, 0b111) == 4
    assert BUILT.prefix_run([], 5) == 0
    with pytest.raises(TypeError, match="mask 1 is 'x', not an int"):
        BUILT.prefix_run([1, "x"], 1)
    with pytest.raises(ValueError, match="does not fit in 63 bits"):
        BUILT.prefix_run([1], 2**63)


def test_prefix_run_on_both_paths(code_path: str) -> None:
    rng = np.random.default_rng(1)
    masks = rng.integers(0, 2**40, 500).tolist()
    for prefix in (0, 1, 0b11, 2**39 + 1):
        want = next((i for i, m in enumerate(masks) if m & prefix != prefix), len(masks))
        assert prefix_run(masks, prefix, 40) == want


@needs_native
@pytest.mark.parametrize("policy", ["uniform", "per-layer"])
def test_lookups_are_the_same_on_both_paths(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Uniform and per-layer lookups (every layer, and a subset: the partial path) of a held
    prefix followed by blocks no tier holds, with the C helpers and without."""
    layout = get_layout("gpt-oss-20b")
    cfg = {"tiers": [{"name": "dram", "capacity": "64MiB"}], "policies": {"layer_policy": policy}}
    tokens = np.random.default_rng(2).integers(0, 128000, size=layout.block_size * 300, dtype=np.uint32)
    with Engine(cfg, layout=layout) as engine:
        keys = engine.hasher.keys_for_tokens(tokens)
        populate_index(engine, keys[:200])
        asks = [(keys, None), (keys[:200], None), (keys[200:], None), ([], None), (keys, [0, 1]), (keys, [1])]
        answers = {}
        for path in (BUILT, None):
            monkeypatch.setattr(native, "NATIVE", path)
            answers[path is None] = [
                (r.num_blocks, list(r.tier_positions)) for r in (engine.lookup(k, layers) for k, layers in asks)
            ]
        assert answers[True] == answers[False]
        n, positions = answers[True][0]
        assert n == 200 and positions == [0] * n  # the store's end is a restore point
        assert answers[True][2][0] == 0


# ------------------------------------------------------------------ the build
def test_built_artifacts_are_git_ignored() -> None:
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "*.so" in ignored and "build/" in ignored
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'name = "kvstrata._native"' in pyproject and "optional = true" in pyproject


@pytest.mark.skipif(native.NATIVE is None, reason="kvstrata._native is not built")
def test_xxh3_64_matches_xxhash_at_every_short_length_and_long_ones() -> None:
    import xxhash

    rng = np.random.default_rng(7)
    for n in [*range(0, 300), 1023, 1024, 1025, 4096, 65536, 65600]:
        data = rng.integers(0, 256, size=n, dtype=np.uint8).tobytes()
        assert native.NATIVE is not None and native.NATIVE.xxh3_64_intdigest(data) == xxhash.xxh3_64_intdigest(data), n


@pytest.mark.skipif(native.NATIVE is None, reason="kvstrata._native is not built")
@needs_native
def test_stage_out_streams_large_records_exactly_at_any_alignment() -> None:
    """Records from 32 KiB on leave the stage with streaming stores (a head to align the
    destination, 64-byte moves, a tail): exact at every destination offset into a page and length,
    and nothing written around them."""
    from kvstrata.tiers.fileio import aligned_buffer, stage_in, stage_out

    rng = np.random.default_rng(11)
    sizes = [32 * 1024 - 1, 32 * 1024, 32 * 1024 + 1, 65536 + 13, 65536 + 64]
    recs = [rng.integers(0, 256, size=n, dtype=np.uint8) for n in sizes]
    stage = aligned_buffer(1 << 20)
    pos = [i * 69632 for i in range(len(recs))]  # 68 KiB apart, 64-byte aligned
    sums = stage_in(stage, pos, recs, sizes, True)
    for shift in (0, 1, 7, 15, 16, 33):
        # room for the page-boundary start (up to 4096 bytes in) and each record's shift and gap
        pages = np.full(sum(sizes) + (shift + 64) * len(sizes) + 4096, 0x5A, np.uint8)
        starts, at = [], 4096 - (pages.ctypes.data % 4096)  # each destination ``shift`` bytes past a boundary
        for n in sizes:
            starts.append(at + shift)
            at += n + shift + 64
        outs = [pages[a : a + n] for a, n in zip(starts, sizes, strict=True)]
        status = stage_out(stage, pos, outs, sizes, sums)
        assert status is not None and status.tolist() == [1] * len(sizes)
        assert all(np.array_equal(o, r) for o, r in zip(outs, recs, strict=True)), shift
        mask = np.ones(pages.size, bool)
        for a, n in zip(starts, sizes, strict=True):
            mask[a : a + n] = False
        assert (pages[mask] == 0x5A).all(), shift  # not a byte outside the records


def test_stage_in_and_out_copy_checksum_and_refuse_a_corrupt_record() -> None:
    import xxhash

    from kvstrata.tiers.fileio import aligned_buffer, stage_in, stage_out

    rng = np.random.default_rng(3)
    recs = [rng.integers(0, 256, size=n, dtype=np.uint8) for n in (1000, 4096, 65536)]
    stage = aligned_buffer(1 << 20)
    stage[:] = 0xAA
    pos = [0, 1024, 8192]
    span = (recs[1].ctypes.data, recs[1].nbytes)  # a host span goes as well as a buffer
    sums = stage_in(stage, pos, [recs[0], span, recs[2]], [r.nbytes for r in recs], True)
    assert sums == [xxhash.xxh3_64_intdigest(r.tobytes()) for r in recs]
    assert bytes(stage[1000:1024]) == b"\0" * 24  # padding to the 64-byte extent zeroed
    assert all(np.array_equal(stage[p : p + r.nbytes], r) for p, r in zip(pos, recs, strict=True))
    stage[8192 + 5] ^= 1  # the third record is damaged
    outs = [np.zeros_like(r) for r in recs]
    status = stage_out(stage, pos, outs, [r.nbytes for r in recs], sums)
    assert status is not None and status.tolist() == [1, 1, 0]
    assert np.array_equal(outs[0], recs[0]) and np.array_equal(outs[1], recs[1])
    assert not outs[2].any()  # a corrupt record is never copied out
    wrong = stage_out(stage, pos[:1], [np.zeros(10, np.uint8)], [1000], sums[:1])
    assert wrong is not None and wrong.tolist() == [2]  # a destination of another size: left to the caller
    mod = native.NATIVE
    assert mod is not None
    with pytest.raises(ValueError, match="outside a stage"):
        mod.stage_in(stage, np.array([1 << 20]), [recs[0]], np.array([1000]), None, None)
    # through the helper a bad layout is the caller's error, never a quiet fall back to the slow path
    with pytest.raises(ValueError, match="record 1: position 1048000"):
        stage_in(stage, [0, 1_048_000], recs[:2], [1000, 4096], True)
    with pytest.raises(ValueError, match="2 records but 1 positions"):
        stage_in(stage, [0], recs[:2], [1000, 4096], False)
    strided = np.zeros(8192, np.uint8)[::2]  # not host memory the extension takes: the caller copies
    assert stage_in(stage, [0], [strided], [4096], False) is None


# ---------------------------------------------------------------------------------- the collector
@needs_native
@pytest.mark.parametrize("policy", ["lru", "prefix-aware"])
def test_an_index_holds_nothing_the_garbage_collector_walks(policy: str) -> None:
    """A full collection walks every tracked container: the index's entries (the extension's
    Entry) and the eviction order hold keys and ints only, so none of them is tracked, and an
    insert of something trackable has the collector track that container again."""
    import gc

    from kvstrata.engine.index import BlockIndex, Entry
    from kvstrata.policies import EVICTION
    from kvstrata.policies.admission import AdmitAll, SecondTouch

    assert Entry is native.NATIVE.Entry  # type: ignore[union-attr]
    index: BlockIndex[bytes] = BlockIndex(EVICTION.get(policy)(), AdmitAll())
    keys = [bytes([i]) * 16 for i in range(5)]
    index.add_blocks(keys[:4], 0b11, 2048, [None, *keys[:3]])
    index.add(keys[4], 0b01, 1024, keys[3])
    index.add(keys[0], 0b100, 1024, None)  # an update
    index.eviction.access(keys[1])
    index.eviction.cold(keys[2])
    gc.collect()
    orders = [v for v in vars(index.eviction).values() if isinstance(v, dict)]
    assert orders and not any(gc.is_tracked(d) for d in [index.entries, *orders])
    assert not any(gc.is_tracked(e) for e in index.entries.values())
    assert index.entries[keys[0]].layers == 0b111 and index.entries[keys[0]].nbytes == 3072
    assert sorted(index.eviction.victims()) == sorted(keys)
    seen = SecondTouch[bytes]()
    assert not seen.admit(keys[0]) and not gc.is_tracked(seen._seen)

    class Key:  # hashable, and tracked by the collector
        pass

    order = EVICTION.get(policy)()
    order.insert(Key(), None)  # a trackable key: the collector must see the dict again
    assert any(gc.is_tracked(d) for d in vars(order).values() if isinstance(d, dict))


@needs_native
def test_native_entry_is_the_dataclass_with_the_same_fields() -> None:
    import gc
    import weakref

    mod = native.NATIVE
    assert mod is not None
    e = mod.Entry(0b101, 4096, b"p")
    assert (e.layers, e.nbytes, e.parent, e.pins, e.doomed) == (0b101, 4096, b"p", 0, False)
    e.layers |= 1 << 90  # masks of more than 64 layers stay ints
    e.nbytes += 10
    e.pins += 1
    e.doomed = True
    assert e == mod.Entry(0b101 | 1 << 90, 4106, b"p", 1, True) and e != mod.Entry(0b101, 4106, b"p", 1, True)
    assert repr(mod.Entry(3, 10)) == "Entry(layers=3, nbytes=10, parent=None, pins=0, doomed=False)"
    assert not gc.is_tracked(e)
    with pytest.raises(TypeError):
        mod.Entry(3)  # nbytes is required, as in the dataclass
    with pytest.raises(TypeError):
        hash(e)
    assert str(mod.Entry[bytes]).endswith("Entry[bytes]")

    class Probe:  # a parent that can be weakly referenced: freed with its entry by reference counts
        pass

    parent = Probe()
    ref = weakref.ref(parent)
    held = mod.Entry(1, 1, parent)
    del parent
    assert ref() is not None
    del held
    assert ref() is None
    d = {b"k": mod.Entry(1, 1)}
    assert mod.untrack_atoms(d) and not gc.is_tracked(d)
    assert not mod.untrack_atoms({b"k": [1]})  # a trackable value: left tracked
    with pytest.raises(TypeError, match="needs a dict"):
        mod.untrack_atoms([1])


@needs_native
def test_tiers_hold_nothing_the_garbage_collector_walks(tmp_path: Path) -> None:
    """After stores through a DRAM and an NVMe tier, none of the per-block maps a full collection
    would walk is tracked: the engine's indexes, the DRAM slot table's rows, the nvme mirror (its
    values untracked as made) and its keys by segment."""
    import gc

    from kvstrata.workload.benchkit import MiB, batch, layout_for, salted_keys

    layout = layout_for(64 * 1024)
    src = batch(layout, 8, 0)
    cfg = {
        "tiers": [
            {"name": "dram", "capacity": 64 * MiB, "write": "write-through"},
            {"name": "nvme", "kind": "nvme", "path": str(tmp_path), "capacity": 256 * MiB},
        ],
    }
    with Engine(cfg, layout=layout) as engine:
        for salt in range(3):
            engine.store_sync(salted_keys(engine, 8, salt * 8), src)
        engine.flush()
        dram, nvme = (slot.tier for slot in engine.tiers)
        assert len(dram._table) == 24 and len(nvme._mirror) == 24 * layout.num_layers  # type: ignore[attr-defined]
        maps = [slot.entries for slot in engine.tiers]
        maps += [dram._table._key_of, dram._table._row_of, nvme._mirror, *nvme._by_seg.values()]  # type: ignore[attr-defined]
        assert not [type(m).__name__ for m in maps if gc.is_tracked(m)]
        assert not any(gc.is_tracked(v) for v in nvme._mirror.values())  # type: ignore[attr-defined]
