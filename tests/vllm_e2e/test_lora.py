"""LoRA on a real vLLM (CPU build) with KVStrataConnector: two adapters on the same prompt never
restore each other's KV, on both key paths (kvstrata's own keys, which mix in vLLM's extra keys,
and vLLM's sha256 block hashes), and each reproduces its own no-connector output.

The adapters are random PEFT-format adapters made locally (``models.make_lora``); the baseline
first shows that each changes the greedy tokens (against the base model and each other), so a
restore of the wrong adapter's KV would show in the outputs."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from . import models, runner
from .sessions import counter, kvstrata_config

BLOCK = 128  # vLLM's default block size on CPU
PROMPT_LEN = 600  # 4 full blocks (a restore leaves the last token to compute)
RANK = 8
LORA_KW = {"enable_lora": True, "max_lora_rank": RANK, "max_loras": 2}


@pytest.fixture(scope="module")
def adapters(model_root: Path, vllm_models: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """Two adapters for the llama, as the runner's ``lora`` option."""
    base = vllm_models["llama"]
    out = {}
    for i, name in enumerate(("a", "b"), start=1):
        path = models.make_lora(model_root / f"lora-{name}", base, rank=RANK, seed=100 + i)
        out[name] = {"name": f"adapter-{name}", "id": i, "path": str(path)}
    return out


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    rng = random.Random(23)
    return [rng.randrange(3, 1024) for _ in range(PROMPT_LEN)]


@pytest.fixture(scope="module")
def baseline(
    vllm_models: dict[str, Path],
    adapters: dict[str, dict[str, Any]],
    prompt: list[int],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    """No connector: the base model, adapter A and adapter B on the same prompt."""
    turns: list[dict[str, Any]] = [
        {"ids": prompt},
        {"ids": prompt, "lora": adapters["a"]},
        {"ids": prompt, "lora": adapters["b"]},
    ]
    result = runner.run_vllm(
        vllm_models["llama"],
        turns,
        reset_prefix_cache_between=True,
        llm_kwargs=LORA_KW,
        workdir=tmp_path_factory.mktemp("lora-baseline"),
    )
    runner.assert_decisive(result)
    base, a, b = (t["output_ids"] for t in result["turns"])
    # the test proves nothing unless each adapter changes the tokens
    assert a != base and b != base and a != b, (base, a, b)
    return {"base": base, "a": a, "b": b, "result": result}


@pytest.mark.parametrize("hash_algo", ["xxhash", "sha256"])
def test_adapters_never_restore_each_others_kv(
    run_vllm: Any,
    vllm_models: dict[str, Path],
    adapters: dict[str, dict[str, Any]],
    prompt: list[int],
    baseline: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    hash_algo: str,
) -> None:
    """xxhash without PYTHONHASHSEED: vLLM's hashes differ per process, so kvstrata keys the blocks
    itself (token ids plus vLLM's extra keys); sha256: kvstrata namespaces vLLM's block hashes."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)  # the children inherit this environment
    order = ["a", "b", "a", "b"]
    turns = [{"ids": prompt, "lora": adapters[name]} for name in order]
    run = run_vllm(
        vllm_models["llama"],
        turns,
        kv_transfer_config=kvstrata_config(tmp_path / "nvme"),
        reset_prefix_cache_between=True,  # vLLM's own prefix cache must not mask the connector
        llm_kwargs={**LORA_KW, "prefix_caching_hash_algo": hash_algo},
    )
    runner.assert_comparable(baseline["result"], run)
    log = Path(run["log_path"]).read_text()
    path = "kvstrata keys: kvstrata's own" if hash_algo == "xxhash" else "kvstrata keys: vLLM's block hashes"
    assert path in log
    full = (PROMPT_LEN - 1) // BLOCK
    got = [
        (t["output_ids"], t["num_cached_tokens"], counter(run, "vllm:kvstrata_loaded_blocks", i))
        for i, t in enumerate(run["turns"])
    ]
    # turn 0: A computes and stores; turn 1: B on the same prompt finds none of A's blocks
    assert got[0] == (baseline["a"], 0, 0), got
    assert got[1] == (baseline["b"], 0, 0), got
    assert counter(run, "vllm:kvstrata_stored_blocks", 1) >= full  # B stored its own blocks
    # turns 2 and 3: each adapter restores its own blocks and reproduces its own output
    assert got[2] == (baseline["a"], full * BLOCK, full), got
    assert got[3] == (baseline["b"], full * BLOCK, full), got
    assert counter(run, "vllm:kvstrata_failed_loads") == 0
    assert counter(run, "vllm:kvstrata_declined_requests") == 0
