"""The connector on a linear-attention hybrid (a tiny Qwen3-Next, gated delta net + full
attention) on real vLLM (CPU): the Mamba group's recurrent state is stored as snapshots at the
block boundaries vLLM materializes, a second instance restores a prefix through kvstrata, state
slot and full-attention blocks together, and its greedy output equals the run without any
connector."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import models
from .runner import chat_turns
from .test_connector import _blocks_per_layer, counter, explicit_prompts, kvstrata_config

HYBRID_BLOCK = 256  # vLLM's hybrid block size for this model (attention page = padded state page)


def test_linear_attention_state_is_restored_and_outputs_match(run_vllm: Any, model_root: Path, tmp_path: Path) -> None:
    model = models.make_linear_hybrid(model_root / "qwen3next")
    turns = chat_turns((1500, 1700, 1900), max_tokens=8, seed=11)
    baseline = run_vllm(model, turns)
    a = run_vllm(model, turns[:-1], kv_transfer_config=kvstrata_config(tmp_path / "nvme"))
    for ta, tb in zip(a["turns"], baseline["turns"], strict=False):
        assert ta["output_ids"] == tb["output_ids"]
    log = Path(a["log_path"]).read_text()
    assert "('linear', 256, 2, None)" in log and "unsupported=[]" in log  # the Mamba group is mapped
    assert "Turning off hybrid kv cache manager" not in log

    last = explicit_prompts(turns, baseline)[-1]
    b = run_vllm(model, [last], kv_transfer_config=kvstrata_config(tmp_path / "nvme"))
    assert b["turns"][0]["output_ids"] == baseline["turns"][-1]["output_ids"]
    cached = b["turns"][0]["num_cached_tokens"]
    assert cached >= 5 * HYBRID_BLOCK, cached  # the state vLLM checkpointed at 1,280 tokens, and its prefix
    assert counter(b, "vllm:external_prefix_cache_hits") == cached
    assert counter(b, "vllm:kvstrata_loaded_blocks") == cached // HYBRID_BLOCK + 1  # full blocks + one state
    assert counter(b, "vllm:kvstrata_failed_loads") == 0

    counts = _blocks_per_layer(tmp_path / "nvme")
    state = [n for name, n in counts.items() if name.endswith("linear_attn")]
    full = [n for name, n in counts.items() if name.endswith("self_attn.attn")]
    assert len(state) == 2 and len(full) == 2, counts
    assert min(full) >= 6  # every full block of the context
    assert 1 <= max(state) <= 2, counts  # a snapshot per boundary a step ended on, not one per block
