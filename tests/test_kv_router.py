"""The stand-in KV-aware front end's choice (kvstrata.workload.kv_router): weighted reach from
Dynamo's indexer answer, ties to the least loaded, then in turn. The whole path (the indexer
over real vLLM event streams) is tests/vllm_e2e/test_experiment_serve_kv_events.py."""

from __future__ import annotations

import asyncio

import pytest

from kvstrata.workload.kv_router import WEIGHTS, Selector, choose, count_dump, reach_score


def test_reach_is_weighted_by_the_tier_it_comes_through() -> None:
    # the indexer's counts are cumulative: gpu <= cpu <= disk
    assert reach_score({"gpu": 256, "cpu": 256, "disk": 256}) == (256.0, "gpu")
    assert reach_score({"gpu": 0, "cpu": 384, "disk": 384}) == (384 * WEIGHTS["cpu"], "cpu")
    assert reach_score({"gpu": 128, "cpu": 256, "disk": 640}) == (
        128 + 128 * WEIGHTS["cpu"] + 384 * WEIGHTS["disk"],
        "disk",
    )
    assert reach_score({}) == (0.0, "none")
    assert reach_score({"gpu": 128, "cpu": 0, "disk": 0}) == (128.0, "gpu")  # a lower count never subtracts


def pick(*args: object, **kw: object) -> tuple[int, str]:
    i, _, why = choose(*args, **kw)  # type: ignore[arg-type]
    return i, why


def test_the_instance_that_reaches_furthest_wins() -> None:
    answer = {"0": {"gpu": 128, "cpu": 128, "disk": 128}, "1": {"gpu": 0, "cpu": 0, "disk": 1024}}
    assert choose(answer, [0, 0], turn=0, prompt_tokens=1200) == (1, 944, "disk")  # 1024 disk tokens count 256
    answer["0"] = {"gpu": 384, "cpu": 384, "disk": 384}
    assert choose(answer, [0, 0], turn=1, prompt_tokens=1200) == (0, 816, "gpu")


def test_work_in_flight_outweighs_a_small_reach() -> None:
    """A hot prefix (the shared system prompt, cached on one instance) does not pile every request
    there: the prefill work in flight on an instance counts against it, as in Dynamo's cost."""
    shared = {"0": {"gpu": 256, "cpu": 256, "disk": 256}}
    assert pick(shared, [0, 0], turn=1, prompt_tokens=600) == (0, "gpu")
    assert pick(shared, [600, 0], turn=0, prompt_tokens=600) == (1, "none")  # 344 + 600 > 600
    assert pick(shared, [200, 0], turn=1, prompt_tokens=600) == (0, "gpu")  # 344 + 200 < 600


@pytest.mark.parametrize("turn", [0, 1, 2, 5])
def test_ties_go_in_turn(turn: int) -> None:
    assert pick({}, [300, 0, 100], turn, prompt_tokens=500) == (1, "none")  # the least in flight
    assert pick({}, [0, 0, 0], turn, prompt_tokens=500) == (turn % 3, "none")  # nothing cached: round-robin
    same = {str(i): {"gpu": 128, "cpu": 128, "disk": 128} for i in range(3)}
    assert choose(same, [0, 0, 0], turn, prompt_tokens=500) == (turn % 3, 372, "gpu")


def test_a_burst_whose_answers_arrive_together_is_spread() -> None:
    """The front end's race (CI, 2026-12-04: a burst of 4 first turns all went to instance 0, and the
    shared prefix then kept every later turn there): each request awaits its tokenizer and indexer
    answers, then decides; the decision must see the work reserved by those decided just before."""
    sel = Selector(2)
    answered = asyncio.Event()
    shared = {"0": {"gpu": 0, "cpu": 0, "disk": 0}}

    async def request() -> tuple[int, int]:
        await answered.wait()  # the indexer answers every request of the burst in the same loop turn
        return sel.decide(shared, 448)

    async def burst() -> list[tuple[int, int]]:
        tasks = [asyncio.ensure_future(request()) for _ in range(4)]
        await asyncio.sleep(0)
        answered.set()
        return list(await asyncio.gather(*tasks))

    picks = asyncio.run(burst())
    assert [i for i, _ in picks] == [0, 1, 0, 1]
    assert sel.active == [896, 896] and sel.stats["by_backend"] == [2, 2] and sel.turn == 4
    for i, cost in picks:
        sel.release(i, cost)
    assert sel.active == [0, 0]
    # once a request is done its cost is gone, so a cached prefix draws the next one back
    cached = {"0": {"gpu": 256, "cpu": 256, "disk": 256}}
    assert sel.decide(cached, 448) == (0, 192)
    assert sel.stats["by_reach"] == {"gpu": 1, "cpu": 0, "disk": 0, "none": 4}
    assert sel.stats["reached_tokens"] == 256 and sel.stats["below_gpu_tokens"] == 0


def test_a_fallback_goes_to_the_least_loaded_and_is_counted() -> None:
    sel = Selector(3)
    sel.decide({}, 500)  # instance 0: 500 in flight
    assert sel.fallback() == (1, 0)  # a fallback reserves nothing: its cost is unknown
    assert sel.fallback() == (2, 0)
    assert sel.fallback() == (1, 0)  # turn 3 prefers 0, but 0 has work in flight
    assert sel.stats["fallbacks"] == 3 and sel.stats["requests"] == 4 and sel.stats["by_backend"] == [1, 2, 1]


def test_a_router_without_backends_is_refused() -> None:
    with pytest.raises(ValueError, match="got 0"):
        Selector(0)


def _stored(tier: str, hashes: list[int], parent: int | None, worker: int = 0) -> dict[str, object]:
    # one entry of the indexer's GET /dump, in the shape ai-dynamo-runtime 1.6.1 answered it here
    blocks = [{"block_hash": h, "tokens_hash": h * 7, "mm_extra_info": None} for h in hashes]
    return {
        "worker_id": worker,
        "storage_tier": tier,
        "residency_domain": "worker",
        "event": {"event_id": 0, "data": {"stored": {"parent_hash": parent, "start_position": None, "blocks": blocks}}},
        "dp_rank": 0,
    }


def test_the_index_is_counted_by_tier() -> None:
    dump = {
        "tiny:default": {
            "block_size": 128,
            "events": [
                _stored("device", [11, 12, 13], None),
                _stored("host_pinned", [11], None),
                _stored("host_pinned", [12], 11, worker=1),
                _stored("disk", [21, 22], None),
                _stored("external", [31], None),
                {"worker_id": 0, "storage_tier": "device", "event": {"data": {"removed": [11]}}},
            ],
        },
        "other:default": {"events": [_stored("device", [41], None)]},
    }
    assert count_dump(dump) == {"gpu": 4, "cpu": 2, "disk": 3}
    assert count_dump({}) == {"gpu": 0, "cpu": 0, "disk": 0}
    assert count_dump({"tiny:default": {"block_size": 128, "events": []}}) == {"gpu": 0, "cpu": 0, "disk": 0}
