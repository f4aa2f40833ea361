"""The vLLM-independent half of the connector: layouts from KV cache groups, keys, windows."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstrata.core.keys import BlockHasher
from kvstrata.core.layout import LayerKind
from kvstrata.integrations.vllm.plan import RequestKeys, build_plan, group_keys, make_namespace


@dataclass
class AttentionSpec:
    block_size: int
    page_size_bytes: int


class FullAttentionSpec(AttentionSpec):
    pass


@dataclass
class SlidingWindowSpec(AttentionSpec):
    sliding_window: int = 128


class MLAAttentionSpec(FullAttentionSpec):
    pass


@dataclass
class MambaSpec:
    block_size: int
    page_size_bytes: int


@dataclass
class Group:
    layer_names: list[str]
    kv_cache_spec: object
    enable_kv_transfer: bool = True


@dataclass
class FakeRequest:
    all_token_ids: list[int]
    block_hashes: list[bytes] = field(default_factory=list)
    cache_salt: str | None = None


def test_plan_maps_groups_to_layer_kinds_and_strides() -> None:
    groups = [
        Group(["l0", "l2"], SlidingWindowSpec(32, 4096, sliding_window=64)),
        Group(["l1", "l3"], FullAttentionSpec(64, 8192)),
    ]
    plan = build_plan("m", groups, scheduler_block_size=64, hash_block_size=32)
    assert [g.kind for g in plan.groups] == [LayerKind.SLIDING, LayerKind.FULL]
    assert [g.stride for g in plan.groups] == [1, 2]
    assert plan.layout.layer_nbytes(0) == 4096 and plan.layout.layer_nbytes(2) == 8192
    assert plan.layer_index == {"l0": 0, "l2": 1, "l1": 2, "l3": 3}
    assert not plan.unsupported and not plan.mla_only
    sliding = plan.groups[0]
    assert list(sliding.window_blocks(320)) == [8, 9]  # a window of 64 tokens before token 320
    assert list(plan.groups[1].window_blocks(320)) == [0, 1, 2, 3, 4]
    keys = [bytes([i]) * 16 for i in range(10)]
    assert group_keys(plan.groups[1], keys, [0, 1]) == [keys[1], keys[3]]


def test_mamba_groups_are_unsupported_and_mla_is_rank_independent() -> None:
    plan = build_plan("m", [Group(["a"], FullAttentionSpec(16, 64)), Group(["s"], MambaSpec(16, 999))], 16, 16)
    assert plan.unsupported and len(plan.groups) == 1
    mla = build_plan("ds", [Group(["a", "b"], MLAAttentionSpec(16, 1152))], 16, 16)
    assert mla.mla_only
    assert (
        make_namespace(mla, "ds", "bf16", 3, 8, "").fingerprint
        == make_namespace(mla, "ds", "bf16", 0, 8, "").fingerprint
    )
    full = build_plan("m", [Group(["a"], FullAttentionSpec(16, 64))], 16, 16)
    assert (
        make_namespace(full, "m", "bf16", 1, 2, "").fingerprint
        != make_namespace(full, "m", "bf16", 0, 2, "").fingerprint
    )


def test_keys_from_vllm_hashes_are_namespaced_by_salt_and_model() -> None:
    plan = build_plan("m", [Group(["a"], FullAttentionSpec(4, 64))], 4, 4)
    req = FakeRequest(list(range(12)), block_hashes=[b"h0", b"h1", b"h2"])
    k1 = RequestKeys(make_namespace(plan, "m", "bf16", 0, 1, "").seed, None).update(req)
    k2 = RequestKeys(make_namespace(plan, "m", "bf16", 0, 1, "").seed, None).update(req)
    salted = RequestKeys(make_namespace(plan, "m", "bf16", 0, 1, "tenant").seed, None).update(req)
    other = RequestKeys(make_namespace(plan, "m2", "bf16", 0, 1, "").seed, None).update(req)
    assert k1 == k2 and len(k1) == 3
    assert not set(k1) & set(salted) and not set(k1) & set(other)


def test_own_hashing_grows_with_the_request_and_matches_a_fresh_computation() -> None:
    plan = build_plan("m", [Group(["a"], FullAttentionSpec(4, 64))], 4, 4)
    ns = make_namespace(plan, "m", "bf16", 0, 1, "")
    req = FakeRequest(list(range(10)))
    keys = RequestKeys(ns.seed, BlockHasher(ns))
    assert len(keys.update(req)) == 2
    req.all_token_ids += list(range(10, 17))  # decode: tokens arrive
    grown = keys.update(req)
    assert len(grown) == 4
    assert grown == BlockHasher(ns).keys_for_tokens(list(range(17)))


@dataclass
class AlignedMambaSpec:
    """vLLM's ``MambaSpec`` in ``align`` cache mode (prefix caching on): the page is padded to the
    attention page size, the state itself is ``real_page_size_bytes``."""

    block_size: int
    page_size_bytes: int
    real_page_size_bytes: int
    mamba_cache_mode: str = "align"


AlignedMambaSpec.__name__ = "MambaSpec"  # the plan recognises vLLM's spec classes by name


def test_aligned_mamba_groups_map_onto_state_snapshots() -> None:
    groups = [
        Group(["l0.linear_attn", "l2.linear_attn"], AlignedMambaSpec(256, 131072, 68608)),
        Group(["l1.attn", "l3.attn"], FullAttentionSpec(256, 131072)),
    ]
    plan = build_plan("m", groups, scheduler_block_size=256, hash_block_size=256)
    assert not plan.unsupported
    state, full = plan.groups
    assert state.kind is LayerKind.LINEAR and full.kind is LayerKind.FULL
    assert plan.layout.layer_nbytes(0) == 68608  # the state, not the padded page
    assert list(state.window_blocks(768)) == [2]  # a restore at 768 tokens needs slot 2 only
    assert list(state.window_blocks(700)) == [1]
    assert list(full.window_blocks(768)) == [0, 1, 2]
    none_mode = build_plan("m", [Group(["s"], AlignedMambaSpec(256, 1, 1, mamba_cache_mode="none"))], 256, 256)
    assert none_mode.unsupported  # without align mode there is no state at block boundaries


def test_rank_independence_follows_the_layer_policy() -> None:
    mla = build_plan("ds", [Group(["a", "b"], MLAAttentionSpec(16, 1152))], 16, 16)
    per_rank = make_namespace(mla, "ds", "bf16", 3, 8, "", rank_independent=False)
    assert per_rank.fingerprint != make_namespace(mla, "ds", "bf16", 0, 8, "", rank_independent=False).fingerprint
    assert (
        make_namespace(mla, "ds", "bf16", 3, 8, "").fingerprint
        == make_namespace(mla, "ds", "bf16", 0, 1, "").fingerprint
    )
