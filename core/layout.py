"""KV layouts: what one block of each layer looks like.

A :class:`KVLayout` lists every layer of a model with its kind (full attention,
sliding window, linear-attention/Mamba state, MLA latent), the shape and dtype of
one *layer-block* (the bytes that layer keeps for one block of ``block_size``
tokens), and the block size. Layers with the same kind and shape form a
:class:`LayerGroup`.

Glossary (used throughout kvstrata):

* **block**: ``block_size`` consecutive tokens of a prompt, identified by a key.
* **layer-block**: the bytes one layer keeps for one block; addressed by (key, layer).
* **layer group**: layers with the same kind, shape and dtype.
* **key**: a 16-byte chained prefix hash identifying tokens ``0 .. (i+1)*block_size``.
* **tier**: one storage level (hbm, dram, nvme, ...).
* **segment**: a large file of the nvme tier holding many layer-blocks.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from enum import StrEnum

import xxhash

from kvstrata.errors import ConfigError

DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


class LayerKind(StrEnum):
    """What a layer keeps per block."""

    FULL = "full"  # full attention: K and V for every token
    SLIDING = "sliding"  # sliding-window attention: K and V, only the last `window` tokens matter
    LINEAR = "linear"  # linear attention / Mamba: a recurrent state snapshot at a block boundary
    MLA = "mla"  # multi-head latent attention: one latent vector per token, shared by TP ranks


@dataclass(frozen=True)
class LayerSpec:
    """One layer: its kind and the shape/dtype of one layer-block."""

    name: str
    kind: LayerKind
    block_shape: tuple[int, ...]
    dtype: str = "bfloat16"
    window: int | None = None  # tokens, for SLIDING layers

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ConfigError(
                f"layer {self.name!r}: unknown dtype {self.dtype!r}; known: {', '.join(DTYPE_SIZES)}",
                field="dtype",
                value=self.dtype,
            )
        if not self.block_shape or any(int(d) <= 0 for d in self.block_shape):
            raise ConfigError(f"layer {self.name!r}: bad block shape {self.block_shape!r}", field="block_shape")
        if self.kind is LayerKind.SLIDING and (self.window is None or self.window <= 0):
            raise ConfigError(f"layer {self.name!r}: sliding layers need a positive window", field="window")

    @property
    def nbytes(self) -> int:
        """Bytes of one layer-block."""
        return math.prod(self.block_shape) * DTYPE_SIZES[self.dtype]

    @property
    def group_signature(self) -> tuple[object, ...]:
        return (self.kind.value, self.block_shape, self.dtype, self.window)


@dataclass(frozen=True)
class LayerGroup:
    """Layers with the same kind, shape and dtype."""

    index: int
    kind: LayerKind
    layers: tuple[int, ...]
    block_nbytes: int
    window: int | None = None


@dataclass(frozen=True)
class KVLayout:
    """The KV geometry of a model as kvstrata stores it."""

    model: str
    block_size: int
    layers: tuple[LayerSpec, ...]
    groups: tuple[LayerGroup, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {self.block_size!r}", field="block_size")
        if not self.layers:
            raise ConfigError("a layout needs at least one layer", field="layers")
        by_sig: dict[tuple[object, ...], list[int]] = {}
        for i, spec in enumerate(self.layers):
            by_sig.setdefault(spec.group_signature, []).append(i)
        groups = []
        for gi, members in enumerate(by_sig.values()):
            spec = self.layers[members[0]]
            groups.append(LayerGroup(gi, spec.kind, tuple(members), spec.nbytes, spec.window))
        object.__setattr__(self, "groups", tuple(groups))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def all_layers_mask(self) -> int:
        return (1 << len(self.layers)) - 1

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block over all layers."""
        return sum(spec.nbytes for spec in self.layers)

    @property
    def bytes_per_token(self) -> float:
        return self.block_nbytes / self.block_size

    def layer_nbytes(self, layer: int) -> int:
        return self.layers[layer].nbytes

    def to_dict(self) -> dict[str, object]:
        return {
            "model": self.model,
            "block_size": self.block_size,
            "layers": [
                {
                    "name": s.name,
                    "kind": s.kind.value,
                    "block_shape": list(s.block_shape),
                    "dtype": s.dtype,
                    "window": s.window,
                }
                for s in self.layers
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> KVLayout:
        layers = tuple(
            LayerSpec(
                name=str(d["name"]),
                kind=LayerKind(d["kind"]),
                block_shape=tuple(int(x) for x in d["block_shape"]),
                dtype=str(d.get("dtype", "bfloat16")),
                window=d.get("window"),
            )
            for d in data["layers"]  # type: ignore[attr-defined]
        )
        return cls(model=str(data["model"]), block_size=int(data["block_size"]), layers=layers)  # type: ignore[call-overload]

    def fingerprint(self) -> str:
        """A stable 16-hex-digit digest of everything that changes the bytes of a block."""
        canon = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return xxhash.xxh3_64_hexdigest(canon.encode())

    def with_block_size(self, block_size: int) -> KVLayout:
        """The same model with another block size (shapes scale along the token axis)."""
        if block_size == self.block_size:
            return self
        new_layers = []
        for s in self.layers:
            shape = list(s.block_shape)
            if s.kind is not LayerKind.LINEAR:
                axis = 0 if s.kind is LayerKind.MLA else 1  # token axis: (block, dim) or (2, block, heads, dim)
                if shape[axis] != self.block_size:
                    raise ConfigError(f"layer {s.name!r} has no token axis to rescale", field="block_size")
                shape[axis] = block_size
            new_layers.append(LayerSpec(s.name, s.kind, tuple(shape), s.dtype, s.window))
        return KVLayout(self.model, block_size, tuple(new_layers))


def uniform_layout(
    model: str,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: str = "bfloat16",
) -> KVLayout:
    """A layout of identical full-attention layers; a layer-block is ``[2, block, heads, head_dim]``."""
    spec_shape = (2, block_size, num_kv_heads, head_dim)
    layers = tuple(LayerSpec(f"layers.{i}", LayerKind.FULL, spec_shape, dtype) for i in range(num_layers))
    return KVLayout(model=model, block_size=block_size, layers=layers)
