"""The test oracle shared by the conformance suite and the engine tests.

Deterministic contents for every (key, layer) and version, buffer builders for numpy and
torch, checks of what came back, key and layout builders, and :class:`TierFactory`, which
builds tiers of one kind straight from the registry. Nothing here needs pytest; the package
:mod:`kvstrata.testing` does (see its docstring).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import torch
import xxhash

from kvstrata.core.buffers import Buffer, host_bytes
from kvstrata.core.keys import BlockHasher, Key, Namespace
from kvstrata.core.layout import KVLayout, LayerKind, LayerSpec, uniform_layout
from kvstrata.engine.engine import Engine
from kvstrata.tiers import TIERS, BlockId, ReadStatus, Tier, TierContext

TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "float8_e4m3fn": torch.uint8,  # bytes are bytes; avoids depending on float8 support
    "float8_e5m2": torch.uint8,
}


@lru_cache(maxsize=4096)
def _contents(key: Key, layer: int, nbytes: int, version: int) -> np.ndarray:
    seed = xxhash.xxh3_64_intdigest(key + layer.to_bytes(2, "little") + version.to_bytes(4, "little"))
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    data.setflags(write=False)
    return data


def block_bytes(key: Key, layer: int, nbytes: int, version: int = 0) -> np.ndarray:
    """The bytes a test writes for (key, layer): pseudo-random, distinct per key, layer and version."""
    return _contents(key, layer, nbytes, version)


def to_bytes(buf: Buffer) -> np.ndarray:
    """A flat uint8 copy of a numpy array or a CPU torch tensor."""
    return host_bytes(buf).copy()


def make_buffer(layout: KVLayout, layer: int, kind: str = "numpy", data: np.ndarray | None = None) -> Buffer:
    """One layer-block buffer: flat uint8 numpy, or a torch tensor of the layer's shape and dtype."""
    spec = layout.layers[layer]
    buf: Buffer
    if kind == "numpy":
        buf = np.zeros(spec.nbytes, dtype=np.uint8)
    elif kind == "torch":
        buf = torch.zeros(spec.block_shape, dtype=TORCH_DTYPES[spec.dtype])
    else:  # pragma: no cover - test bug
        raise ValueError(kind)
    if data is not None:
        host_bytes(buf)[:] = data
    return buf


def source_buffers(
    layout: KVLayout, keys: Sequence[Key], kind: str = "numpy", layers: Sequence[int] | None = None, version: int = 0
) -> dict[int, list[Buffer]]:
    """``buffers[layer][i]`` holding the oracle bytes of ``keys[i]``, ready for ``Engine.store``."""
    layers = range(layout.num_layers) if layers is None else layers
    return {
        layer: [
            make_buffer(layout, layer, kind, block_bytes(k, layer, layout.layer_nbytes(layer), version)) for k in keys
        ]
        for layer in layers
    }


def empty_buffers(
    layout: KVLayout, n: int, kind: str = "numpy", layers: Sequence[int] | None = None
) -> dict[int, list[Buffer]]:
    """Zeroed destination buffers for ``Engine.load`` of ``n`` blocks."""
    layers = range(layout.num_layers) if layers is None else layers
    return {layer: [make_buffer(layout, layer, kind) for _ in range(n)] for layer in layers}


def mismatches(
    layout: KVLayout, keys: Sequence[Key], buffers: Mapping[int, Sequence[Buffer]], n: int, version: int = 0
) -> list[tuple[int, int]]:
    """(block position, layer) pairs among the first ``n`` blocks whose bytes differ from the oracle."""
    bad = []
    for layer, bufs in buffers.items():
        size = layout.layer_nbytes(layer)
        for i in range(n):
            if not np.array_equal(to_bytes(bufs[i]), block_bytes(keys[i], layer, size, version)):
                bad.append((i, layer))
    return bad


def chain_keys(layout: KVLayout, seed: int, n_blocks: int, shared: Sequence[int] = ()) -> list[Key]:
    """Keys of a prompt of ``n_blocks`` full blocks: the tokens ``shared`` then seeded random ones."""
    rng = np.random.default_rng(seed)
    tokens = list(shared) + rng.integers(0, 50_000, n_blocks * layout.block_size - len(shared)).tolist()
    hasher = BlockHasher(default_namespace(layout))
    return hasher.keys_for_tokens(tokens)


def default_namespace(layout: KVLayout) -> Namespace:
    """The namespace an ``Engine`` builds for ``layout`` when given none."""
    return Namespace(
        model=layout.model,
        kv_dtype=layout.layers[0].dtype,
        layout_fingerprint=layout.fingerprint(),
        block_size=layout.block_size,
    )


def raw_block_keys(n: int, seed: int = 0) -> list[Key]:
    """``n`` distinct 16-byte keys for tier-level tests (no engine involved)."""
    rng = random.Random(seed)
    return [rng.randbytes(16) for _ in range(n)]


def mixed_layout() -> KVLayout:
    """Three layers of three kinds and sizes (256, 400 and 288 bytes), to exercise size classes."""
    return KVLayout(
        model="test-mixed",
        block_size=4,
        layers=(
            LayerSpec("attn", LayerKind.FULL, (2, 4, 2, 8), "float16"),
            LayerSpec("state", LayerKind.LINEAR, (100,), "float32"),
            LayerSpec("mla", LayerKind.MLA, (4, 36), "bfloat16"),
        ),
    )


def engine_layout() -> KVLayout:
    """Layout of the engine-level conformance tests: two layers of 4 KiB layer-blocks."""
    return uniform_layout("conformance", num_layers=2, num_kv_heads=2, head_dim=64, block_size=4, dtype="float32")


def tier_usage(engine: Engine, name: str) -> tuple[int, int, int]:
    """(used_bytes, live_bytes, capacity_bytes) of one tier from ``Engine.stats()``."""
    t = engine.stats()["tiers"][name]
    return t["used_bytes"], t["live_bytes"], t["capacity_bytes"]


class HookedBuffer:
    """A host destination buffer that runs ``hook`` (in another thread) the first time its size is read.

    It pins down one interleaving of a read with other operations, without timing: a
    tier reads the destination's size between finding a block and copying it. The hook
    runs in a helper thread, joined with a timeout, so a tier that holds a lock there
    serializes the hook instead of deadlocking.
    """

    def __init__(self, data: np.ndarray, hook: Callable[[], None]) -> None:
        self.data = data
        self._hook: Callable[[], None] | None = hook
        self.fired = False

    @property
    def nbytes(self) -> int:
        hook, self._hook = self._hook, None
        if hook is not None:
            self.fired = True
            helper = threading.Thread(target=hook)
            helper.start()
            helper.join(5)
        return int(self.data.nbytes)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self.data


class TierFactory:
    """Builds tiers of one kind straight from the registry; closes them all at the end."""

    def __init__(
        self, kind: str, options: dict[str, Any], layout: KVLayout, wrap: Callable[[Tier], Tier] | None = None
    ) -> None:
        self.kind = kind
        self.options = options
        self.layout = layout
        self.context = TierContext(layout, default_namespace(layout))
        self.wrap = wrap or (lambda tier: tier)
        self.opened: list[Tier] = []

    def make(self, capacity: int, name: str | None = None) -> Tier:
        cls = TIERS.get(self.kind)
        tier = self.wrap(cls(name or self.kind, capacity, cls.Options.model_validate(self.options), self.context))
        self.opened.append(tier)
        return tier

    def reopen(self, tier: Tier) -> Tier:
        """Close ``tier`` and open a new instance with the same name, capacity and options."""
        tier.close()
        return self.make(tier.capacity, tier.name)

    def close_all(self) -> None:
        for tier in self.opened:
            tier.close()


def write_items(layout: KVLayout, ids: Sequence[BlockId], kind: str = "numpy", version: int = 0) -> list:
    return [
        ((k, layer), make_buffer(layout, layer, kind, block_bytes(k, layer, layout.layer_nbytes(layer), version)))
        for k, layer in ids
    ]


def read_back(tier: Tier, layout: KVLayout, ids: Sequence[BlockId], kind: str = "numpy") -> tuple[list, list]:
    """Read ``ids`` into fresh buffers; returns (statuses, buffers)."""
    bufs = [make_buffer(layout, layer, kind) for _, layer in ids]
    statuses = tier.read(list(zip(ids, bufs, strict=True)))
    return statuses, bufs


def assert_read_back(
    tier: Tier, layout: KVLayout, ids: Sequence[BlockId], kind: str = "numpy", version: int = 0
) -> None:
    statuses, bufs = read_back(tier, layout, ids, kind)
    assert statuses == [ReadStatus.OK] * len(ids)
    for (k, layer), buf in zip(ids, bufs, strict=True):
        expected = block_bytes(k, layer, layout.layer_nbytes(layer), version)
        assert np.array_equal(to_bytes(buf), expected), f"wrong bytes for layer {layer} of key {k.hex()}"
