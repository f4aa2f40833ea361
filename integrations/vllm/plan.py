"""The vLLM-independent half of the connector: KV layout, keys and transfer planning.

vLLM describes a model's KV cache as *groups* (one block table each): full
attention, sliding window, MLA, Mamba. kvstrata stores one layer-block per
(key, layer), where a layer-block is vLLM's whole page for that layer and block,
copied as opaque bytes (the CPU and GPU backends lay K and V out differently
inside a page; kvstrata never looks inside).

Keys: vLLM's ``request.block_hashes`` are chained over the prompt (and include the
request's ``cache_salt`` in the first block) and, with the default ``sha256`` /
``sha256_cbor`` algorithms, identical in every process and on every host. kvstrata
namespaces each of them: ``key = xxh3_128(namespace_seed || block_hash)``, where
the namespace digests model, weights identity, KV dtype, the page layout of every layer,
block size, tensor-parallel rank/size and the cache salt. With vLLM's ``xxhash`` algorithms
and no ``PYTHONHASHSEED`` the hashes are random per process, so kvstrata hashes the
token ids itself (chained xxh3-128) instead; both choices give cross-instance hits.

What changes a block's KV besides its tokens (a LoRA adapter, the multimodal items in it and their
offsets, prompt embeddings, the cache salt) vLLM calls a block's *extra keys*; its hashes mix
them in. On kvstrata's own path :class:`ExtraKeys` asks vLLM for them (its own
``generate_block_hash_extra_keys``, so kvstrata follows whatever vLLM considers KV-changing),
encodes them canonically (:func:`kvstrata.core.keys.encode_extra_keys`) and mixes them into the
key of each hash block that has any; blocks without extras keep the keys they always had. The
cache salt needs no extra: it is in the namespace, and so in every key of the request. A request
whose extra keys cannot be computed or encoded is *declined* (:class:`DeclinedRequest`): vLLM
computes it, kvstrata neither restores nor stores it.

Groups map onto kvstrata's per-layer policies (:mod:`kvstrata.policies.layers`): full
attention and MLA keep every block, sliding-window groups only the blocks in the window before
each restore point, and Mamba / linear-attention groups (vLLM's ``MambaSpec`` in ``align``
cache mode, where slot ``p`` of a request holds the recurrent state after exactly
``(p + 1) * block_size`` tokens) one state snapshot per restore point: the slot of a block
boundary at which a scheduler step ended. A restore at ``n`` tokens loads the state slot
``n / block_size - 1`` and every full-attention block before it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from kvstrata.config import KVStrataConfig
from kvstrata.core.keys import BlockHasher, Key, Namespace, UnencodableExtraKey, encode_extra_keys
from kvstrata.core.layout import KVLayout, LayerKind, LayerSpec
from kvstrata.policies.layers import LayerPolicies

DETERMINISTIC_HASHES = ("sha256", "sha256_cbor")  # vLLM hash algorithms equal in every process

#: vLLM's ``generate_block_hash_extra_keys(request, start_token, end_token, start_mm_idx)
#: -> (extra keys of the block or None, next multimodal index)``.
ExtraKeysFn = Callable[[Any, int, int, int], tuple[tuple[Any, ...] | None, int]]

# Why a request is declined (the ``reason`` label of ``vllm:kvstrata_declined_requests``).
EXTRA_KEYS_UNAVAILABLE = "extra_keys_unavailable"  # this vLLM has no generate_block_hash_extra_keys
UNENCODABLE_EXTRA_KEY = "unencodable_extra_key"  # an extra key of a type with no canonical bytes
EXTRA_KEYS_ERROR = "extra_keys_error"  # vLLM's function raised


@dataclass(frozen=True)
class GroupPlan:
    """One vLLM KV cache group as kvstrata sees it."""

    group_id: int
    kind: LayerKind
    block_size: int  # tokens per block of this group
    stride: int  # hash blocks per group block
    layers: tuple[int, ...]  # kvstrata layer indices
    layer_names: tuple[str, ...]
    window: int | None = None  # sliding window, tokens

    def window_blocks(self, end_tokens: int) -> range:
        """Group-block indices a restore point at ``end_tokens`` needs."""
        end = end_tokens // self.block_size
        if self.kind is LayerKind.SLIDING and self.window is not None:
            start = max(0, (end_tokens - self.window) // self.block_size)
            return range(start, end)
        if self.kind is LayerKind.LINEAR:  # one state snapshot: the slot of the last block
            return range(max(0, end - 1), end)
        return range(0, end)


@dataclass(frozen=True)
class ModelPlan:
    """Layout, groups and block sizes of one vLLM model, the same in scheduler and workers."""

    layout: KVLayout
    groups: tuple[GroupPlan, ...]
    unsupported: tuple[str, ...]  # groups kvstrata cannot restore (e.g. Mamba without align mode): no hits
    scheduler_block_size: int
    hash_block_size: int
    mla_only: bool

    @property
    def layer_index(self) -> dict[str, int]:
        return {spec.name: i for i, spec in enumerate(self.layout.layers)}


def _kind_of(spec: Any) -> LayerKind | None:
    names = {cls.__name__ for cls in type(spec).__mro__}
    if "MambaSpec" in names:  # state snapshots at block boundaries exist only in align mode
        return LayerKind.LINEAR if getattr(spec, "mamba_cache_mode", "none") == "align" else None
    if "SlidingWindowSpec" in names or "SlidingWindowMLASpec" in names:
        return LayerKind.SLIDING
    if "MLAAttentionSpec" in names:
        return LayerKind.MLA
    if "AttentionSpec" in names:
        return LayerKind.FULL
    return None


def build_plan(model: str, groups: Sequence[Any], scheduler_block_size: int, hash_block_size: int) -> ModelPlan:
    """``groups``: vLLM ``KVCacheGroupSpec``s (``layer_names``, ``kv_cache_spec``, ``enable_kv_transfer``)."""
    layers: list[LayerSpec] = []
    plans: list[GroupPlan] = []
    unsupported: list[str] = []
    for gid, group in enumerate(groups):
        spec = group.kv_cache_spec
        kind = _kind_of(spec)
        if not getattr(group, "enable_kv_transfer", True):
            continue
        if kind is None:
            unsupported.append(f"group {gid} ({type(spec).__name__})")
            continue
        window = int(spec.sliding_window) if kind is LayerKind.SLIDING else None
        first = len(layers)
        for name in group.layer_names:
            layers.append(LayerSpec(name, kind, (_page_bytes(spec, kind),), "uint8", window))
        block = int(spec.block_size)
        plans.append(
            GroupPlan(
                gid,
                kind,
                block,
                max(1, block // hash_block_size),
                tuple(range(first, len(layers))),
                tuple(group.layer_names),
                window,
            )
        )
    if not layers:  # nothing restorable: keep a valid (empty-handed) layout
        layers.append(LayerSpec("none", LayerKind.FULL, (1,), "uint8"))
    layout = KVLayout(model=model, block_size=scheduler_block_size, layers=tuple(layers))
    mla_only = bool(plans) and all(g.kind is LayerKind.MLA for g in plans)
    return ModelPlan(layout, tuple(plans), tuple(unsupported), scheduler_block_size, hash_block_size, mla_only)


def _page_bytes(spec: Any, kind: LayerKind) -> int:
    """Bytes of one layer's page: a Mamba page is its state (vLLM pads the page to the attention
    page size; the tensor a connector is given per layer holds the state only)."""
    if kind is LayerKind.LINEAR:
        return int(getattr(spec, "real_page_size_bytes", spec.page_size_bytes))
    return int(spec.page_size_bytes)


def make_namespace(
    plan: ModelPlan,
    model: str,
    kv_dtype: str,
    tp_rank: int,
    tp_size: int,
    salt: str,
    *,
    rank_independent: bool | None = None,
    weights: str = "",
) -> Namespace:
    """MLA latents are the same on every tensor-parallel rank: stored once, under rank 0 of 1
    (``rank_independent``: the per-layer policy's say; default: the model is MLA-only).
    ``weights``: the weights identity (:mod:`kvstrata.integrations.vllm.weights`), the same in
    the scheduler and every worker."""
    if plan.mla_only if rank_independent is None else rank_independent:
        tp_rank, tp_size = 0, 1
    return Namespace(
        model=model,
        kv_dtype=kv_dtype,
        layout_fingerprint=plan.layout.fingerprint(),
        block_size=plan.hash_block_size,
        tp_rank=tp_rank,
        tp_size=tp_size,
        tenant_salt=salt,
        weights=weights,
    )


class DeclinedRequest(Exception):
    """kvstrata cannot key this request safely: it must be neither restored nor stored."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def has_extra_key_sources(request: Any) -> bool:
    """Whether the request carries an input vLLM 0.32 keys besides its tokens and salt."""
    return bool(
        getattr(request, "lora_request", None)
        or getattr(request, "mm_features", None)
        or getattr(request, "prompt_embeds", None) is not None
    )


class ExtraKeys:
    """The encoded extra keys of a request's hash blocks, from vLLM's own function ``fn``
    (None: this vLLM has none, and requests with LoRA, multimodal or embedding inputs are
    declined). Raises :class:`DeclinedRequest` where they cannot be computed or encoded."""

    def __init__(self, fn: ExtraKeysFn | None) -> None:
        self.fn = fn

    def of_blocks(
        self, request: Any, start: int, end: int, block_size: int, mm_idx: int
    ) -> tuple[dict[int, bytes], int]:
        """``{block: encoded extras}`` of hash blocks ``start .. end - 1`` that have any, and the
        multimodal index to continue from at block ``end`` (blocks are asked in order, from 0)."""
        if self.fn is None:
            if has_extra_key_sources(request):
                raise DeclinedRequest(
                    EXTRA_KEYS_UNAVAILABLE,
                    "this vLLM has no vllm.v1.core.kv_cache_utils.generate_block_hash_extra_keys, so the "
                    "LoRA / multimodal / prompt-embeds inputs of the request cannot be keyed",
                )
            return {}, mm_idx
        salt = getattr(request, "cache_salt", None)
        out: dict[int, bytes] = {}
        for i in range(start, end):
            try:
                extra, mm_idx = self.fn(request, i * block_size, (i + 1) * block_size, mm_idx)
            except Exception as exc:
                raise DeclinedRequest(
                    EXTRA_KEYS_ERROR, f"generate_block_hash_extra_keys raised {type(exc).__name__}: {exc}"
                ) from exc
            if not extra:
                continue
            # the salt is in the namespace (every key of the request): not repeated in block 0
            kept = tuple(k for k in extra if not (isinstance(k, tuple) and k == ("cache_salt", salt)))
            if kept:
                try:
                    out[i] = encode_extra_keys(kept)
                except UnencodableExtraKey as exc:
                    raise DeclinedRequest(UNENCODABLE_EXTRA_KEY, str(exc)) from None
        return out, mm_idx


@dataclass
class RequestKeys:
    """Keys of one request at hash-block granularity, extended as its tokens grow.

    ``extra_keys``: on the own-hash path, where the extra keys of each block come from (None:
    token ids only). :meth:`update` raises :class:`DeclinedRequest` for a request that cannot be
    keyed; the keys computed before stay valid."""

    seed: Key
    own_hasher: BlockHasher | None  # None: derive from vLLM's block hashes
    keys: list[Key] = field(default_factory=list)
    extra_keys: ExtraKeys | None = None
    mm_idx: int = 0  # vLLM's multimodal cursor at hash block len(keys)

    def update(self, request: Any) -> list[Key]:
        if self.own_hasher is None:
            hashes = request.block_hashes
            for bh in hashes[len(self.keys) :]:
                raw = bh if isinstance(bh, bytes) else str(bh).encode()
                self.keys.append(xxhash.xxh3_128_digest(self.seed + raw))
        else:
            tokens = request.all_token_ids
            bs = self.own_hasher.block_size
            n = len(tokens) // bs
            if n > len(self.keys):
                start = len(self.keys)
                parent = self.keys[-1] if self.keys else None
                extras: dict[int, bytes] | None = None
                mm_idx = self.mm_idx
                if self.extra_keys is not None:
                    extras, mm_idx = self.extra_keys.of_blocks(request, start, n, bs, mm_idx)
                self.keys += self.own_hasher.keys_for_tokens(
                    list(tokens[: n * bs]), parent=parent, start_block=start, extras=extras
                )
                self.mm_idx = mm_idx
        return self.keys


def group_keys(plan: GroupPlan, hash_keys: Sequence[Key], blocks: Sequence[int]) -> list[Key]:
    """Keys of group blocks ``blocks`` (a group block is ``stride`` hash blocks)."""
    return [hash_keys[(i + 1) * plan.stride - 1] for i in blocks]


def lcm_block(plan: ModelPlan) -> int:
    sizes = [g.block_size for g in plan.groups] or [plan.scheduler_block_size]
    return math.lcm(plan.scheduler_block_size, *sizes)


def rank_keys(keys: list[Key], rank: int) -> list[Key]:
    """Keys of a tensor-parallel rank (each rank holds its own heads): rank 0 keeps the request keys."""
    if rank == 0:
        return keys
    tag = b"tp" + rank.to_bytes(2, "little")
    return [xxhash.xxh3_128_digest(k + tag) for k in keys]


def layer_policies(plan: ModelPlan, config: KVStrataConfig) -> LayerPolicies:
    """The groups' placement and priorities from the config; retention is the connector's own."""
    names = [t.name for t in config.tiers]
    return LayerPolicies.resolve(plan.layout, config.policies, tier_names=names).with_caller_retention()


def rank_independent(plan: ModelPlan, config: KVStrataConfig) -> bool:
    """MLA-only models under the per-layer policy: one copy of the latents for every rank."""
    return plan.mla_only and LayerPolicies.resolve(plan.layout, config.policies).rank_independent
