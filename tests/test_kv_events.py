"""KV events for routers (integrations/vllm/events.py) on a real engine, with vLLM's own event
classes: a block stored into a tier is one ``BlockStored`` with that tier's medium and vLLM's
hash, a block leaving it is a ``BlockRemoved``; a full queue drops and counts, never blocks."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

import msgspec
from conformance import chain_keys, source_buffers
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from kvstrata.core.layout import KVLayout
from kvstrata.errors import ConfigError
from kvstrata.integrations.vllm.events import BlockInfo, EventGate, EventSpec, TierEvents, stored_event
from kvstrata.integrations.vllm.settings import ExtraConfig

BS = 4  # the test layout's block size (tokens); a block is 512 bytes


def _info(i: int) -> BlockInfo:
    return BlockInfo(bytes([i]) * 32, bytes([i - 1]) * 32 if i else None, tuple(range(i * BS, (i + 1) * BS)), BS, 0)


def _events_engine(make_engine: Any, dram_blocks: int) -> tuple[Any, TierEvents]:
    """A DRAM tier of ``dram_blocks`` blocks alone (what leaves it is dropped, not demoted)."""
    eng = make_engine({"name": "dram", "capacity": dram_blocks * 512})
    events = TierEvents([("CPU", "LOCAL"), ("STORAGE", "LOCAL")])
    eng.set_block_events(events.hook)
    return eng, events


def test_stored_and_evicted_blocks_become_vllm_events(make_engine: Any, layout: KVLayout) -> None:
    eng, events = _events_engine(make_engine, dram_blocks=4)
    keys = chain_keys(layout, 18, 8)
    for i, key in enumerate(keys):
        events.track(key, EventSpec(0, (_info(i),)))
    assert eng.store_sync(keys[:4], source_buffers(layout, keys[:4])).stored == 4
    first = events.drain()
    cpu = [e for e in first if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert sorted(h for e in cpu for h in e.block_hashes) == sorted(_info(i).block_hash for i in range(4))
    assert all(e.locality == "LOCAL" and e.block_size == BS and e.group_idx == 0 for e in cpu)
    e0 = next(e for e in cpu if e.block_hashes == [_info(0).block_hash])
    assert e0.parent_block_hash is None and e0.token_ids == [0, 1, 2, 3]
    assert not [e for e in first if isinstance(e, BlockRemoved)]
    assert eng.store_sync(keys[4:], source_buffers(layout, keys[4:]), parent=keys[3]).stored == 4  # evicts
    second = events.drain()
    gone = {h for e in second if isinstance(e, BlockRemoved) and e.medium == "CPU" for h in e.block_hashes}
    assert gone & {_info(i).block_hash for i in range(4)}  # some of the first four left DRAM
    # vLLM's own wire format carries them
    batch = KVEventBatch(ts=0.0, events=[e for e in first + second if isinstance(e, BlockStored | BlockRemoved)])
    back = msgspec.msgpack.Decoder(type=KVEventBatch).decode(msgspec.msgpack.Encoder().encode(batch))
    assert back.events == batch.events


def test_untracked_blocks_fire_nothing_and_a_full_queue_drops_and_counts(make_engine: Any, layout: KVLayout) -> None:
    eng, events = _events_engine(make_engine, dram_blocks=64)
    events.queue_max = 3
    keys = chain_keys(layout, 18, 6)
    for i, key in enumerate(keys[:5]):  # keys[5] is not tracked (no vLLM hash known)
        events.track(key, EventSpec(0, (_info(i),)))
    assert eng.store_sync(keys, source_buffers(layout, keys)).stored == 6
    assert len(events.queue) == 3  # bounded: 5 tracked blocks stored, 3 queued, 2 dropped
    assert events.dropped == 2
    assert len(events.drain()) == 3 and not events.queue


def test_removed_only_blocks_announce_their_leaving_only(make_engine: Any, layout: KVLayout) -> None:
    """Hybrid models: an attention block between restore points tells only that it left; the
    restore point's key announces every block since the last point."""
    eng, events = _events_engine(make_engine, dram_blocks=2)
    keys = chain_keys(layout, 18, 4)
    events.track(keys[0], EventSpec(0, (_info(0),), removed_only=True))
    events.track(keys[1], EventSpec(1, (_info(0), _info(1))))  # the restore point: both blocks
    assert eng.store_sync(keys[:2], source_buffers(layout, keys[:2])).stored == 2
    out = events.drain()
    stored = [e for e in out if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in stored] == [[_info(0).block_hash, _info(1).block_hash]] and len(out) == 1
    assert stored[0].token_ids == list(range(2 * BS)) and stored[0].parent_block_hash is None
    assert eng.store_sync(keys[2:], source_buffers(layout, keys[2:]), parent=keys[1]).stored == 2  # evicts
    out = events.drain()
    assert not [e for e in out if isinstance(e, BlockStored)]  # keys[2:] are not tracked
    gone = [k for k in keys[:2] if k not in eng.tiers[0].entries]
    assert gone
    want = {b.block_hash for k in gone for b in events.tracked[k].blocks}  # keys[1] takes both with it
    assert {h for e in out if isinstance(e, BlockRemoved) for h in e.block_hashes} == want


def test_the_gate_waits_for_every_tp_worker_and_is_bounded() -> None:
    ev = stored_event((_info(0),), "CPU", "LOCAL")
    gate = EventGate(workers=2, pending_max=2)
    gate.add([ev])
    assert gate.take() == []
    gate.add([stored_event((_info(0),), "CPU", "LOCAL")])  # the other rank, an equal event
    assert gate.take() == [ev]
    gate.add([stored_event((_info(i),), "CPU", "LOCAL") for i in (1, 2, 3)])
    assert gate.dropped == 1 and gate.take() == []


def test_kv_events_switch_is_validated() -> None:
    assert ExtraConfig.parse({"kv_events": True}).kv_events is True
    assert ExtraConfig.parse({}).kv_events is None
    with pytest.raises(ConfigError, match=r"kv_events.*'yes'"):
        ExtraConfig.parse({"kv_events": "yes"})


def _step(req_id: str, new: Any = None, cached: tuple[int, int] | None = None, n: int = 0) -> Any:
    """A vLLM ``SchedulerOutput`` of one request: new (block tables) or cached (computed tokens)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        scheduled_new_reqs=[new] if new is not None else [],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[req_id] if cached else [],
            new_block_ids=[None] if cached else [],
            resumed_req_ids=set(),
            num_computed_tokens=[cached[0]] if cached else [],
        ),
        num_scheduled_tokens={req_id: n if new is not None else (cached[1] if cached else 0)},
        finished_req_ids=set(),
    )


def test_a_hybrid_model_announces_attention_blocks_only_at_restore_points(tmp_path: Any) -> None:
    """Full attention + Mamba (align mode), 16-token blocks: a step ending mid-block stores
    attention blocks but no state, so they are announced for removal only; the step that ends on
    a block boundary stores the state there, and its key announces every attention block up to
    it, with vLLM's hashes of the full-attention group."""
    from types import SimpleNamespace

    from test_vllm_halves import Request
    from test_vllm_plan import AlignedMambaSpec, FullAttentionSpec, Group

    from kvstrata.config import load_config
    from kvstrata.integrations.vllm.plan import build_plan
    from kvstrata.integrations.vllm.scheduler import SchedulerSide
    from kvstrata.integrations.vllm.settings import ConnectorSettings

    groups = [Group(["a0", "a1"], FullAttentionSpec(16, 1024)), Group(["m0"], AlignedMambaSpec(16, 1024, 512))]
    plan = build_plan("hybrid", groups, 16, 16)
    extra = ExtraConfig(
        config=load_config({"tiers": [{"name": "dram", "capacity": "1MiB"}]}), worker_lookup_timeout_s=0.1
    )
    settings = ConnectorSettings(extra, "hybrid", "float16", 1, f"ev-{tmp_path.name}", 0, True, kv_events=True)
    sched = SchedulerSide(settings, plan)
    try:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        raw = [bytes([i + 1]) * 32 for i in range(4)]
        hashes = [maybe_convert_block_hash(h) for h in raw]  # type: ignore[arg-type]  # vLLM publishes these
        req = Request("r1", 65, raw, list(range(100, 165)))
        sched.get_num_new_matched_tokens(req, 0)
        tables = ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
        new = SimpleNamespace(req_id="r1", block_ids=tables, num_computed_tokens=0)
        first = sched.build_connector_meta(_step("r1", new=new, n=40))  # ends mid-block 2
        specs = [(plan.groups[s.group].kind.value, e) for s in first.stores for e in s.events or []]
        assert [k for k, _ in specs] == ["full", "full"]
        assert all(e.removed_only for _, e in specs)
        assert [e.blocks[0].block_hash for _, e in specs] == hashes[:2]
        second = sched.build_connector_meta(_step("r1", cached=(40, 24)))  # ends at 64: a restore point
        points = [(plan.groups[s.group].kind.value, s, e) for s in second.stores for e in s.events or []]
        announce = [(s, e) for kind, s, e in points if not e.removed_only]
        assert len(announce) == 1
        spec, ev = announce[0]
        assert plan.groups[spec.group].kind.value == "linear"
        assert [b.block_hash for b in ev.blocks] == hashes  # every attention block up to the point
        assert ev.blocks[0].parent_hash is None and ev.blocks[3].parent_hash == hashes[2]
        assert ev.blocks[3].token_ids == tuple(range(148, 164))
        assert {b.group_idx for b in ev.blocks} == {plan.groups[sched.anchor or 0].group_id}
    finally:
        sched.close()
