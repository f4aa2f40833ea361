"""kvstrata chained with another connector in vLLM's MultiConnector, on a real vLLM (CPU build).

The study's prefill/decode shape (its figure 3): a cache connector first, so a prefix already
cached is restored locally, then a transfer connector (NIXL or Mooncake's in production; vLLM's
``ExampleConnector`` stands in for it here, as the README's MultiConnector config describes).
vLLM's MultiConnector asks its connectors in order and loads from the first with hits; every
connector sees every save. The chain must serve the same tokens as no connector at all, the
restored prefix must come through kvstrata, the other connector must keep storing and serving,
and a fault in one must not break the other:

* both connectors hold the session: kvstrata restores it, ``ExampleConnector`` keeps saving;
* kvstrata lost its tier (empty NVMe directory): ``ExampleConnector`` serves what it stored;
* kvstrata's records are corrupt: its loads fail, vLLM recomputes (``kv_load_failure_policy``
  ``recompute``), the outputs stay right and the other connector is unaffected.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from . import runner, sessions
from .sessions import BLOCK, Recompute, counter, kvstrata_config
from .test_connector import explicit_prompts

pytestmark = pytest.mark.slow


def multi_config(nvme: Path, store: Path) -> dict[str, Any]:
    """MultiConnector over kvstrata (DRAM over NVMe at ``nvme``) then ExampleConnector at ``store``."""
    ours = kvstrata_config(nvme)
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "connectors": [
                {k: v for k, v in ours.items() if k != "kv_load_failure_policy"},
                {
                    "kv_connector": "ExampleConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": str(store)},
                },
            ]
        },
    }


@pytest.fixture(scope="module")
def baseline(llama_recompute: Recompute) -> dict[str, Any]:
    """The connector session without any connector (a part of the shared llama recompute run)."""
    result = llama_recompute.parts["connector"]
    runner.assert_decisive(result)
    return result


@pytest.fixture(scope="module")
def chained(vllm_models: dict[str, Path], baseline: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A first instance ran the session but its last turn through the chain and exited: both
    connectors' files, which each test copies (so a test may damage its copy)."""
    root = tmp_path_factory.mktemp("chained")
    (root / "example").mkdir()
    turns = list(sessions.CONNECTOR_SESSION)[:-1]
    with sessions.clean_child_env(tmp_path_factory):
        result = runner.run_vllm(
            vllm_models["llama"],
            turns,
            kv_transfer_config=multi_config(root / "nvme", root / "example"),
            workdir=root / "run",
        )
    runner.assert_comparable(baseline, result)
    for k, (got, want) in enumerate(zip(result["turns"], baseline["turns"], strict=False)):
        assert got["output_ids"] == want["output_ids"], f"turn {k} through the chain"
    assert counter(result, "vllm:kvstrata_stored_blocks") > 0
    assert any((root / "example").iterdir()), "ExampleConnector stored nothing inside the chain"
    return root


def copies(chained: Path, tmp_path: Path, nvme: bool = True) -> tuple[Path, Path]:
    """Private copies of the chain's stores: kvstrata's NVMe directory (or an empty one) and
    ExampleConnector's directory."""
    mine, example = tmp_path / "nvme", tmp_path / "example"
    if nvme:
        shutil.copytree(chained / "nvme", mine)
    shutil.copytree(chained / "example", example)
    return mine, example


def saved_prompts(example: Path) -> int:
    return sum(1 for _ in example.iterdir())


def test_kvstrata_restores_first_and_the_other_connector_keeps_working(
    run_vllm: Any, vllm_models: dict[str, Path], baseline: dict[str, Any], chained: Path, tmp_path: Path
) -> None:
    nvme, example = copies(chained, tmp_path)
    before = saved_prompts(example)
    last = explicit_prompts(list(sessions.CONNECTOR_SESSION), baseline)[-1]
    run = run_vllm(vllm_models["llama"], [last], kv_transfer_config=multi_config(nvme, example))
    runner.assert_comparable(baseline, run)
    assert run["turns"][0]["output_ids"] == baseline["turns"][-1]["output_ids"]
    full = len(last) // BLOCK
    assert run["turns"][0]["num_cached_tokens"] >= 0.9 * full * BLOCK
    assert counter(run, "vllm:kvstrata_loaded_blocks") >= 0.9 * full  # the prefix came through kvstrata
    assert counter(run, "vllm:kvstrata_failed_loads") == 0
    assert saved_prompts(example) > before, "ExampleConnector stopped saving inside the chain"


def test_a_kvstrata_without_its_tier_leaves_the_other_connector_serving(
    run_vllm: Any, vllm_models: dict[str, Path], baseline: dict[str, Any], chained: Path, tmp_path: Path
) -> None:
    """kvstrata starts on an empty directory (its NVMe tier lost): it finds nothing, and
    ExampleConnector restores a prompt it stored (it matches whole stored prompts only)."""
    nvme, example = copies(chained, tmp_path, nvme=False)
    prompts = explicit_prompts(list(sessions.CONNECTOR_SESSION), baseline)
    k = len(prompts) - 2  # the chain's last stored turn
    run = run_vllm(vllm_models["llama"], [prompts[k]], kv_transfer_config=multi_config(nvme, example))
    runner.assert_comparable(baseline, run)
    assert run["turns"][0]["output_ids"] == baseline["turns"][k]["output_ids"]
    assert counter(run, "vllm:kvstrata_hit_blocks") == 0 and counter(run, "vllm:kvstrata_loaded_blocks") == 0
    external = counter(run, "vllm:external_prefix_cache_hits")
    assert external == (len(prompts[k]) - 1) // BLOCK * BLOCK, external  # all of it from ExampleConnector
    assert run["log_facts"]["inject_kv"] >= 1


def test_corrupt_kvstrata_records_are_recomputed_and_the_chain_keeps_serving(
    run_vllm: Any, vllm_models: dict[str, Path], baseline: dict[str, Any], chained: Path, tmp_path: Path
) -> None:
    """Every kvstrata record is damaged on disk (a byte in every 4 KiB page of its segments): its
    index still says hit, its loads fail their checksums, vLLM recomputes those blocks; the
    outputs stay right, and ExampleConnector still saves."""
    nvme, example = copies(chained, tmp_path)
    segments = [p for p in nvme.rglob("*") if p.is_file() and p.parent.name == "segments"]
    assert segments, sorted(str(p) for p in nvme.rglob("*"))
    for seg in segments:
        data = bytearray(seg.read_bytes())
        for off in range(100, len(data), 4096):
            data[off] ^= 0xFF
        seg.write_bytes(bytes(data))
    before = saved_prompts(example)
    last = explicit_prompts(list(sessions.CONNECTOR_SESSION), baseline)[-1]
    run = run_vllm(vllm_models["llama"], [last], kv_transfer_config=multi_config(nvme, example))
    runner.assert_comparable(baseline, run)
    assert run["turns"][0]["output_ids"] == baseline["turns"][-1]["output_ids"]
    assert counter(run, "vllm:kvstrata_failed_loads") > 0
    assert saved_prompts(example) > before
