from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from shared_files import MOONCAKE_CONVERSATION, MOONCAKE_SYNTHETIC

from kvstrata.core.keys import BlockHasher, Namespace
from kvstrata.errors import ConfigError, TraceFormatError
from kvstrata.workload.traces import (
    VOCAB_SIZE,
    Request,
    Span,
    Trace,
    agentic_header,
    iter_trace,
    read_trace,
    scale_trace,
    span_tokens,
    synth_agentic,
    write_jsonl,
)

CONVERSATION = MOONCAKE_CONVERSATION
SYNTHETIC = MOONCAKE_SYNTHETIC
needs_traces = pytest.mark.needs_shared(CONVERSATION, SYNTHETIC)


def hasher(block_size: int = 16) -> BlockHasher:
    return BlockHasher(Namespace("tiny", "bfloat16", "0" * 16, block_size))


@pytest.fixture(scope="module")
def agentic() -> list[Request]:
    return synth_agentic()


def by_turn(reqs: list[Request]) -> dict[tuple[str, int], Request]:
    out = {}
    for r in reqs:
        assert r.session is not None and r.turn is not None
        out[(r.session, r.turn)] = r
    return out


# ---- spans ------------------------------------------------------------------------------------


def test_span_tokens_are_deterministic_prefix_consistent_and_in_range() -> None:
    a = span_tokens("x", 1000)
    assert a.dtype == np.uint32 and len(a) == 1000
    assert int(a.max()) < VOCAB_SIZE
    assert np.array_equal(a, span_tokens("x", 1000))
    assert np.array_equal(span_tokens("x", 300), a[:300])
    assert np.array_equal(span_tokens("x", 5000)[:1000], a)
    assert not np.array_equal(span_tokens("y", 1000), a)
    assert len(span_tokens("x", 0)) == 0
    assert np.array_equal(Span("x", 7).tokens(), a[:7])
    assert len(np.unique(span_tokens("z", 20000))) > 10000  # not degenerate


# ---- synthetic agentic workload ---------------------------------------------------------------


def test_synth_defaults_match_the_study(agentic: list[Request]) -> None:
    assert len(agentic) == 8 * 30
    turns = by_turn(agentic)
    assert len(turns) == 240
    for (_, t), r in turns.items():
        assert r.input_length == 20000 + 10000 + t * (900 + 2048)
        assert len(r.prompt_tokens()) == r.input_length
        assert r.output_length == 900 and len(r.output_tokens()) == 900
    assert turns[("s0", 29)].input_length == 30000 + 29 * 2948


def test_synth_sorted_and_indexed(agentic: list[Request]) -> None:
    ts = [r.timestamp_ms for r in agentic]
    assert ts == sorted(ts)
    assert [r.index for r in agentic] == list(range(len(agentic)))
    sessions_in_first_8 = {r.session for r in agentic[:8]}
    assert len(sessions_in_first_8) > 1  # interleaved across sessions
    turns = by_turn(agentic)
    for s in range(8):
        times = [turns[(f"s{s}", t)].timestamp_ms for t in range(30)]
        assert times == sorted(times)
        gaps = np.diff(times)
        assert gaps.min() >= 30000 * 0.9 - 1e-6 and gaps.max() <= 30000 * 1.1 + 1e-6


def test_shared_prefix_equal_across_sessions(agentic: list[Request]) -> None:
    turns = by_turn(agentic)
    p0 = turns[("s0", 0)].prompt_tokens()
    p1 = turns[("s1", 0)].prompt_tokens()
    p5 = turns[("s5", 3)].prompt_tokens()
    assert np.array_equal(p0[:20000], p1[:20000])
    assert np.array_equal(p0[:20000], p5[:20000])
    assert not np.array_equal(p0[20000:30000], p1[20000:30000])


def test_turn_prompt_extends_previous_prompt_and_output(agentic: list[Request]) -> None:
    turns = by_turn(agentic)
    for s in ("s0", "s3"):
        for t in range(1, 30, 7):
            prev, cur = turns[(s, t - 1)], turns[(s, t)]
            history = np.concatenate([prev.prompt_tokens(), prev.output_tokens()])
            cur_tokens = cur.prompt_tokens()
            assert np.array_equal(cur_tokens[: len(history)], history)
            assert len(cur_tokens) == len(history) + 2048


@pytest.mark.parametrize("block_size", [16, 256])
def test_keys_chain_across_turns(agentic: list[Request], block_size: int) -> None:
    h = hasher(block_size)
    turns = by_turn(agentic)
    k0 = turns[("s2", 0)].keys(h)
    k1 = turns[("s2", 1)].keys(h)
    k0_out = turns[("s2", 0)].keys(h, include_output=True)
    assert len(k0) == 30000 // block_size
    assert len(k0_out) == 30900 // block_size
    assert k1[: len(k0)] == k0
    assert k1[: len(k0_out)] == k0_out
    # the shared system prompt gives shared keys across sessions
    other = turns[("s6", 4)].keys(h)
    n_shared = 20000 // block_size
    assert other[:n_shared] == k0[:n_shared]
    assert other[n_shared] != k0[n_shared]
    # keys are the token keys
    assert k0 == h.keys_for_tokens(turns[("s2", 0)].prompt_tokens())


def test_synth_deterministic_per_seed() -> None:
    a = synth_agentic(sessions=3, turns=4, seed=7)
    b = synth_agentic(sessions=3, turns=4, seed=7)
    c = synth_agentic(sessions=3, turns=4, seed=8)
    assert a == b
    assert [r.timestamp_ms for r in a] != [r.timestamp_ms for r in c]
    assert not np.array_equal(a[0].prompt_tokens(), c[0].prompt_tokens())
    h = hasher()
    assert a[-1].keys(h) == b[-1].keys(h)


def test_synth_parameters() -> None:
    reqs = synth_agentic(
        sessions=2, turns=3, shared_tokens=0, first_turn_tokens=100, turn_tokens=50, output_tokens=10, jitter=0.0
    )
    assert len(reqs) == 6
    assert sorted(r.input_length for r in reqs) == [100, 100, 160, 160, 220, 220]
    assert [r.timestamp_ms for r in reqs] == [0.0, 15000.0, 30000.0, 45000.0, 60000.0, 75000.0]
    with pytest.raises(ConfigError):
        synth_agentic(sessions=-1)
    with pytest.raises(ConfigError):
        synth_agentic(jitter=1.5)


# ---- JSONL round trip --------------------------------------------------------------------------


def test_write_read_round_trip(tmp_path: Path) -> None:
    reqs = synth_agentic(sessions=3, turns=5, seed=3)
    path = tmp_path / "agentic.jsonl"
    write_jsonl(path, reqs, agentic_header(sessions=3, turns=5, seed=3))
    first = json.loads(path.read_text().splitlines()[0])
    assert first["kvstrata_trace"] == 1 and first["block_size"] is None
    trace = read_trace(path)
    assert isinstance(trace, Trace)
    assert trace.format == "kvstrata" and trace.block_size is None
    assert trace.header["generator"]["seed"] == 3
    assert trace.requests == reqs
    h = hasher()
    assert trace.requests[-1].keys(h, include_output=True) == reqs[-1].keys(h, include_output=True)
    # the documented line format
    line = json.loads(path.read_text().splitlines()[1])
    assert set(line) >= {"timestamp", "session", "turn", "input_length", "output_length", "spans", "output_span"}
    assert line["spans"][0] == ["3/sys", 20000]


def test_read_without_header(tmp_path: Path) -> None:
    reqs = synth_agentic(sessions=1, turns=2)
    path = tmp_path / "plain.jsonl"
    path.write_text("".join(json.dumps(r.to_json()) + "\n\n" for r in reqs))
    trace = read_trace(path)
    assert trace.requests == reqs and trace.format == "kvstrata"
    assert list(iter_trace(path)) == reqs


def test_limit_and_scale(tmp_path: Path) -> None:
    reqs = synth_agentic(sessions=2, turns=3)
    path = tmp_path / "t.jsonl"
    write_jsonl(path, reqs)
    assert read_trace(path, limit=4).requests == reqs[:4]
    assert read_trace(path, limit=0).requests == []
    assert list(iter_trace(path, limit=2)) == reqs[:2]
    trace = read_trace(path)
    fast = scale_trace(trace, time_scale=0.5, limit=5)
    assert len(fast) == 5
    assert [r.timestamp_ms for r in fast] == [r.timestamp_ms * 0.5 for r in reqs[:5]]
    assert [r.timestamp_ms for r in trace] == [r.timestamp_ms for r in reqs]  # original untouched
    assert trace.limit(3).requests == reqs[:3]
    assert trace.time_scaled(2.0)[1].timestamp_ms == reqs[1].timestamp_ms * 2
    with pytest.raises(ConfigError):
        scale_trace(trace, time_scale=-1)


# ---- Mooncake traces ---------------------------------------------------------------------------


@needs_traces
@pytest.mark.parametrize(("path", "count"), [(CONVERSATION, 12031), (SYNTHETIC, 3993)])
def test_read_mooncake_traces(path: Path, count: int) -> None:
    trace = read_trace(path)
    assert len(trace) == count
    assert trace.format == "mooncake" and trace.block_size == 512
    r = trace[0]
    assert r.hash_ids is not None and r.spans is None and r.session is None
    assert len(r.hash_ids) == -(-r.input_length // 512)
    assert [q.index for q in trace.requests[:5]] == list(range(5))


@needs_traces
def test_mooncake_keys() -> None:
    trace = read_trace(CONVERSATION, limit=50)
    a, b = trace[0], trace[1]
    assert a.hash_ids is not None and b.hash_ids is not None
    assert a.hash_ids[0] == b.hash_ids[0] and a.hash_ids[1] != b.hash_ids[1]
    # at the trace block size keys come from the hash ids: full blocks only
    h512 = hasher(512)
    ka, kb = a.keys(h512), b.keys(h512)
    assert len(ka) == a.input_length // 512
    assert ka == h512.keys_for_hash_ids(a.hash_ids[: a.input_length // 512])
    assert ka[0] == kb[0] and ka[1] != kb[1]
    ka_out = a.keys(h512, include_output=True)
    assert ka_out[: len(ka)] == ka and len(ka_out) == (a.input_length + a.output_length) // 512
    # at another block size the ids become synthetic tokens; sharing is kept
    h16 = hasher(16)
    ta, tb = a.keys(h16), b.keys(h16)
    assert len(ta) == a.input_length // 16
    assert ta[:32] == tb[:32] and ta[32] != tb[32]
    assert len(a.prompt_tokens()) == a.input_length


@needs_traces
def test_mooncake_round_trip_through_kvstrata_format(tmp_path: Path) -> None:
    trace = read_trace(SYNTHETIC, limit=20)
    path = tmp_path / "mc.jsonl"
    write_jsonl(path, trace.requests)
    back = read_trace(path)
    assert back.format == "kvstrata" and back.block_size == 512
    assert back.requests == trace.requests
    h = hasher(512)
    assert back[3].keys(h) == trace[3].keys(h)


# ---- malformed input ---------------------------------------------------------------------------

GOOD = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}'
GOOD_SPANS = '{"timestamp": 1.5, "session": "a", "input_length": 30, "output_length": 2, "spans": [["x", 30]]}'


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2, 3]", "JSON object"),
        ('{"input_length": 600, "output_length": 5, "hash_ids": [1, 2]}', "timestamp"),
        ('{"timestamp": 0, "output_length": 5, "hash_ids": [1, 2]}', "input_length"),
        ('{"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]}', "output_length"),
        ('{"timestamp": 0, "input_length": -600, "output_length": 5, "hash_ids": [1, 2]}', "input_length"),
        ('{"timestamp": -1, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}', "timestamp"),
        ('{"timestamp": "x", "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}', "timestamp"),
        ('{"timestamp": 0, "input_length": "600", "output_length": 5, "hash_ids": [1, 2]}', "input_length"),
        ('{"timestamp": 0, "input_length": 600, "output_length": true, "hash_ids": [1, 2]}', "output_length"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, "2"]}', "hash_ids"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, -2]}', "hash_ids"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": 7}', "hash_ids"),
        ('{"timestamp": 0, "input_length": 6000, "output_length": 5, "hash_ids": [1, 2]}', "hash_ids"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 5}', "spans"),
        ('{"timestamp": 0, "input_length": 31, "output_length": 2, "spans": [["x", 30]]}', "add up"),
        ('{"timestamp": 0, "input_length": 30, "output_length": 2, "spans": [["x"]]}', "spans"),
        ('{"timestamp": 0, "input_length": 30, "output_length": 2, "spans": [[1, 30]]}', "spans"),
        ('{"timestamp": 0, "input_length": 30, "output_length": 2, "spans": "x"}', "spans"),
        ('{"timestamp": 0, "input_length": 30, "output_length": 2, "spans": [["x", 30]], "output_span": 3}', "output"),
        ('{"timestamp": 0, "session": [], "input_length": 30, "output_length": 2, "spans": [["x", 30]]}', "session"),
    ],
)
@pytest.mark.parametrize("good", [GOOD, GOOD_SPANS])
def test_malformed_line_names_file_and_line(tmp_path: Path, bad: str, match: str, good: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{good}\n{good}\n\n{bad}\n{good}\n")
    with pytest.raises(TraceFormatError, match=match) as info:
        read_trace(path)
    assert str(info.value).startswith(f"{path}:4: ")
    # the error is also raised when the bad line comes first
    path.write_text(f"{bad}\n{good}\n")
    with pytest.raises(TraceFormatError) as info:
        read_trace(path)
    assert str(info.value).startswith(f"{path}:1: ")
    # a limit that stops before the bad line reads fine
    path.write_text(f"{good}\n{bad}\n")
    assert len(read_trace(path, limit=1)) == 1


@pytest.mark.parametrize("content", ["", "\n\n  \n", '{"kvstrata_trace": 1, "block_size": null}\n'])
def test_empty_trace(tmp_path: Path, content: str) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(TraceFormatError, match="empty") as info:
        read_trace(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    "header",
    ['{"kvstrata_trace": 2}', '{"kvstrata_trace": 1, "block_size": 0}', '{"kvstrata_trace": 1, "block_size": "x"}'],
)
def test_bad_header(tmp_path: Path, header: str) -> None:
    path = tmp_path / "h.jsonl"
    path.write_text(f"{header}\n{GOOD_SPANS}\n")
    with pytest.raises(TraceFormatError) as info:
        read_trace(path)
    assert str(info.value).startswith(f"{path}:1: ")


def test_missing_file_and_binary(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="cannot read"):
        read_trace(tmp_path / "nope.jsonl")
    path = tmp_path / "bin.jsonl"
    path.write_bytes(GOOD.encode() + b"\n\xff\xfe\x00garbage\n")
    with pytest.raises(TraceFormatError) as info:
        read_trace(path)
    assert str(info.value).startswith(f"{path}:2: ")


def test_request_needs_one_key_source() -> None:
    with pytest.raises(ConfigError):
        Request(0, 0.0, None, 10, 1)
    with pytest.raises(ConfigError):
        Request(0, 0.0, None, 10, 1, hash_ids=[1], spans=[Span("x", 10)])
