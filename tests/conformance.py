"""The conformance suite and its oracle, for the tests here: they ship in the package as
:mod:`kvstrata.testing` (so a tier of another distribution can run the same suite); this module
re-exports them under the name the test files import (``from conformance import ...``)."""

from __future__ import annotations

from kvstrata.testing.conformance import MiB, TierConformance
from kvstrata.testing.oracle import (
    TORCH_DTYPES,
    HookedBuffer,
    TierFactory,
    assert_read_back,
    block_bytes,
    chain_keys,
    default_namespace,
    empty_buffers,
    engine_layout,
    make_buffer,
    mismatches,
    raw_block_keys,
    read_back,
    source_buffers,
    tier_usage,
    to_bytes,
    write_items,
)
from kvstrata.testing.stateful import MAX_BLOCKS, MODEL_CAPACITY_BLOCKS, N_CHAINS, EngineModel

__all__ = [
    "MAX_BLOCKS",
    "MODEL_CAPACITY_BLOCKS",
    "N_CHAINS",
    "TORCH_DTYPES",
    "EngineModel",
    "HookedBuffer",
    "MiB",
    "TierConformance",
    "TierFactory",
    "assert_read_back",
    "block_bytes",
    "chain_keys",
    "default_namespace",
    "empty_buffers",
    "engine_layout",
    "make_buffer",
    "mismatches",
    "raw_block_keys",
    "read_back",
    "source_buffers",
    "tier_usage",
    "to_bytes",
    "write_items",
]
