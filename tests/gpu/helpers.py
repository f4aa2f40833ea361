"""Buffers on a device and byte checks of them, for the GPU path tests (the oracle's buffers are
host ones: :mod:`kvstrata.testing.oracle`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xxhash
from conformance import TORCH_DTYPES, block_bytes

from kvstrata.core.keys import Key
from kvstrata.core.layout import KVLayout
from kvstrata.tiers import BlockId


def on_device(layout: KVLayout, layer: int, device: str, data: np.ndarray | None = None) -> torch.Tensor:
    """One layer-block as a tensor of the layer's shape and dtype on ``device`` (zeros, or ``data``)."""
    spec = layout.layers[layer]
    host = torch.zeros(spec.block_shape, dtype=TORCH_DTYPES[spec.dtype])
    if data is not None:
        host.reshape(-1).view(torch.uint8).numpy()[:] = data
    return host.to(device)


def device_bytes(buf: torch.Tensor) -> np.ndarray:
    """A host copy of a tensor's bytes, wherever it lives."""
    return buf.detach().reshape(-1).view(torch.uint8).cpu().numpy().copy()


def digest(buf: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(device_bytes(buf).tobytes())


def items_on(layout: KVLayout, ids: Sequence[BlockId], device: str, version: int = 0) -> list:
    """(id, buffer on ``device`` holding the oracle bytes) pairs, ready for ``Tier.write``."""
    return [
        ((k, layer), on_device(layout, layer, device, block_bytes(k, layer, layout.layer_nbytes(layer), version)))
        for k, layer in ids
    ]


def wrong_blocks(layout: KVLayout, ids: Sequence[BlockId], bufs: Sequence[torch.Tensor], version: int = 0) -> list:
    """The ids whose buffer's checksum differs from the oracle's bytes."""
    return [
        (k.hex(), layer)
        for (k, layer), buf in zip(ids, bufs, strict=True)
        if digest(buf) != xxhash.xxh3_64_intdigest(block_bytes(k, layer, layout.layer_nbytes(layer), version).tobytes())
    ]


def engine_buffers(layout: KVLayout, keys: Sequence[Key], device: str, fill: bool = True) -> dict[int, list]:
    """``buffers[layer][i]`` on ``device`` for ``Engine.store`` (oracle bytes) or ``Engine.load`` (zeros)."""
    return {
        layer: [
            on_device(layout, layer, device, block_bytes(k, layer, layout.layer_nbytes(layer)) if fill else None)
            for k in keys
        ]
        for layer in range(layout.num_layers)
    }
