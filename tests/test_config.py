"""Configuration: the embedded default, TOML files, sizes, env overrides, and errors that name the culprit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pydantic
import pytest

from kvstrata.config import KVStrataConfig, load_config, resolve_auto_capacity
from kvstrata.errors import ConfigError
from kvstrata.units import format_size, parse_size

GiB = 1024**3


@pytest.fixture
def nvme_available() -> None:
    pytest.importorskip("kvstrata.tiers.nvme", reason="nvme tier not available")


def dram_only(**tier: Any) -> dict[str, Any]:
    return {"tiers": [{"name": "dram", **tier}]}


def config_error(source: Any, environ: dict[str, str] | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(source, environ=environ or {})
    return info.value


# --------------------------------------------------------------------------- valid configs


@pytest.mark.usefixtures("nvme_available")
def test_embedded_default_is_dram_over_nvme_in_the_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    config = load_config(None, environ={})
    assert [(t.name, t.kind) for t in config.tiers] == [("dram", "dram"), ("nvme", "nvme")]
    dram, nvme = config.tiers
    assert dram.write == "write-through" and dram.promote and dram.eviction == "prefix-aware"
    assert nvme.options.path == str(tmp_path / "xdg" / "kvstrata" / "nvme")
    assert dram.capacity == nvme.capacity == "auto"
    assert 64 * 1024**2 <= resolve_auto_capacity(dram) <= 16 * GiB
    assert 64 * 1024**2 <= resolve_auto_capacity(nvme) <= 64 * GiB
    assert config.engine.io_threads >= 1


def test_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "kvstrata.toml"
    path.write_text(
        """
[engine]
io_threads = 3
max_pending_bytes = "512MiB"

[[tiers]]
name = "gpu"
kind = "hbm"
capacity = "2GiB"
eviction = "lru"

[[tiers]]
name = "dram"
capacity = 1073741824
admission = "second-touch"
write = "write-back"
pin_memory = "off"
"""
    )
    config = load_config(path, environ={})
    assert config.engine.io_threads == 3 and config.engine.max_pending_bytes == 512 * 1024**2
    gpu, dram = config.tiers
    assert (gpu.name, gpu.kind, gpu.capacity, gpu.eviction, gpu.promote) == ("gpu", "hbm", 2 * GiB, "lru", False)
    assert (dram.kind, dram.capacity, dram.admission, dram.write, dram.promote) == (
        "dram",
        GiB,
        "second-touch",
        "write-back",
        True,
    )
    assert dram.options.pin_memory == "off"
    assert load_config(str(path), environ={}) == config


def test_config_file_named_by_env(tmp_path: Path) -> None:
    path = tmp_path / "k.toml"
    path.write_text('[[tiers]]\nname = "dram"\ncapacity = "1MiB"\n')
    config = load_config(None, environ={"KVSTRATA_CONFIG": str(path)})
    assert config.tiers[0].capacity == 1024**2


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("64GiB", 64 * GiB),
        ("1.5TB", 1_500_000_000_000),
        ("512 MiB", 512 * 1024**2),
        ("4k", 4000),
        ("2 kib", 2048),
        ("100", 100),
        ("0", 0),
        (".5GiB", GiB // 2),
        (4096, 4096),
        (0, 0),
        (2.0, 2),
    ],
)
def test_sizes(text: Any, expected: int) -> None:
    assert parse_size(text) == expected
    assert load_config(dram_only(capacity=text), environ={}).tiers[0].capacity == expected


@pytest.mark.parametrize("bad", [-1, "-1GiB", "lots", "12 parsecs", "", "1.2.3GB", True, None, [1], float("nan")])
def test_bad_sizes(bad: Any) -> None:
    with pytest.raises(ValueError):
        parse_size(bad)
    err = config_error(dram_only(capacity=bad))
    assert err.field == "tiers.0.capacity"
    assert "tiers.0.capacity" in str(err)
    if bad != "" and bad is not None:
        assert repr(bad) in str(err) or str(bad) in str(err)


def test_format_size() -> None:
    assert format_size(512) == "512 B"
    assert format_size(1536) == "1.5 KiB"
    assert format_size(64 * GiB) == "64.0 GiB"


def test_promote_defaults_and_overrides() -> None:
    config = load_config(
        {"tiers": [{"name": "hbm"}, {"name": "dram", "promote": False}, {"name": "d2", "kind": "dram"}]}, environ={}
    )
    assert [t.promote for t in config.tiers] == [False, False, True]


def test_tier_options_may_sit_beside_or_under_options(nvme_available: None, tmp_path: Path) -> None:
    config = load_config(
        {"tiers": [{"name": "nvme", "path": str(tmp_path), "options": {"fsync": False}, "segment_size": "1MiB"}]},
        environ={},
    )
    opts = config.tiers[0].options
    assert (opts.path, opts.fsync, opts.segment_size) == (str(tmp_path), False, 1024**2)


def test_config_is_frozen() -> None:
    config = load_config(dram_only(), environ={})
    with pytest.raises(pydantic.ValidationError):
        config.engine.io_threads = 9  # type: ignore[misc]
    assert isinstance(config, KVStrataConfig) and load_config(config) is config


# --------------------------------------------------------------------------- errors name the field and value


def test_malformed_toml(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text("[engine\nio_threads = 2\n")
    err = config_error(path)
    assert str(path) in str(err) and "malformed TOML" in str(err)
    assert err.field == "config" and err.value == str(path)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    err = config_error(path)
    assert "not found" in str(err) and str(path) in str(err)


def test_unknown_tier_kind_lists_the_known_ones(tmp_path: Path) -> None:
    err = config_error({"tiers": [{"name": "fast", "kind": "floppy"}]})
    msg = str(err)
    assert "'floppy'" in msg and "tiers.0" in msg
    assert "known: " in msg and all(n in msg for n in ("dram", "hbm", "nvme"))
    path = tmp_path / "k.toml"
    path.write_text('[[tiers]]\nname = "floppy"\n')
    assert str(path) in str(config_error(path))  # the file is named as the source


@pytest.mark.parametrize(
    ("field", "value", "known"),
    [("eviction", "random", "lru, prefix-aware"), ("admission", "third-touch", "all, second-touch")],
)
def test_unknown_policy_names(field: str, value: str, known: str) -> None:
    err = config_error(dram_only(**{field: value}))
    assert f"tiers.0.{field}" in str(err) and repr(value) in str(err) and known in str(err)
    assert err.field == f"tiers.0.{field}" and err.value == value


def test_duplicate_tier_names() -> None:
    err = config_error({"tiers": [{"name": "dram"}, {"name": "x", "kind": "hbm"}, {"name": "dram"}]})
    assert "duplicate tier name 'dram'" in str(err) and err.field == "tiers"


@pytest.mark.parametrize(
    ("config", "field", "value"),
    [
        ({"engine": {"turbo": 1}, "tiers": [{"name": "dram"}]}, "engine.turbo", 1),
        (dram_only(colour="red"), "tiers.0.colour", "red"),
        ({"tiers": [{"name": "dram"}], "extra": True}, "extra", True),
    ],
)
def test_unknown_fields(config: dict[str, Any], field: str, value: Any) -> None:
    err = config_error(config)
    assert field in str(err) and repr(value) in str(err)
    assert err.field == field


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"engine": {"io_threads": 0}, "tiers": [{"name": "dram"}]}, "engine.io_threads"),
        ({"tiers": []}, "tiers"),
        (dram_only(write="sometimes"), "tiers.0.write"),
        ({"tiers": [{"kind": "dram"}]}, "tiers.0.name"),
        (dram_only(pin_memory="maybe"), "tiers.0.pin_memory"),
    ],
)
def test_invalid_values(config: dict[str, Any], field: str) -> None:
    err = config_error(config)
    assert err.field == field and field in str(err)


@pytest.mark.usefixtures("nvme_available")
def test_nvme_needs_a_path() -> None:
    err = config_error({"tiers": [{"name": "nvme"}]})
    assert err.field == "tiers.0.path"


# --------------------------------------------------------------------------- environment overrides


@pytest.mark.usefixtures("nvme_available")
def test_env_overrides(tmp_path: Path) -> None:
    base = {"tiers": [{"name": "dram", "capacity": "1GiB"}, {"name": "nvme", "path": "/somewhere"}]}
    env = {
        "KVSTRATA__TIERS__NVME__PATH": str(tmp_path / "kv"),
        "KVSTRATA__ENGINE__IO_THREADS": "4",
        "KVSTRATA__TIERS__DRAM__CAPACITY": "2GiB",
        "KVSTRATA__TIERS__NVME__FSYNC": "false",
        "UNRELATED": "1",
    }
    config = load_config(base, environ=env)
    assert config.engine.io_threads == 4
    assert config.tiers[0].capacity == 2 * GiB
    assert config.tiers[1].options.path == str(tmp_path / "kv") and config.tiers[1].options.fsync is False
    assert base["tiers"][1]["path"] == "/somewhere"  # the caller's dict is not modified


def test_env_override_from_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTRATA__ENGINE__IO_THREADS", "5")
    assert load_config(dram_only()).engine.io_threads == 5


def test_env_override_for_an_unknown_tier() -> None:
    err = config_error(dram_only(), {"KVSTRATA__TIERS__SSD__PATH": "/x"})
    assert "KVSTRATA__TIERS__SSD__PATH" in str(err) and "'ssd'" in str(err) and "dram" in str(err)
    assert err.field == "KVSTRATA__TIERS__SSD__PATH" and err.value == "/x"


@pytest.mark.parametrize(
    ("var", "value", "field"),
    [
        ("KVSTRATA__ENGINE", "1", "KVSTRATA__ENGINE"),
        ("KVSTRATA__ENGINE__IO_THREADS", "many", "engine.io_threads"),
        ("KVSTRATA__ENGINE__NOPE", "1", "engine.nope"),
        ("KVSTRATA__TIERS__DRAM__CAPACITY", "-5", "tiers.0.capacity"),
    ],
)
def test_bad_env_overrides(var: str, value: str, field: str) -> None:
    err = config_error(dram_only(), {var: value})
    assert err.field == field and field in str(err)
