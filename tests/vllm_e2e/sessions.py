"""The prompts several end-to-end test modules share, and ONE recompute baseline run per model.

A vLLM run costs about a minute on 2 cores, almost all of it start-up and shutdown; a turn of a
tiny model costs a fraction of a second. So the no-connector baselines of the test modules run
as parts of one run per model (:func:`concat` joins the parts' turns, :func:`part` cuts a part's
result back out), instead of one fresh process each.

That is the same recompute as a run of its own: every part begins with its own random ids (no
prefix-cache block is shared between parts), each turn is its own ``generate`` call (no batch is
shared), and the run has the compute settings the tests compare (pinned threads, dtype,
``assert_comparable``). Each part is then checked decisive (``assert_decisive``: every greedy
step leads by at least the dtype's margin floor), so a difference of rounding between a
turn at the start of a process and one later in it could not change a compared token.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from .runner import Turn, chat_turns

MAX_TOKENS = 8  # every shared part generates 8 tokens per turn (runner default)
BLOCK = 128  # vLLM's default block size on CPU
BASELINE_SESSION = (600, 900, 1200)
CONNECTOR_LENGTHS = (1500, 1700, 1900)  # agentic: each turn adds little to a long context
SLIDING_LENGTHS = (1200, 1600, 2000)


def baseline_turns() -> list[Turn]:
    """test_baseline's turns: a 3-turn session, then turn 0's prompt again three times with cache
    salts: "a" (no local hit: turn 0 was unsalted), "b" (no hit) and "a" again (hit)."""
    session = chat_turns(BASELINE_SESSION, max_tokens=MAX_TOKENS, vocab=1024, seed=7)
    first = list(session[0])  # type: ignore[arg-type]
    return [
        *session,
        {"ids": first, "cache_salt": "a"},
        {"ids": first, "cache_salt": "b"},
        {"ids": first, "cache_salt": "a"},
    ]


#: test_baseline's turns.
BASELINE_TURNS = baseline_turns()
#: test_connector's llama session (also the prompt of the DRAM re-send test, its turn 0).
CONNECTOR_SESSION = chat_turns(CONNECTOR_LENGTHS, max_tokens=MAX_TOKENS, seed=11)
#: test_connector's sliding-window session (its restore points fall after the window).
SLIDING_SESSION = chat_turns(SLIDING_LENGTHS, max_tokens=MAX_TOKENS, seed=5)


def random_ids(seed: int, n: int, low: int = 3, vocab: int = 1024) -> list[int]:
    """``n`` ids in ``[low, vocab)`` from ``random.Random(seed)``."""
    rng = random.Random(seed)
    return [rng.randrange(low, vocab) for _ in range(n)]


#: test_weights' prompt: 7 full blocks and 40 tokens.
WEIGHTS_PROMPT = random_ids(21, 7 * BLOCK + 40)
#: test_lookup_socket's prompt: 9 full blocks and 30 tokens.
LOOKUP_PROMPT = random_ids(5, 9 * BLOCK + 30)

#: ``dram_only_run``'s parts (conftest.py): the lookup-socket test's prompt sent twice, then the
#: DRAM re-send test's (test_connector's session, turn 0) sent twice.
DRAM_ONLY_SPANS = {"lookup": (0, 2), "resend": (2, 4)}

#: The parts of the one llama recompute run, in order.
LLAMA_PARTS: dict[str, list[Turn]] = {
    "baseline": BASELINE_TURNS,
    "connector": CONNECTOR_SESSION,
    "weights": [WEIGHTS_PROMPT],
}
#: The parts of the one sliding-window recompute run, in order.
SLIDING_PARTS: dict[str, list[Turn]] = {
    "baseline": BASELINE_TURNS,
    "sliding": SLIDING_SESSION,
}


def _shift(spec: Any, offset: int) -> Any:
    """One prompt spec with its ``continue`` reference moved ``offset`` turns on."""
    if not isinstance(spec, Mapping) or "continue" not in spec:
        return spec
    ref = spec["continue"]
    moved = ref + offset if isinstance(ref, int) else [int(ref[0]) + offset, int(ref[1])]
    return {**spec, "continue": moved}


def concat(parts: Mapping[str, Sequence[Turn]]) -> tuple[list[Turn], dict[str, tuple[int, int]]]:
    """All parts' turns in one list (``continue`` references moved with their part), and each
    part's ``(start, stop)`` in it."""
    turns: list[Turn] = []
    spans: dict[str, tuple[int, int]] = {}
    for name, own in parts.items():
        start = len(turns)
        for turn in own:
            if isinstance(turn, Mapping) and "prompts" in turn:
                turns.append({**turn, "prompts": [_shift(s, start) for s in turn["prompts"]]})
            else:
                turns.append(_shift(turn, start))
        spans[name] = (start, len(turns))
    return turns, spans


def part(result: Mapping[str, Any], span: tuple[int, int]) -> dict[str, Any]:
    """The result of one part, as if its turns had been a run of their own: its turns
    (re-indexed from 0) with the run's settings, threads and log. The run's whole-run counters
    (``metrics``, ``histograms``) are left out: they count the other parts too."""
    start, stop = span
    out = {k: v for k, v in result.items() if k not in ("turns", "metrics", "histograms")}
    out["turns"] = [{**t, "index": i} for i, t in enumerate(result["turns"][start:stop])]
    out["part_of_run"] = {"start": start, "stop": stop, "turns": len(result["turns"])}
    return out


def kvstrata_config(nvme: Path, **extra: Any) -> dict[str, Any]:
    """``kv_transfer_config`` for KVStrataConnector with a DRAM tier over an NVMe tier at
    ``nvme`` (buffered I/O), recompute on a failed load; ``extra`` goes to the connector."""
    tiers = [
        {"name": "dram", "capacity": "256MiB"},
        {"name": "nvme", "capacity": "1GiB", "path": str(nvme), "direct_io": "off"},
    ]
    return {
        "kv_connector": "KVStrataConnector",
        "kv_connector_module_path": "kvstrata.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"config": {"tiers": tiers}, **extra},
    }


def counter(run: Mapping[str, Any], name: str, turn: int | None = None) -> float:
    """Counter ``name`` (all its labels summed): its change in ``turn``, or the run's total."""
    metrics = run["turns"][turn]["metrics_delta"] if turn is not None else run["metrics"]
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


@dataclass(frozen=True)
class Recompute:
    """One no-connector run of several parts (:func:`concat`): ``run`` the whole result,
    ``turns`` what it ran, ``spans`` each part's turns in it; ``parts`` each part's result as if
    it had been a run of its own (:func:`part`)."""

    run: dict[str, Any]
    turns: list[Turn]
    spans: dict[str, tuple[int, int]]
    parts: dict[str, dict[str, Any]] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "parts", {name: part(self.run, span) for name, span in self.spans.items()})


@contextlib.contextmanager
def clean_child_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """For a run made by a fixture wider than one test: the environment tests/conftest.py's
    autouse ``_no_kvstrata_env`` gives every test (no ``KVSTRATA*`` variables, a private
    ``XDG_CACHE_HOME``), which such a fixture is set up before."""
    mp = pytest.MonkeyPatch()
    try:
        for var in list(os.environ):
            if var.startswith("KVSTRATA"):
                mp.delenv(var)
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
        yield
    finally:
        mp.undo()
