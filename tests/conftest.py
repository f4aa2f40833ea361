"""Shared fixtures: small KV layouts, an engine factory, and a clean environment.

Helpers that are plain functions (block contents, buffers, checks) live in
``conformance.py`` so the conformance suite and the engine tests share one oracle.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from shared_files import require_shared

from kvstrata.core import native
from kvstrata.core.layout import KVLayout, uniform_layout
from kvstrata.engine.engine import Engine
from kvstrata.testing import oracle
from kvstrata.tiers import Tier

EngineFactory = Callable[..., Engine]


def pytest_runtest_setup(item: pytest.Item) -> None:
    """``@pytest.mark.needs_shared(path, ...)``: the files under ../shared a test reads (see
    ``shared_files.py``: a missing one fails the test under CI=true and skips it elsewhere)."""
    for mark in item.iter_markers("needs_shared"):
        require_shared(*mark.args)


@pytest.fixture(autouse=True)
def _no_kvstrata_env(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A developer's KVSTRATA__* variables must not change what the tests configure, and the
    embedded default's NVMe tier must not write into the developer's real cache directory."""
    for var in list(os.environ):
        if var.startswith("KVSTRATA"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))


BUILT = native.NATIVE  # the extension as imported (None: not built, or KVSTRATA_NATIVE=0 for the run)


@pytest.fixture(params=["native", "python"])
def code_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test on both paths of the hot loops: the C extension and the pure-Python code
    (:mod:`kvstrata.core.native`); the native one skips where the extension is not built."""
    if request.param == "native":
        if BUILT is None:
            pytest.skip(f"the native path is off: {native.native_reason()}")
        monkeypatch.setattr(native, "NATIVE", BUILT)
    else:
        monkeypatch.setattr(native, "NATIVE", None)
    return str(request.param)


@pytest.fixture
def layout() -> KVLayout:
    """Two identical full-attention layers; a layer-block is 256 bytes, a block 512."""
    return uniform_layout("test-model", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")


@pytest.fixture
def mixed_layout() -> KVLayout:
    """Three layers of three kinds and sizes (256, 400 and 288 bytes), to exercise size classes."""
    return oracle.mixed_layout()


def tier_config(tier: dict[str, Any], root: Path) -> dict[str, Any]:
    """Fill in what a test tier needs: a private directory and buffered I/O for nvme tiers."""
    out = dict(tier)
    if out.get("kind", out["name"]) == "nvme":
        out.setdefault("path", str(root / out["name"]))
        out.setdefault("direct_io", "off")
    return out


@pytest.fixture
def make_engine(tmp_path: Path, layout: KVLayout) -> Iterator[EngineFactory]:
    """Build engines from tier dicts (top tier first); every engine is closed at teardown.

    ``make_engine({"name": "dram", "capacity": 4096}, engine={"io_threads": 2}, layout=...)``;
    ``wrap={0: lambda t: FaultInjectingTier(t)}`` builds the engine with tier 0 wrapped
    (:meth:`Engine.with_tiers`; the wrapper is then ``engine.tiers[0].tier``).
    """
    engines: list[Engine] = []

    def factory(
        *tiers: dict[str, Any],
        engine: dict[str, Any] | None = None,
        wrap: Mapping[int, Callable[[Tier], Tier]] | None = None,
        **kwargs: Any,
    ) -> Engine:
        kwargs.setdefault("layout", layout)
        config = {"engine": dict(engine or {}), "tiers": [tier_config(t, tmp_path) for t in tiers]}
        eng = Engine(config, **kwargs) if wrap is None else Engine.with_tiers(config, wrap=wrap, **kwargs)
        engines.append(eng)
        return eng

    yield factory
    for eng in engines:
        eng.close()
