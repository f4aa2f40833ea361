"""What each layer policy stores of a workload, counted without moving bytes.

:func:`count_stored_bytes` walks a trace the way :class:`~kvstrata.workload.replay.Replayer`
drives the engine (look up the longest restorable prefix, then store the rest of the request,
prompt and output), but keeps only layer masks per block key, with unbounded tiers and
write-through to every tier. It uses the same :class:`~kvstrata.policies.layers.LayerPolicies`
decisions as the engine (restore points, branch points, retention, placement), so the bytes it
counts are the bytes a replay through the real engine writes into each tier when nothing is
evicted (the test suite checks this on small layouts). That makes whole-model figures
(100K-token contexts of 80-layer models, hundreds of GB for uniform linear-attention state)
cheap to compute: the planner and ``kvstrata layers`` use it.

Tensor parallelism: layouts are per rank, so a deployment of ``tp_size`` ranks stores
``tp_size`` copies of every rank-dependent group and one of a rank-independent one (MLA under
the per-layer policy).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvstrata.core.keys import BlockHasher, Key, Namespace
from kvstrata.core.layout import KVLayout
from kvstrata.policies.layers import LayerPolicies
from kvstrata.workload.traces import Request, Span, synth_agentic

__all__ = ["LayerBytesReport", "agentic_context", "compare_policies", "count_stored_bytes"]


@dataclass
class LayerBytesReport:
    """Bytes each tier holds after a workload, and the restorable-prefix hits along the way."""

    model: str
    layer_policy: str
    tp_size: int
    context_tokens: int
    per_tier: dict[str, int] = field(default_factory=dict)
    per_group: dict[str, int] = field(default_factory=dict)  # kind -> bytes in the top tier
    prompt_tokens: int = 0
    hit_tokens: int = 0
    requests: int = 0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def total(self) -> int:
        return sum(self.per_tier.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "layer_policy": self.layer_policy,
            "tp_size": self.tp_size,
            "context_tokens": self.context_tokens,
            "bytes_stored": {"total": self.total, "per_tier": dict(self.per_tier)},
            "bytes_per_group": dict(self.per_group),
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "token_hit_rate": round(self.token_hit_rate, 6),
        }


def agentic_context(context_tokens: int, **params: Any) -> list[Request]:
    """One session of the agentic synthetic trace (``synth_agentic`` defaults unless given in
    ``params``) whose last turn ends, prompt plus output, at exactly ``context_tokens``."""
    params = {"sessions": 1, "jitter": 0.0, **params}
    step = params.get("turn_tokens", 2048) + params.get("output_tokens", 900)
    base = params.get("shared_tokens", 20000) + params.get("first_turn_tokens", 10000)
    params["turns"] = max(1, (max(0, context_tokens - base) // max(step, 1)) + 1)
    reqs = [r for r in synth_agentic(**params) if r.input_length <= context_tokens]
    if not reqs:
        raise ValueError(f"a {context_tokens}-token context is shorter than the first prompt ({base} tokens)")
    last = reqs[-1]
    out = context_tokens - last.input_length
    span = last.output_span or Span(f"ctx-out/{context_tokens}", out)
    reqs[-1] = replace(last, output_length=out, output_span=Span(span.seed, out))
    return reqs


def count_stored_bytes(
    requests: Iterable[Request],
    layout: KVLayout,
    policies: LayerPolicies,
    tiers: Sequence[tuple[str, str]] = (("dram", "dram"), ("nvme", "nvme")),
    *,
    tp_size: int = 1,
) -> LayerBytesReport:
    """Replay ``requests`` against unbounded ``tiers`` (``(name, kind)``, top first) under
    ``policies``; return the bytes each tier holds at the end, summed over ``tp_size`` ranks."""
    hasher = BlockHasher(Namespace(layout.model, layout.layers[0].dtype, layout.fingerprint(), layout.block_size))
    prefix = policies.prefix_mask
    held: dict[Key, int] = {}
    wanted: set[Key] = set()
    report = LayerBytesReport(layout.model, policies.mode, tp_size, 0)
    bs = layout.block_size
    for req in requests:
        keys = req.keys(hasher)
        report.requests += 1
        report.prompt_tokens += req.input_length
        report.context_tokens = max(report.context_tokens, req.input_length + req.output_length)
        avail: list[int] = []
        for key in keys:
            a = held.get(key, 0)
            if a & prefix != prefix:
                break
            avail.append(a)
        n = policies.restorable(avail)
        if n < len(avail):
            wanted.add(keys[len(avail) - 1])
        report.hit_tokens += n * bs
        part = req.keys(hasher, include_output=True)[n:]
        points = policies.restore_points(len(part), n, lambda i, part=part: part[i] in wanted)  # type: ignore[misc]
        for key, mask in zip(part, policies.keep_masks(len(part), points), strict=True):
            held[key] = held.get(key, 0) | mask
    sizes = [spec.nbytes for spec in layout.layers]
    copies = [1 if policies.group_of(i).rank_independent else tp_size for i in range(layout.num_layers)]
    per_layer = [0] * layout.num_layers
    for mask in held.values():
        for i in range(layout.num_layers):
            if mask >> i & 1:
                per_layer[i] += sizes[i] * copies[i]
    for name, kind in tiers:
        tmask = policies.tier_mask(name, kind)
        report.per_tier[name] = sum(b for i, b in enumerate(per_layer) if tmask >> i & 1)
    for g in policies.groups:
        report.per_group[g.kind.value] = report.per_group.get(g.kind.value, 0) + sum(per_layer[i] for i in g.layers)
    return report


def compare_policies(
    model: str,
    *,
    context_tokens: int = 100_000,
    tp_size: int = 1,
    tiers: Sequence[tuple[str, str]] = (("dram", "dram"), ("nvme", "nvme"), ("fs", "fs")),
    rules: Any = None,
    block_size: int | None = None,
) -> list[dict[str, Any]]:
    """Bytes per tier of one ``context_tokens`` agentic session of ``model``: the uniform policy,
    the per-layer policy with its defaults, and (when ``rules``, a ``[policies]`` section, has
    layer rules) the per-layer policy under those rules. One dict per row (``to_dict`` plus
    ``policy``, a row label)."""
    from kvstrata.core.catalog import get_layout

    layout = get_layout(model, block_size=block_size, tp_size=1)
    requests = agentic_context(context_tokens)
    names = [name for name, _ in tiers]
    rows: list[tuple[str, LayerPolicies]] = [
        ("uniform", LayerPolicies.resolve(layout, None, mode="uniform")),
        ("per-layer", LayerPolicies.resolve(layout, None, mode="per-layer")),
    ]
    layer_rules = rules.get("layers") if isinstance(rules, dict) else getattr(rules, "layers", None)
    if layer_rules:
        rows.append(("per-layer + rules", LayerPolicies.resolve(layout, rules, mode="per-layer", tier_names=names)))
    out = []
    for label, policies in rows:
        report = count_stored_bytes(requests, layout, policies, tiers, tp_size=tp_size)
        out.append({"policy": label, **report.to_dict()})
    return out
