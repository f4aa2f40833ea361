"""The connector on a linear-attention hybrid (a tiny Qwen3-Next, gated delta net + full
attention) on real vLLM (CPU): the Mamba group's recurrent state is stored as snapshots at the
block boundaries vLLM materializes, a second instance restores a prefix through kvstrata, state
slot and full-attention blocks together, and its greedy output equals the run without any
connector."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import models
from .runner import assert_comparable, assert_same_decisive_outputs, chat_turns, margin_floor
from .test_connector import _blocks_per_layer, counter, explicit_prompts, kvstrata_config

HYBRID_BLOCK = 256  # vLLM's hybrid block size for this model (attention page = padded state page)
# vLLM CPU keeps the SSM state in the model dtype unless the CPU has AVX-512 BF16 (then float32),
# which changes the state page and so the hybrid block size (128 or 256): pinned to float32.
PINNED = {"mamba_ssm_cache_dtype": "float32"}


def test_linear_attention_state_is_restored_and_outputs_match(run_vllm: Any, model_root: Path, tmp_path: Path) -> None:
    model = models.make_linear_hybrid(model_root / "qwen3next")
    turns = chat_turns((1500, 1700, 1900), max_tokens=8, seed=11)
    baseline = run_vllm(model, turns, dtype="bfloat16", llm_kwargs=PINNED)
    assert baseline["config"]["dtype"] == "bfloat16"  # vLLM's CPU gated-delta-net kernel needs it
    floor = margin_floor(baseline)
    cfg = kvstrata_config(tmp_path / "nvme")
    a = run_vllm(model, turns[:-1], kv_transfer_config=cfg, dtype="bfloat16", llm_kwargs=PINNED)
    assert a["config"]["block_size"] == HYBRID_BLOCK, a["config"]
    assert_comparable(baseline, a)
    # bf16 leaves some greedy steps of a random-weight model near-tied; compare up to the first one
    pairs = zip(a["turns"], baseline["turns"][:-1], strict=True)
    compared = [assert_same_decisive_outputs(ta, tb, floor) for ta, tb in pairs]
    log = Path(a["log_path"]).read_text()
    assert f"('linear', {HYBRID_BLOCK}, 2, None)" in log and "unsupported=[]" in log  # the Mamba group is mapped
    assert "Turning off hybrid kv cache manager" not in log

    last = explicit_prompts(turns, baseline)[-1]
    b = run_vllm(model, [last], kv_transfer_config=cfg, dtype="bfloat16", llm_kwargs=PINNED)
    assert_comparable(baseline, b)
    compared.append(assert_same_decisive_outputs(b["turns"][0], baseline["turns"][-1], floor))
    # the restored turn, and the session as a whole, are compared over enough decided tokens
    assert compared[-1] >= 4 and sum(compared) >= 8, (compared, [t["margins"] for t in baseline["turns"]])
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
