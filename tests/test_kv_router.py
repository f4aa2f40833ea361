"""The stand-in KV-aware front end's choice (kvstrata.workload.kv_router): weighted reach from
Dynamo's indexer answer, ties to the least loaded, then in turn. The whole path (the indexer
over real vLLM event streams) is tests/vllm_e2e/test_experiment_serve_kv_events.py."""

from __future__ import annotations

import pytest

from kvstrata.workload.kv_router import WEIGHTS, choose, reach_score


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
