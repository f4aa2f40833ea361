"""Baselines on real vLLM, without kvstrata: what the kvstrata connector tests compare against.

* Greedy decoding of a 3-turn session (600 -> 900 -> 1200 prompt tokens, each turn extending the
  previous prompt and output) is deterministic across two fresh vLLM processes, for the Llama
  model and for the sliding-window hybrid.
* ``cache_salt`` (inside the token prompt) separates vLLM's local prefix cache.
* vLLM's built-in ``ExampleConnector`` stores the KV in one process and a second process loads
  it, reports external hits (``vllm:external_prefix_cache_hits``, ``num_cached_tokens``, the
  "External Cache Hit!" log line) and produces the same tokens as the baseline.
* A connector that subclasses ``SupportsHMA`` keeps the hybrid KV cache manager on: the sliding
  model gets two KV cache groups (sliding layers 0, 2 and full layers 1, 3).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from . import runner, sessions
from .sessions import Recompute

MAX_TOKENS = sessions.MAX_TOKENS
BLOCK = sessions.BLOCK  # vLLM's default block size on CPU; the runs below leave block_size unset
SESSION = sessions.BASELINE_SESSION
TURNS = sessions.BASELINE_TURNS  # the session, then turn 0 again with cache salts "a", "b", "a"


def _aligned(n: int) -> int:
    return n // BLOCK * BLOCK


def _outputs(result: dict[str, Any]) -> list[list[int]]:
    return [t["output_ids"] for t in result["turns"]]


def _describe(result: dict[str, Any]) -> str:
    return (
        "\n".join(
            f"turn {t['index']}: prompt={t['prompt_len']} cached={t['num_cached_tokens']} "
            f"out={t['output_ids']} delta={t['metrics_delta']}"
            for t in result["turns"]
        )
        + f"\nlog: {result.get('log_path')}"
    )


@pytest.fixture(scope="session")
def llama_baseline(llama_recompute: Recompute) -> dict[str, Any]:
    """TURNS on the llama without any connector: a part of the shared llama recompute run."""
    return llama_recompute.parts["baseline"]


@pytest.fixture(scope="session")
def sliding_baseline(sliding_recompute: Recompute) -> dict[str, Any]:
    """TURNS on the sliding-window model without any connector: a part of the shared run."""
    return sliding_recompute.parts["baseline"]


def _check_session_shape(result: dict[str, Any]) -> None:
    """Prompt lengths, output lengths, and the local prefix-cache hits vLLM should report."""
    turns = result["turns"]
    assert [t["prompt_len"] for t in turns[:3]] == list(SESSION), _describe(result)
    for t in turns:
        assert len(t["output_ids"]) == MAX_TOKENS
        assert len(set(t["output_ids"])) > 1, f"degenerate output (the model repeats itself): {t['output_ids']}"
        # No connector: every cached token is a local prefix-cache hit.
        assert t["metrics_delta"].get("vllm:prefix_cache_hits", 0) == t["num_cached_tokens"], _describe(result)
        assert t["metrics_delta"].get("vllm:external_prefix_cache_hits", 0) == 0
    assert turns[0]["num_cached_tokens"] == 0
    for k in (1, 2):
        # Turn k-1 computed KV for its prompt and all outputs but the last one.
        expect = _aligned(SESSION[k - 1] + MAX_TOKENS - 1)
        assert turns[k]["num_cached_tokens"] == expect, _describe(result)
    # cache_salt: a salted copy of turn 0 shares nothing with the unsalted turn 0 or another salt,
    # and hits when the salt repeats (a full-prompt hit stops short of the last token).
    assert turns[3]["num_cached_tokens"] == 0, _describe(result)
    assert turns[4]["num_cached_tokens"] == 0, _describe(result)
    assert turns[5]["num_cached_tokens"] == _aligned(SESSION[0] - 1), _describe(result)
    assert turns[3]["output_ids"] == turns[4]["output_ids"] == turns[5]["output_ids"] == turns[0]["output_ids"]


def _check_again(first: Recompute, again: dict[str, Any]) -> None:
    """``again`` (the same turns in a fresh process) has the shape and every output of ``first``."""
    _check_session_shape(sessions.part(again, first.spans["baseline"]))
    runner.assert_comparable(first.run, again)
    assert _outputs(again) == _outputs(first.run), _describe(first.run) + "\n---\n" + _describe(again)


def test_llama_greedy_is_deterministic(
    llama_baseline: dict[str, Any], llama_recompute: Recompute, vllm_models: dict[str, Path], run_vllm: Any
) -> None:
    """Two fresh processes on the same turns (the shared run's: TURNS and the other modules'
    baselines) produce the same tokens."""
    _check_session_shape(llama_baseline)
    runner.assert_decisive(llama_baseline)
    assert llama_baseline["config"]["block_size"] == BLOCK
    again = run_vllm(vllm_models["llama"], llama_recompute.turns, max_tokens=MAX_TOKENS)
    _check_again(llama_recompute, again)


def test_sliding_greedy_is_deterministic(
    sliding_baseline: dict[str, Any], sliding_recompute: Recompute, vllm_models: dict[str, Path], run_vllm: Any
) -> None:
    _check_session_shape(sliding_baseline)
    runner.assert_decisive(sliding_baseline)
    facts = sliding_baseline["log_facts"]
    # Without a connector the hybrid KV cache manager is on: one group per layer kind.
    assert not facts["hma_turned_off"]
    assert facts.get("kv_cache_group_sizes") == [BLOCK, BLOCK], facts
    again = run_vllm(vllm_models["sliding"], sliding_recompute.turns, max_tokens=MAX_TOKENS)
    _check_again(sliding_recompute, again)


def test_example_connector_across_processes(
    llama_baseline: dict[str, Any], vllm_models: dict[str, Path], run_vllm: Any, tmp_path: Path
) -> None:
    store = tmp_path / "example-store"
    store.mkdir()
    kv = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(store)},
    }
    first = run_vllm(vllm_models["llama"], TURNS, max_tokens=MAX_TOKENS, kv_transfer_config=kv)
    assert first["log_facts"]["hma_turned_off"]  # ExampleConnector does not subclass SupportsHMA
    # A kv_transfer_config makes vLLM's automatic binding reserve one more core: with the runner's
    # explicit binding the connector run computes with the same threads as the baseline.
    runner.assert_comparable(llama_baseline, first)
    assert _outputs(first) == _outputs(llama_baseline), _describe(first)
    assert first["turns"][0]["metrics_delta"].get("vllm:external_prefix_cache_hits", 0) == 0
    assert any(store.iterdir()), "ExampleConnector stored nothing"

    second = run_vllm(vllm_models["llama"], TURNS, max_tokens=MAX_TOKENS, kv_transfer_config=kv)
    runner.assert_comparable(llama_baseline, second)
    assert _outputs(second) == _outputs(llama_baseline), _describe(second)
    t0 = second["turns"][0]
    # A fresh process has an empty local prefix cache: turn 0's hit is all external.
    # ExampleConnector matches only whole prompts it stored, aligned down from len-1 to blocks.
    ext = _aligned(SESSION[0] - 2)
    assert t0["metrics_delta"].get("vllm:external_prefix_cache_hits") == ext, _describe(second)
    assert t0["metrics_delta"].get("vllm:prefix_cache_hits", 0) == 0
    # num_cached_tokens counts local + external hits.
    assert t0["num_cached_tokens"] == ext, _describe(second)
    # Turn 1: turn 0's blocks are local now; the connector supplies the rest of its stored prompt.
    t1 = second["turns"][1]
    local = t1["metrics_delta"].get("vllm:prefix_cache_hits", 0)
    external = t1["metrics_delta"].get("vllm:external_prefix_cache_hits", 0)
    assert local == _aligned(SESSION[0] + MAX_TOKENS - 1), _describe(second)
    assert external > 0 and t1["num_cached_tokens"] == local + external, _describe(second)
    assert second["log_facts"]["external_cache_hit"] >= 3
    assert second["log_facts"]["inject_kv"] >= 3
    assert second["metrics"].get("vllm:external_prefix_cache_hits", 0) >= 3 * ext


def test_supports_hma_connector_keeps_hybrid_groups(
    sliding_baseline: dict[str, Any], vllm_models: dict[str, Path], run_vllm: Any
) -> None:
    """A connector that subclasses SupportsHMA (``runner.HMAProbeConnector``, which moves no
    data) keeps HMA on: the scheduler-side and worker-side connectors both see one
    SlidingWindowSpec group (layers 0, 2; window 128) and one FullAttentionSpec group
    (layers 1, 3), both with 128-token blocks, and the outputs equal the baseline."""
    res = run_vllm(vllm_models["sliding"], TURNS, max_tokens=MAX_TOKENS, kv_transfer_config=runner.PROBE_CONNECTOR)
    facts = res["log_facts"]
    assert not facts["hma_turned_off"], facts
    assert res["config"]["disable_hybrid_kv_cache_manager"] is False
    assert facts.get("kv_cache_group_sizes") == [BLOCK, BLOCK], facts
    inits = [p for p in facts.get("probe", []) if p["event"] == "init"]
    assert {p["role"] for p in inits} == {"SCHEDULER", "WORKER"}, facts.get("probe")
    for p in inits:
        kinds = {g["spec"]: g for g in p["groups"]}
        assert set(kinds) == {"SlidingWindowSpec", "FullAttentionSpec"}, p
        sw, full = kinds["SlidingWindowSpec"], kinds["FullAttentionSpec"]
        assert sw["sliding_window"] == 128 and sw["block_size"] == BLOCK and full["block_size"] == BLOCK
        assert [name.split(".")[2] for name in sw["layers"]] == ["0", "2"]
        assert [name.split(".")[2] for name in full["layers"]] == ["1", "3"]
    regs = [p for p in facts["probe"] if p["event"] == "register_kv_caches"]
    assert regs and len(regs[0]["tensors"]) == 4
    runner.assert_comparable(sliding_baseline, res)
    assert _outputs(res) == _outputs(sliding_baseline), _describe(res)


def test_runs_record_the_threads_their_worker_got(
    llama_baseline: dict[str, Any], vllm_models: dict[str, Path], run_vllm: Any
) -> None:
    """``result["threads"]`` is read inside vLLM's worker, not copied from the setting: a run
    bound to two CPUs reports two torch threads, the default binding one, and
    :func:`runner.assert_comparable` names the difference."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip(f"needs 2 CPUs, this process may use {cpus}")
    assert [w["torch_threads"] for w in llama_baseline["threads"]["workers"]] == [runner.DEFAULT_THREADS]
    assert llama_baseline["threads"]["bind"] == runner.default_threads_bind()
    two = run_vllm(
        vllm_models["llama"],
        [TURNS[0]],
        max_tokens=MAX_TOKENS,
        extra_env={"VLLM_CPU_OMP_THREADS_BIND": runner.default_threads_bind(2)},
    )
    assert [w["torch_threads"] for w in two["threads"]["workers"]] == [2], two["threads"]
    assert [w["omp_num_threads"] for w in two["threads"]["workers"]] == ["2"], two["threads"]
    with pytest.raises(AssertionError, match=r"different compute settings:\n.*threads=\[1\].*\n.*threads=\[2\]"):
        runner.assert_comparable(llama_baseline, two)
