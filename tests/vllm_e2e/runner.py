"""Run ONE vLLM ``LLM`` in a fresh subprocess and get its results back as JSON.

Parent side: :func:`run_vllm`. It writes the arguments to a JSON file, starts
``[python, runner.py, args.json]`` in a new session (so the engine-core and worker processes
vLLM spawns can be cleaned up as a group), waits, and returns the result dict. The child's
stdout and stderr (vLLM's logs, including those of its spawned processes) go to a log file;
on failure the tail of that log is in the raised :class:`VllmRunError`. By default that child
is not exec'ed but forked from the session's zygote (``zygote.py``: a ``runner.py --zygote``
process that imported vLLM once, saving that import, 15-20 s on 2 cores, per run); it is the
same process otherwise (own session, the run's environment and log, the same ``_child``), and
vLLM still spawns a fresh engine core and worker from it. ``VLLM_E2E_ZYGOTE=0`` execs every
child; ``result["started_by"]`` says which way a run started.

Child side (``python runner.py args.json``): builds
``LLM(model=dir, skip_tokenizer_init=True, dtype=DEFAULT_DTYPE, enforce_eager=True, ...)`` with
stats logging ON (``disable_log_stats=False``, needed for ``llm.get_metrics()``), then runs the
turns IN ORDER, one ``llm.generate`` call per turn, greedy
(``SamplingParams(temperature=0, max_tokens=N, detokenize=False, ignore_eos=True)``).

A turn is one of:

* ``[ids...]`` - an explicit prompt (token ids < vocab size);
* ``{"continue": k, "append": [ids...]}`` - prompt = turn k's prompt + turn k's output +
  ``append`` (a chat session: turn k+1 extends turn k). For a batch turn k use
  ``"continue": [k, j]`` (request j of turn k);
* ``{"ids": [ids...], "cache_salt": "..."}`` - an explicit prompt with options;
* ``{"prompts": [spec, ...]}`` - a batch: several prompts (each an explicit list or one of the
  dicts above) submitted in ONE ``generate`` call.

A dict turn may carry ``"pause_s": x``: the runner sleeps x seconds before it (after any prefix
cache reset), e.g. to let a connector's background work from earlier turns finish. Before that, a
turn's ``"mark": path`` makes the runner create that file, and ``"wait_for": path`` makes it wait
(up to ``"wait_s"``, default 60 s, then the run fails) until that file exists: a test's other
processes act between turns that way (e.g. resume a stopped subscriber). ``"reset_prefix_cache":
bool`` overrides ``reset_prefix_cache_between`` for that turn (e.g. ``False`` to re-send a
prompt as a hit in vLLM's own prefix cache).

A dict turn may also carry ``"gate": path``, so that another process decides when it runs (e.g.
several instances taking turns, only one computing at a time): after any reset, mark, wait and
pause the runner makes ``path`` a FIFO (unless something is there already), writes ``path + ".waiting"``
(JSON: its pid, which leads its session, and the session's CPU seconds so far), and blocks reading
one byte from ``path`` (no polling, so a waiting instance uses no CPU) until the other process
writes it; then it runs the turn and writes ``path + ".done"`` (the same JSON). Such a turn's
record has ``session_cpu_s``: the CPU seconds of every process in the run's session (the
runner, vLLM's engine core and worker) at its start and end.

:func:`chat_turns` builds such a session with exact prompt lengths.

Any prompt dict may carry ``"lora": {"name": ..., "path": ..., "id": n}``: the prompt runs
with that adapter (``LoRARequest(name, id, path)``; the ``LLM`` needs ``enable_lora=True`` and a
``max_lora_rank`` in ``llm_kwargs``). The records of such a prompt carry ``"lora"`` (its name).

Any prompt dict may carry ``"cache_salt": "..."``; ``cache_salts[i]`` gives the default salt
for every prompt of turn i. The salt is passed the vLLM 0.32 way, inside the token prompt:
``{"prompt_token_ids": ids, "cache_salt": salt}``; vLLM mixes it into the hash of the first
block, so differently-salted prompts never share prefix-cache blocks (``Request.cache_salt`` is
what a connector sees).

Result (``dict``; ``json``-able):

* ``engine_start_s``: seconds to construct the ``LLM``;
* ``turns``: per turn ``prompt_len``, ``output_ids``, ``num_cached_tokens`` (vLLM's
  ``RequestOutput.num_cached_tokens`` = local prefix-cache hits + external/connector hits),
  ``num_cache_creation_tokens``, ``elapsed_s`` (wall time of the ``generate`` call),
  ``ttft_s`` (the request's ``metrics.first_token_latency``), ``kv_transfer_params``, and
  ``metrics_delta``: the change of every Prometheus counter during that turn, keyed
  ``"vllm:name"`` or ``"vllm:name{label=value}"`` (model/engine labels dropped), e.g.
  ``vllm:prefix_cache_hits`` (local, in tokens), ``vllm:external_prefix_cache_hits``
  (connector, in tokens; counted when a request is admitted), ``vllm:prompt_tokens_cached``.
  Batch turns put one such record per prompt in ``requests`` (single-prompt turns have
  ``requests`` too, with the fields also copied to the turn);
* ``metrics``: all counters at the end (same keys); ``histograms``: count/sum of histograms;
* ``config``: block size, HMA on/off, prefix caching as vLLM resolved them;
* ``log_facts``: selected log lines (``kv cache group sizes``, ``kv lcm block sizes``, KV cache
  size, "Turning off hybrid kv cache manager", connector lines) and counts of
  "External Cache Hit" / "Inject KV cache" lines;
* ``log_path``: the full log; ``wall_s``: the whole child, imports and shutdown included.

:data:`PROBE_CONNECTOR` is a ``kv_transfer_config`` for a do-nothing connector that subclasses
``SupportsHMA`` and logs the KV cache groups and tensors vLLM hands it (``log_facts["probe"]``).

CPU threads: left to itself (``VLLM_CPU_OMP_THREADS_BIND=auto``) vLLM reserves one core per
rank for the engine-core process, plus one more when a ``kv_transfer_config`` is set: on a
2-core machine that is 1 compute thread without a connector and 2 with one, and a different
reduction order gives other greedy tokens. So every child gets an explicit binding, the same with
and without a connector: ``VLLM_CPU_OMP_THREADS_BIND`` from the caller's environment or
``extra_env`` if set there, else :func:`default_threads_bind` (one thread, on the first CPU this
process may run on). ``result["threads"]`` records what the worker actually got (its torch thread
count, ``OMP_NUM_THREADS`` and CPU affinity, read inside the worker through
:class:`ThreadProbe`), and :func:`assert_comparable` fails with both settings named when two runs
being compared differ in it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING or __package__:
    from . import zygote as _zygote
else:  # run as a script (the child, the zygote) or imported by vLLM's processes as ``runner``
    import zygote as _zygote

#: Environment every child gets unless the caller overrides it (``extra_env``).
DEFAULT_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "PYTHONUNBUFFERED": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

#: How many OpenMP threads a child's worker gets unless ``VLLM_CPU_OMP_THREADS_BIND`` is set.
DEFAULT_THREADS = 1

#: The dtype children run in (``LLM(dtype=...)``) unless a call says otherwise. float32, not the
#: bfloat16 of production: a random-weight model's top-1 lead is often a few hundredths of a nat,
#: and bf16 rounding (~2^-8 per step, more when the thread count changes the reduction order)
#: flips such near-ties between equivalent computations; in float32 the same runs differ by
#: ~1e-5 nats. kvstrata moves pages as bytes, so the dtype does not change what is tested.
#: The TTFT benchmark passes ``dtype="bfloat16"``.
DEFAULT_DTYPE = "float32"


def default_threads_bind(threads: int = DEFAULT_THREADS) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``threads`` threads on the first CPUs this process may
    run on (ids from its affinity mask, so it also works in a container given CPUs 4-7)."""
    cpus = sorted(os.sched_getaffinity(0))
    if threads < 1 or threads > len(cpus):
        raise ValueError(f"threads={threads}: this process may run on {len(cpus)} CPU(s) ({cpus})")
    return ",".join(str(c) for c in cpus[:threads])


def _compute_config(result: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of a run that change its arithmetic (not just its speed)."""
    config = result.get("config", {})
    return {k: config.get(k) for k in ("dtype", "mamba_ssm_cache_dtype")}


def assert_comparable(*results: Mapping[str, Any]) -> None:
    """Fail, naming the settings, unless every run had the same compute threads and dtypes.

    Greedy tokens of runs with different thread counts may differ by reduction order alone; a
    test comparing outputs calls this first, so such a difference names itself instead of
    showing up as a token mismatch."""
    seen = [(r.get("threads"), _compute_config(r)) for r in results]
    for i, (threads, dtype) in enumerate(seen):
        if threads is None or not threads.get("workers"):
            raise AssertionError(f"run {i} recorded no worker thread count: {results[i].get('log_path')}")
        if dtype.get("dtype") is None:
            raise AssertionError(f"run {i} recorded no dtype: {results[i].get('log_path')}")
    key = [([w["torch_threads"] for w in t["workers"]], t["bind"], d) for t, d in seen]  # type: ignore[index]
    if any(k != key[0] for k in key[1:]):
        lines = [f"run {i}: threads={k[0]} bind={k[1]!r} compute={k[2]}" for i, k in enumerate(key)]
        raise AssertionError("runs compared with different compute settings:\n" + "\n".join(lines))


#: Smallest top-1 lead (nats) over the runner-up that rounding cannot overturn, per dtype. In
#: float32 equivalent computations (other thread counts, prefix hit vs full prefill) move these
#: log-probabilities by ~1e-5 (1.5e-5 measured between 1 and 2 threads), so 1e-3 is decisive.
#: In bfloat16 the logits themselves are quantised to ~0.03 nats and upstream rounding moves
#: them by more, so only a lead of several steps counts.
MARGIN_FLOORS = {"float32": 1e-3, "bfloat16": 0.1}


def margin_floor(result: Mapping[str, Any]) -> float:
    dtype = result["config"]["dtype"]
    if dtype not in MARGIN_FLOORS:
        raise ValueError(f"no margin floor for dtype {dtype!r}: known {sorted(MARGIN_FLOORS)}")
    return MARGIN_FLOORS[dtype]


def decisive_prefix(request: Mapping[str, Any], floor: float) -> int:
    """How many leading greedy steps of ``request`` led by at least ``floor`` nats: up to there
    its tokens are decided by the model, after the first near-tie by rounding (and every later
    step continues from that choice)."""
    margins = request.get("margins")
    if margins is None:
        raise AssertionError(f"no margins recorded for a request with outputs {request.get('output_ids')}")
    n = 0
    while n < len(margins) and margins[n] >= floor:
        n += 1
    return n


def assert_same_decisive_outputs(got: Mapping[str, Any], want: Mapping[str, Any], floor: float) -> int:
    """``got``'s tokens equal ``want``'s over ``want``'s decisive prefix; returns its length."""
    n = decisive_prefix(want, floor)
    assert list(got["output_ids"][:n]) == list(want["output_ids"][:n]), (
        f"outputs differ within the first {n} decisive steps: {got['output_ids']} vs {want['output_ids']} "
        f"(margins of the reference: {want['margins']})"
    )
    return n


def assert_decisive(result: Mapping[str, Any], floor: float | None = None) -> None:
    """Fail unless every greedy step of ``result`` led its runner-up by at least ``floor`` nats
    (default: :data:`MARGIN_FLOORS` for its dtype): output equality against it then means the KV
    was right, not that a near-tie fell one way."""
    floor = margin_floor(result) if floor is None else floor
    for turn in result["turns"]:
        for j, req in enumerate(turn["requests"]):
            margins = req.get("margins")
            if margins is None:
                raise AssertionError(f"turn {turn['index']} request {j}: no margins recorded")
            low = [(i, m) for i, m in enumerate(margins) if m < floor]
            if low:
                raise AssertionError(
                    f"turn {turn['index']} request {j}: greedy step(s) {low} lead by less than {floor} nats "
                    f"(outputs {req['output_ids']}); token equality there would be decided by rounding"
                )


#: Log lines worth surfacing in ``result["log_facts"]["lines"]``.
_LOG_FACT_PATTERNS = (
    r"kv cache group sizes",
    r"kv lcm block sizes",
    r"KV cache size:",
    r"Maximum concurrency",
    r"Turning off hybrid kv cache manager",
    r"[Hh]ybrid",
    r"KV ?[Cc]onnector",
    r"kv_transfer",
    r"block_size",
    r"sliding",
)
_LOG_COUNT_PATTERNS = {
    "external_cache_hit": r"External Cache Hit",
    "inject_kv": r"Inject KV cache of",
}

Turn = Sequence[int] | Mapping[str, Any]


class VllmRunError(RuntimeError):
    """The child failed or timed out; ``log_tail`` holds the end of its log."""

    def __init__(self, msg: str, log_path: Path, log_tail: str) -> None:
        super().__init__(f"{msg}\n--- log {log_path} (tail) ---\n{log_tail}")
        self.log_path = log_path
        self.log_tail = log_tail


def _tail(path: Path, max_chars: int = 8000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return "<no log>"
    return data[-max_chars:].decode("utf-8", "replace")


def run_vllm(
    model_dir: str | os.PathLike[str],
    turns: Sequence[Turn],
    *,
    kv_transfer_config: Mapping[str, Any] | None = None,
    max_tokens: int = 8,
    block_size: int | None = None,
    enable_prefix_caching: bool = True,
    reset_prefix_cache_between: bool = False,
    reset_connector: bool = False,
    extra_env: Mapping[str, str] | None = None,
    timeout: float = 300,
    cache_salts: Sequence[str | None] | None = None,
    max_model_len: int = 4096,
    max_num_batched_tokens: int | None = None,
    seed: int = 0,
    dtype: str = DEFAULT_DTYPE,
    llm_kwargs: Mapping[str, Any] | None = None,
    log_path: str | os.PathLike[str] | None = None,
    workdir: str | os.PathLike[str] | None = None,
    python: str | None = None,
    use_zygote: bool = True,
) -> dict[str, Any]:
    """Run the turns in one fresh vLLM process; return the result dict (see module docstring).

    ``kv_transfer_config`` is passed to ``LLM(kv_transfer_config=...)`` as a dict (vLLM turns it
    into a ``KVTransferConfig``), e.g. ``{"kv_connector": "ExampleConnector", "kv_role":
    "kv_both", "kv_connector_extra_config": {"shared_storage_path": "/some/dir"}}``; a connector
    class outside vLLM also needs ``"kv_connector_module_path"``. ``block_size=None`` keeps
    vLLM's default (128 on CPU). ``reset_prefix_cache_between`` calls ``llm.reset_prefix_cache(
    reset_connector=reset_connector)`` before every turn but the first. ``llm_kwargs`` are
    passed to ``LLM`` last and override everything. ``use_zygote=False`` execs the child even
    where the zygote is enabled (the zygote serves one run at a time: runs alive together, e.g.
    taking turns through ``"gate"``, each need their own process). Raises :class:`VllmRunError`
    on failure.
    """
    work = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="vllm-run-"))
    work.mkdir(parents=True, exist_ok=True)
    args_path = work / "args.json"
    result_path = work / "result.json"
    log = Path(log_path) if log_path is not None else work / "vllm.log"
    if result_path.exists():
        result_path.unlink()
    args = {
        "model": str(model_dir),
        "turns": [t if isinstance(t, Mapping) else list(t) for t in turns],
        "kv_transfer_config": dict(kv_transfer_config) if kv_transfer_config is not None else None,
        "max_tokens": max_tokens,
        "block_size": block_size,
        "enable_prefix_caching": enable_prefix_caching,
        "reset_prefix_cache_between": reset_prefix_cache_between,
        "reset_connector": reset_connector,
        "cache_salts": list(cache_salts) if cache_salts is not None else None,
        "max_model_len": max_model_len,
        "max_num_batched_tokens": max_num_batched_tokens,
        "seed": seed,
        "dtype": dtype,
        "llm_kwargs": dict(llm_kwargs or {}),
        "result_path": str(result_path),
    }
    args_path.write_text(json.dumps(args))
    env = dict(os.environ)
    for k, v in DEFAULT_ENV.items():
        env.setdefault(k, v)
    here = str(Path(__file__).resolve().parent)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (here, env.get("PYTHONPATH")) if x)
    env.update(extra_env or {})
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", default_threads_bind())
    script = Path(__file__).with_name("runner.py")
    t0 = time.monotonic()
    started_by = "zygote" if use_zygote and _zygote.enabled() and python in (None, sys.executable) else "exec"
    if started_by == "zygote":
        try:
            rc, timed_out = _zygote.run_in_zygote(script, args_path, log, env, timeout)
        except RuntimeError as e:
            raise VllmRunError(str(e), log, _tail(log)) from e
    else:
        with open(log, "wb") as logf:
            proc = subprocess.Popen(
                [python or sys.executable, str(script), str(args_path)],
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        try:
            timed_out = not _zygote.wait_no_reap(proc.pid, t0 + timeout)
        finally:
            # The child leads its own session: killing the group hits only what this run started,
            # vLLM's engine-core and worker processes, if any outlived the child.
            _zygote.kill_group(proc.pid)
            rc = proc.wait()
    if timed_out:
        raise VllmRunError(f"vLLM run timed out after {timeout:.0f} s", log, _tail(log))
    wall = time.monotonic() - t0
    if rc != 0 or not result_path.exists():
        raise VllmRunError(f"vLLM run failed (exit code {rc})", log, _tail(log))
    result = json.loads(result_path.read_text())
    result["log_path"] = str(log)
    result["wall_s"] = wall
    result["started_by"] = started_by
    result["log_facts"] = _log_facts(log)
    result.setdefault("threads", {})["bind"] = env["VLLM_CPU_OMP_THREADS_BIND"]
    return result


def _log_facts(log: Path) -> dict[str, Any]:
    try:
        text = log.read_text("utf-8", "replace")
    except OSError:
        return {}
    fact_re = re.compile("|".join(_LOG_FACT_PATTERNS))
    lines = []
    for line in text.splitlines():
        if fact_re.search(line) and line not in lines:
            lines.append(line[:400])
    out: dict[str, Any] = {"lines": lines[:60]}
    for key, pat in _LOG_COUNT_PATTERNS.items():
        out[key] = len(re.findall(pat, text))
    m = re.search(r"kv cache group sizes \(([^)]*)\)", text)
    if m:
        out["kv_cache_group_sizes"] = [int(x) for x in m.group(1).replace(" ", "").split(",") if x]
    m = re.search(r"kv lcm block sizes (\d+)", text)
    if m:
        out["kv_lcm_block_size"] = int(m.group(1))
    m = re.search(r"KV cache size: ([\d,]+) tokens", text)
    if m:
        out["kv_cache_size_tokens"] = int(m.group(1).replace(",", ""))
    out["hma_turned_off"] = "Turning off hybrid kv cache manager" in text
    probes = []
    for m in re.finditer(r"\[kv-probe\] (\{.*\})", text):
        with contextlib.suppress(ValueError):
            probes.append(json.loads(m.group(1)))
    if probes:
        out["probe"] = probes
    return out


def chat_turns(
    lengths: Sequence[int] = (600, 900, 1200),
    *,
    max_tokens: int = 8,
    vocab: int = 1024,
    seed: int = 0,
    low: int = 3,
) -> list[Turn]:
    """A multi-turn session whose prompts have exactly ``lengths`` tokens: turn 0 is explicit
    random ids; turn k continues turn k-1 (its prompt + its ``max_tokens`` outputs) and appends
    random ids up to ``lengths[k]``. Ids are in ``[low, vocab)`` (below 3 are special ids)."""
    import random

    rng = random.Random(seed)
    turns: list[Turn] = [[rng.randrange(low, vocab) for _ in range(lengths[0])]]
    for k in range(1, len(lengths)):
        n = lengths[k] - lengths[k - 1] - max_tokens
        if n < 0:
            raise ValueError(f"turn {k}: {lengths[k]} tokens is less than turn {k - 1} + its output")
        turns.append({"continue": k - 1, "append": [rng.randrange(low, vocab) for _ in range(n)]})
    return turns


#: ``kv_transfer_config`` for :class:`HMAProbeConnector` (defined lazily below; the runner's
#: directory is on the children's ``PYTHONPATH``, so vLLM can import it as module ``runner``).
PROBE_CONNECTOR: dict[str, Any] = {
    "kv_connector": "HMAProbeConnector",
    "kv_connector_module_path": "runner",
    "kv_role": "kv_both",
}


def _make_probe_connector() -> type:
    """A connector that moves nothing and declares ``SupportsHMA``: it shows whether vLLM keeps
    the hybrid KV cache manager on, and logs (``[kv-probe] {json}`` lines, collected into
    ``log_facts["probe"]``) the KV cache groups it is given and the registered KV tensors."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        SupportsHMA,
    )

    def emit(obj: dict[str, Any]) -> None:
        print("[kv-probe] " + json.dumps(obj, default=str), flush=True)

    class HMAProbeConnector(KVConnectorBase_V1, SupportsHMA):
        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            super().__init__(vllm_config, role, kv_cache_config)
            groups = []
            for g in getattr(kv_cache_config, "kv_cache_groups", None) or []:
                spec = g.kv_cache_spec
                groups.append(
                    {
                        "spec": type(spec).__name__,
                        "block_size": spec.block_size,
                        "sliding_window": getattr(spec, "sliding_window", None),
                        "layers": list(g.layer_names),
                    }
                )
            emit(
                {
                    "event": "init",
                    "role": getattr(role, "name", str(role)),
                    "groups": groups,
                    "num_blocks": getattr(kv_cache_config, "num_blocks", None),
                }
            )

        def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
            emit(
                {
                    "event": "register_kv_caches",
                    "tensors": {
                        n: {"shape": list(t.shape), "dtype": str(t.dtype), "data_ptr": t.data_ptr()}
                        for n, t in kv_caches.items()
                    },
                }
            )

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            pass

        def wait_for_layer_load(self, layer_name: str) -> None:
            pass

        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
            pass

        def wait_for_save(self) -> None:
            pass

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
            return 0, False

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
            pass

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            return KVConnectorMetadata()

        def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
            return False, None

    return HMAProbeConnector


class ThreadProbe:
    """Mixed into vLLM's worker (``worker_extension_cls="runner.ThreadProbe"``): reports, from
    inside the worker process, the compute threads it really runs with."""

    def runner_threads(self) -> dict[str, Any]:
        import torch

        return {
            "torch_threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "affinity": sorted(os.sched_getaffinity(0)),
        }


def __getattr__(name: str) -> Any:
    # Lazy, so that importing this module (in the test process) does not import vLLM.
    if name == "HMAProbeConnector":
        cls = _make_probe_connector()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------------------------
# Child side
# ----------------------------------------------------------------------------------------------

_DROP_LABELS = {"model_name", "engine"}


def _metric_key(m: Any) -> str:
    labels = {k: v for k, v in (m.labels or {}).items() if k not in _DROP_LABELS}
    if not labels:
        return m.name
    return m.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"


def _snapshot(llm: Any) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Counters (and gauges) by key, and histograms as {count, sum}."""
    from vllm.v1.metrics.reader import Counter, Gauge, Histogram, Vector

    scalars: dict[str, float] = {}
    hists: dict[str, dict[str, float]] = {}
    try:
        metrics = llm.get_metrics()
    except Exception as e:  # pragma: no cover - stats disabled or API change
        return {"_error": repr(e)}, {}  # type: ignore[dict-item]
    for m in metrics:
        key = _metric_key(m)
        if isinstance(m, Counter | Gauge):
            scalars[key] = scalars.get(key, 0) + float(m.value)
        elif isinstance(m, Histogram):
            h = hists.setdefault(key, {"count": 0, "sum": 0.0})
            h["count"] += m.count
            h["sum"] += m.sum
        elif isinstance(m, Vector):
            scalars[key] = float(sum(m.values))
    return scalars, hists


def _margins(logprobs: Any) -> list[float] | None:
    """Per generated token: top-1 minus top-2 log-probability (nats); None without logprobs."""
    if not logprobs:
        return None
    out = []
    for step in logprobs:
        top = sorted((lp.logprob for lp in step.values()), reverse=True)
        out.append(float(top[0] - top[1]) if len(top) > 1 else float("inf"))
    return out


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    out = {}
    for k, v in after.items():
        if isinstance(v, int | float) and ":" in k:
            d = v - before.get(k, 0)
            if d:
                out[k] = d
    return out


def proc_stats() -> dict[int, tuple[int, int, int, str]]:
    """``pid -> (process group, session, CPU ticks (user + system), command name)`` of every live
    process, from ``/proc/<pid>/stat`` (a process that ends meanwhile is left out)."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        r = data.rfind(b")")  # the command name may hold spaces and parentheses
        fields = data[r + 2 :].split()
        comm = data[data.find(b"(") + 1 : r].decode("utf-8", "replace")
        with contextlib.suppress(IndexError, ValueError):
            out[int(name)] = (int(fields[2]), int(fields[3]), int(fields[11]) + int(fields[12]), comm)
    return out


def session_cpu_s(sid: int) -> float:
    """CPU seconds (user + system) of the live processes in session ``sid``, from ``/proc``."""
    ticks = sum(t for _pgrp, s, t, _comm in proc_stats().values() if s == sid)
    return ticks / os.sysconf("SC_CLK_TCK")


def _gate_mark(path: str, cpu: float) -> None:
    tmp = path + ".tmp"
    Path(tmp).write_text(json.dumps({"pid": os.getpid(), "sid": os.getsid(0), "session_cpu_s": cpu}))
    os.replace(tmp, path)


def _imports() -> None:
    """What a child imports before it reads its arguments (the zygote imports it once)."""
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401
    from vllm.v1.metrics.reader import Counter  # noqa: F401


def _between_turns(turn: Mapping[str, Any]) -> None:
    """A dict turn's ``mark``, ``wait_for`` and ``pause_s``, in that order."""
    if turn.get("mark"):
        Path(turn["mark"]).write_text(f"{time.time()}\n")
    if turn.get("wait_for"):
        path, end = Path(turn["wait_for"]), time.monotonic() + float(turn.get("wait_s", 60.0))
        while not path.exists():
            if time.monotonic() > end:
                raise RuntimeError(f"turn waited {turn.get('wait_s', 60.0)} s for {path}, which never appeared")
            time.sleep(0.05)
    if turn.get("pause_s"):
        time.sleep(float(turn["pause_s"]))


def _child(args_path: str) -> None:
    _imports()
    args = json.loads(Path(args_path).read_text())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = dict(
        model=args["model"],
        skip_tokenizer_init=True,
        dtype=args["dtype"],
        worker_extension_cls="runner.ThreadProbe",
        enforce_eager=True,
        max_model_len=args["max_model_len"],
        enable_prefix_caching=args["enable_prefix_caching"],
        disable_log_stats=False,
        seed=args["seed"],
    )
    if args["kv_transfer_config"] is not None:
        kwargs["kv_transfer_config"] = args["kv_transfer_config"]
    if args["block_size"] is not None:
        kwargs["block_size"] = args["block_size"]
    if args["max_num_batched_tokens"] is not None:
        kwargs["max_num_batched_tokens"] = args["max_num_batched_tokens"]
    kwargs.update(args["llm_kwargs"])

    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    engine_start_s = time.perf_counter() - t0
    print(f"[runner] engine_start_s={engine_start_s:.2f}", flush=True)

    workers = llm.collective_rpc("runner_threads")
    print(f"[runner] worker threads: {workers}", flush=True)
    vcfg = llm.llm_engine.vllm_config
    config = {
        "dtype": str(vcfg.model_config.dtype).removeprefix("torch."),
        "mamba_ssm_cache_dtype": vcfg.cache_config.mamba_ssm_cache_dtype,
        "block_size": vcfg.cache_config.block_size,
        "enable_prefix_caching": vcfg.cache_config.enable_prefix_caching,
        "disable_hybrid_kv_cache_manager": vcfg.scheduler_config.disable_hybrid_kv_cache_manager,
        "max_num_batched_tokens": vcfg.scheduler_config.max_num_batched_tokens,
        "num_gpu_blocks": getattr(vcfg.cache_config, "num_gpu_blocks", None),
        "kv_cache_size_tokens": getattr(vcfg.cache_config, "kv_cache_size_tokens", None),
        "max_model_len": vcfg.model_config.max_model_len,
    }

    # logprobs=2: the top-2 log-probabilities of every greedy step, so a run records how far its
    # chosen token was ahead (``margins``): a near-tie can flip on rounding alone.
    sp = SamplingParams(temperature=0, max_tokens=args["max_tokens"], detokenize=False, ignore_eos=True, logprobs=2)
    salts = args["cache_salts"]
    turn_prompts: list[list[list[int]]] = []  # per turn, per request: the prompt ids
    turn_outputs: list[list[list[int]]] = []
    turns_out: list[dict[str, Any]] = []

    def resolve(spec: Any, default_salt: str | None) -> tuple[list[int], str | None]:
        if isinstance(spec, list):
            return [int(x) for x in spec], default_salt
        salt = spec.get("cache_salt", default_salt)
        if "continue" in spec:
            ref = spec["continue"]
            k, j = (ref, 0) if isinstance(ref, int) else (int(ref[0]), int(ref[1]))
            ids = turn_prompts[k][j] + turn_outputs[k][j] + [int(x) for x in spec.get("append", [])]
            return ids, salt
        if "ids" in spec:
            return [int(x) for x in spec["ids"]], salt
        raise ValueError(f"bad prompt spec: {spec!r}")

    def lora_of(spec: Any) -> Any:
        lora = spec.get("lora") if isinstance(spec, dict) else None
        if lora is None:
            return None
        from vllm.lora.request import LoRARequest

        return LoRARequest(str(lora["name"]), int(lora["id"]), str(lora["path"]))

    before, hist_before = _snapshot(llm)
    for i, turn in enumerate(args["turns"]):
        default_salt = salts[i] if salts is not None and i < len(salts) else None
        specs = turn["prompts"] if isinstance(turn, dict) and "prompts" in turn else [turn]
        resolved = [resolve(s, default_salt) for s in specs]
        loras = [lora_of(s) for s in specs]
        prompts: list[TokensPrompt] = []
        for ids, salt in resolved:
            p = TokensPrompt(prompt_token_ids=ids)
            if salt:
                p["cache_salt"] = salt
            prompts.append(p)
        opts = turn if isinstance(turn, dict) else {}
        if opts.get("reset_prefix_cache", args["reset_prefix_cache_between"]) and i > 0:
            ok = llm.reset_prefix_cache(reset_connector=args["reset_connector"])
            print(f"[runner] reset_prefix_cache -> {ok}", flush=True)
        _between_turns(opts)  # mark, wait_for, pause_s
        gate = opts.get("gate")
        cpu_start = None
        if gate is not None:
            cpu_start = session_cpu_s(os.getsid(0))
            if not os.path.exists(gate):
                os.mkfifo(gate)
            _gate_mark(str(gate) + ".waiting", cpu_start)
            with open(gate, "rb") as g:  # blocks until the other side opens it, then for its byte
                g.read(1)
        t1 = time.perf_counter()
        if any(lr is not None for lr in loras):
            outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=loras)
        else:
            outs = llm.generate(prompts, sp, use_tqdm=False)
        elapsed = time.perf_counter() - t1
        after, hist_after = _snapshot(llm)
        reqs: list[dict[str, Any]] = []
        for (ids, salt), lr, o in zip(resolved, loras, outs, strict=True):
            m = o.metrics
            reqs.append(
                {
                    "prompt_len": len(ids),
                    "cache_salt": salt,
                    "lora": lr.lora_name if lr is not None else None,
                    "output_ids": list(o.outputs[0].token_ids),
                    "margins": _margins(o.outputs[0].logprobs),
                    "num_cached_tokens": o.num_cached_tokens,
                    "num_cache_creation_tokens": getattr(o, "num_cache_creation_tokens", None),
                    "ttft_s": getattr(m, "first_token_latency", None) if m is not None else None,
                    "kv_transfer_params": o.kv_transfer_params,
                    "finish_reason": o.outputs[0].finish_reason,
                }
            )
        turn_prompts.append([ids for ids, _ in resolved])
        turn_outputs.append([r["output_ids"] for r in reqs])
        rec: dict[str, Any] = {
            "index": i,
            "elapsed_s": elapsed,
            "requests": reqs,
            "metrics_delta": _delta(after, before),
            "histograms_delta": {
                k: {
                    "count": v["count"] - hist_before.get(k, {}).get("count", 0),
                    "sum": v["sum"] - hist_before.get(k, {}).get("sum", 0.0),
                }
                for k, v in hist_after.items()
                if v["count"] != hist_before.get(k, {}).get("count", 0)
            },
        }
        if len(reqs) == 1:
            rec.update({k: v for k, v in reqs[0].items()})
        if gate is not None:
            cpu_end = session_cpu_s(os.getsid(0))
            rec["session_cpu_s"] = [cpu_start, cpu_end]
        turns_out.append(rec)
        before, hist_before = after, hist_after
        print(
            f"[runner] turn {i}: prompts={[r['prompt_len'] for r in reqs]} "
            f"cached={[r['num_cached_tokens'] for r in reqs]} elapsed={elapsed:.3f}s "
            f"delta={rec['metrics_delta']}",
            flush=True,
        )
        if gate is not None:
            _gate_mark(str(gate) + ".done", rec["session_cpu_s"][1])

    final, hists = _snapshot(llm)
    result = {
        "engine_start_s": engine_start_s,
        "config": config,
        "threads": {"workers": workers},
        "turns": turns_out,
        "metrics": final,
        "histograms": hists,
    }
    tmp = args["result_path"] + ".tmp"
    Path(tmp).write_text(json.dumps(result))
    os.replace(tmp, args["result_path"])
    print("[runner] done", flush=True)
    del llm


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} ARGS.json | --zygote  (see run_vllm() for the parent side)")
    if sys.argv[1] == "--zygote":
        _zygote.serve(_child, _imports)
    else:
        _child(sys.argv[1])
