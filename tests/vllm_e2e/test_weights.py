"""The weights identity on a real vLLM (CPU build): a re-trained checkpoint served under the same
name never restores the old one's KV from a shared NVMe tier, and the same checkpoint at another
path does (the identity digests the files, not where they are)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from . import models, runner, sessions
from .sessions import BLOCK, Recompute, counter, kvstrata_config

SERVED = {"served_model_name": "team/llama"}  # both checkpoints: one name, one architecture


def test_other_weights_under_the_same_name_never_restore_and_a_moved_copy_does(
    run_vllm: Any, vllm_models: dict[str, Path], llama_recompute: Recompute, model_root: Path, tmp_path: Path
) -> None:
    """The first checkpoint's recompute is a part of the shared llama recompute run (no
    connector; the served name is only a label there, it does not enter the computation)."""
    first = vllm_models["llama"]
    second = models.make_llama(model_root / "llama-retrained", seed=models.SEED + 1)  # same config
    assert models.read_config(first) == models.read_config(second)
    prompt = sessions.WEIGHTS_PROMPT
    full_blocks = len(prompt) // BLOCK

    base_first = llama_recompute.parts["weights"]
    assert [t["prompt_len"] for t in base_first["turns"]] == [len(prompt)]
    base_second = run_vllm(second, [prompt], llm_kwargs=SERVED)
    runner.assert_decisive(base_first)
    runner.assert_decisive(base_second)
    want_first, want_second = base_first["turns"][0]["output_ids"], base_second["turns"][0]["output_ids"]
    assert want_first != want_second  # else equal outputs below would prove nothing

    nvme = tmp_path / "nvme"
    stored = run_vllm(first, [prompt], kv_transfer_config=kvstrata_config(nvme), llm_kwargs=SERVED)
    runner.assert_comparable(base_first, stored)
    assert stored["turns"][0]["output_ids"] == want_first
    assert counter(stored, "vllm:kvstrata_stored_blocks") >= full_blocks
    log = Path(stored["log_path"]).read_text()
    assert "weights=files:" in log and "(digest of 2 files" in log  # the start-up line names it

    other = run_vllm(second, [prompt], kv_transfer_config=kvstrata_config(nvme), llm_kwargs=SERVED)
    runner.assert_comparable(base_second, other)
    assert counter(other, "vllm:kvstrata_loaded_blocks") == 0
    assert counter(other, "vllm:kvstrata_hit_blocks") == 0
    assert other["turns"][0]["num_cached_tokens"] == 0  # a fresh process: nothing but kvstrata could hit
    assert other["turns"][0]["output_ids"] == want_second

    moved = tmp_path / "elsewhere" / "llama-copy"  # the control: the same files at another path
    shutil.copytree(first, moved)
    again = run_vllm(moved, [prompt], kv_transfer_config=kvstrata_config(nvme), llm_kwargs=SERVED)
    runner.assert_comparable(base_first, again)
    assert again["turns"][0]["output_ids"] == want_first
    assert again["turns"][0]["num_cached_tokens"] >= 0.9 * full_blocks * BLOCK
    assert counter(again, "vllm:kvstrata_loaded_blocks") >= 0.9 * full_blocks
    assert counter(again, "vllm:kvstrata_hit_blocks") >= 0.9 * full_blocks
    assert counter(again, "vllm:kvstrata_failed_loads") == 0
