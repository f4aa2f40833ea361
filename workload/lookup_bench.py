"""Hash + lookup of a long prompt whose every block is cached (the worst case: no early exit).

Two paths: the uniform one (Llama-3-8B-like layout, every layer of every block) and the
per-layer one (gpt-oss-20b, sliding-window and full-attention layers, under per-layer policies:
a lookup there finds the longest prefix at which every layer group can be restored). The index
is filled directly with what a store of the prompt in one call leaves behind (every block's
full-attention layers, the window layers of the blocks before its end), so the benchmark
measures lookups, not stores of gigabytes. Beside them: hashing alone, and vLLM's default prefix
hash (sha256 of pickled tuples, chained) of the same tokens.
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any

import numpy as np

from kvstrata.core.catalog import get_layout
from kvstrata.core.keys import Key
from kvstrata.core.layout import KVLayout
from kvstrata.engine.engine import Engine
from kvstrata.workload.benchkit import best, llama8b_layout

__all__ = ["bench_lookup", "lookup_seconds", "populate_index", "vllm_default_hash"]


def vllm_default_hash(tokens: list[int], block_size: int) -> list[bytes]:
    """vLLM's default prefix hash: sha256 over a pickled (parent, tokens, extra) tuple, chained."""
    out: list[bytes] = []
    parent = b""
    for i in range(len(tokens) // block_size):
        blk = tuple(tokens[i * block_size : (i + 1) * block_size])
        parent = hashlib.sha256(pickle.dumps((parent, blk, None), protocol=pickle.HIGHEST_PROTOCOL)).digest()
        out.append(parent)
    return out


def populate_index(engine: Engine, keys: list[Key]) -> None:
    """Record ``keys`` in the top tier's index as one store of them leaves it (under per-layer
    policies: the layers each block keeps with a restore point at the end), moving no bytes."""
    state = engine._state  # a benchmark of the index alone: it fills the index the way stores do
    top = state.tiers[0]
    policies = engine.policies
    masks = policies.keep_masks(len(keys), [len(keys)]) if engine.hybrid else [state.all_mask] * len(keys)
    with state.lock:
        parent = None
        for i, (key, mask) in enumerate(zip(keys, masks, strict=True)):
            state.record(top, key, mask, parent, i + 1)
            parent = key


def lookup_seconds(layout: KVLayout, tokens: np.ndarray, repeats: int, layer_policy: str) -> dict[str, Any]:
    """Best-of-``repeats`` seconds of hash + lookup and of hashing alone, for one layout."""
    cfg = {"tiers": [{"name": "dram", "capacity": "64MiB"}], "policies": {"layer_policy": layer_policy}}
    with Engine(cfg, layout=layout) as engine:
        hasher = engine.hasher
        keys = hasher.keys_for_tokens(tokens)
        populate_index(engine, keys)

        def hash_and_lookup() -> int:
            return engine.lookup(hasher.keys_for_tokens(tokens)).num_blocks

        found = hash_and_lookup()
        lookup_s = best(lambda: engine.lookup(keys), repeats)
        both_s = best(hash_and_lookup, repeats)
        hash_s = best(lambda: hasher.keys_for_tokens(tokens), repeats)
        hybrid = engine.hybrid
    return {
        "layout": layout.model,
        "per_layer": hybrid,
        "blocks": len(keys),
        "blocks_found": found,
        "hash_and_lookup_ms": both_s * 1e3,
        "hash_ms": hash_s * 1e3,
        "lookup_ms": lookup_s * 1e3,
    }


def bench_lookup(tokens: int = 131072, repeats: int = 20) -> dict[str, Any]:
    """Hash + lookup of a ``tokens``-token prompt on the uniform and the per-layer path."""
    rng = np.random.default_rng(3)
    toks = rng.integers(0, 128000, size=tokens, dtype=np.uint32)
    uniform = lookup_seconds(llama8b_layout(), toks, repeats, "uniform")
    per_layer = lookup_seconds(get_layout("gpt-oss-20b"), toks, repeats, "per-layer")
    as_list = toks.tolist()
    sha_s = best(lambda: vllm_default_hash(as_list, 16), max(3, repeats // 5))
    return {
        "tokens": tokens,
        "blocks_found": uniform["blocks_found"],
        "uniform": uniform,
        "per_layer": per_layer,
        "lookup_128k_ms": uniform["hash_and_lookup_ms"],
        "hash_128k_ms": uniform["hash_ms"],
        "per_layer_lookup_128k_ms": per_layer["hash_and_lookup_ms"],
        "vllm_sha256_hash_128k_ms": sha_s * 1e3,
        "hash_speedup_vs_sha256": sha_s / (uniform["hash_ms"] / 1e3),
    }
