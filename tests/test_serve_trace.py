"""The Mooncake conversation trace as the serve experiment's workload, scaled down (no vLLM here:
the dataset aiperf replays, checked against the trace itself)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from shared_files import MOONCAKE_CONVERSATION, require_shared
from tokenizers import Tokenizer

from kvstrata.cli import main
from kvstrata.workload.fleet_model import train_tokenizer
from kvstrata.workload.serve_trace import TraceSetup, select_conversations, write_trace_dataset
from kvstrata.workload.traces import Request, read_trace


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(out, 1024)
    return out


def test_the_longest_conversations_are_kept_whole_and_in_order() -> None:
    require_shared(MOONCAKE_CONVERSATION)
    reqs = read_trace(MOONCAKE_CONVERSATION).requests
    picked = select_conversations(reqs, 8)

    def conv(r: Request) -> tuple[int, ...]:
        return tuple((r.hash_ids or [])[:2])

    convs = {conv(r) for r in picked}
    assert len(convs) == 8
    assert [r.index for r in picked] == sorted(r.index for r in picked)
    for c in convs:  # every request of a kept conversation is kept
        assert sum(1 for r in reqs if conv(r) == c) == sum(1 for r in picked if conv(r) == c)
    lengths = sorted((sum(1 for r in reqs if conv(r) == c) for c in convs), reverse=True)
    assert lengths[0] == 43 and len(picked) == sum(lengths)  # the trace's longest conversation has 43 requests


def test_equal_hash_ids_become_equal_text_and_the_schedule_is_compressed(tmp_path: Path, tokenizer_dir: Path) -> None:
    require_shared(MOONCAKE_CONVERSATION)
    trace = TraceSetup(str(MOONCAKE_CONVERSATION), conversations=4, block_tokens=16, duration_s=60.0)
    out = tmp_path / "t.jsonl"
    counts = write_trace_dataset(out, trace, max_model_len=2048, output_tokens=16, tokenizer_dir=tokenizer_dir, seed=3)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    picked = select_conversations(read_trace(MOONCAKE_CONVERSATION).requests, 4)
    assert counts["requests"] == len(rows) and counts["requests"] + counts["left_out"] == len(picked)
    assert rows[0]["timestamp"] == 0 and max(r["timestamp"] for r in rows) <= 60_000
    assert all(1 <= r["output_length"] <= 16 for r in rows)
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    kept = [r for r in picked if round(r.input_length * 16 / 512) <= 2048 - 16 - 48]
    assert len(kept) == len(rows)
    # two requests that share their first k hash ids share the text of those k blocks (16 tokens each)
    for a, b in itertools.pairwise(kept):
        k = 0
        for x, y in zip(a.hash_ids or [], b.hash_ids or [], strict=False):
            if x != y:
                break
            k += 1
        ta, tb = (rows[kept.index(r)]["text_input"] for r in (a, b))
        prefix = tok.decode(tok.encode(ta).ids[: (k - 1) * 16]) if k > 1 else ""
        assert tb.startswith(prefix)
    assert 0.5 < counts["ideal_hit_tokens"] / counts["prompt_tokens"] < 1.0
    other = tmp_path / "o.jsonl"
    write_trace_dataset(other, trace, max_model_len=2048, output_tokens=16, tokenizer_dir=tokenizer_dir, seed=4)
    assert json.loads(other.read_text().splitlines()[0])["text_input"] != rows[0]["text_input"]  # rows never share


def test_bad_trace_settings_are_named() -> None:
    with pytest.raises(ValueError, match="600"):
        TraceSetup("x", block_tokens=600)
    with pytest.raises(ValueError, match="0"):
        TraceSetup("x", conversations=0)
    result = CliRunner().invoke(main, ["experiment", "serve", "--trace", __file__, "--routing", "sticky"])
    assert result.exit_code == 2 and "no session to stick to" in result.output


def test_the_sessions_length_check_does_not_apply_to_a_trace() -> None:
    from kvstrata.workload.serve import ServeSetup

    with pytest.raises(ValueError, match="max_model_len 1024"):
        ServeSetup(max_model_len=1024, kv_blocks=9)
    ServeSetup(max_model_len=1024, kv_blocks=9, trace=TraceSetup("t.jsonl"))  # trace lengths are checked per request


def test_the_served_model_size_is_a_setting_checked_before_anything_starts() -> None:
    from kvstrata.workload.serve import ServeSetup

    assert ServeSetup().model_shape() == {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2}
    assert ServeSetup(model_layers=8, model_hidden=1024).model_shape() == {
        "layers": 8,
        "hidden": 1024,
        "heads": 16,
        "kv_heads": 2,
    }
    with pytest.raises(ValueError, match="model_hidden 200"):
        ServeSetup(model_hidden=200)
    result = CliRunner().invoke(main, ["experiment", "serve", "--model-hidden", "320"])
    assert result.exit_code == 2 and "model_hidden 320" in result.output
    result = CliRunner().invoke(main, ["experiment", "serve", "--model-layers", "0"])
    assert result.exit_code == 2 and "--model-layers" in result.output


def test_instances_picks_the_rows_of_a_sweep() -> None:
    from kvstrata.workload.serve import sweep_plan

    both = ("round-robin", "sticky")
    assert sweep_plan([1, 2], both) == [(1, "round-robin"), (2, "round-robin"), (2, "sticky")]
    assert sweep_plan([3], both) == [(3, "round-robin"), (3, "sticky")]  # --instances 3: N = 3 alone
    for bad in ("0", "x", "2,65", ""):
        result = CliRunner().invoke(main, ["experiment", "serve", "--instances", bad])
        assert result.exit_code == 2 and "instance counts from 1 to 64" in result.output, bad
