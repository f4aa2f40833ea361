"""Packaging that cannot silently drop code, and type checking that really checks.

* The built wheel holds every package directory of the source tree and every module in it,
  and every ``package-data`` entry names a file that exists and ships.
* The wheel installed on its own (no editable finder, no source tree on the path) gives a
  working ``kvstrata`` CLI.
* mypy resolves ``kvstrata.*`` imports to our own code: a first-party name is never ``Any``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

#: Directories of the repository that are not part of the installed package.
NOT_SHIPPED = {"tests", "benchmarks", "build", "docs", "out"}
_COPY_IGNORE = shutil.ignore_patterns(
    ".git", ".venv", ".typecheck", "build", "dist", "out", "__pycache__", "*.egg-info", ".*_cache", ".benchmarks"
)


def source_packages() -> dict[str, set[str]]:
    """Dotted name -> module files (``.py``) of every package directory of the source tree."""
    found: dict[str, set[str]] = {}
    for init in sorted(ROOT.rglob("__init__.py")):
        rel = init.parent.relative_to(ROOT)
        if rel.parts and (rel.parts[0] in NOT_SHIPPED or rel.parts[0].startswith(".")):
            continue
        name = ".".join(("kvstrata", *rel.parts))
        found[name] = {p.name for p in init.parent.glob("*.py")}
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python -m build --wheel`` of a copy of the source tree (the checkout stays clean)."""
    src = tmp_path_factory.mktemp("src") / "kvstrata"
    shutil.copytree(ROOT, src, ignore=_COPY_IGNORE, symlinks=True)
    out = tmp_path_factory.mktemp("dist")
    res = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    wheels = list(out.glob("kvstrata-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def wheel_packages(path: Path) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
    for name in names:
        if name.endswith("/__init__.py"):
            found[name.removesuffix("/__init__.py").replace("/", ".")] = set()
    for name in names:
        d, _, f = name.rpartition("/")
        if f.endswith(".py") and d.replace("/", ".") in found:
            found[d.replace("/", ".")].add(f)
    return found


def test_the_wheel_holds_every_package_and_module(wheel: Path) -> None:
    want = source_packages()
    assert "kvstrata.integrations.vllm" in want and "kvstrata.engine" in want  # the walk found the tree
    got = wheel_packages(wheel)
    missing = sorted(set(want) - set(got))
    assert not missing, f"package directories missing from the wheel (list them in [tool.setuptools]): {missing}"
    assert not sorted(set(got) - set(want)), f"the wheel ships packages that are not in the source tree: {got}"
    for name, modules in want.items():
        assert modules == got[name], f"{name}: modules missing from the wheel: {sorted(modules - got[name])}"


def test_the_wheel_holds_the_native_extension(wheel: Path) -> None:
    """kvstrata._native is built into the wheel where there is a C compiler (it is optional:
    without one the build still succeeds, and kvstrata runs its Python code)."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the extension is optional")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    assert [n for n in names if re.fullmatch(r"kvstrata/_native\..*\.so", n)], names
    assert "kvstrata/_native.pyi" in names


def test_the_package_list_names_only_real_directories() -> None:
    declared = set(PYPROJECT["tool"]["setuptools"]["packages"])
    assert declared == set(source_packages()), sorted(declared ^ set(source_packages()))


def test_every_package_data_entry_exists_and_ships(wheel: Path) -> None:
    package_dir = PYPROJECT["tool"]["setuptools"]["package-dir"]
    assert package_dir == {"kvstrata": "."}
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    entries = PYPROJECT["tool"]["setuptools"]["package-data"]
    assert entries
    for package, files in entries.items():
        rel = Path(*package.split(".")[1:])
        for pattern in files:
            matches = sorted((ROOT / rel).glob(pattern))
            assert matches, f"package-data of {package!r} names {pattern!r}, which does not exist in {ROOT / rel}"
            for m in matches:
                shipped = "/".join(("kvstrata", *m.relative_to(ROOT).parts))
                assert shipped in names, f"{shipped} is declared as package data but not in the wheel"


def test_the_installed_wheel_gives_a_working_cli(wheel: Path, tmp_path: Path) -> None:
    """The wheel installed by itself into a fresh target: ``kvstrata`` runs from it (not from
    this checkout or the editable install), and a command that touches engine, tiers, policies,
    workload and the embedded default config works."""
    target = tmp_path / "site"
    res = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target", str(target), wheel],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTRATA")}
    env["PYTHONPATH"] = str(target)
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    run = tmp_path / "cwd"
    run.mkdir()  # away from the checkout, so that nothing is found through the current directory

    def sh(*args: str) -> str:
        r = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env, cwd=run)
        assert r.returncode == 0, f"{args}: {r.stdout[-3000:]}{r.stderr[-3000:]}"
        return r.stdout

    probe = "import kvstrata, kvstrata.integrations.vllm as v; print(kvstrata.__file__, v.__file__)"
    where = sh(sys.executable, "-c", probe)
    assert all(Path(p).is_relative_to(target) for p in where.split()), where
    script = target / "bin" / "kvstrata"
    assert script.is_file(), sorted(p.name for p in (target / "bin").iterdir())
    assert "replay" in sh(sys.executable, str(script), "--help")
    demo = tmp_path / "demo.json"
    out = sh(sys.executable, str(script), "demo", "--sessions", "1", "--turns", "2", "--json", str(demo))
    assert re.search(r"token hit rate", out), out
    assert demo.is_file()


def _mypy(code: str, tmp_path: Path) -> str:
    """Run the project's mypy configuration on one extra module; return its report."""
    probe = tmp_path / "kvstrata_typing_probe.py"
    probe.write_text(code)
    res = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), str(probe)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    return res.stdout + res.stderr


@pytest.mark.slow
def test_mypy_resolves_first_party_imports(tmp_path: Path) -> None:
    """What `make lint` relies on: ``kvstrata.*`` resolves to the package (through the
    ``.typecheck/kvstrata`` link `make venv` makes), so names are real types and mistakes in
    their use are errors. Before, the editable install's import hook made every one ``Any``."""
    if not (ROOT / ".typecheck" / "kvstrata").is_dir():
        pytest.fail(f"{ROOT / '.typecheck' / 'kvstrata'} is missing: run `make venv` (it links the package there)")
    out = _mypy(
        "from kvstrata.core.layout import KVLayout\n"
        "from kvstrata.engine.engine import Engine\n"
        "reveal_type(KVLayout)\n"
        "reveal_type(Engine.lookup)\n"
        "Engine.no_such_method\n",
        tmp_path,
    )
    revealed = re.findall(r'Revealed type is "([^"]*)"', out)
    assert len(revealed) == 2, out
    assert all(r != "Any" and "kvstrata" in r for r in revealed), out
    assert 'has no attribute "no_such_method"' in out, out


def test_the_wheel_declares_the_vllm_plugin(wheel: Path) -> None:
    """vLLM finds KVStrataConnector by name (MultiConnector needs that) through this entry point."""
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt")]
        text = zf.read(name).decode()
    section = text.split("[vllm.general_plugins]", 1)[1].split("[", 1)[0]
    assert "kvstrata = kvstrata.integrations.vllm.plugin:register" in section, text


def test_the_vllm_plugin_registers_the_connector_once() -> None:
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvstrata.integrations.vllm import plugin
    from kvstrata.integrations.vllm.connector import KVStrataConnector

    plugin.register()
    plugin.register()  # vLLM loads plugins in every process, maybe more than once: never an error
    assert KVConnectorFactory.get_connector_class_by_name("KVStrataConnector") is KVStrataConnector
