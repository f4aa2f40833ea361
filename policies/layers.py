"""Per-layer-group policies for hybrid models: what each group keeps, where, and what a restore needs.

A hybrid model mixes layer kinds that keep very different things per block. Storing every
layer of every block, as a uniform cache does, wastes most of the bytes, and a prefix is only
restorable where *every* group can be restored at the same token position. This module turns
the layout plus the ``[policies]`` config section into one :class:`LayerGroupPolicy` per group:

=============  ==============================================================================
kind           retention (per-layer policy)
=============  ==============================================================================
``full``       ``all``: every block of the prefix
``mla``        ``all``, and one latent per token shared by all tensor-parallel ranks: stored
               once, under a rank-independent key (:attr:`LayerPolicies.rank_independent`)
``sliding``    ``window``: at a restore point after block ``n`` only the blocks covering the
               last ``window`` tokens, ``[n - ceil(window / block_size), n)``, are needed; a
               block outside every restore point's window is never stored
``linear``     ``snapshot``: the recurrent state is a snapshot at a block boundary, not
               per-block KV; one snapshot per restore point
=============  ==============================================================================

**Restore points** are block boundaries at which a prefix can be restored: the end of every
``store`` call (a turn end), every ``checkpoint_every`` blocks (when the caller gives block
positions), and *branch points* the engine has seen (a lookup found full-attention blocks past
the last restore point, so a restore point there would have paid: Marconi's idea of keeping
state where prefixes are known to be shared). Window and snapshot groups keep data only at
restore points.

**Snapshot admission** (Marconi again): a snapshot is valued by the prefill it saves per byte;
snapshots of one layout all have the same size, so the value is the prefix length it restores.
Each tier gives snapshots at most ``checkpoint_budget`` of its capacity; when a new snapshot
does not fit, the lowest-value snapshots (shortest prefixes) are dropped if the new one is worth
more, otherwise the new one is not admitted.

**Placement**: a rule's ``tiers`` lists the tiers the group may occupy; write-through, demotion
and promotion carry only the layers the destination allows. An ``hbm`` tier (the inference
engine's own cache) always holds every group. **Priority**: when a tier evicts a block, the
layers of its lowest-priority groups go first, and the rest of the block stays while that
freed enough (equal priorities, the default: a block leaves whole).

Lookup returns the longest prefix ``n`` at which every group is restorable (:meth:`LayerPolicies.
restorable`): full/MLA groups hold blocks ``[0, n)``, window groups the window before ``n``,
snapshot groups a snapshot at ``n``. ``uniform`` is the baseline: every layer of every block,
every tier (what kvstrata did before per-layer policies, and what uniform caches do).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from kvstrata.core.layout import KVLayout, LayerKind
from kvstrata.errors import ConfigError

__all__ = [
    "KIND_NAMES",
    "LAYER_POLICY_MODES",
    "LayerGroupPolicy",
    "LayerPolicies",
    "Retention",
    "parse_match",
]

LAYER_POLICY_MODES = ("per-layer", "uniform")

#: Names a rule's ``match`` may use for a layer kind.
KIND_NAMES: dict[str, LayerKind] = {
    "full": LayerKind.FULL,
    "full_attention": LayerKind.FULL,
    "attention": LayerKind.FULL,
    "sliding": LayerKind.SLIDING,
    "sliding_window": LayerKind.SLIDING,
    "sliding_attention": LayerKind.SLIDING,
    "swa": LayerKind.SLIDING,
    "linear": LayerKind.LINEAR,
    "linear_attention": LayerKind.LINEAR,
    "mamba": LayerKind.LINEAR,
    "state": LayerKind.LINEAR,
    "mla": LayerKind.MLA,
}

_GLOB_CHARS = frozenset("*?[.")


class Retention(StrEnum):
    """What a group keeps of a stored prefix."""

    ALL = "all"  # every block
    WINDOW = "window"  # the blocks of the window before each restore point
    SNAPSHOT = "snapshot"  # one state snapshot per restore point


_DEFAULT_RETENTION = {
    LayerKind.FULL: Retention.ALL,
    LayerKind.MLA: Retention.ALL,
    LayerKind.SLIDING: Retention.WINDOW,
    LayerKind.LINEAR: Retention.SNAPSHOT,
}


def parse_match(text: str) -> tuple[str, Any]:
    """A rule's ``match``: ``("kind", LayerKind)`` or ``("name", glob)``.

    A word without glob characters or dots must be a kind name (``full``, ``sliding_window``,
    ``mamba``, ...); ``kind:NAME`` and ``name:PATTERN`` say which one explicitly; anything with
    ``* ? [`` or ``.`` is a layer-name pattern (``fnmatch``, e.g. ``model.layers.*.linear_attn``).
    """
    raw = str(text).strip()
    if not raw:
        raise ConfigError(
            "an empty match matches nothing; give a layer kind "
            f"({', '.join(sorted(set(KIND_NAMES)))}) or a layer-name pattern such as 'layers.*'",
            field="match",
            value=text,
        )
    prefix, sep, rest = raw.partition(":")
    if sep and prefix in ("kind", "name"):
        if not rest.strip():
            raise ConfigError(f"match {raw!r}: nothing after {prefix!r}", field="match", value=text)
        if prefix == "name":
            return "name", rest.strip()
        raw = rest.strip()
    elif any(c in _GLOB_CHARS for c in raw):
        return "name", raw
    kind = KIND_NAMES.get(raw.lower())
    if kind is None:
        raise ConfigError(
            f"match {raw!r}: unknown layer kind; known: {', '.join(sorted(KIND_NAMES))} "
            "(a layer-name pattern needs a '*', '?', '[' or '.', or the 'name:' prefix)",
            field="match",
            value=text,
        )
    return "kind", kind


def _field(rule: Any, name: str) -> Any:
    return rule.get(name) if isinstance(rule, Mapping) else getattr(rule, name, None)


@dataclass(frozen=True)
class LayerGroupPolicy:
    """The policy of one group of layers (same kind, window and settings)."""

    kind: LayerKind
    layers: tuple[int, ...]
    mask: int  # bitmask of ``layers``
    retention: Retention
    tiers: frozenset[str] | None = None  # tier names the group may occupy; None: every tier
    priority: int = 0  # eviction: lower leaves a victim block first
    window: int | None = None  # tokens, for WINDOW retention
    window_blocks: int = 0  # ceil(window / block_size)
    nbytes: int = 0  # bytes of one block over the group's layers
    rank_independent: bool = False  # MLA: the same bytes on every tensor-parallel rank

    def needed(self, n: int) -> range:
        """Block positions of the prefix a restore at ``n`` blocks needs from this group."""
        if n <= 0:
            return range(0)
        if self.retention is Retention.WINDOW:
            return range(max(0, n - self.window_blocks), n)
        if self.retention is Retention.SNAPSHOT:
            return range(n - 1, n)
        return range(n)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "layers": len(self.layers),
            "retention": self.retention.value,
            "tiers": sorted(self.tiers) if self.tiers is not None else "all",
            "priority": self.priority,
            "window": self.window,
            "block_nbytes": self.nbytes,
            "rank_independent": self.rank_independent,
        }


@dataclass(frozen=True)
class LayerPolicies:
    """Every group's policy for one layout, plus the restore-point settings."""

    mode: str
    block_size: int
    num_layers: int
    groups: tuple[LayerGroupPolicy, ...]
    checkpoint_every: int = 0  # blocks between restore points (0: turn ends and branch points only)
    checkpoint_budget: float = 0.5  # share of a tier's capacity snapshots may take

    # ---------------------------------------------------------------- construction
    @classmethod
    def uniform(cls, layout: KVLayout) -> LayerPolicies:
        """Every layer of every block, in every tier (the baseline; kvstrata before per-layer policies)."""
        return cls.resolve(layout, None, mode="uniform")

    @classmethod
    def resolve(
        cls,
        layout: KVLayout,
        config: Any = None,
        *,
        mode: str | None = None,
        tier_names: Iterable[str] | None = None,
    ) -> LayerPolicies:
        """The policies of ``layout`` under ``config`` (a ``PoliciesConfig`` or its dict form).

        Rules apply in order; a later matching rule overrides the fields it sets. ``mode``
        overrides ``config.layer_policy``; with ``uniform`` every group keeps every block.
        ``tier_names``: the configured tiers (names in rules outside it are ignored).
        """
        mode = mode or (_field(config, "layer_policy") if config is not None else None) or "per-layer"
        if mode not in LAYER_POLICY_MODES:
            raise ConfigError(
                f"unknown layer policy {mode!r}; known: {', '.join(LAYER_POLICY_MODES)}",
                field="layer_policy",
                value=mode,
            )
        rules = list(_field(config, "layers") or ()) if config is not None else []
        known = set(tier_names) if tier_names is not None else None
        settings = [_layer_settings(layout, i, rules, known, mode) for i in range(layout.num_layers)]
        by_sig: dict[tuple[Any, ...], list[int]] = {}
        for i, sig in enumerate(settings):
            by_sig.setdefault(sig, []).append(i)
        groups = []
        for (kind, retention, tiers, priority, window), layers in by_sig.items():
            groups.append(
                LayerGroupPolicy(
                    kind=kind,
                    layers=tuple(layers),
                    mask=sum(1 << i for i in layers),
                    retention=retention,
                    tiers=tiers,
                    priority=priority,
                    window=window,
                    window_blocks=-(-window // layout.block_size) if window else 0,
                    nbytes=sum(layout.layer_nbytes(i) for i in layers),
                    rank_independent=kind is LayerKind.MLA and mode == "per-layer",
                )
            )
        every = int(_field(config, "checkpoint_every") or 0) if config is not None else 0
        budget = _field(config, "checkpoint_budget") if config is not None else None
        return cls(
            mode=mode,
            block_size=layout.block_size,
            num_layers=layout.num_layers,
            groups=tuple(groups),
            checkpoint_every=every,
            checkpoint_budget=float(budget) if budget is not None else 0.5,
        )

    def with_caller_retention(self) -> LayerPolicies:
        """The same placement and priorities, every group keeping whatever the caller stores: for
        callers that apply retention themselves (the vLLM connector knows each group's block size)."""
        groups = tuple(replace(g, retention=Retention.ALL) for g in self.groups)
        return replace(self, groups=groups)

    # ---------------------------------------------------------------- properties
    @property
    def all_mask(self) -> int:
        return (1 << self.num_layers) - 1

    @property
    def prefix_mask(self) -> int:
        """Layers that keep every block of a prefix (full attention, MLA)."""
        return sum(g.mask for g in self.groups if g.retention is Retention.ALL)

    @property
    def snapshot_mask(self) -> int:
        return sum(g.mask for g in self.groups if g.retention is Retention.SNAPSHOT)

    @property
    def window_groups(self) -> tuple[LayerGroupPolicy, ...]:
        return tuple(g for g in self.groups if g.retention is Retention.WINDOW)

    @property
    def snapshot_nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups if g.retention is Retention.SNAPSHOT)

    @property
    def sparse(self) -> bool:
        """Some group keeps less than every block (window or snapshot retention)."""
        return any(g.retention is not Retention.ALL for g in self.groups)

    @property
    def placed(self) -> bool:
        """Some group may not occupy every tier."""
        return any(g.tiers is not None for g in self.groups)

    @property
    def trivial(self) -> bool:
        """Every layer of every block in every tier: the engine's plain (uniform) path applies."""
        return not self.sparse and not self.placed and len({g.priority for g in self.groups}) <= 1

    @property
    def rank_independent(self) -> bool:
        """Every group holds the same bytes on every tensor-parallel rank (MLA-only models)."""
        return bool(self.groups) and all(g.rank_independent for g in self.groups)

    def tier_mask(self, name: str, kind: str = "") -> int:
        """Layers that may live in tier ``name``; a tier of a kind that declares ``device_memory``
        (``hbm``: the inference engine's own cache) holds every layer."""
        if kind and _in_device_memory(kind):
            return self.all_mask
        return sum(g.mask for g in self.groups if g.tiers is None or name in g.tiers)

    def group_of(self, layer: int) -> LayerGroupPolicy:
        for g in self.groups:
            if g.mask >> layer & 1:
                return g
        raise ValueError(f"layer {layer} out of range 0..{self.num_layers - 1}")

    def describe(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "checkpoint_every": self.checkpoint_every,
            "checkpoint_budget": self.checkpoint_budget,
            "groups": [g.to_dict() for g in self.groups],
        }

    # ---------------------------------------------------------------- store side
    def restore_points(
        self,
        count: int,
        first_block: int | None = None,
        wanted: Callable[[int], bool] | None = None,
    ) -> list[int]:
        """Restore points of a store of ``count`` consecutive blocks, as block counts ``r`` in
        ``1..count`` relative to the first stored block (a restore after its ``r``-th block):
        the end of the store, every ``checkpoint_every`` blocks when ``first_block`` (the
        absolute position of the first stored block) is known, and the positions ``i`` for
        which ``wanted(i)`` says a restore after block ``i`` would pay (branch points)."""
        if count <= 0:
            return []
        points = {count}
        k = self.checkpoint_every
        if k > 0 and first_block is not None:
            r = k - first_block % k
            points.update(range(r, count + 1, k))
        if wanted is not None:
            points.update(i + 1 for i in range(count) if wanted(i))
        return sorted(points)

    def keep_masks(self, count: int, points: Sequence[int]) -> list[int]:
        """Per stored block, the layers the per-layer policy keeps given restore points ``points``."""
        masks = [self.prefix_mask] * count
        windows = self.window_groups
        snap = self.snapshot_mask
        for r in points:
            for g in windows:
                for i in range(max(0, r - g.window_blocks), r):
                    masks[i] |= g.mask
            if snap:
                masks[r - 1] |= snap
        return masks

    # ---------------------------------------------------------------- restore side
    def restorable(self, avail: Sequence[int], held: int | None = None) -> int:
        """Longest ``n`` such that a restore at ``n`` blocks finds everything it needs, where
        ``avail[i]`` is the mask of layers available for block ``i``. ``held``: how many of the
        first blocks are known to hold every full-attention layer (the caller checked)."""
        full = self.prefix_mask
        m = held if held is not None else next((i for i, a in enumerate(avail) if a & full != full), len(avail))
        if not self.sparse or not m:
            return m
        snap = self.snapshot_mask
        if (not snap or avail[m - 1] & snap == snap) and all(  # the usual case: restorable where the prefix ends
            avail[i] & g.mask == g.mask for g in self.window_groups for i in range(max(0, m - g.window_blocks), m)
        ):
            return m
        runs = []
        for g in self.window_groups:
            run, c = [0] * m, 0
            for i in range(m):
                c = c + 1 if avail[i] & g.mask == g.mask else 0
                run[i] = c
            runs.append((run, g.window_blocks))
        for n in range(m, 0, -1):
            if snap and avail[n - 1] & snap != snap:
                continue
            if all(run[n - 1] >= min(n, need) for run, need in runs):
                return n
        return 0

    def needed_masks(self, n: int) -> list[int]:
        """Per block of a restore at ``n`` blocks, the layers it needs."""
        masks = [self.prefix_mask] * n
        for g in self.groups:
            if g.retention is not Retention.ALL:
                for i in g.needed(n):
                    masks[i] |= g.mask
        return masks

    def needed(self, n: int) -> dict[int, range]:
        """Per layer, the block positions a restore at ``n`` blocks needs."""
        return {layer: g.needed(n) for g in self.groups for layer in g.layers}


def _layer_settings(
    layout: KVLayout, i: int, rules: Sequence[Any], known: set[str] | None, mode: str
) -> tuple[Any, ...]:
    spec = layout.layers[i]
    retention = _DEFAULT_RETENTION[spec.kind] if mode == "per-layer" else Retention.ALL
    tiers: frozenset[str] | None = None
    priority = 0
    for rule in rules:
        how, what = parse_match(str(_field(rule, "match") or ""))
        hit = spec.kind is what if how == "kind" else fnmatch.fnmatchcase(spec.name, what)
        if not hit:
            continue
        if _field(rule, "tiers") is not None:
            names = frozenset(str(t) for t in _field(rule, "tiers"))
            tiers = names & known if known is not None else names
        if _field(rule, "priority") is not None:
            priority = int(_field(rule, "priority"))
        if _field(rule, "retention") == "all":
            retention = Retention.ALL
    if mode == "uniform":
        return (spec.kind, Retention.ALL, None, 0, spec.window)
    return (spec.kind, retention, tiers, priority, spec.window if retention is Retention.WINDOW else None)


def _in_device_memory(kind: str) -> bool:
    from kvstrata.errors import UnknownNameError
    from kvstrata.tiers import TIERS  # same floor; imported here so policies load without the tiers

    try:
        return bool(TIERS.get(kind).capabilities.device_memory)
    except UnknownNameError:
        return False
