"""The rooms of the package and the direction of their imports.

Every first-party import (top-level or inside a function) must point to a room of the same or a
lower floor: the data model (``core``) at the bottom, then tiers and policies, the engine, and the
front doors on top. The engine sees tiers only through their public face (``kvstrata.tiers``,
``kvstrata.tiers.base``), never a tier's internals.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FLOOR: dict[str, int] = {
    "errors": 0,
    "units": 0,
    "core": 1,
    "registry": 2,
    "policies": 3,
    "tiers": 3,
    "servers": 3,  # launchers of local mooncake_master / SeaweedFS processes; import nothing of ours
    "config": 4,  # validates against the tier and policy registries
    "engine": 5,
    "testing": 6,
    "workload": 6,
    "planner": 7,
    "daemon": 8,
    "integrations": 8,
    "cli": 9,
    "__main__": 10,
}
ENGINE_MAY_SEE_OF_TIERS = {"kvstrata.tiers", "kvstrata.tiers.base"}


def package_modules() -> list[Path]:
    skip = {"tests", "benchmarks", "docs", "build", "dist"}
    return sorted(
        p
        for p in ROOT.rglob("*.py")
        if not (set(p.relative_to(ROOT).parts[:-1]) & skip)
        and not any(part.startswith(".") or part.endswith(".egg-info") for part in p.relative_to(ROOT).parts)
    )


def room_of(path: Path) -> str:
    return path.relative_to(ROOT).parts[0].removesuffix(".py")


def first_party_imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "kvstrata":
                out += [f"kvstrata.{a.name}" for a in node.names if a.name in FLOOR]  # else: __version__ & co.
            elif node.module.startswith("kvstrata."):
                out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.startswith("kvstrata.")]
    return out


def test_every_room_has_a_floor() -> None:
    rooms = {room_of(p) for p in package_modules()} - {"__init__"}
    assert rooms <= set(FLOOR), f"rooms without a floor in FLOOR: {sorted(rooms - set(FLOOR))}"


def test_no_import_runs_upward() -> None:
    upward = []
    for path in package_modules():
        src = room_of(path)
        if src == "__init__":
            continue
        for module in first_party_imports(path):
            dst = module.split(".")[1]
            if dst != src and FLOOR.get(dst, 99) > FLOOR[src]:
                upward.append(f"{path.relative_to(ROOT)} ({src}, floor {FLOOR[src]}) imports {module}")
    assert not upward, "imports that run upward:\n" + "\n".join(upward)


@pytest.mark.parametrize("room", ["engine"])
def test_the_engine_sees_tiers_only_through_their_public_face(room: str) -> None:
    inside = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in package_modules()
        if room_of(path) == room
        for module in first_party_imports(path)
        if module.startswith("kvstrata.tiers") and module not in ENGINE_MAY_SEE_OF_TIERS
    ]
    assert not inside, "\n".join(inside)


def test_tiers_and_the_engine_do_not_import_each_other_both_ways() -> None:
    tiers_to_engine = [
        f"{path.relative_to(ROOT)} imports {m}"
        for path in package_modules()
        if room_of(path) == "tiers"
        for m in first_party_imports(path)
        if m.startswith("kvstrata.engine")
    ]
    assert not tiers_to_engine, "\n".join(tiers_to_engine)


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from kvstrata.engine.engine import Engine\n    from kvstrata import config\n")
    assert first_party_imports(probe) == ["kvstrata.engine.engine", "kvstrata.config"]


MAX_MODULE_LINES = 600
DATA_MODULES = {"core/catalog.py"}  # the published model geometries: a table, not code


def test_no_module_is_a_house_of_its_own() -> None:
    big = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for p in package_modules()
        if str(p.relative_to(ROOT)) not in DATA_MODULES and (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not big, f"modules over {MAX_MODULE_LINES} lines (split them along their jobs):\n" + "\n".join(big)
