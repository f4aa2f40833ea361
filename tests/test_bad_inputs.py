"""Every bad input is one clear line and exit status 2, never a traceback.

Each case drives one command of ``kvstrata`` (every command and subcommand of ``kvstrata --help``)
or one section of the config (engine, every tier kind, policies, daemon, the environment
overrides) with one bad value, in-process through the CLI's own ``main`` (click's ``CliRunner``),
and checks: exit status 2, exactly one line on standard error, ``error: ...`` naming the value,
no traceback. A few run as real processes, whose standard error is a pipe: there the line must not
be wrapped at 80 columns either.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from kvstrata.cli import main
from kvstrata.workload.traces import synth_agentic, write_jsonl

DRAM = '[[tiers]]\nname = "dram"\ncapacity = "1MiB"\n'
NVME = '[[tiers]]\nname = "nvme"\npath = "/tmp/kvstrata-never-opened"\n'
FS = '[[tiers]]\nname = "fs"\nurl = "memory://x"\ncapacity = "1GiB"\n'
KEY = "0" * 32
MOONCAKE = '[[tiers]]\nname = "mooncake"\ncapacity = "1GiB"\n'


@dataclass(frozen=True)
class Case:
    """One bad input: the arguments (``{name}`` is a prepared file, see ``files``), the words the
    error line must contain, and the environment it runs with."""

    id: str
    args: tuple[str, ...]
    names: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    stdin: bytes | None = None


def case(id: str, args: str | list[str], *names: str, env: dict[str, str] | None = None) -> Case:
    return Case(id, tuple(args.split() if isinstance(args, str) else args), names, env or {})


# ------------------------------------------------------------------------------------------------ prepared files

TRACES = {  # name -> file content (one bad line after a good one, so the line number is 2)
    "tr_binary": bytes(range(256)) * 8,
    "tr_empty": b"",
    "tr_blank": b"\n\n  \n",
    "tr_truncated": b'{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1, "i',
    "tr_huge_input": b'{"timestamp": 0, "input_length": 1e15, "output_length": 1, "hash_ids": [1]}\n',
    "tr_huge_output": b'{"timestamp": 0, "input_length": 512, "output_length": 1e15, "hash_ids": [1]}\n',
    "tr_hash_2_64": b'{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [18446744073709551616]}\n',
    "tr_hash_negative": b'{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [-3]}\n',
    "tr_hash_float": b'{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1.5]}\n',
    "tr_hash_string": b'{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": "1,2"}\n',
    "tr_deep": b"[" * 100_000 + b"]" * 100_000 + b"\n",
    "tr_bigint": b'{"timestamp": 0, "input_length": ' + b"9" * 5000 + b', "output_length": 1, "hash_ids": [1]}\n',
    "tr_nan_ts": b'{"timestamp": NaN, "input_length": 512, "output_length": 1, "hash_ids": [1]}\n',
    "tr_inf_ts": b'{"timestamp": Infinity, "input_length": 512, "output_length": 1, "hash_ids": [1]}\n',
    "tr_string_ts": b'{"timestamp": "noon", "input_length": 512, "output_length": 1, "hash_ids": [1]}\n',
    "tr_neg_input": b'{"timestamp": 0, "input_length": -512, "output_length": 1, "hash_ids": [1]}\n',
    "tr_no_keys": b'{"timestamp": 0, "input_length": 512, "output_length": 1}\n',
    "tr_array_line": b"[1, 2, 3]\n",
    "tr_garbage_line2": b'{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}\nhello world\n',
    "tr_unicode_line2": '{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}\n«ключ»\n'.encode(),
    "tr_latin1": b'{"timestamp": 0, "session": "caf\xe9", "input_length": 512, "output_length": 1, "hash_ids": [1]}\n',
    "tr_span_huge": b'{"timestamp": 0, "input_length": 1000000000000, "output_length": 1, '
    b'"spans": [["a", 1000000000000]]}\n',
    "tr_span_bad": b'{"timestamp": 0, "input_length": 4, "output_length": 1, "spans": [["a", "four"]]}\n',
    "tr_span_sum": b'{"timestamp": 0, "input_length": 5, "output_length": 1, "spans": [["a", 4]]}\n',
    "tr_header_bs0": b'{"kvstrata_trace": 1, "block_size": 0}\n',
    "tr_header_bs_huge": b'{"kvstrata_trace": 1, "block_size": 1e30}\n',
    "tr_header_version": b'{"kvstrata_trace": 99}\n',
    "tr_turn_huge": b'{"timestamp": 0, "turn": 1e300, "input_length": 512, "output_length": 1, "hash_ids": [1]}\n',
    "tr_too_many_ids": b'{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1, 2, 3, 4]}\n',
}


def toml_files() -> dict[str, str]:
    """Configs, each with one bad value (name -> TOML text)."""
    nvme = '[[tiers]]\nname = "nvme"\npath = "{d}/nvme-ok"\ncapacity = "8MiB"\ndirect_io = "off"\n'
    return {
        "cfg_truncated": '[[tiers]\nname = "dram',
        "cfg_bigint": DRAM + "[engine]\nio_threads = " + "9" * 5000 + "\n",
        "cfg_deep": "a = " + "[" * 50_000 + "]" * 50_000 + "\n",
        "cfg_no_tiers": "[engine]\nio_threads = 2\n",
        "cfg_unknown_section": DRAM + "[turbo]\nboost = true\n",
        "cfg_dram_1000tib": '[[tiers]]\nname = "dram"\ncapacity = "1000TiB"\n',
        "cfg_hbm_1000tib": '[[tiers]]\nname = "hbm"\ncapacity = "1000TiB"\n',
        "cfg_nvme_path_file": '[[tiers]]\nname = "nvme"\npath = "{afile}"\ncapacity = "8MiB"\n',
        "cfg_nvme_path_proc": '[[tiers]]\nname = "nvme"\npath = "/proc/kvstrata-nvme"\ncapacity = "8MiB"\n',
        "cfg_nvme_ok": nvme,
        "cfg_stray": '[[tiers]]\nname = "nvme"\npath = "{d}/nv-stray"\ncapacity = "8MiB"\ndirect_io = "off"\n'
        '[daemon]\nstate_dir = "{d}/state-stray"\n',
        "cfg_corrupt": '[[tiers]]\nname = "nvme"\npath = "{d}/nv-corrupt"\ncapacity = "8MiB"\ndirect_io = "off"\n',
    }


# (id, TOML text, words naming the bad value): validated by `config show`
CONFIG_CASES: list[tuple[str, str, tuple[str, ...]]] = [
    # engine
    ("engine-io-threads-0", DRAM + "[engine]\nio_threads = 0\n", ("io_threads", "0")),
    ("engine-io-threads-neg", DRAM + "[engine]\nio_threads = -4\n", ("io_threads", "-4")),
    ("engine-io-threads-str", DRAM + '[engine]\nio_threads = "four"\n', ("io_threads", "'four'")),
    ("engine-io-threads-huge", DRAM + "[engine]\nio_threads = 100000\n", ("io_threads", "100000")),
    ("engine-io-threads-inf", DRAM + "[engine]\nio_threads = inf\n", ("io_threads", "inf")),
    ("engine-io-threads-bool", DRAM + "[engine]\nio_threads = true\n", ("io_threads", "True")),
    ("engine-pending-stores-0", DRAM + "[engine]\nmax_pending_stores = 0\n", ("max_pending_stores", "0")),
    ("engine-pending-bytes-inf", DRAM + "[engine]\nmax_pending_bytes = inf\n", ("max_pending_bytes", "inf")),
    ("engine-pending-bytes-neg", DRAM + '[engine]\nmax_pending_bytes = "-1GiB"\n', ("max_pending_bytes", "-1GiB")),
    ("engine-pending-bytes-word", DRAM + '[engine]\nmax_pending_bytes = "lots"\n', ("max_pending_bytes", "lots")),
    ("engine-wait-nan", DRAM + "[engine]\nstore_wait_s = nan\n", ("store_wait_s", "nan")),
    ("engine-wait-inf", DRAM + "[engine]\nstore_wait_s = inf\n", ("store_wait_s", "inf")),
    ("engine-wait-neg", DRAM + "[engine]\nstore_wait_s = -1.0\n", ("store_wait_s", "-1.0")),
    ("engine-bg-bytes-1e35", DRAM + "[engine]\nmax_background_bytes = 1e35\n", ("max_background_bytes", "1e+35")),
    ("engine-bg-bytes-unit", DRAM + '[engine]\nmax_background_bytes = "3 pc"\n', ("max_background_bytes", "3 pc")),
    ("engine-unknown-field", DRAM + "[engine]\nturbo = true\n", ("engine.turbo",)),
    # tiers: common fields, each kind
    ("dram-capacity-inf", '[[tiers]]\nname = "dram"\ncapacity = inf\n', ("capacity", "inf")),
    ("dram-capacity-nan", '[[tiers]]\nname = "dram"\ncapacity = nan\n', ("capacity", "nan")),
    ("dram-capacity-neg", '[[tiers]]\nname = "dram"\ncapacity = -1\n', ("capacity", "-1")),
    ("dram-capacity-neg-str", '[[tiers]]\nname = "dram"\ncapacity = "-4GiB"\n', ("capacity", "-4GiB")),
    ("dram-capacity-400-digits", f'[[tiers]]\nname = "dram"\ncapacity = "{"9" * 400}"\n', ("capacity", "99999999")),
    ("dram-capacity-1e35", '[[tiers]]\nname = "dram"\ncapacity = 1e35\n', ("capacity", "1e+35")),
    ("dram-capacity-eib", '[[tiers]]\nname = "dram"\ncapacity = "2000PiB"\n', ("capacity", "2000PiB")),
    ("dram-capacity-bool", '[[tiers]]\nname = "dram"\ncapacity = true\n', ("capacity", "True")),
    ("dram-capacity-list", '[[tiers]]\nname = "dram"\ncapacity = [1]\n', ("capacity", "[1]")),
    ("dram-capacity-unicode", '[[tiers]]\nname = "dram"\ncapacity = "16 ГиБ"\n', ("capacity", "ГиБ")),
    ("dram-eviction", '[[tiers]]\nname = "dram"\ncapacity = "1MiB"\neviction = "fifo-ish"\n', ("fifo-ish",)),
    ("dram-admission", '[[tiers]]\nname = "dram"\ncapacity = "1MiB"\nadmission = "vip"\n', ("vip",)),
    ("dram-write", '[[tiers]]\nname = "dram"\ncapacity = "1MiB"\nwrite = "write-around"\n', ("write-around",)),
    ("dram-promote", '[[tiers]]\nname = "dram"\ncapacity = "1MiB"\npromote = "maybe"\n', ("promote", "maybe")),
    (
        "dram-read-latency",
        '[[tiers]]\nname = "dram"\ncapacity = "1MiB"\nread_latency_s = -0.5\n',
        ("read_latency_s", "-0.5"),
    ),
    (
        "dram-write-latency",
        '[[tiers]]\nname = "dram"\ncapacity = "1MiB"\nwrite_latency_s = "slow"\n',
        ("write_latency_s", "slow"),
    ),
    ("dram-pin", '[[tiers]]\nname = "dram"\ncapacity = "1MiB"\npin_memory = "always"\n', ("pin_memory", "always")),
    ("dram-prefault", '[[tiers]]\nname = "dram"\ncapacity = "1MiB"\nprefault = 7\n', ("prefault", "7")),
    ("dram-unknown-option", '[[tiers]]\nname = "dram"\ncapacity = "1MiB"\ncolour = "red"\n', ("colour",)),
    ("tier-empty-name", '[[tiers]]\nname = ""\nkind = "dram"\n', ("name", "''")),
    ("tier-unknown-kind", '[[tiers]]\nname = "tape"\ncapacity = "1TiB"\n', ("tape",)),
    ("tier-unicode-kind", '[[tiers]]\nname = "dräm"\n', ("dräm",)),
    ("tier-duplicate", DRAM + DRAM, ("duplicate", "dram")),
    ("hbm-capacity-inf", '[[tiers]]\nname = "hbm"\ncapacity = inf\n', ("capacity", "inf")),
    ("hbm-pin", '[[tiers]]\nname = "hbm"\ncapacity = "1MiB"\npin_memory = 3\n', ("pin_memory", "3")),
    ("nvme-no-path", '[[tiers]]\nname = "nvme"\ncapacity = "8MiB"\n', ("path",)),
    ("nvme-direct-io", NVME + 'direct_io = "sometimes"\n', ("sometimes",)),
    ("nvme-segment-size", NVME + 'segment_size = "-1MiB"\n', ("-1MiB",)),
    ("nvme-map-size", NVME + 'lmdb_map_size = "1KiB"\n', ("lmdb_map_size",)),
    ("nvme-compact-nan", NVME + "compact_threshold = nan\n", ("nan",)),
    ("nvme-capacity-huge", NVME + 'capacity = "5000PB"\n', ("5000PB",)),
    ("fs-no-url", '[[tiers]]\nname = "fs"\ncapacity = "1GiB"\n', ("url",)),
    ("fs-timeout-inf", FS + "timeout_s = inf\n", ("timeout_s", "inf")),
    ("fs-retries", FS + "retries = 1000\n", ("retries", "1000")),
    ("mooncake-master", MOONCAKE + 'master_address = "nowhere"\n', ("nowhere",)),
    ("mooncake-protocol", MOONCAKE + 'protocol = "carrier-pigeon"\n', ("carrier-pigeon",)),
    ("mooncake-prefix", MOONCAKE + 'prefix = "a/b c"\n', ("prefix", "a/b c")),
    # policies
    ("policies-layer-policy", DRAM + '[policies]\nlayer_policy = "sometimes"\n', ("layer_policy", "sometimes")),
    ("policies-checkpoint-every", DRAM + "[policies]\ncheckpoint_every = -2\n", ("checkpoint_every", "-2")),
    ("policies-budget-0", DRAM + "[policies]\ncheckpoint_budget = 0\n", ("checkpoint_budget", "0")),
    ("policies-budget-nan", DRAM + "[policies]\ncheckpoint_budget = nan\n", ("checkpoint_budget", "nan")),
    ("policies-rule-match", DRAM + '[[policies.layers]]\nmatch = "wormhole"\n', ("wormhole",)),
    ("policies-rule-tiers-empty", DRAM + '[[policies.layers]]\nmatch = "full"\ntiers = []\n', ("empty tier list",)),
    ("policies-rule-tier-unknown", DRAM + '[[policies.layers]]\nmatch = "full"\ntiers = ["tape"]\n', ("tape",)),
    ("policies-rule-retention", DRAM + '[[policies.layers]]\nmatch = "full"\nretention = "some"\n', ("some",)),
    ("policies-rule-priority", DRAM + '[[policies.layers]]\nmatch = "full"\npriority = "high"\n', ("priority", "high")),
    # daemon
    ("daemon-high-1.5", DRAM + "[daemon]\nhigh_watermark = 1.5\n", ("high_watermark", "1.5")),
    ("daemon-high-nan", DRAM + "[daemon]\nhigh_watermark = nan\n", ("high_watermark", "nan")),
    ("daemon-low-above-high", DRAM + "[daemon]\nhigh_watermark = 0.5\nlow_watermark = 0.6\n", ("0.6", "0.5")),
    ("daemon-watermarks-tier", DRAM + "[daemon.watermarks.tape]\nhigh = 0.9\n", ("tape",)),
    ("daemon-interval-0", DRAM + "[daemon]\ninterval_s = 0\n", ("interval_s", "0")),
    ("daemon-interval-inf", DRAM + "[daemon]\ninterval_s = inf\n", ("interval_s", "inf")),
    ("daemon-move-batch", DRAM + '[daemon]\nmove_batch = "9999EB"\n', ("move_batch", "9999EB")),
    ("daemon-port", DRAM + "[daemon]\nmetrics_port = 70000\n", ("metrics_port", "70000")),
    ("daemon-host-empty", DRAM + '[daemon]\nmetrics_host = ""\n', ("metrics_host", "''")),
    ("daemon-startup-check", DRAM + '[daemon]\nstartup_check = "sometimes"\n', ("startup_check", "sometimes")),
    ("daemon-log-level", DRAM + '[daemon]\nlog_level = "verbose"\n', ("log_level", "verbose")),
    ("daemon-hint-ttl-inf", DRAM + "[daemon]\nhint_ttl_s = inf\n", ("hint_ttl_s", "inf")),
    ("daemon-unknown", DRAM + "[daemon]\nturbo = 1\n", ("daemon.turbo",)),
    # the file itself
    ("file-truncated", "{cfg_truncated}", ("malformed TOML",)),
    ("file-bigint", "{cfg_bigint}", ("malformed TOML", "4300")),
    ("file-deep", "{cfg_deep}", ("nested too deeply",)),
    ("file-no-tiers", "{cfg_no_tiers}", ("tiers",)),
    ("file-unknown-section", "{cfg_unknown_section}", ("turbo",)),
]


def cli_cases() -> list[Case]:
    synth = "trace synth --out {d}/ok.jsonl --sessions 1 --turns 1"
    replay = "replay --trace {good_trace}"
    plan = "plan --trace {good_trace} --tiers dram=1GiB"
    return [
        # the group
        case("main-no-such-command", "sync", "sync"),
        case("main-no-such-option", "--turbo", "--turbo"),
        case("main-extra-argument", "models please", "please"),
        # trace synth
        case("synth-out-missing-dir", "trace synth --out {d}/no/such/dir/t.jsonl", "{d}/no/such/dir"),
        case("synth-out-under-file", "trace synth --out {afile}/t.jsonl", "{afile}", "not a directory"),
        case("synth-out-is-dir", "trace synth --out {d}", "{d}"),
        case("synth-out-proc", "trace synth --out /proc/kvstrata.jsonl", "/proc/kvstrata.jsonl"),
        case("synth-sessions-0", f"{synth} --sessions 0", "--sessions", "0"),
        case("synth-sessions-word", f"{synth} --sessions many", "--sessions", "many"),
        case("synth-sessions-huge", f"{synth} --sessions 1000000000", "1,000,000,000"),
        case("synth-turns-neg", f"{synth} --turns -3", "--turns", "-3"),
        case("synth-tokens-huge", f"{synth} --shared-tokens 100000000000", "shared_tokens 100000000000"),
        case("synth-gap-nan", f"{synth} --turn-gap-ms nan", "--turn-gap-ms", "nan"),
        case("synth-gap-inf", f"{synth} --turn-gap-ms inf", "--turn-gap-ms", "inf"),
        case("synth-seed-neg", f"{synth} --seed -1", "--seed", "-1"),
        case("synth-seed-float", f"{synth} --seed 1.5", "--seed", "1.5"),
        # replay: the trace
        case("replay-trace-missing", "replay --trace {d}/missing.jsonl", "{d}/missing.jsonl"),
        case("replay-trace-dir", "replay --trace {d}", "{d}"),
        case("replay-trace-proc-dir", "replay --trace /proc/self", "/proc/self"),
        case("replay-trace-binary", "replay --trace {tr_binary}", "{tr_binary}:1"),
        case("replay-trace-empty", "replay --trace {tr_empty}", "{tr_empty}", "empty"),
        case("replay-trace-blank", "replay --trace {tr_blank}", "{tr_blank}", "empty"),
        case("replay-trace-truncated", "replay --trace {tr_truncated}", "{tr_truncated}:2"),
        case("replay-trace-input-1e15", "replay --trace {tr_huge_input}", ":1", "input_length", "1000000000000000"),
        case("replay-trace-output-1e15", "replay --trace {tr_huge_output}", ":1", "output_length", "1000000000000000"),
        case("replay-trace-hash-2-64", "replay --trace {tr_hash_2_64}", ":1", "18446744073709551616"),
        case("replay-trace-hash-neg", "replay --trace {tr_hash_negative}", ":1", "-3"),
        case("replay-trace-hash-float", "replay --trace {tr_hash_float}", ":1", "1.5"),
        case("replay-trace-hash-string", "replay --trace {tr_hash_string}", ":1", "hash_ids"),
        case("replay-trace-deep", "replay --trace {tr_deep}", ":1", "nested too deeply"),
        case("replay-trace-bigint", "replay --trace {tr_bigint}", ":1", "4300"),
        case("replay-trace-nan-ts", "replay --trace {tr_nan_ts}", ":1", "nan"),
        case("replay-trace-inf-ts", "replay --trace {tr_inf_ts}", ":1", "inf"),
        case("replay-trace-string-ts", "replay --trace {tr_string_ts}", ":1", "'noon'"),
        case("replay-trace-neg-input", "replay --trace {tr_neg_input}", ":1", "-512"),
        case("replay-trace-no-keys", "replay --trace {tr_no_keys}", ":1", "hash_ids"),
        case("replay-trace-array", "replay --trace {tr_array_line}", ":1", "list"),
        case("replay-trace-garbage", "replay --trace {tr_garbage_line2}", ":2", "not valid JSON"),
        case("replay-trace-unicode", "replay --trace {tr_unicode_line2}", ":2", "not valid JSON"),
        case("replay-trace-latin1", "replay --trace {tr_latin1}", ":1", "not valid JSON"),
        case("replay-trace-span-huge", "replay --trace {tr_span_huge}", ":1", "1000000000000"),
        case("replay-trace-span-type", "replay --trace {tr_span_bad}", ":1", "'four'"),
        case("replay-trace-span-sum", "replay --trace {tr_span_sum}", ":1", "add up to 4"),
        case("replay-trace-header-bs0", "replay --trace {tr_header_bs0}", ":1", "block_size", "0"),
        case("replay-trace-header-bs-huge", "replay --trace {tr_header_bs_huge}", ":1", "1e+30"),
        case("replay-trace-header-version", "replay --trace {tr_header_version}", ":1", "99"),
        case("replay-trace-turn-huge", "replay --trace {tr_turn_huge}", ":1", "turn"),
        case("replay-trace-too-many-ids", "replay --trace {tr_too_many_ids}", ":1", "4 hash_ids"),
        # replay: the other options
        case("replay-config-missing", f"{replay} --config {{d}}/nope.toml", "{d}/nope.toml"),
        case("replay-config-dir", f"{replay} --config {{d}}", "{d}"),
        case("replay-config-binary", f"{replay} --config {{tr_binary}}", "{tr_binary}"),
        case("replay-config-unicode-path", f"{replay} --config {{d}}/конфиг.toml", "конфиг.toml"),
        case("replay-dram-1000tib", f"{replay} --config {{cfg_dram_1000tib}}", "'dram'", "1000.0 TiB", "available"),
        case("replay-hbm-1000tib", f"{replay} --config {{cfg_hbm_1000tib}}", "'hbm'", "1000.0 TiB", "available"),
        case("replay-nvme-path-file", f"{replay} --config {{cfg_nvme_path_file}}", "{afile}"),
        case("replay-nvme-path-proc", f"{replay} --config {{cfg_nvme_path_proc}}", "/proc/kvstrata-nvme"),
        case("replay-corrupt-lmdb", f"{replay} --config {{cfg_corrupt}}", "index.lmdb", "{d}/nv-corrupt"),
        case("replay-model", f"{replay} --model llama-9000", "llama-9000"),
        case("replay-model-json", f"{replay} --model {{tr_truncated}}", "{tr_truncated}"),
        case("replay-hbm-inf", f"{replay} --hbm-capacity inf", "--hbm-capacity", "'inf'"),
        case("replay-hbm-neg", f"{replay} --hbm-capacity -8MiB", "--hbm-capacity", "-8MiB"),
        case("replay-hbm-400-digits", [*replay.split(), "--hbm-capacity", "9" * 400], "--hbm-capacity", "99999999"),
        case("replay-hbm-opt-1000tib", f"{replay} --hbm-capacity 1000TiB", "'hbm'", "1000.0 TiB"),
        case("replay-limit-neg", f"{replay} --limit -1", "--limit", "-1"),
        case("replay-json-under-file", f"{replay} --json {{afile}}/r.json", "{afile}"),
        case("replay-json-missing-dir", f"{replay} --json {{d}}/nowhere/r.json", "{d}/nowhere"),
        case("replay-json-proc", f"{replay} --json /proc/r.json", "/proc/r.json"),
        case("replay-json-dir", f"{replay} --json {{d}}", "{d}"),
        case("replay-instances-0", f"{replay} --instances 0", "--instances", "0"),
        case("replay-instances-huge", f"{replay} --instances 100000", "--instances", "100000"),
        case("replay-routing", f"{replay} --routing random", "--routing", "random"),
        case("replay-tiers-inf", f"{replay} --tiers dram=inf", "'dram'", "inf"),
        case("replay-tiers-1000tib", f"{replay} --tiers dram=1000TiB", "'dram'", "1000.0 TiB"),
        case("replay-tiers-kind", f"{replay} --tiers tape=1GiB", "tape"),
        case("replay-tiers-syntax", f"{replay} --tiers dram", "'dram'", "NAME=SIZE"),
        case("replay-tiers-and-config", f"{replay} --tiers dram=1MiB --config {{cfg_nvme_ok}}", "not both"),
        case("replay-layer-policy", f"{replay} --layer-policy some", "--layer-policy", "some"),
        # plan
        case("plan-synth-word", "plan --synth sessions=lots --tiers dram=1GiB", "'lots'"),
        case("plan-synth-name", "plan --synth colour=red --tiers dram=1GiB", "colour=red"),
        case("plan-synth-huge", "plan --synth turns=100000000 --tiers dram=1GiB", "100,000,000"),
        case("plan-trace-deep", "plan --trace {tr_deep} --tiers dram=1GiB", "{tr_deep}:1"),
        case("plan-tp-0", f"{plan} --tp 0", "--tp", "0"),
        case("plan-tp-huge", f"{plan} --tp 1000000", "--tp", "1000000"),
        case("plan-instances-huge", f"{plan} --instances 10000000", "--instances", "10000000"),
        case("plan-sweep-1", f"{plan} --sweep-points 1", "--sweep-points", "1"),
        case("plan-target-nan", f"{plan} --target-hit-rate nan", "--target-hit-rate", "nan"),
        case("plan-target-2", f"{plan} --target-hit-rate 2", "--target-hit-rate", "2"),
        case("plan-mfu-nan", f"{plan} --mfu nan", "--mfu", "nan"),
        case("plan-active-inf", f"{plan} --active-params inf", "--active-params", "inf"),
        case("plan-gpu", f"{plan} --gpu abacus", "abacus"),
        case("plan-nvme-profile", f"{plan} --nvme-profile floppy", "floppy"),
        case("plan-nic-profile", f"{plan} --nic-profile smoke-signals", "smoke-signals"),
        case("plan-fs-profile", f"{plan} --fs-profile tape", "tape"),
        case("plan-bandwidth-word", f"{plan} --bandwidth dram=fast", "fast"),
        case("plan-bandwidth-tier", f"{plan} --bandwidth tape=1GB/s", "tape"),
        case("plan-kv-dtype", f"{plan} --kv-dtype float7", "float7"),
        case("plan-shared", f"{plan} --shared tape", "tape"),
        case("plan-hbm-unit", f"{plan} --hbm-capacity 3parsecs", "parsecs"),
        case("plan-tiers-huge", "plan --trace {good_trace} --tiers dram=9999PiB", "9999PiB"),
        case("plan-json-under-file", f"{plan} --json {{afile}}/p.json", "{afile}"),
        case("plan-markdown-missing", f"{plan} --markdown {{d}}/none/p.md", "{d}/none"),
        case("plan-plot-under-file", f"{plan} --plot {{afile}}/p.png", "{afile}"),
        case("plan-plot-proc", f"{plan} --plot /proc/p.png", "/proc/p.png"),
        case("plan-routing", f"{plan} --routing psychic", "psychic"),
        # experiment
        case("exp-max-0", "experiment round-robin --max-instances 0", "--max-instances", "0"),
        case("exp-max-65", "experiment round-robin --max-instances 65", "--max-instances", "65"),
        case("exp-model", "experiment round-robin --model llama-9000", "llama-9000"),
        case("exp-master", "experiment round-robin --master nowhere", "--master", "'nowhere'"),
        case("exp-master-port", "experiment round-robin --master 127.0.0.1:99999", "127.0.0.1:99999"),
        case("exp-s3", ["experiment", "round-robin", "--s3-endpoint", "not a url"], "--s3-endpoint", "'not a url'"),
        case("exp-s3-scheme", "experiment round-robin --s3-endpoint ftp://127.0.0.1:1", "ftp://127.0.0.1:1"),
        case("exp-routing", "experiment round-robin --routing zigzag", "zigzag"),
        case("exp-json", "experiment round-robin --json {afile}/e.json", "{afile}"),
        # demo
        case("demo-sessions-0", "demo --sessions 0", "--sessions", "0"),
        case("demo-model", "demo --model llama-9000", "llama-9000"),
        case("demo-hbm-tokens-0", "demo --hbm-tokens 0", "--hbm-tokens", "0"),
        case("demo-hbm-tokens-huge", "demo --hbm-tokens 1000000000000000000", "--hbm-tokens", "1000000000000000000"),
        case("demo-config", "demo --config {cfg_truncated}", "{cfg_truncated}"),
        case("demo-json", "demo --json {d}/gone/d.json", "{d}/gone"),
        # layers
        case("layers-model", "layers --model llama-9000", "llama-9000"),
        case("layers-context-small", "layers --model tiny --context 100", "--context", "100"),
        case("layers-context-huge", "layers --model tiny --context 1000000000000", "--context", "1000000000000"),
        case("layers-tp-0", "layers --model tiny --tp 0", "--tp", "0"),
        case("layers-rule-syntax", "layers --model tiny --rule nonsense", "'nonsense'"),
        case("layers-rule-tier", "layers --model tiny --rule sliding=tape", "'tape'"),
        case("layers-rule-match", "layers --model tiny --rule wormhole=dram", "wormhole"),
        case("layers-tiers", "layers --model tiny --tiers tape", "tape"),
        case("layers-config", "layers --model tiny --config {d}/nope.toml", "{d}/nope.toml"),
        case("layers-json", "layers --model tiny --json {d}", "{d}"),
        # verify
        case("verify-config", "verify --config {cfg_no_tiers}", "{cfg_no_tiers}", "tiers"),
        case("verify-corrupt-lmdb", "verify --config {cfg_corrupt}", "index.lmdb", "{d}/nv-corrupt"),
        case("verify-json", "verify --config {cfg_nvme_ok} --json {afile}/v.json", "{afile}"),
        # bench
        case("bench-dir-file", "bench --dir {afile}", "{afile}"),
        case("bench-dir-missing", "bench --dir {d}/missing-dir", "{d}/missing-dir"),
        case("bench-dir-proc", "bench --dir /proc/self", "/proc/self"),
        case("bench-json", "bench --json {afile}/b.json", "{afile}"),
        case("bench-plot", "bench --scaling --plot {afile}/s.png", "{afile}"),
        # config show
        case("config-show-binary", "config show --config {tr_binary}", "{tr_binary}"),
        case("config-show-subcommand", "config edit", "edit"),
        # daemon
        case("daemon-config", "daemon --config {cfg_deep}", "{cfg_deep}"),
        case("daemon-port-opt", "daemon --metrics-port 65536", "--metrics-port", "65536"),
        case("daemon-host", ["daemon", "--metrics-host", "not a host"], "--metrics-host", "'not a host'"),
        case("daemon-host-unicode", "daemon --metrics-host хост!", "хост!"),
        # status
        case("status-url-text", ["status", "--url", "not a url"], "--url", "'not a url'"),
        case("status-url-scheme", "status --url ftp://127.0.0.1:9477", "ftp://127.0.0.1:9477"),
        case("status-url-port", "status --url http://127.0.0.1:99999", "http://127.0.0.1:99999"),
        case("status-url-refused", "status --url http://127.0.0.1:1", "http://127.0.0.1:1"),
        case("status-no-daemon", "status --config {cfg_stray}", "{d}/state-stray"),
        case("status-json", "status --url http://127.0.0.1:1 --json {afile}/s.json", "{afile}"),
        # prefetch
        case("prefetch-key-word", "prefetch --config {cfg_stray} zz", "'zz'"),
        case("prefetch-key-short", "prefetch --config {cfg_stray} abcd", "'abcd'"),
        case("prefetch-key-unicode", "prefetch --config {cfg_stray} ключ", "ключ"),
        case("prefetch-no-keys", "prefetch --config {cfg_stray}", "keys"),
        case("prefetch-keys-binary", "prefetch --config {cfg_stray} --keys-file {tr_binary}", "{tr_binary}:1"),
        case("prefetch-keys-missing", "prefetch --config {cfg_stray} --keys-file {d}/keys.txt", "{d}/keys.txt"),
        case("prefetch-keys-garbage", "prefetch --config {cfg_stray} --keys-file {tr_garbage_line2}", ":1"),
        case("prefetch-url", ["prefetch", "--url", "not a url", "0" * 32], "--url", "'not a url'"),
        case("prefetch-namespace-word", f"prefetch --config {{cfg_stray}} --namespace ../x {KEY}", "'../x'"),
        case("prefetch-namespace-stray", f"prefetch --config {{cfg_stray}} --namespace {'ab' * 8} {KEY}", "meta.json"),
        # the environment
        case("env-io-threads", "config show", "io_threads", "'many'", env={"KVSTRATA__ENGINE__IO_THREADS": "many"}),
        case("env-capacity", "config show", "capacity", "-1", env={"KVSTRATA__TIERS__DRAM__CAPACITY": "-1"}),
        case("env-tier", "config show", "'tape'", env={"KVSTRATA__TIERS__TAPE__CAPACITY": "1GiB"}),
        case("env-shape", "config show", "KVSTRATA__X", env={"KVSTRATA__X": "1"}),
        case("env-daemon-port", "config show", "metrics_port", "-1", env={"KVSTRATA__DAEMON__METRICS_PORT": "-1"}),
        case("env-config-missing", "config show", "/nowhere/kv.toml", env={"KVSTRATA_CONFIG": "/nowhere/kv.toml"}),
    ]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The prepared files (name -> path) and ``d``, the directory holding them."""
    d = tmp_path_factory.mktemp("bad-inputs")
    paths = {"d": str(d), "afile": str(d / "afile.txt")}
    (d / "afile.txt").write_text("just a file\n")
    good = d / "good.jsonl"
    write_jsonl(good, synth_agentic(sessions=1, turns=2, shared_tokens=64, first_turn_tokens=64, turn_tokens=32))
    paths["good_trace"] = str(good)
    for name, content in TRACES.items():
        (d / f"{name}.jsonl").write_bytes(content)
        paths[name] = str(d / f"{name}.jsonl")
    for name, text in toml_files().items():
        (d / f"{name}.toml").write_text(text.format(**paths))
        paths[name] = str(d / f"{name}.toml")
    return paths


@pytest.fixture(scope="module")
def namespaces(files: dict[str, str]) -> dict[str, str]:
    """A real NVMe namespace, copied twice: beside a stray directory with a bad meta.json, and with
    its LMDB index overwritten by garbage."""
    d = Path(files["d"])
    res = CliRunner().invoke(main, ["replay", "--trace", files["good_trace"], "--config", files["cfg_nvme_ok"]])
    assert res.exit_code == 0, res.output
    (good_ns,) = [p for p in (d / "nvme-ok").iterdir() if (p / "meta.json").exists()]
    shutil.copytree(d / "nvme-ok", d / "nv-stray")
    stray = d / "nv-stray" / ("ab" * 8)
    stray.mkdir()
    (stray / "meta.json").write_text('{"layout": {"model": ')
    shutil.copytree(d / "nvme-ok", d / "nv-corrupt")
    (d / "nv-corrupt" / good_ns.name / "index.lmdb" / "data.mdb").write_bytes(os.urandom(65536))
    return {"good": good_ns.name, "stray": stray.name}


def invoke(args: tuple[str, ...] | list[str], env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, list(args), env=env)


def check_clean_error(res: Result, names: tuple[str, ...]) -> str:
    """Exit status 2, one line ``error: ...`` on standard error naming the value, no traceback."""
    everything = res.stdout + res.stderr
    assert "Traceback" not in everything
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert res.exit_code == 2, everything
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: "), lines[0]
    for word in names:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    return lines[0]


@pytest.mark.parametrize("bad", cli_cases(), ids=lambda c: c.id)
def test_every_command_refuses_bad_input_in_one_line(
    bad: Case, files: dict[str, str], namespaces: dict[str, str]
) -> None:
    args = [a.format(**files) for a in bad.args]
    check_clean_error(invoke(args, bad.env), tuple(n.format(**files) for n in bad.names))


@pytest.mark.parametrize(("name", "text", "names"), CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_every_config_section_refuses_bad_values_in_one_line(
    name: str, text: str, names: tuple[str, ...], files: dict[str, str], tmp_path: Path
) -> None:
    if text.startswith("{"):
        path = Path(text.format(**files))
    else:
        path = tmp_path / f"{name}.toml"
        path.write_text(text)
    line = check_clean_error(invoke(["config", "show", "--config", str(path)]), names)
    assert str(path) in line  # and the file


def test_the_tally_is_over_one_hundred() -> None:
    distinct = {c.id for c in cli_cases()} | {c[0] for c in CONFIG_CASES}
    assert len(distinct) == len(cli_cases()) + len(CONFIG_CASES) >= 100


def test_keys_from_standard_input_name_the_line(files: dict[str, str], namespaces: dict[str, str]) -> None:
    runner = CliRunner()
    binary = runner.invoke(main, ["prefetch", "--config", files["cfg_stray"], "--keys-file", "-"], input=b"\xff\xfe\n")
    check_clean_error(binary, ("-:1", "binary"))
    words = runner.invoke(main, ["prefetch", "--config", files["cfg_stray"], "--keys-file", "-"], input=b"\nhello\n")
    check_clean_error(words, ("-:2", "'hello'"))


def test_a_stray_namespace_directory_is_skipped_with_a_warning_in_listings(
    files: dict[str, str], namespaces: dict[str, str], tmp_path: Path
) -> None:
    stray = f"{files['d']}/nv-stray/{namespaces['stray']}"
    res = invoke(["verify", "--config", files["cfg_stray"], "--json", str(tmp_path / "v.json")])
    assert res.exit_code == 0, res.output
    assert stray in res.stderr and "meta.json" in res.stderr and "Traceback" not in res.stderr
    report = json.loads((tmp_path / "v.json").read_text())
    assert [ns["namespace"] for ns in report["namespaces"]] == [namespaces["good"]] and report["ok"]
    # prefetch lists the namespaces to find the only one: the stray directory is not a candidate
    hinted = invoke(["prefetch", "--config", files["cfg_stray"], "ab" * 16])
    assert hinted.exit_code == 0, hinted.output
    assert f"namespace {namespaces['good']}" in hinted.stderr
    hints = (Path(files["d"]) / "state-stray" / "hints.jsonl").read_text().splitlines()
    assert json.loads(hints[-1])["ns"] == namespaces["good"]


def kvstrata(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """A real ``python -m kvstrata`` process; its standard error is a pipe, not a terminal."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    return subprocess.run(
        [sys.executable, "-m", "kvstrata", *args], capture_output=True, text=True, timeout=120, env=env, cwd=cwd
    )


def test_real_processes_print_one_unwrapped_line(files: dict[str, str], namespaces: dict[str, str]) -> None:
    deep = Path(files["d"]) / ("a-directory-with-a-long-name-" * 3) / "kvstrata.toml"
    runs = [
        (("config", "show", "--config", str(deep)), (str(deep),)),
        (("replay", "--trace", files["good_trace"], "--config", files["cfg_dram_1000tib"]), ("1000.0 TiB",)),
        (("verify", "--config", files["cfg_corrupt"]), ("index.lmdb", "corrupt")),
        (("status", "--url", "not a url, but a sentence long enough to wrap twice at eighty columns"), ("--url",)),
    ]
    for args, names in runs:
        res = kvstrata(*args)
        assert res.returncode == 2, res.stdout + res.stderr
        assert "Traceback" not in res.stdout + res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
        assert len(lines[0]) > 80  # long enough that Rich would have wrapped it
        assert all(word in lines[0] for word in names), lines[0]
