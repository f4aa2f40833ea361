"""KVStrataConnector on a real vLLM (CPU build): hits across instances, identical greedy outputs,
hybrid (sliding-window) models with HMA on, faults, and tenant isolation."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvstrata.engine.verify import namespaces_under
from kvstrata.tiers import TIERS, TierContext

from . import runner, sessions
from .sessions import BLOCK, Recompute, counter, kvstrata_config

LENGTHS = sessions.CONNECTOR_LENGTHS  # agentic: each turn adds little to a long context


def explicit_prompts(turns: list[Any], result: dict[str, Any]) -> list[list[int]]:
    """The token ids every turn of ``chat_turns`` sent, rebuilt from a run's outputs."""
    prompts: list[list[int]] = []
    for i, turn in enumerate(turns):
        if isinstance(turn, dict):
            prev = turn["continue"]
            prompts.append(prompts[prev] + list(result["turns"][prev]["output_ids"]) + list(turn["append"]))
        else:
            prompts.append(list(turn))
        assert len(prompts[-1]) == result["turns"][i]["prompt_len"]
    return prompts


@pytest.fixture(scope="module")
def session_turns() -> list[Any]:
    return list(sessions.CONNECTOR_SESSION)


@pytest.fixture(scope="module")
def baseline(llama_recompute: Recompute) -> dict[str, Any]:
    """The session without any connector (a part of the shared llama recompute run): the outputs
    every kvstrata run must reproduce."""
    result = llama_recompute.parts["connector"]
    runner.assert_decisive(result)
    return result


@pytest.fixture(scope="module")
def stored_session(
    vllm_models: dict[str, Path], session_turns: list[Any], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """A first instance that ran the session but its last turn with kvstrata (DRAM over NVMe)
    and exited: the tier files a second instance starts from. Its run is the same for every test
    that reads it (same model, turns, config and pinned threads), so it runs once per module and
    each test gets a copy of the files (:func:`copy_store`); ``result`` is its run."""
    root = tmp_path_factory.mktemp("stored-session")
    with sessions.clean_child_env(tmp_path_factory):
        result = runner.run_vllm(
            vllm_models["llama"],
            session_turns[:-1],
            kv_transfer_config=kvstrata_config(root / "nvme"),
            workdir=root / "run",
        )
    return {"result": result, "nvme": root / "nvme"}


def copy_store(stored: dict[str, Any], tmp_path: Path) -> Path:
    """A private copy of ``stored_session``'s NVMe tier files (byte for byte, modes kept)."""
    nvme = tmp_path / "nvme"
    shutil.copytree(stored["nvme"], nvme)
    return nvme


@pytest.mark.parametrize("load_mode", ["async", "sync"])
def test_second_instance_restores_the_session_and_matches_recompute(
    run_vllm: Any,
    vllm_models: dict[str, Path],
    session_turns: list[Any],
    baseline: dict[str, Any],
    stored_session: dict[str, Any],
    tmp_path: Path,
    load_mode: str,
) -> None:
    """A first instance ran the session but its last turn (``stored_session``); a second one,
    given a copy of its tier files, runs the last turn. async: the request waits while kvstrata
    loads; sync: loads run inside the step, layer by layer (the forward waits for each layer just
    before it needs it)."""
    model = vllm_models["llama"]
    a = stored_session["result"]
    runner.assert_comparable(baseline, a)
    for ta, tb in zip(a["turns"], baseline["turns"], strict=False):
        assert ta["output_ids"] == tb["output_ids"]
    nvme = copy_store(stored_session, tmp_path)
    last = explicit_prompts(session_turns, baseline)[-1]
    b = run_vllm(model, [last], kv_transfer_config=kvstrata_config(nvme, load_mode=load_mode))
    runner.assert_comparable(baseline, b)
    assert b["turns"][0]["output_ids"] == baseline["turns"][-1]["output_ids"]
    full_blocks = len(last) // BLOCK
    cached = b["turns"][0]["num_cached_tokens"]
    assert cached >= 0.9 * full_blocks * BLOCK, (cached, full_blocks)
    assert counter(b, "vllm:kvstrata_loaded_blocks") >= 0.9 * full_blocks
    assert counter(b, "vllm:kvstrata_hit_blocks") >= 0.9 * full_blocks
    assert counter(b, "vllm:kvstrata_failed_loads") == 0
    assert counter(b, "vllm:kvstrata_worker_hook_time_ms") > 0  # the time vLLM's steps spent in kvstrata
    assert counter(b, "vllm:kvstrata_scheduler_hook_time_ms") > 0
    assert "kvstrata connector (scheduler)" in Path(b["log_path"]).read_text()  # the start-up line


def test_every_reused_token_comes_through_the_connector(
    run_vllm: Any, vllm_models: dict[str, Path], session_turns: list[Any], baseline: dict[str, Any], tmp_path: Path
) -> None:
    model = vllm_models["llama"]
    run = run_vllm(
        model,
        session_turns,
        kv_transfer_config=kvstrata_config(tmp_path / "nvme"),
        reset_prefix_cache_between=True,
    )
    runner.assert_comparable(baseline, run)
    prompts = explicit_prompts(session_turns, baseline)
    for k, (got, want) in enumerate(zip(run["turns"], baseline["turns"], strict=True)):
        assert got["output_ids"] == want["output_ids"], f"turn {k}"
    for k in range(1, len(session_turns)):
        reused = (len(prompts[k - 1]) + 8) // BLOCK  # the previous turn's full blocks
        assert run["turns"][k]["num_cached_tokens"] >= 0.9 * reused * BLOCK
        assert counter(run, "vllm:prefix_cache_hits", k) == 0  # vLLM's own cache was reset


def _blocks_per_layer(nvme: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for _directory, layout, namespace in namespaces_under(str(nvme)):
        cls = TIERS.get("nvme")
        opts = cls.Options.model_validate({"path": str(nvme)})
        tier = cls("nvme", 1 << 30, opts, TierContext(layout, namespace))
        try:
            for (_key, layer), _size in tier.scan():
                name = layout.layers[layer].name
                counts[name] = counts.get(name, 0) + 1
        finally:
            tier.close()
    return counts


def test_sliding_window_hybrid_keeps_hma_and_bounds_window_bytes(
    run_vllm: Any, vllm_models: dict[str, Path], sliding_recompute: Recompute, tmp_path: Path
) -> None:
    model = vllm_models["sliding"]
    turns = list(sessions.SLIDING_SESSION)
    baseline = sliding_recompute.parts["sliding"]  # the session without any connector
    runner.assert_decisive(baseline)
    a = run_vllm(model, turns[:-1], kv_transfer_config=kvstrata_config(tmp_path / "nvme"))
    facts = " ".join(a["log_facts"]["lines"])
    assert "Turning off hybrid kv cache manager" not in facts
    assert a["config"].get("hma", True) is not False
    last = explicit_prompts(turns, baseline)[-1]
    b = run_vllm(model, [last], kv_transfer_config=kvstrata_config(tmp_path / "nvme"))
    runner.assert_comparable(baseline, a, b)
    assert b["turns"][0]["output_ids"] == baseline["turns"][-1]["output_ids"]
    assert b["turns"][0]["num_cached_tokens"] >= BLOCK
    counts = _blocks_per_layer(tmp_path / "nvme")
    full = [n for name, n in counts.items() if name.endswith(("1.self_attn.attn", "3.self_attn.attn"))]
    sliding = [n for name, n in counts.items() if name.endswith(("0.self_attn.attn", "2.self_attn.attn"))]
    assert full and sliding, counts
    context_blocks = (LENGTHS[-1] + 1200) // BLOCK
    # full-attention layers keep every block of the context; sliding layers only the windows
    # before each turn's restore points (window 128 = one or two blocks per turn)
    assert min(full) >= (1600 + 8) // BLOCK
    assert max(sliding) <= 2 * len(turns) + 2 < context_blocks, counts


def _corrupt(nvme: Path, mode: str) -> None:
    segs = sorted(nvme.rglob("*.seg"))
    assert segs
    rnd = random.Random(3)
    for seg in segs:
        if mode == "delete":
            seg.unlink()
            continue
        data = bytearray(seg.read_bytes())
        for _ in range(max(1, len(data) // 2048)):
            data[rnd.randrange(len(data))] ^= 0xFF
        seg.write_bytes(bytes(data))


@pytest.mark.parametrize("mode", ["flip", "delete"])
def test_damaged_tier_files_are_recomputed_not_served(
    run_vllm: Any,
    vllm_models: dict[str, Path],
    session_turns: list[Any],
    baseline: dict[str, Any],
    stored_session: dict[str, Any],
    tmp_path: Path,
    mode: str,
) -> None:
    """A copy of ``stored_session``'s tier files (the session but its last turn), damaged; a
    second instance runs the last turn."""
    model = vllm_models["llama"]
    nvme = copy_store(stored_session, tmp_path)
    _corrupt(nvme, mode)
    last = explicit_prompts(session_turns, baseline)[-1]
    b = run_vllm(model, [last], kv_transfer_config=kvstrata_config(nvme))
    runner.assert_comparable(baseline, b)
    assert b["turns"][0]["output_ids"] == baseline["turns"][-1]["output_ids"]
    assert counter(b, "vllm:kvstrata_loaded_blocks") < len(last) // BLOCK


def test_cache_salt_separates_tenants(run_vllm: Any, vllm_models: dict[str, Path], tmp_path: Path) -> None:
    """Tenant A stores a prompt; a second instance sends the same ids as tenant B (nothing may
    hit), then as tenant A again (vLLM's own cache reset first, and this instance's DRAM holds
    only B's blocks: the hit comes from A's blocks on NVMe)."""
    model = vllm_models["llama"]
    prompt = sessions.random_ids(9, 900)
    cfg = kvstrata_config(tmp_path / "nvme")
    run_vllm(model, [prompt], kv_transfer_config=cfg, cache_salts=["tenant-a"])
    run = run_vllm(
        model,
        [prompt, prompt],
        kv_transfer_config=cfg,
        cache_salts=["tenant-b", "tenant-a"],
        reset_prefix_cache_between=True,
    )
    other, same = run["turns"]
    assert other["num_cached_tokens"] == 0
    assert counter(run, "vllm:kvstrata_loaded_blocks", 0) == 0
    assert counter(run, "vllm:kvstrata_hit_blocks", 0) == 0
    assert same["num_cached_tokens"] >= (len(prompt) // BLOCK) * BLOCK * 0.9
    assert counter(run, "vllm:prefix_cache_hits", 1) == 0  # every hit of tenant A's turn is kvstrata's


def test_a_prompt_re_sent_at_once_hits_the_workers_dram(
    dram_only_run: dict[str, Any], baseline: dict[str, Any], session_turns: list[Any]
) -> None:
    """DRAM only, no persistent tier: the scheduler must see the worker's DRAM and its stores
    still in flight, so the second send restores every full block at once, and the output
    matches the run without a connector. (The run, ``dram_only_run``, is shared with the
    lookup-socket test, which sends its own prompt twice first; vLLM CPU runs the worker in its
    own process either way.)"""
    prompt = explicit_prompts(session_turns, baseline)[0]
    run = sessions.part(dram_only_run, sessions.DRAM_ONLY_SPANS["resend"])
    assert [t["prompt_len"] for t in run["turns"]] == [len(prompt)] * 2
    runner.assert_comparable(baseline, run)
    first, second = run["turns"]
    assert first["num_cached_tokens"] == 0
    assert second["num_cached_tokens"] == ((len(prompt) - 1) // BLOCK) * BLOCK
    assert first["output_ids"] == second["output_ids"] == baseline["turns"][0]["output_ids"]
    assert counter(run, "vllm:kvstrata_loaded_blocks", 1) > 0
    assert counter(run, "vllm:prefix_cache_hits", 1) == 0


def test_a_store_queue_budget_below_one_step_still_stores_the_whole_prefix(
    run_vllm: Any, vllm_models: dict[str, Path], baseline: dict[str, Any], session_turns: list[Any], tmp_path: Path
) -> None:
    """``max_pending_bytes`` = 1 MiB, two of the tiny model's 512 KiB blocks, while one prefill step
    stores ~11 blocks: the engine splits each store and admits it part by part. The prompt re-sent
    in the same process restores every full block (from the worker's DRAM, waiting for queued parts
    where needed), and a fresh process restores them all from NVMe; outputs match recompute."""
    model = vllm_models["llama"]
    prompt = explicit_prompts(session_turns, baseline)[0]
    full = (len(prompt) - 1) // BLOCK
    budget = 1024**2
    cfg = kvstrata_config(tmp_path / "nvme")
    cfg["kv_connector_extra_config"]["config"]["engine"] = {"max_pending_bytes": budget}
    first = run_vllm(model, [prompt, prompt], kv_transfer_config=cfg, reset_prefix_cache_between=True)
    runner.assert_comparable(baseline, first)
    assert counter(first, "vllm:kvstrata_saved_bytes", 0) >= 4 * budget  # one step is several budgets
    assert counter(first, "vllm:kvstrata_dropped_blocks") == 0
    assert counter(first, "vllm:kvstrata_dropped_stores") == 0
    assert first["turns"][1]["num_cached_tokens"] == full * BLOCK
    assert counter(first, "vllm:kvstrata_loaded_blocks", 1) == full
    fresh = run_vllm(model, [prompt], kv_transfer_config=cfg)
    assert fresh["turns"][0]["num_cached_tokens"] == full * BLOCK
    assert counter(fresh, "vllm:kvstrata_loaded_blocks") == full
    want = baseline["turns"][0]["output_ids"]
    assert first["turns"][0]["output_ids"] == first["turns"][1]["output_ids"] == want
    assert fresh["turns"][0]["output_ids"] == want
