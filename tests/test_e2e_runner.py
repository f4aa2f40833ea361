"""The vLLM end-to-end runner's comparison guards, without vLLM: runs with other compute
settings are refused by name, and near-tied greedy steps are never taken as evidence."""

from __future__ import annotations

import os
from typing import Any

import pytest
from vllm_e2e import runner


def run(
    threads: int = 1, bind: str = "0", dtype: str = "float32", margins: list[float] | None = None
) -> dict[str, Any]:
    req = {"output_ids": [5, 6, 7], "margins": margins if margins is not None else [0.5, 0.2, 0.3]}
    return {
        "threads": {"workers": [{"torch_threads": threads}], "bind": bind},
        "config": {"dtype": dtype, "mamba_ssm_cache_dtype": "auto"},
        "turns": [{"index": 0, "requests": [req], **req}],
        "log_path": "/nowhere/vllm.log",
    }


def test_same_settings_are_comparable() -> None:
    runner.assert_comparable(run(), run(), run())


@pytest.mark.parametrize(
    ("other", "words"),
    [
        (run(threads=2, bind="0-1"), r"threads=\[1\] bind='0'.*\n.*threads=\[2\] bind='0-1'"),
        (run(dtype="bfloat16"), "bfloat16"),
    ],
)
def test_other_compute_settings_are_named(other: dict[str, Any], words: str) -> None:
    with pytest.raises(AssertionError, match=words):
        runner.assert_comparable(run(), other)


def test_a_run_without_a_thread_record_is_refused() -> None:
    bad = run()
    bad["threads"] = {"bind": "0"}
    with pytest.raises(AssertionError, match="no worker thread count"):
        runner.assert_comparable(run(), bad)


def test_near_ties_are_not_decisive() -> None:
    runner.assert_decisive(run(margins=[0.5, 0.01, 0.002]))  # float32 floor: 1e-3
    with pytest.raises(AssertionError, match=r"step\(s\) \[\(1, 0.0005\)\]"):
        runner.assert_decisive(run(margins=[0.5, 0.0005, 0.3]))
    with pytest.raises(AssertionError, match=r"lead by less than 0\.1"):
        runner.assert_decisive(run(dtype="bfloat16", margins=[0.5, 0.0625, 0.3]))


def test_outputs_are_compared_up_to_the_first_near_tie() -> None:
    want = run(dtype="bfloat16", margins=[0.5, 0.3, 0.05])["turns"][0]
    got = {"output_ids": [5, 6, 9]}  # differs only after the near-tie
    assert runner.assert_same_decisive_outputs(got, want, 0.1) == 2
    with pytest.raises(AssertionError, match="within the first 2 decisive steps"):
        runner.assert_same_decisive_outputs({"output_ids": [5, 8, 7]}, want, 0.1)


def test_default_binding_uses_cpus_this_process_may_run_on() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    assert runner.default_threads_bind() == str(cpus[0])
    with pytest.raises(ValueError, match=f"threads={len(cpus) + 1}"):
        runner.default_threads_bind(len(cpus) + 1)
