"""Time to first token on a real vLLM (CPU build): recompute vs kvstrata (DRAM, NVMe) vs vLLM's
``ExampleConnector``, and kvstrata's overhead on cache misses, all measured in ONE run.

    python benchmarks/vllm_ttft.py --context 16384 --json out/vllm_ttft.json

Every vLLM instance runs in a fresh subprocess (``tests/vllm_e2e/runner.py``) on the bench model
(``tests/vllm_e2e/models.py``: Llama, 8 layers, hidden 1024, 8 KV heads, bf16 weights; reused from
``--model-dir`` or ``$VLLM_E2E_MODEL_CACHE/bench``, else built into the work directory), computed
in bfloat16 where the CPU has native bfloat16 arithmetic and in float32 where it would be emulated
(``--dtype``, ``default_dtype()``; the figures say which, ``fairness.dtype``). Each
instance first runs a short warm-up prompt, then the measured turns (greedy, 1 output token, so
TTFT = the request's ``first_token_latency``). P is the long prompt, M1..Mk (``misses``) other
never-seen prompts of the same length; every figure is the median of its n = 1 + k samples, and
comes with its spread (``spread()``: median, min, max, and an interval: for n >= 5 a seeded 95%
bootstrap of the median, for fewer samples the range).

1. ``no_connector``: P, M1..Mk cold (the recompute baseline and the no-connector side of the miss
   overhead), then P n times: hits in vLLM's own prefix cache, the compute floor of any restore
   (the last partial block is recomputed);
2. ``kvstrata_dram``: kvstrata with an empty NVMe directory, ``reset_prefix_cache`` before every
   turn: P cold (stored), P again at once (``kvstrata_dram_immediate``), M1..Mk cold (stored; the
   kvstrata side of the sequential miss overhead), then, after a ``SETTLE_S`` pause, P, M1..Mk
   again: restored from the worker's DRAM tier, each followed at once by the same prompt with
   vLLM's prefix cache kept (a local hit: the floor paired with that restore).
   The immediate re-request is reported on its own: vLLM's scheduler only sees blocks once
   kvstrata's background write-through has put them on the persistent (NVMe) tier, so a
   re-request right after the store misses what the worker's DRAM already holds;
3. ``kvstrata_nvme``: a fresh instance (empty DRAM) on the same NVMe directory: P, M1..Mk restored
   from NVMe (O_DIRECT reads where the filesystem allows, so not from the page cache), each with
   its paired floor;
4. ``example_store`` / ``example_restore``: ``ExampleConnector`` stores P in one instance and a fresh
   one restores it n times (the first after the same pause) (its files are in the OS page cache, as they naturally are);
   ``example_restore_cold``: once more after dropping those files from the page cache
   (``posix_fadvise(DONTNEED)`` on them only), like for like with kvstrata's NVMe tier; every
   restore with its paired floor;
5. ``miss_interleaved`` (``measure_miss_interleaved``): kvstrata's overhead on cold prompts at
   ``miss_context`` tokens (default 4096), three instances alive together (two without a
   connector, A and A2, one with kvstrata, B) taking turns on never-seen prompts in a rotating
   order, one computing at a time, for ``miss_rounds`` rounds: per round B/A - 1 and the null
   test A2/A - 1, adjacent in time, so slow drift (other work on the machine, thermal, page
   cache) cancels and the null test shows the noise floor. This is the figure the miss target
   uses. A shorter prompt than P because one 16K cold sample takes ~43 s on a 2-core VM, so a
   dozen interleaved 16K rounds would take half an hour; the store kvstrata adds grows linearly
   with the prompt while the prefill grows faster (attention), so the relative overhead at 4K
   is if anything larger than at 16K. The 16K cold prompts of runs 1 and 2 still give the
   ``miss_sequential`` figure (paired by prompt, minutes apart), with its spread. Each B turn
   also gives kvstrata's own time on that critical path: what vLLM's worker and scheduler spent
   in its hooks (``connector_hook_ms``, and ``connector_hook_share`` of the TTFT), measured in
   one instance, so none of the turn-to-turn noise enters it (target
   ``miss_hook_share_le_2pct``: the upper end of its interval within 2%). ``--miss-only`` runs
   this part alone.

``restore_over_floor_s``: a restore's TTFT above the compute floor, per sample: ``paired`` (minus
the paired floor; the target ``dram_over_floor_below_example`` compares these medians) and
``vs_no_connector_floor`` (minus the no-connector instance's median hit, as the README's older
figures were computed).

Fairness: every instance gets the same ``VLLM_CPU_OMP_THREADS_BIND`` (vLLM otherwise reserves a
core for the connector and computes with fewer threads without one) and the same
``max_num_batched_tokens`` = ``max_model_len``, so a prompt is prefilled in one step. The latter
is needed by ``ExampleConnector``: it saves a new request's KV once, at its first step, so with
chunked prefill it would save only the first chunk and then fail to load a longer prompt.

Work on this machine by other processes is sampled from ``/proc`` during every run
(``runs[*].foreign_*``, and ``foreign_cpu_s`` per turn, to within half a second): CPU seconds used
by processes that are not this benchmark's. Compare ratios from turns with little foreign CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

_E2E_DIR = Path(__file__).resolve().parents[1] / "tests" / "vllm_e2e"

DEFAULT_CONTEXT = 16384
WARMUP_TOKENS = 256

#: Targets from the issue (ratios of TTFTs measured in the same run).
SETTLE_S = 5.0  # pause before the first restore of a run (see settled())
TARGETS = {"dram_speedup": 40.0, "nvme_speedup": 20.0, "miss_overhead": 0.02}
HOOK_TIME = ("worker_hook_time_ms", "scheduler_hook_time_ms")  # the connector's time in vLLM's hooks


#: vLLM compute dtypes the benchmark runs in; the model's weights are saved in bfloat16 either way.
DTYPES = ("bfloat16", "float32")
#: CPU flags (``/proc/cpuinfo``: x86's ``flags``, aarch64's ``Features``) of native bfloat16
#: arithmetic: without one, bfloat16 matrix products are emulated (torch: 0.3 GFLOPS against 114
#: in float32 on a 2-core AMD EPYC with AVX2 only), and one 16K-token prefill outlasts vLLM's
#: 300 s ``execute_model`` limit.
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def default_dtype(cpuinfo: str | os.PathLike[str] = "/proc/cpuinfo") -> tuple[str, str]:
    """The compute dtype for this machine and why: bfloat16 (what production serves) where the
    CPU has native bfloat16 arithmetic, else float32."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError as e:
        return "bfloat16", f"{cpuinfo} unreadable ({e.strerror}): assumed native bfloat16"
    flags: set[str] = set()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            flags.update(value.split())
    have = [f for f in BF16_FLAGS if f in flags]
    if have:
        return "bfloat16", f"the CPU has {', '.join(have)}"
    return "float32", f"the CPU has none of {', '.join(BF16_FLAGS)} (bfloat16 would be emulated)"


def _e2e(name: str) -> Any:
    """``tests/vllm_e2e/<name>.py`` (``runner`` or ``models``), imported by path."""
    if str(_E2E_DIR) not in sys.path:
        sys.path.insert(0, str(_E2E_DIR))
    return importlib.import_module(name)


def vllm_skip_reason(python: str | None = None) -> str | None:
    """None when ``import vllm`` works (checked in a subprocess), else why not."""
    try:
        proc = subprocess.run(
            [python or sys.executable, "-c", "import vllm"],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"vLLM import check failed: {e!r}"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return f"vLLM is not importable ({last}); install the CPU build (requirements-vllm.txt)"
    return None


def kvstrata_transfer_config(nvme_dir: str | os.PathLike[str]) -> dict[str, Any]:
    tiers = [{"name": "dram", "capacity": "2GiB"}, {"name": "nvme", "capacity": "8GiB", "path": str(nvme_dir)}]
    return {
        "kv_connector": "KVStrataConnector",
        "kv_connector_module_path": "kvstrata.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"config": {"tiers": tiers}},
    }


def example_transfer_config(storage: str | os.PathLike[str]) -> dict[str, Any]:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }


# ----------------------------------------------------------------------------------------------
# Other work on the machine


def _descends_from(pid: int, ancestor: int) -> bool:
    """Whether ``ancestor`` is among ``pid``'s parents (from ``/proc/<pid>/stat``; False once a
    process on the way has ended)."""
    for _ in range(64):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                data = f.read()
        except OSError:
            return False
        pid = int(data[data.rfind(b")") + 2 :].split()[1])
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
    return False


class ForeignLoad:
    """Samples ``/proc`` every ``period`` seconds in a thread and adds up the CPU time of the
    processes that are not this benchmark's: ours are this process group and the sessions of
    the vLLM children that descend from this process or whose command line contains ``marker``
    (their work directory; vLLM's engine-core and worker processes stay in the child's session).
    A run forked from the e2e zygote keeps the zygote's command line, so the command line alone
    counted every such run's own engine core and worker as foreign (run G found it: 52-77% of
    the machine "foreign" on an otherwise idle VM)."""

    def __init__(self, marker: str, log_path: str | os.PathLike[str] | None = None, period: float = 0.5) -> None:
        self.marker = marker
        self.period = period
        self._log_path = Path(log_path) if log_path is not None else None
        self._log_pos = 0
        self._marks: list[tuple[str, float]] = []  # ("start" | turn index, foreign CPU s so far)
        self._tick = os.sysconf("SC_CLK_TCK")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._base: dict[int, int] = {}
        self._last: dict[int, tuple[int, int, int, str]] = {}  # pid -> (pgrp, sid, ticks, comm)
        self._our_sids: set[int] = set()
        self._seen: set[int] = set()
        self._t0 = 0.0

    @staticmethod
    def _snapshot() -> dict[int, tuple[int, int, int, str]]:
        """pid -> (process group, session, CPU ticks, command name), from ``/proc``."""
        return dict(_e2e("runner").proc_stats())

    def _sample(self) -> None:
        snap = self._snapshot()
        for pid in snap.keys() - self._seen:
            self._seen.add(pid)
            if _descends_from(pid, os.getpid()):  # a run forked from the zygote keeps its cmdline
                self._our_sids.add(snap[pid][1])
                continue
            with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
                if self.marker.encode() in f.read():
                    self._our_sids.add(snap[pid][1])
        self._last.update(snap)
        if self._log_path is not None:
            self._read_marks()

    def _foreign_now(self) -> float:
        mine = os.getpgrp()
        ticks = sum(
            t - self._base.get(pid, 0)
            for pid, (pgrp, sid, t, _) in self._last.items()
            if pgrp != mine and sid not in self._our_sids
        )
        return ticks / self._tick

    def _read_marks(self) -> None:
        """Note the foreign CPU so far at each ``[runner] engine_start_s`` / ``[runner] turn i:``
        line the child has logged since the last sample (turn boundaries, to within a period)."""
        assert self._log_path is not None
        try:
            with open(self._log_path, "rb") as f:
                f.seek(self._log_pos)
                data = f.read()
        except OSError:
            return
        end = data.rfind(b"\n") + 1
        self._log_pos += end
        now = None
        for m in re.finditer(rb"^\[runner\] (?:engine_start_s=|turn (\d+):)", data[:end], re.M):
            now = self._foreign_now() if now is None else now
            self._marks.append(("start" if m.group(1) is None else m.group(1).decode(), now))

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()

    def start(self) -> ForeignLoad:
        snap = self._snapshot()
        self._base = {pid: v[2] for pid, v in snap.items()}
        self._seen = set(snap)
        self._last = dict(snap)
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        wall = time.monotonic() - self._t0
        mine = os.getpgrp()
        by_comm: dict[str, float] = {}
        total = 0.0
        for pid, (pgrp, sid, ticks, comm) in self._last.items():
            if pgrp == mine or sid in self._our_sids:
                continue
            cpu = (ticks - self._base.get(pid, 0)) / self._tick
            if cpu > 0:
                total += cpu
                by_comm[comm] = by_comm.get(comm, 0.0) + cpu
        ncpu = os.cpu_count() or 1
        top = sorted(by_comm.items(), key=lambda kv: -kv[1])[:4]
        per_turn: dict[str, float] = {}
        prev = None
        for label, cpu in self._marks:
            if prev is not None and label != "start":
                per_turn[label] = round(cpu - prev, 2)
            prev = cpu
        return {
            "foreign_cpu_s": round(total, 2),
            "foreign_busy_frac": round(total / max(wall * ncpu, 1e-9), 3),
            "foreign_top": {k: round(v, 2) for k, v in top},
            "foreign_cpu_s_by_turn": per_turn,
        }


# ----------------------------------------------------------------------------------------------
# Helpers


_HITS = "vllm:kvstrata_hit_blocks"


def _counter(metrics: Mapping[str, float], name: str) -> float:
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


def _drop_from_page_cache(root: Path) -> int:
    """fsync + ``POSIX_FADV_DONTNEED`` every file under ``root``; returns the bytes dropped."""
    total = 0
    for path in root.rglob("*"):
        if not path.is_file():
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


_PROBLEM_RE = re.compile(r"ERROR|Traceback|Exception|Error:|failed|dropped|WARNING.*kvstrata")
_BENIGN_RE = re.compile(r"libiomp is not found|LD_PRELOAD|\[base\.py:380\]|Chat template warmup")


def _log_info(log_path: str) -> dict[str, Any]:
    try:
        text = Path(log_path).read_text("utf-8", "replace")
    except OSError:
        return {}
    m = re.search(r"core ids=\[([\d, ]*)\]", text)
    cores = [int(x) for x in m.group(1).replace(" ", "").split(",") if x] if m else None
    problems = [ln[:300] for ln in text.splitlines() if _PROBLEM_RE.search(ln) and not _BENIGN_RE.search(ln)]
    return {"omp_core_ids": cores, "problems": problems[:20]}


def _nvme_blocks(nvme_dir: Path) -> dict[str, int] | str:
    """Distinct blocks (and block-layer entries) kvstrata's NVMe tier holds under ``nvme_dir``."""
    try:
        from kvstrata.engine.verify import namespaces_under
        from kvstrata.tiers import TIERS, TierContext

        keys: set[Any] = set()
        entries = 0
        for _directory, layout, namespace in namespaces_under(str(nvme_dir)):
            cls = TIERS.get("nvme")
            tier = cls(
                "nvme", 1 << 40, cls.Options.model_validate({"path": str(nvme_dir)}), TierContext(layout, namespace)
            )
            try:
                for (key, _layer), _size in tier.scan():
                    keys.add((namespace, key))
                    entries += 1
            finally:
                tier.close()
        return {"blocks": len(keys), "block_layers": entries}
    except Exception as e:  # diagnostics only
        return f"scan failed: {e!r}"


def _turn_record(turn: Mapping[str, Any]) -> dict[str, Any]:
    md = turn.get("metrics_delta", {})
    rec = {
        "prompt_len": turn["prompt_len"],
        "ttft_s": turn["ttft_s"],
        "elapsed_s": round(turn["elapsed_s"], 4),
        "num_cached_tokens": turn["num_cached_tokens"],
        "first_token": (turn.get("output_ids") or [None])[0],
    }
    kv = {k.removeprefix("vllm:"): v for k, v in md.items() if "kvstrata" in k or "external_prefix" in k}
    if kv:
        rec["counters"] = kv
    return rec


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return round(a / b, 3)


#: A turn is "quiet" when other processes used under this share of the machine's CPU during it.
QUIET_FRAC = 0.02

#: Fewer samples than this get their range as the interval, not a bootstrap.
BOOTSTRAP_MIN_N = 5


def spread(xs: Sequence[float], *, digits: int = 4, resamples: int = 4000, seed: int = 0) -> dict[str, Any] | None:
    """Median of ``xs`` with its spread: ``min``/``max``, and ``interval``: for n >= 5 a 95%
    percentile-bootstrap interval of the median (seeded, so the same samples give the same
    interval), for fewer samples their range (``interval_kind`` says which). None if empty."""
    vals = sorted(float(x) for x in xs)
    if not vals:
        return None
    n = len(vals)
    if n >= BOOTSTRAP_MIN_N:
        rng = random.Random(seed)
        meds = sorted(_median([vals[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples))
        lo, hi = meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1]
        kind = "bootstrap 95% of the median"
    else:
        lo, hi = vals[0], vals[-1]
        kind = "range"
    return {
        "median": round(_median(vals), digits),
        "min": round(vals[0], digits),
        "max": round(vals[-1], digits),
        "n": n,
        "interval": [round(lo, digits), round(hi, digits)],
        "interval_kind": kind,
        "samples": [round(float(x), digits) for x in xs],
    }


def target_verdict(s: Mapping[str, Any] | None, limit: float, what: str) -> dict[str, Any]:
    """Whether a spread's median is <= ``limit``, and what its interval says about that."""
    if s is None:
        return {"met": False, "verdict": f"{what}: not measured"}
    med, (lo, hi) = s["median"], s["interval"]
    if med > limit:
        verdict = f"not met: {what} median {med:+.2%} > {limit:.0%} (interval {lo:+.2%} .. {hi:+.2%})"
    elif hi > limit:
        verdict = (
            f"met by the median only: {what} median {med:+.2%} <= {limit:.0%}, but its interval "
            f"{lo:+.2%} .. {hi:+.2%} ({s['interval_kind']}, n = {s['n']}) reaches above {limit:.0%}"
        )
    else:
        verdict = f"met: {what} median {med:+.2%}, interval {lo:+.2%} .. {hi:+.2%} all <= {limit:.0%}"
    return {"met": med <= limit, "interval_within": hi <= limit, "verdict": verdict}


def _fmt_spread(s: Mapping[str, Any] | None, pct: bool = False) -> str:
    if s is None:
        return "n/a"
    f = (lambda x: f"{x:+.2%}") if pct else (lambda x: f"{x:.3f}")
    lo, hi = s["interval"]
    return (
        f"{f(s['median'])} (min {f(s['min'])}, max {f(s['max'])}; "
        f"{s['interval_kind']} {f(lo)} .. {f(hi)}; n = {s['n']})"
    )


# ----------------------------------------------------------------------------------------------
# Miss overhead, interleaved


#: The orders the interleaved instances take turns in, round by round (every order as often).
def _orders(names: Sequence[str]) -> list[tuple[str, ...]]:
    import itertools

    return list(itertools.permutations(names))


class _Sessions:
    """CPU seconds by session (ours) and of everything else (foreign), from ``/proc``."""

    def __init__(self) -> None:
        self.sids: dict[str, int] = {}
        self._prev = ForeignLoad._snapshot()
        self._mine = os.getpgrp()

    def take(self) -> dict[str, float]:
        """CPU used since the previous call: per named session and ``"foreign"``."""
        snap = ForeignLoad._snapshot()
        tick = os.sysconf("SC_CLK_TCK")
        by_sid = {sid: name for name, sid in self.sids.items()}
        out = {name: 0.0 for name in self.sids}
        out["foreign"] = 0.0
        for pid, (pgrp, sid, ticks, _comm) in snap.items():
            prev = self._prev.get(pid)
            d = (ticks - (prev[2] if prev is not None and prev[1] == sid else 0)) / tick
            if sid in by_sid:
                out[by_sid[sid]] += d
            elif pgrp != self._mine:
                out["foreign"] += d
        self._prev = snap
        return {k: round(v, 3) for k, v in out.items()}


def measure_miss_interleaved(
    model: str | os.PathLike[str],
    context: int,
    rounds: int,
    *,
    work: Path,
    vocab: int,
    threads_bind: str,
    kv_space_gib: int,
    dtype: str = "bfloat16",
    seed: int = 1,
    min_gap_s: float = 0.5,
    timeout: float | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """kvstrata's overhead on cold prompts, with drift cancelled and the noise floor measured.

    Three instances are alive together, identical but for the connector: ``A`` and ``A2``
    without one, ``B`` with kvstrata (empty DRAM and NVMe tiers). All run their warm-up first;
    then, round by round, each gets one never-seen ``context``-token prompt, one instance at a
    time (the others block on a FIFO in their runner), in a rotating
    order (all six orders equally often over six rounds). After each turn the next waits until
    the instance that ran is idle (its session below 5% of a core over 0.25 s, at least
    ``min_gap_s``; every instance uses CPU for about a second after its turn, with or without a
    connector, so this matters for all of them): kvstrata's background store (copy into DRAM, write-through to NVMe) is
    done before anyone computes, and its CPU is reported (``background_cpu_s``) instead of
    landing in another instance's TTFT. Per round: ``B/A - 1`` (the overhead) and ``A2/A - 1``
    (the null test: the same comparison with no connector on either side; its spread is the
    noise floor). ``idle_partner_cpu_s``: CPU the two waiting instances used during a turn
    (idle OpenMP threads that spin would show here)."""
    runner = _e2e("runner")
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    names = ("A", "A2", "B")
    root = work / "miss_interleaved"
    shutil.rmtree(root, ignore_errors=True)
    (root / "nvme").mkdir(parents=True)
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    warm = {name: prompt(WARMUP_TOKENS) for name in names}
    prompts = {name: [prompt(context) for _ in range(rounds)] for name in names}
    max_model_len = context + 64
    env = {"VLLM_CPU_OMP_THREADS_BIND": threads_bind, "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib)}
    cfgs: dict[str, Any] = {"A": None, "A2": None, "B": kvstrata_transfer_config(root / "nvme")}
    limit = timeout if timeout is not None else 900 + 3 * rounds * (2 + 0.004 * context)

    def gate(name: str, r: int) -> Path:
        return root / name / f"gate-{r}"

    results: dict[str, dict[str, Any]] = {}
    errors: dict[str, BaseException] = {}

    def start(name: str) -> None:
        turns: list[Any] = [warm[name]]
        turns += [{"prompts": [prompts[name][r]], "gate": str(gate(name, r))} for r in range(rounds)]
        try:
            results[name] = runner.run_vllm(
                model,
                turns,
                kv_transfer_config=cfgs[name],
                max_tokens=1,
                max_model_len=max_model_len,
                max_num_batched_tokens=max_model_len,
                extra_env=env,
                dtype=dtype,
                timeout=limit,
                workdir=root / name,
                reset_prefix_cache_between=True,
                use_zygote=False,
            )
        except BaseException as e:  # reported below
            errors[name] = e

    threads = {}
    for name in names:
        (root / name).mkdir(parents=True, exist_ok=True)
        threads[name] = threading.Thread(target=start, args=(name,), daemon=True)
    say(f"[vllm_ttft] miss_interleaved: {names} x {rounds} rounds of {context} tokens ...")
    t0 = time.monotonic()
    for t in threads.values():
        t.start()
    sessions = _Sessions()

    def check(deadline: float, what: Path) -> None:
        if errors:
            raise RuntimeError(f"an interleaved instance failed: {errors}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")

    def wait_file(path: Path, deadline: float) -> dict[str, Any]:
        while not path.exists():  # 20 ms polls here; the waiting runners block on their FIFO
            check(deadline, path)
            time.sleep(0.02)
        return dict(json.loads(path.read_text()))

    def open_gate(path: Path, deadline: float) -> None:
        """Write the byte the runner waiting on FIFO ``path`` reads (once it has opened it)."""
        while True:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as e:
                if e.errno not in (errno.ENXIO, errno.ENOENT):
                    raise
                check(deadline, path)
                time.sleep(0.002)
                continue
            try:
                os.write(fd, b"g")
            finally:
                os.close(fd)
            return

    def idle(name: str, cap_s: float = 15.0) -> float:
        """Wait until session ``name`` is idle (at least min_gap_s); the seconds waited."""
        t = time.monotonic()
        time.sleep(min_gap_s)
        cpu = runner.session_cpu_s(sessions.sids[name])
        while time.monotonic() - t < cap_s:
            time.sleep(0.25)
            now = runner.session_cpu_s(sessions.sids[name])
            if now - cpu < 0.0125:
                break
            cpu = now
        return round(time.monotonic() - t, 3)

    order_list = _orders(names)
    log_turns: list[dict[str, Any]] = []
    background: dict[str, list[float]] = {name: [] for name in names}
    try:
        deadline = t0 + limit
        for name in names:
            sessions.sids[name] = int(wait_file(Path(str(gate(name, 0)) + ".waiting"), deadline)["sid"])
        for name in names:
            idle(name)
        sessions.take()
        say(f"[vllm_ttft] miss_interleaved: all warm after {time.monotonic() - t0:.0f}s")
        for r in range(rounds):
            for name in order_list[r % len(order_list)]:
                wait_file(Path(str(gate(name, r)) + ".waiting"), deadline)
                sessions.take()
                open_gate(gate(name, r), deadline)
                wait_file(Path(str(gate(name, r)) + ".done"), deadline)
                during = sessions.take()
                waited = idle(name)
                after = sessions.take()
                background[name].append(after[name])
                log_turns.append(
                    {
                        "round": r,
                        "instance": name,
                        "cpu_s": during[name],
                        "idle_partner_cpu_s": round(sum(v for k, v in during.items() if k not in (name, "foreign")), 3),
                        "foreign_cpu_s": during["foreign"],
                        "background_cpu_s": after[name],
                        "idle_wait_s": waited,
                        "foreign_cpu_s_while_idle": after["foreign"],
                    }
                )
    except BaseException:
        for name, sid in sessions.sids.items():
            with contextlib.suppress(Exception):
                os.killpg(sid, 9)
            say(f"[vllm_ttft] miss_interleaved: killed {name}")
        raise
    for t in threads.values():
        t.join(timeout=limit)
    if errors:
        raise RuntimeError(f"an interleaved instance failed: {errors}")
    ttft = {name: [float(results[name]["turns"][1 + r]["ttft_s"]) for r in range(rounds)] for name in names}
    for i, rec in enumerate(log_turns):
        rec["ttft_s"] = ttft[rec["instance"]][rec["round"]]
        log_turns[i] = rec
    ab = [b / a - 1 for a, b in zip(ttft["A"], ttft["B"], strict=True)]
    aa = [a2 / a - 1 for a, a2 in zip(ttft["A"], ttft["A2"], strict=True)]
    # rounds in which no turn of the pair met other work: foreign CPU under QUIET_FRAC of the
    # turn's CPU capacity (its TTFT x the machine's cores); decided from /proc, not from the TTFTs
    ncpu = os.cpu_count() or 1
    fcpu = {(t["round"], t["instance"]): t["foreign_cpu_s"] / max(t["ttft_s"] * ncpu, 1e-9) for t in log_turns}

    def quiet(r: int, *pair: str) -> bool:
        return all(fcpu[(r, name)] <= QUIET_FRAC for name in pair)

    ab_quiet = [x for r, x in enumerate(ab) if quiet(r, "A", "B")]
    aa_quiet = [x for r, x in enumerate(aa) if quiet(r, "A", "A2")]
    stores = [
        _counter(results["B"]["turns"][1 + r]["metrics_delta"], "vllm:kvstrata_stored_blocks") for r in range(rounds)
    ]
    # kvstrata's own time on the critical path of each cold B turn: the time vLLM's worker and
    # scheduler spent inside its hooks (the lookup that misses, the pages copied out for the store),
    # as a share of the turn's TTFT; unlike B/A it needs no second instance, so no drift or
    # turn-to-turn noise of the computation enters it
    hook_ms = [
        sum(_counter(results["B"]["turns"][1 + r]["metrics_delta"], f"vllm:kvstrata_{key}") for key in HOOK_TIME)
        for r in range(rounds)
    ]
    hook_share = [ms / 1e3 / t for ms, t in zip(hook_ms, ttft["B"], strict=True)]
    hits = [int(results[name]["turns"][1 + r]["num_cached_tokens"]) for name in names for r in range(rounds)]
    cores = {name: _log_info(results[name]["log_path"]).get("omp_core_ids") for name in names}
    workers = {name: [w["torch_threads"] for w in results[name]["threads"]["workers"]] for name in names}
    out = {
        "context": context,
        "rounds": rounds,
        "orders": [list(order_list[r % len(order_list)]) for r in range(rounds)],
        "ttft_s": {name: spread(ttft[name]) for name in names},
        "overhead": spread(ab),  # B/A - 1, per round
        "null_a2_vs_a": spread(aa),  # A2/A - 1, per round
        "quiet_frac": QUIET_FRAC,
        "overhead_quiet_rounds": spread(ab_quiet),
        "null_quiet_rounds": spread(aa_quiet),
        "overhead_of_medians": round(_median(ttft["B"]) / _median(ttft["A"]) - 1, 4),
        "null_of_medians": round(_median(ttft["A2"]) / _median(ttft["A"]) - 1, 4),
        "connector_hook_ms": spread(hook_ms, digits=2),  # per B turn, worker + scheduler hooks
        "connector_hook_share": spread(hook_share),  # of the B turn's TTFT
        "background_cpu_s": {name: spread(background[name], digits=3) for name in names},
        "idle_partner_cpu_s": spread([t["idle_partner_cpu_s"] for t in log_turns], digits=3),
        "foreign_cpu_s_during_turns": spread([t["foreign_cpu_s"] for t in log_turns], digits=3),
        "foreign_cpu_s_total": round(sum(t["foreign_cpu_s"] + t["foreign_cpu_s_while_idle"] for t in log_turns), 2),
        "kvstrata_stored_blocks": stores,
        "cached_tokens_max": max(hits) if hits else None,
        "omp_core_ids": cores,
        "worker_threads": workers,
        "same_threads_everywhere": len({json.dumps(v) for v in cores.values()}) == 1
        and len({json.dumps(v) for v in workers.values()}) == 1,
        "max_num_batched_tokens": max_model_len,
        "wall_s": round(time.monotonic() - t0, 1),
        "turns": log_turns,
        "log_problems": {n: p for n in names if (p := _log_info(results[n]["log_path"]).get("problems"))},
    }
    say(
        f"[vllm_ttft] miss_interleaved: overhead {_fmt_spread(out['overhead'], True)}; "
        f"null A2/A {_fmt_spread(out['null_a2_vs_a'], True)}; wall {out['wall_s']:.0f}s"
    )
    return out


# ----------------------------------------------------------------------------------------------
# The benchmark


def measure(
    context: int = DEFAULT_CONTEXT,
    *,
    misses: int = 2,
    workdir: str | os.PathLike[str] | None = None,
    model_dir: str | os.PathLike[str] | None = None,
    threads_bind: str = "0-1",
    kv_space_gib: int = 2,
    dtype: str | None = None,
    example_cold: bool = True,
    miss_context: int | None = 4096,
    miss_rounds: int = 18,
    timeout: float | None = None,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
    miss_only: bool = False,
) -> dict[str, Any]:
    """Run every instance (see the module docstring) and return the figures as a JSON-able dict;
    ``miss_only``: only the interleaved miss overhead (5.), as ``{"miss_interleaved": ...}``."""
    runner = _e2e("runner")
    models = _e2e("models")
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    work = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="vllm-ttft-"))
    work.mkdir(parents=True, exist_ok=True)
    if model_dir is None:
        cache = os.environ.get("VLLM_E2E_MODEL_CACHE")
        model_dir = Path(cache) / "bench" if cache else work / "models" / "bench"
    model = models.make_bench_model(model_dir)
    vocab = int(models.read_config(model)["vocab_size"])
    dtype, dtype_why = (dtype, "as asked") if dtype is not None else default_dtype()
    say(f"[vllm_ttft] compute dtype {dtype} ({dtype_why})")

    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    long_prompt = prompt(context)
    miss_prompts = [prompt(context) for _ in range(misses)]
    warm = [prompt(WARMUP_TOKENS) for _ in range(6)]  # one per instance, never shared

    max_model_len = context + 64
    env = {"VLLM_CPU_OMP_THREADS_BIND": threads_bind, "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib)}
    # Cold 16K prefills take about a minute each here; leave room for a busy machine.
    limit = timeout if timeout is not None else 600 + 0.06 * context * (3 + misses)
    nvme_dir = work / "nvme"
    example_dir = work / "example"
    for d in (nvme_dir, example_dir):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)

    def misses_interleaved(miss_context: int) -> dict[str, Any]:
        return measure_miss_interleaved(
            model,
            miss_context,
            miss_rounds,
            work=work,
            vocab=vocab,
            threads_bind=threads_bind,
            kv_space_gib=kv_space_gib,
            dtype=dtype,
            seed=seed + 1,
            log=say,
        )

    if miss_only:
        if miss_context is None or miss_rounds <= 0:
            raise ValueError(f"miss_only needs miss rounds (miss_context={miss_context}, miss_rounds={miss_rounds})")
        return {
            "miss_only": True,
            "dtype": dtype,
            "dtype_why": dtype_why,
            "miss_interleaved": misses_interleaved(miss_context),
            "workdir": str(work),
        }

    runs: dict[str, dict[str, Any]] = {}
    raw: dict[str, dict[str, Any]] = {}

    def run(name: str, turns: list[Any], cfg: Mapping[str, Any] | None, reset: bool = False) -> dict[str, Any]:
        sizes = [len(t["prompts"][0]) if isinstance(t, dict) else len(t) for t in turns]
        say(f"[vllm_ttft] {name}: {len(turns)} turns, prompts {sizes} ...")
        run_dir = work / name
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "vllm.log").unlink(missing_ok=True)
        load = ForeignLoad(str(run_dir), run_dir / "vllm.log").start()
        try:
            res = runner.run_vllm(
                model,
                turns,
                kv_transfer_config=cfg,
                max_tokens=1,
                max_model_len=max_model_len,
                max_num_batched_tokens=max_model_len,
                extra_env=env,
                dtype=dtype,
                timeout=limit,
                workdir=run_dir,
                reset_prefix_cache_between=reset,
            )
        finally:
            foreign = load.stop()
        by_turn = foreign.pop("foreign_cpu_s_by_turn")
        records = [_turn_record(t) for t in res["turns"]]
        for i, rec in enumerate(records):
            rec["foreign_cpu_s"] = by_turn.get(str(i))  # other processes' CPU during the turn (+-0.5 s)
        raw[name] = res
        runs[name] = {
            "engine_start_s": round(res["engine_start_s"], 2),
            "wall_s": round(res["wall_s"], 2),
            "log_path": res["log_path"],
            # what the worker really computed with (read inside it), not the setting
            "worker_threads": [w["torch_threads"] for w in res["threads"]["workers"]],
            **foreign,
            **_log_info(res["log_path"]),
            "turns": records,
        }
        ttfts = ", ".join(f"{t['ttft_s']:.3f}" for t in res["turns"])
        say(f"[vllm_ttft] {name}: ttft_s [{ttfts}] wall {res['wall_s']:.0f}s foreign {foreign} by turn {by_turn}")
        return res

    n = 1 + misses  # samples of every figure but the cold-page-cache ExampleConnector restore

    def settled(prompt: list[int]) -> dict[str, Any]:
        """The first restore of a run starts after SETTLE_S: kvstrata's stores of the cold prompts
        just before run in the background (the copy into DRAM, the write-through to NVMe) and
        would otherwise share the two cores with it; ExampleConnector saves synchronously inside
        the storing prompt's own forward pass, so its restores never meet that work."""
        return {"prompts": [prompt], "pause_s": SETTLE_S}

    def hit(prompt: list[int]) -> dict[str, Any]:
        """The prompt again at once, vLLM's prefix cache kept: the compute floor of the restore
        just before, in the same instance (its pair)."""
        return {"prompts": [prompt], "reset_prefix_cache": False}

    def paired(restores: Sequence[Any]) -> list[Any]:
        return [x for r in restores for x in (r, hit(r["prompts"][0] if isinstance(r, dict) else r))]

    kvs = kvstrata_transfer_config(nvme_dir)
    exc = example_transfer_config(example_dir)
    # cold: P, M...; then P hits vLLM's own prefix cache n times (the compute floor of a restore)
    a = run("no_connector", [warm[0], long_prompt, *miss_prompts, *[long_prompt] * n], None)
    # cold: P, (P at once), M...; then P, M... restored from DRAM, each followed by its floor
    b = run(
        "kvstrata_dram",
        [warm[1], long_prompt, long_prompt, *miss_prompts, *paired([settled(long_prompt), *miss_prompts])],
        kvs,
        reset=True,
    )
    nvme_after_store = _nvme_blocks(nvme_dir)
    c = run("kvstrata_nvme", [warm[2], *paired([long_prompt, *miss_prompts])], kvs, reset=True)
    run("example_store", [warm[3], long_prompt], exc)
    e = run("example_restore", [warm[4], *paired([settled(long_prompt), *[long_prompt] * (n - 1)])], exc, reset=True)
    f = None
    dropped = 0
    if example_cold:
        dropped = _drop_from_page_cache(example_dir)
        f = run("example_restore_cold", [warm[5], *paired([long_prompt])], exc)
    interleaved = None
    if miss_context is not None and miss_rounds > 0:
        interleaved = misses_interleaved(miss_context)

    block = int(a["config"]["block_size"])
    expected_cached = (context - 1) // block * block

    def turns(res: Mapping[str, Any] | None, idx: Sequence[int]) -> list[Mapping[str, Any]]:
        return [] if res is None else [res["turns"][i] for i in idx]

    def ttfts(ts: Sequence[Mapping[str, Any]]) -> list[float]:
        return [float(t["ttft_s"]) for t in ts]

    def restored(ts: Sequence[Mapping[str, Any]]) -> list[float]:
        """TTFTs of the turns that restored the whole prompt (all of them if none did)."""
        full = [t for t in ts if t["num_cached_tokens"] >= expected_cached]
        return ttfts(full or ts)

    def med(xs: Sequence[float]) -> float | None:
        return round(_median(xs), 4) if xs else None

    cold_a = turns(a, range(1, 1 + n))
    hits_a = turns(a, range(1 + n, 1 + 2 * n))
    cold_b_idx = [1, *range(3, 3 + misses)]
    cold_b = turns(b, cold_b_idx)
    now_b = turns(b, [2])
    dram_b = turns(b, range(3 + misses, 3 + misses + 2 * n, 2))
    dram_b_floor = turns(b, range(4 + misses, 4 + misses + 2 * n, 2))
    nvme_c = turns(c, range(1, 1 + 2 * n, 2))
    nvme_c_floor = turns(c, range(2, 2 + 2 * n, 2))
    ex_e = turns(e, range(1, 1 + 2 * n, 2))
    ex_e_floor = turns(e, range(2, 2 + 2 * n, 2))
    ex_f = turns(f, [1])
    ex_f_floor = turns(f, [2])

    recompute, floor = med(ttfts(cold_a)), med(ttfts(hits_a))
    dram, dram_now, nvme = med(restored(dram_b)), med(ttfts(now_b)), med(restored(nvme_c))
    ex, ex_cold = med(restored(ex_e)), med(restored(ex_f))
    # the 16K cold prompts, paired by prompt (P, M1.. on both sides; not adjacent in time)
    miss_seq = spread([b_ / a_ - 1 for a_, b_ in zip(ttfts(cold_a), ttfts(cold_b), strict=True)])
    miss_seq_of_medians = round(_median(ttfts(cold_b)) / _median(ttfts(cold_a)) - 1, 4)

    def over_floor(ts: Sequence[Mapping[str, Any]], fl: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """A restore's TTFT above the compute floor: ``paired`` = restore - the same prompt's
        prefix-cache hit right after it in the same instance (the figure the target uses);
        ``vs_no_connector_floor`` = restore - the no-connector instance's median hit;
        ``same_instance_floor_s`` = those hits themselves (a connector's own cost on a hit)."""
        r, h = ttfts(ts), ttfts(fl)
        return {
            "paired": spread([x - y for x, y in zip(r, h, strict=True)]),
            "vs_no_connector_floor": spread([x - floor for x in r]) if floor is not None else None,
            "same_instance_floor_s": spread(h),
        }

    overhead_over_floor = {
        "kvstrata_dram": over_floor(dram_b, dram_b_floor),
        "kvstrata_nvme": over_floor(nvme_c, nvme_c_floor),
        "example": over_floor(ex_e, ex_e_floor),
        "example_cold_page_cache": over_floor(ex_f, ex_f_floor),
    }
    dram_over = overhead_over_floor["kvstrata_dram"]["paired"]
    ex_over = overhead_over_floor["example"]["paired"]
    dram_below_example = dram_over is not None and ex_over is not None and dram_over["median"] < ex_over["median"]
    dram_below_example_note = (
        "not measured"
        if dram_over is None or ex_over is None
        else (
            f"kvstrata DRAM {dram_over['median']:.3f} s (range {dram_over['min']:.3f} .. {dram_over['max']:.3f}) vs "
            f"ExampleConnector {ex_over['median']:.3f} s (range {ex_over['min']:.3f} .. {ex_over['max']:.3f}) above "
            "the paired floor: "
            + (
                "below, ranges apart"
                if dram_over["max"] < ex_over["min"]
                else ("below by the median, ranges overlap" if dram_below_example else "not below")
            )
        )
    )
    miss_main = interleaved["overhead"] if interleaved is not None else miss_seq
    miss_what = (
        f"interleaved miss overhead at {interleaved['context']} tokens" if interleaved is not None else "miss overhead"
    )
    miss_target = target_verdict(miss_main, TARGETS["miss_overhead"], miss_what)
    if interleaved is not None and interleaved["null_a2_vs_a"] is not None:
        nl = interleaved["null_a2_vs_a"]
        miss_target["verdict"] += (
            f"; null A/A {nl['median']:+.2%} (interval {nl['interval'][0]:+.2%} .. {nl['interval'][1]:+.2%})"
        )
        resolvable = max(abs(nl["interval"][0]), abs(nl["interval"][1])) <= TARGETS["miss_overhead"]
        miss_target["resolvable"] = resolvable
        if not resolvable:
            miss_target["verdict"] += (
                f": the noise floor is wider than {TARGETS['miss_overhead']:.0%}, so this run cannot resolve the target"
            )
        q = interleaved["overhead_quiet_rounds"]
        miss_target["verdict"] += (
            "; no quiet rounds (other work on the machine in every pair)"
            if q is None
            else f"; quiet rounds only: {q['median']:+.2%} (n = {q['n']})"
        )
    miss_overhead = miss_main["median"] if miss_main is not None else miss_seq_of_medians

    def restore_check(ts: Sequence[Mapping[str, Any]], tier: str | None) -> dict[str, Any]:
        if not ts:
            return {}
        out: dict[str, Any] = {
            "num_cached_tokens": [t["num_cached_tokens"] for t in ts],
            "expected_cached_tokens": expected_cached,
            "full": all(t["num_cached_tokens"] >= expected_cached for t in ts),
            "local_prefix_cache_hits": sum(_counter(t["metrics_delta"], "vllm:prefix_cache_hits") for t in ts),
        }
        if tier is None:
            return out
        hits: dict[str, float] = {}
        served = True
        for t in ts:
            md = t["metrics_delta"]
            mine = {k.split("tier=", 1)[1].rstrip("}"): v for k, v in md.items() if k.startswith(_HITS + "{")}
            served = served and mine.get(tier, 0) > 0
            for k, v in mine.items():
                hits[k] = hits.get(k, 0) + v
        load_ms = [_counter(t["metrics_delta"], "vllm:kvstrata_load_time_ms") for t in ts]
        loaded = [_counter(t["metrics_delta"], "vllm:kvstrata_loaded_bytes") for t in ts]
        out.update(
            {
                "hit_blocks": hits,
                "served_by_expected_tier": served,
                "loaded_blocks": sum(_counter(t["metrics_delta"], "vllm:kvstrata_loaded_blocks") for t in ts),
                "failed_loads": sum(_counter(t["metrics_delta"], "vllm:kvstrata_failed_loads") for t in ts),
                "load_time_ms": load_ms,
                "load_gib_per_s": [
                    round(by / 2**30 / (ms / 1e3), 3) if ms > 0 else None
                    for by, ms in zip(loaded, load_ms, strict=True)
                ],
            }
        )
        return out

    def first_token_ok(ts: Sequence[Mapping[str, Any]], ref: Sequence[Mapping[str, Any]]) -> bool | None:
        if not ts:
            return None
        return all(t["output_ids"][:1] == r["output_ids"][:1] for t, r in zip(ts, ref, strict=True))

    speedups = {
        "kvstrata_dram": _ratio(recompute, dram),
        "kvstrata_nvme": _ratio(recompute, nvme),
        "example": _ratio(recompute, ex),
        "example_cold_page_cache": _ratio(recompute, ex_cold),
        "kvstrata_dram_immediate": _ratio(recompute, dram_now),
        "vllm_prefix_cache_hit": _ratio(recompute, floor),
    }
    dram_vs_example = _ratio(ex, dram)
    overlapped = {name: r["foreign_busy_frac"] for name, r in runs.items() if r["foreign_busy_frac"] > 0.05}
    problems = {name: r["problems"] for name, r in runs.items() if r.get("problems")}
    cores = {name: r["omp_core_ids"] for name, r in runs.items()}
    threads = {name: r["worker_threads"] for name, r in runs.items()}

    def minus(x: float | None, y: float | None) -> float | None:
        return None if x is None or y is None else round(x - y, 4)

    figures: dict[str, Any] = {
        "context": context,
        "block_size": block,
        "samples": n,
        "ttft_s": {
            "recompute": recompute,
            "vllm_prefix_cache_hit": floor,
            "kvstrata_dram": dram,
            "kvstrata_nvme": nvme,
            "example": ex,
            "example_cold_page_cache": ex_cold,
            "kvstrata_dram_immediate": dram_now,
        },
        "ttft_samples_s": {
            "recompute": ttfts(cold_a),
            "vllm_prefix_cache_hit": ttfts(hits_a),
            "kvstrata_dram": ttfts(dram_b),
            "kvstrata_nvme": ttfts(nvme_c),
            "example": ttfts(ex_e),
            "example_cold_page_cache": ttfts(ex_f),
            "kvstrata_cold": ttfts(cold_b),
        },
        "speedups": speedups,
        "kvstrata_dram_vs_example": dram_vs_example,
        "kvstrata_nvme_vs_example_cold_page_cache": _ratio(ex_cold, nvme),
        "restore_overhead_over_prefix_cache_hit_s": {
            "kvstrata_dram": minus(dram, floor),
            "kvstrata_nvme": minus(nvme, floor),
            "example": minus(ex, floor),
            "example_cold_page_cache": minus(ex_cold, floor),
        },
        "restore_over_floor_s": overhead_over_floor,
        "miss": {
            "no_connector_ttft_s": ttfts(cold_a),
            "kvstrata_ttft_s": ttfts(cold_b),
            "no_connector_median_s": med(ttfts(cold_a)),
            "kvstrata_median_s": med(ttfts(cold_b)),
            "no_connector_foreign_cpu_s": [runs["no_connector"]["turns"][i]["foreign_cpu_s"] for i in range(1, 1 + n)],
            "kvstrata_foreign_cpu_s": [runs["kvstrata_dram"]["turns"][i]["foreign_cpu_s"] for i in cold_b_idx],
        },
        "miss_sequential": {
            "context": context,
            "overhead": miss_seq,  # per prompt: kvstrata / no connector - 1 (separate instances, minutes apart)
            "overhead_of_medians": miss_seq_of_medians,
        },
        "miss_interleaved": interleaved,
        "miss_overhead": miss_overhead,
        "miss_overhead_source": "miss_interleaved" if interleaved is not None else "miss_sequential",
        "targets": {
            "dram_ge_example": dram_vs_example is not None and dram_vs_example >= 1.0,
            "dram_ge_40x": (speedups["kvstrata_dram"] or 0) >= TARGETS["dram_speedup"],
            "nvme_ge_20x": (speedups["kvstrata_nvme"] or 0) >= TARGETS["nvme_speedup"],
            "dram_over_floor_below_example": dram_below_example,
            "dram_over_floor_below_example_note": dram_below_example_note,
            "miss_overhead_le_2pct": miss_target["met"],
            "miss_overhead_interval_le_2pct": miss_target.get("interval_within", False),
            "miss_overhead_resolvable": miss_target.get("resolvable"),
            "miss_overhead_note": miss_target["verdict"],
            # kvstrata's own time on a miss's critical path (its hooks), whole interval under 2%
            "miss_hook_share_le_2pct": hook_share_within(interleaved, TARGETS["miss_overhead"]),
        },
        "checks": {
            "kvstrata_dram": restore_check(dram_b, "dram"),
            "kvstrata_nvme": restore_check(nvme_c, "nvme"),
            "kvstrata_dram_immediate": restore_check(now_b, "dram"),
            "example": restore_check(ex_e, None),
            "example_cold_page_cache": restore_check(ex_f, None),
            "vllm_prefix_cache_hit": restore_check(hits_a, None),
            "kvstrata_dram_floor": restore_check(dram_b_floor, None),
            "kvstrata_nvme_floor": restore_check(nvme_c_floor, None),
            "example_floor": restore_check(ex_e_floor, None),
        },
        "first_token_matches_recompute": {
            "kvstrata_dram": first_token_ok(dram_b, cold_a),
            "kvstrata_nvme": first_token_ok(nvme_c, cold_a),
            "example": first_token_ok(ex_e, cold_a[:1] * n),
            "vllm_prefix_cache_hit": first_token_ok(hits_a, cold_a[:1] * n),
        },
        "fairness": {
            "omp_core_ids": cores,
            "worker_threads": threads,
            "same_threads_everywhere": len({json.dumps(v) for v in cores.values()}) == 1
            and len({json.dumps(v) for v in threads.values()}) == 1,
            "max_num_batched_tokens": max_model_len,
            "max_model_len": max_model_len,
            "kv_cache_space_gib": kv_space_gib,
            "dtype": dtype,
            "dtype_why": dtype_why,
            "example_page_cache_dropped_bytes": dropped,
        },
        "nvme_after_store_run": nvme_after_store,
        "nvme_blocks_expected": WARMUP_TOKENS // block + (context // block) * n,
        "overlapped_runs": overlapped,
        "log_problems": problems,
        "runs": runs,
        "workdir": str(work),
    }
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=DEFAULT_CONTEXT, help="prompt length in tokens (default 16384)")
    p.add_argument("--misses", type=int, default=2, help="extra never-seen prompts per side for the miss overhead")
    p.add_argument("--json", metavar="OUT", help="write the figures here")
    p.add_argument("--workdir", help="work directory (default: a temporary one, removed unless --keep)")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, NVMe and example files)")
    p.add_argument("--model-dir", help="bench model directory (default $VLLM_E2E_MODEL_CACHE/bench)")
    p.add_argument("--threads-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND for every instance")
    p.add_argument("--kv-space", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    p.add_argument(
        "--dtype",
        choices=("auto", *DTYPES),
        default="auto",
        help="vLLM's compute dtype (auto: bfloat16 where the CPU computes it natively, else float32)",
    )
    p.add_argument("--no-example-cold", action="store_true", help="skip the ExampleConnector cold-page-cache run")
    p.add_argument(
        "--miss-context",
        type=int,
        default=4096,
        help="prompt length of the interleaved miss-overhead runs (default 4096)",
    )
    p.add_argument("--miss-rounds", type=int, default=18, help="interleaved rounds (0: skip; default 18)")
    p.add_argument("--timeout", type=float, help="seconds per vLLM instance")
    p.add_argument(
        "--miss-only", action="store_true", help="only the interleaved miss overhead (3 instances at --miss-context)"
    )
    args = p.parse_args(argv)
    if args.miss_only and args.miss_rounds <= 0:
        p.error(f"--miss-only needs --miss-rounds above 0, not {args.miss_rounds}")
    reason = vllm_skip_reason()
    if reason is not None:
        print(reason, file=sys.stderr)
        return 2
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="vllm-ttft-"))
    try:
        figures = measure(
            args.context,
            misses=args.misses,
            workdir=work,
            model_dir=args.model_dir,
            threads_bind=args.threads_bind,
            kv_space_gib=args.kv_space,
            dtype=None if args.dtype == "auto" else args.dtype,
            example_cold=not args.no_example_cold,
            miss_context=args.miss_context,
            miss_rounds=args.miss_rounds,
            timeout=args.timeout,
            miss_only=args.miss_only,
        )
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(figures, indent=2)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    if args.miss_only:
        print("\n".join(_miss_lines(figures["miss_interleaved"])))
        return 0
    summary = {k: figures[k] for k in ("ttft_s", "speedups", "kvstrata_dram_vs_example", "miss_overhead", "targets")}
    print(json.dumps(summary, indent=2))
    print(summary_text(figures))
    return 0


def summary_text(figures: Mapping[str, Any]) -> str:
    """The spreads, one line each: restore cost over the floor, miss overheads, foreign CPU."""
    lines = [
        f"restore above the compute floor at {figures['context']} tokens (s; paired: minus the same prompt's hit next)"
    ]
    for name, v in figures["restore_over_floor_s"].items():
        lines.append(f"  {name:24s} paired {_fmt_spread(v['paired'])}")
        lines.append(f"  {'':24s} vs no-connector floor {_fmt_spread(v['vs_no_connector_floor'])}")
    seq = figures["miss_sequential"]
    lines.append(
        f"miss overhead, sequential at {seq['context']} tokens, per prompt: {_fmt_spread(seq['overhead'], True)}"
    )
    il = figures.get("miss_interleaved")
    if il is not None:
        lines += _miss_lines(il)
    foreign = {k: r["foreign_cpu_s"] for k, r in figures["runs"].items()}
    lines.append(f"foreign CPU s by run: {foreign}")
    lines.append(f"targets: {json.dumps(figures['targets'], indent=1)}")
    return "\n".join(lines)


def hook_share_within(il: Mapping[str, Any] | None, target: float) -> bool | None:
    """Whether the upper end of the interval of kvstrata's hook-time share of a cold turn's TTFT
    is within ``target``; None without the interleaved run."""
    share = None if il is None else il.get("connector_hook_share")
    return None if share is None else bool(share["interval"][1] <= target)


def _miss_lines(il: Mapping[str, Any]) -> list[str]:
    """The interleaved miss overhead's lines of the summary."""
    lines: list[str] = []
    lines.append(
        f"miss overhead, interleaved at {il['context']} tokens, per round B/A: {_fmt_spread(il['overhead'], True)}"
    )
    lines.append(f"  null test A2/A (no connector on either side):      {_fmt_spread(il['null_a2_vs_a'], True)}")
    if il.get("connector_hook_share") is not None:
        lines.append(
            f"  kvstrata's hooks in B's turns: {_fmt_spread(il['connector_hook_ms'])} ms, "
            f"{_fmt_spread(il['connector_hook_share'], True)} of the TTFT"
        )
    lines.append(f"  quiet rounds only, B/A:  {_fmt_spread(il['overhead_quiet_rounds'], True)}")
    lines.append(f"  quiet rounds only, A2/A: {_fmt_spread(il['null_quiet_rounds'], True)}")
    bg = il["background_cpu_s"]
    lines.append(
        f"  CPU after a turn (until idle), kvstrata B: {_fmt_spread(bg['B'])} s, no connector A: "
        f"{_fmt_spread(bg['A'])} s"
    )
    lines.append(
        f"  idle partners' CPU per turn {_fmt_spread(il['idle_partner_cpu_s'])} s; "
        f"foreign CPU {il['foreign_cpu_s_total']} s over {il['wall_s']} s"
    )
    return lines


if __name__ == "__main__":
    sys.exit(main())
