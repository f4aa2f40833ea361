"""Replay a trace through the real engine and its real tiers.

For every request, in arrival order: hash the prompt into block keys, look up
the longest restorable prefix, load it (real bytes into scratch buffers) and
check every loaded byte, then store the request's KV (prompt, plus output tokens
for kvstrata traces) as an inference engine would after prefill/decode. An
optional ``hbm`` tier at the top models the inference engine's own GPU prefix
cache, so hits there are the ones a GPU-only setup would get too.

Hybrid layouts replay under the engine's per-layer policies (``layer_policy``): a restore loads
only what it needs (window blocks, the last block's state snapshot), and a store hands state
layers a snapshot only at the engine's restore points, the way an inference engine that
checkpoints its recurrent state at block boundaries would. ``bytes_stored`` reports what each
tier holds at the end, ``bytes_written`` what was written into it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstrata.config import KVStrataConfig, TierConfig, load_config
from kvstrata.core.keys import Key
from kvstrata.core.layout import KVLayout
from kvstrata.engine.engine import Buffers, Engine
from kvstrata.workload.content import block_contents, count_mismatches
from kvstrata.workload.traces import Request, Trace


@dataclass
class HitCounts:
    """What every replay counts, on one engine or across instances."""

    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    per_tier: Counter[str] = field(default_factory=Counter)
    mismatched_loads: int = 0
    failed_loads: int = 0
    blocks_stored: int = 0
    elapsed_s: float = 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def hit_dict(self, tiers: Iterable[str]) -> dict[str, Any]:
        """The counts as JSON, with hits per tier for ``tiers`` (in that order)."""
        names = list(tiers)
        p = self.prompt_tokens
        return {
            "requests": self.requests,
            "prompt_tokens": p,
            "hit_tokens": self.hit_tokens,
            "token_hit_rate": round(self.token_hit_rate, 6),
            "per_tier": {name: int(self.per_tier.get(name, 0)) for name in names},
            "per_tier_hit_rate": {name: round(self.per_tier.get(name, 0) / p, 6) if p else 0.0 for name in names},
            "mismatched_loads": self.mismatched_loads,
            "failed_loads": self.failed_loads,
            "blocks_stored": self.blocks_stored,
            "elapsed_s": round(self.elapsed_s, 3),
        }


@dataclass(kw_only=True)
class ReplayReport(HitCounts):
    """What a replay measured. ``to_dict`` is the ``--json`` output."""

    model: str
    block_size: int
    tiers: list[str]
    cacheable_tokens: int = 0
    engine_stats: dict[str, Any] = field(default_factory=dict)
    layer_policy: str = "uniform"

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "block_size": self.block_size,
            "tiers": self.tiers,
            **self.hit_dict(self.tiers),
            "cacheable_tokens": self.cacheable_tokens,
            "layer_policy": self.layer_policy,
            "bytes_stored": self._bytes("live_bytes"),
            "bytes_written": self._bytes("bytes_written"),
            "stats": self.engine_stats,
        }

    def _bytes(self, counter: str) -> dict[str, Any]:
        tiers = self.engine_stats.get("tiers", {})
        per = {name: int(tiers.get(name, {}).get(counter) or 0) for name in self.tiers}
        return {"total": sum(per.values()), "per_tier": per}


def with_hbm(config: KVStrataConfig, hbm_capacity: int | None) -> KVStrataConfig:
    """Put an ``hbm`` tier (the GPU prefix cache stand-in) on top unless the config has one."""
    if hbm_capacity is None or any(t.kind == "hbm" for t in config.tiers):
        return config
    hbm = TierConfig.model_validate(
        {"name": "hbm", "capacity": hbm_capacity, "eviction": "lru", "write": "write-through", "promote": False}
    )
    return config.with_tiers((hbm, *config.tiers))


def with_layer_policy(config: KVStrataConfig, layer_policy: str | None) -> KVStrataConfig:
    """``config`` with ``policies.layer_policy`` set (``None``: unchanged)."""
    if layer_policy is None:
        return config
    policies = config.policies.model_validate({**config.policies.model_dump(), "layer_policy": layer_policy})
    return config.model_copy(update={"policies": policies})


class Replayer:
    """Drives one engine through a trace."""

    def __init__(self, engine: Engine, *, verify: bool = True) -> None:
        self.engine = engine
        self.layout: KVLayout = engine.layout
        self.verify = verify
        self.report = ReplayReport(
            model=self.layout.model,
            block_size=self.layout.block_size,
            tiers=[t.name for t in engine.tiers],
            layer_policy=engine.policies.mode,
        )

    def run(self, requests: Iterable[Request], on_request: Callable[[int], None] | None = None) -> ReplayReport:
        start = time.perf_counter()
        for req in requests:
            self.step(req)
            if on_request is not None:
                on_request(req.input_length)
        self.engine.flush()
        self.report.elapsed_s = time.perf_counter() - start
        self.report.engine_stats = self.engine.stats()
        return self.report

    def step(self, req: Request) -> None:
        rep = self.report
        hasher = self.engine.hasher
        keys = req.keys(hasher)
        rep.requests += 1
        rep.prompt_tokens += req.input_length
        rep.cacheable_tokens += len(keys) * self.layout.block_size
        found = self.engine.lookup(keys)
        loaded = self._load(keys[: found.num_blocks])
        for name in loaded:
            rep.per_tier[name] += self.layout.block_size
        rep.hit_tokens += len(loaded) * self.layout.block_size
        all_keys = req.keys(hasher, include_output=True)
        top = self.engine.tiers[0].name
        first_new = next((i for i, t in enumerate(loaded) if t != top), len(loaded))
        self._store(all_keys, first_new)

    def _load(self, keys: list[Key]) -> list[str]:
        if not keys:
            return []
        if self.engine.hybrid:
            return self._restore(keys)
        bufs = {
            layer: np.empty((len(keys), self.layout.layer_nbytes(layer)), dtype=np.uint8)
            for layer in range(self.layout.num_layers)
        }
        result = self.engine.load_sync(keys, bufs)
        n = result.loaded_blocks
        if n < len(keys):
            self.report.failed_loads += len(keys) - n
        if self.verify:
            bad = np.zeros(n, dtype=bool)
            for layer, data in bufs.items():
                expected = block_contents(keys[:n], layer, data.shape[1])
                bad |= (expected != data[:n]).any(axis=1)
            self.report.mismatched_loads += int(bad.sum())
        return result.tiers[:n]

    def _restore(self, keys: list[Key]) -> list[str]:
        """A restore under per-layer policies: buffers only for the blocks each layer needs."""
        needs = self.engine.restore_needs(len(keys))
        bufs = {
            layer: {i: np.empty(self.layout.layer_nbytes(layer), dtype=np.uint8) for i in needs[layer]}
            for layer in range(self.layout.num_layers)
        }
        result = self.engine.load_sync(keys, bufs)
        n = result.loaded_blocks
        if n < len(keys):
            self.report.failed_loads += len(keys) - n
        if self.verify:
            bad: set[int] = set()
            for layer, blocks in (result.layer_blocks or {}).items():
                for i in blocks:
                    want = block_contents([keys[i]], layer, self.layout.layer_nbytes(layer))[0]
                    if not np.array_equal(want, bufs[layer][i]):
                        bad.add(i)
            self.report.mismatched_loads += len(bad)
        return result.tiers[:n]

    def _store(self, keys: list[Key], first: int) -> None:
        if first >= len(keys):
            return
        part = keys[first:]
        bufs: Buffers = {
            layer: block_contents(part, layer, self.layout.layer_nbytes(layer))
            for layer in range(self.layout.num_layers)
        }
        if self.engine.hybrid:  # state layers: a snapshot at each restore point only
            points = self.engine.restore_points(part, first_block=first)
            snap = self.engine.policies.snapshot_mask
            bufs = {
                layer: {r - 1: data[r - 1] for r in points} if snap >> layer & 1 else data
                for layer, data in bufs.items()
            }
        parent = keys[first - 1] if first else None
        res = self.engine.store_sync(part, bufs, parent=parent, first_block=first)
        self.report.blocks_stored += res.stored
        self.engine.flush()


def replay_trace(
    trace: Trace,
    layout: KVLayout,
    config: KVStrataConfig | dict[str, Any] | str | None = None,
    *,
    hbm_capacity: int | None = None,
    tenant_salt: str = "",
    verify: bool = True,
    on_request: Callable[[int], None] | None = None,
    layer_policy: str | None = None,
) -> ReplayReport:
    """Replay ``trace`` on a fresh engine built from ``config`` (plus an optional hbm tier);
    ``layer_policy`` (``per-layer`` | ``uniform``) overrides the config's."""
    if trace.block_size is not None and trace.block_size != layout.block_size:
        layout = layout.with_block_size(trace.block_size)
    cfg = with_layer_policy(with_hbm(load_config(config), hbm_capacity), layer_policy)
    with Engine(cfg, layout=layout, tenant_salt=tenant_salt) as engine:
        return Replayer(engine, verify=verify).run(trace.requests, on_request)


__all__ = ["ReplayReport", "Replayer", "count_mismatches", "replay_trace", "with_hbm", "with_layer_policy"]
