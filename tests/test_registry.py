"""The registry refuses to overwrite a name silently, in code and through entry points, and a tier
of another distribution, found through its entry point, runs the conformance suite that ships in
the package.

Plugins here are real distributions: a ``*.dist-info`` directory with ``METADATA`` and
``entry_points.txt`` beside their module, in a temporary directory put on ``sys.path``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstrata.config import load_config
from kvstrata.engine.engine import Engine
from kvstrata.errors import ConfigError, KVStrataError, UnknownNameError
from kvstrata.policies import EVICTION, LRUPolicy
from kvstrata.registry import DuplicateNameError, Registry
from kvstrata.testing.conformance import TierConformance
from kvstrata.testing.oracle import engine_layout
from kvstrata.tiers import TIERS
from kvstrata.tiers.memory import DRAMTier


class Alpha:
    pass


class Beta:
    pass


def make_dist(root: Path, name: str, entry_points: str, modules: dict[str, str]) -> Path:
    """A distribution ``name`` 0.1 installed into ``root``: its modules and a dist-info directory."""
    root.mkdir(parents=True, exist_ok=True)
    info = root / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))
    return root


# --------------------------------------------------------------------------- names in code
def test_a_taken_name_is_refused_with_both_classes_named() -> None:
    reg: Registry[object] = Registry("widget")
    reg.register("a", Alpha)
    with pytest.raises(DuplicateNameError) as err:
        reg.register("a", Beta)
    message = str(err.value)
    assert "widget registry" in message and "'a'" in message
    assert f"{__name__}:Alpha" in message and f"{__name__}:Beta" in message
    assert "replace=True" in message
    assert isinstance(err.value, KVStrataError) and isinstance(err.value, ValueError)
    assert reg.get("a") is Alpha  # the refused registration changed nothing


def test_the_decorator_and_lazy_paths_are_refused_too() -> None:
    reg: Registry[object] = Registry("widget")
    reg.register("lazy", "collections:OrderedDict")
    with pytest.raises(DuplicateNameError, match="collections:OrderedDict"):
        reg.register("lazy", Alpha)
    reg.register("a")(Alpha)
    with pytest.raises(DuplicateNameError, match="'a'"):
        reg.register("a")(Beta)


def test_the_same_class_again_is_a_no_op() -> None:
    reg: Registry[object] = Registry("widget")
    reg.register("a", Alpha)
    reg.register("a", Alpha)
    reg.register("a")(Alpha)
    reg.register("a", f"{__name__}:Alpha")  # its lazy path names the same class
    assert reg.get("a") is Alpha and reg.names() == ["a"]


def test_replace_replaces_on_purpose() -> None:
    reg: Registry[object] = Registry("widget")
    reg.register("a", Alpha)
    reg.register("a", Beta, replace=True)
    assert reg.get("a") is Beta
    reg.register("a", replace=True)(Alpha)
    assert reg.get("a") is Alpha


def test_builtin_tier_names_are_guarded() -> None:
    TIERS.register("dram", DRAMTier)  # the class behind the builtin lazy path: nothing happens
    assert TIERS.get("dram") is DRAMTier

    class OtherDRAM(DRAMTier):
        pass

    with pytest.raises(DuplicateNameError, match=r"tier registry: 'dram' is already registered to kvstrata\.tiers"):
        TIERS.register("dram", OtherDRAM)
    assert TIERS.get("dram") is DRAMTier


def test_unknown_names_still_list_the_known_ones() -> None:
    with pytest.raises(UnknownNameError, match=r"unknown tier 'no-such-tier'; known: .*dram"):
        TIERS.get("no-such-tier")


# --------------------------------------------------------------------------- entry points
PLUGIN = """\
from kvstrata.policies import LRUPolicy
from kvstrata.tiers.memory import DRAMTier


class EntryPointDRAM(DRAMTier):
    \"\"\"DRAM under another name, from another distribution.\"\"\"


class EntryPointLRU(LRUPolicy):
    pass
"""


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dist(
        tmp_path_factory.mktemp("site") / "good",
        "kvstrata-test-plugin",
        """\
        [kvstrata.tier]
        ep-dram = kvstrata_test_plugin:EntryPointDRAM

        [kvstrata.eviction]
        ep-lru = kvstrata_test_plugin:EntryPointLRU
        """,
        {"kvstrata_test_plugin": PLUGIN},
    )


@pytest.fixture
def plugin(plugin_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The plugin distribution on ``sys.path`` for one test; its names are forgotten after it."""
    monkeypatch.syspath_prepend(str(plugin_dir))
    yield plugin_dir
    TIERS.unregister("ep-dram")
    EVICTION.unregister("ep-lru")


def test_an_entry_point_tier_and_policy_are_found_by_name(plugin: Path) -> None:
    cls = TIERS.get("ep-dram")
    assert cls.__name__ == "EntryPointDRAM" and issubclass(cls, DRAMTier)
    assert cls.__module__ == "kvstrata_test_plugin"
    assert "ep-dram" in TIERS.names()
    assert issubclass(EVICTION.get("ep-lru"), LRUPolicy)
    cfg = load_config({"tiers": [{"name": "pool", "kind": "ep-dram", "capacity": "1MiB", "eviction": "ep-lru"}]})
    assert cfg.tiers[0].kind == "ep-dram"
    TIERS.register("ep-dram", cls)  # the same class again: no-op
    TIERS.register("ep-dram", "kvstrata_test_plugin:EntryPointDRAM")
    assert TIERS.get("ep-dram") is cls


def test_an_entry_point_cannot_take_a_builtin_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = make_dist(
        tmp_path / "clash",
        "kvstrata-clash-plugin",
        "[kvstrata.tier]\ndram = kvstrata_clash_plugin:Clash\n",
        {"kvstrata_clash_plugin": "from kvstrata.tiers.memory import DRAMTier\n\nclass Clash(DRAMTier):\n    pass\n"},
    )
    monkeypatch.syspath_prepend(str(root))
    assert TIERS.get("dram") is DRAMTier  # a known name does not read the entry points
    with pytest.raises(DuplicateNameError) as err:
        TIERS.get("some-plugin-tier")  # an unknown one does, and the clash is reported
    message = str(err.value)
    assert "tier registry: 'dram' is already registered to kvstrata.tiers.memory:DRAMTier" in message
    assert "kvstrata_clash_plugin:Clash" in message and "kvstrata-clash-plugin 0.1" in message
    assert TIERS.get("dram") is DRAMTier


def test_a_plugin_that_fails_to_import_is_a_clear_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = make_dist(
        tmp_path / "broken",
        "kvstrata-broken-plugin",
        "[kvstrata.tier]\nbroken = kvstrata_broken_plugin:Broken\nmissing = kvstrata_no_such_module:Tier\n",
        {"kvstrata_broken_plugin": "raise RuntimeError('the plugin is broken')\n"},
    )
    monkeypatch.syspath_prepend(str(root))
    try:
        with pytest.raises(ConfigError) as err:
            TIERS.get("broken")
        message = str(err.value)
        assert "tier 'broken' comes from the entry point broken = kvstrata_broken_plugin:Broken" in message
        assert "kvstrata-broken-plugin 0.1" in message and "RuntimeError: the plugin is broken" in message
        with pytest.raises(ConfigError, match=r"entry point missing = .*failed to import: ModuleNotFoundError"):
            TIERS.get("missing")
    finally:
        TIERS.unregister("broken")
        TIERS.unregister("missing")


def test_replace_wins_over_an_entry_point(plugin: Path) -> None:
    class Mine(DRAMTier):
        pass

    TIERS.register("ep-dram", Mine, replace=True)
    assert TIERS.get("ep-dram") is Mine
    with pytest.raises(UnknownNameError):
        TIERS.get("still-unknown")  # reads the entry points again: ep-dram's is ignored, no clash
    assert TIERS.get("ep-dram") is Mine


def test_an_entry_point_tier_serves_an_engine(plugin: Path) -> None:
    tiers = [{"name": "ep-dram", "kind": "ep-dram", "capacity": "1MiB"}]
    engine = Engine({"engine": {"io_threads": 1}, "tiers": tiers}, layout=engine_layout())
    try:
        assert type(engine.tiers[0].tier).__name__ == "EntryPointDRAM"
    finally:
        engine.close()


class TestEntryPointTier(TierConformance):
    """The shipped conformance suite, run as a third party runs it: against a tier that only
    its entry point makes known (a DRAM subclass under the new kind ``ep-dram``)."""

    kind = "ep-dram"

    @pytest.fixture(autouse=True)
    def _installed(self, plugin: Path) -> None:
        assert "ep-dram" in TIERS.names()


# --------------------------------------------------------------------------- kvstrata.testing
def test_kvstrata_testing_without_pytest_says_what_to_install() -> None:
    code = (
        "import sys\n"
        "sys.modules['hypothesis'] = None\n"
        "try:\n"
        "    import kvstrata.testing.conformance\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "needs pytest and hypothesis" in res.stdout and "pip install 'kvstrata[testing]'" in res.stdout
