"""The connector's settings: every ``kv_connector_extra_config`` key parsed once, bad ones named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvstrata.config import KVStrataConfig, load_config
from kvstrata.errors import ConfigError, KVStrataError
from kvstrata.integrations.vllm.lookup import lookup_address
from kvstrata.integrations.vllm.settings import KNOWN_KEYS, ConnectorSettings, ExtraConfig

TIERS = {"tiers": [{"name": "dram", "capacity": "16MiB"}]}


def vllm_config(extra: dict[str, Any] | None = None, **over: Any) -> Any:
    """The parts of a ``VllmConfig`` the connector reads."""
    model = SimpleNamespace(
        model=str(over.pop("model", "/models/m")),
        served_model_name=over.pop("served", None),
        dtype="torch.bfloat16",
        revision=over.pop("revision", None),
        quantization=over.pop("quantization", None),
    )
    load = SimpleNamespace(load_format=over.pop("load_format", "auto"), download_dir=over.pop("download_dir", None))
    cache = SimpleNamespace(cache_dtype=over.pop("cache_dtype", "auto"))
    if "algo" in over:
        cache.prefix_caching_hash_algo = over.pop("algo")
    parallel = SimpleNamespace(tensor_parallel_size=over.pop("tp", 1), data_parallel_rank=over.pop("dp", 0))
    ktc = SimpleNamespace(kv_connector_extra_config=extra)
    return SimpleNamespace(
        kv_transfer_config=ktc,
        model_config=model,
        cache_config=cache,
        parallel_config=parallel,
        load_config=load,
        **over,
    )


def test_defaults_when_absent() -> None:
    empty: tuple[dict[str, Any] | None, ...] = (None, {})
    for extra in empty:
        got = ExtraConfig.parse(extra)
        assert got.config == load_config(None)  # the embedded default
        assert (got.model_id, got.worker_lookup_timeout_s, got.load_mode) == (None, 1.0, "auto")


def test_config_as_dict_inline_json_toml_path_or_object(tmp_path: Path) -> None:
    want = load_config(TIERS)
    path = tmp_path / "kvstrata.toml"
    path.write_text('[[tiers]]\nname = "dram"\ncapacity = "16MiB"\n')
    for raw in (TIERS, json.dumps(TIERS), "  " + json.dumps(TIERS), str(path), want):
        assert ExtraConfig.parse({"config": raw}).config == want


def test_every_other_key() -> None:
    got = ExtraConfig.parse({"model_id": "team/m", "worker_lookup_timeout_s": 2, "load_mode": "sync"})
    assert (got.model_id, got.worker_lookup_timeout_s, got.load_mode) == ("team/m", 2.0, "sync")
    assert ExtraConfig.parse({"worker_lookup_timeout_s": "0.25"}).worker_lookup_timeout_s == 0.25
    assert ExtraConfig.parse({"weights_id": "ft-7"}).weights_id == "ft-7"
    assert (ExtraConfig.parse({}).model_id, ExtraConfig.parse({}).weights_id) == (None, None)
    for mode in ("auto", "async", "sync"):
        assert ExtraConfig.parse({"load_mode": mode}).load_mode == mode


def test_unknown_key_names_it_and_the_known_ones() -> None:
    with pytest.raises(ConfigError) as err:
        ExtraConfig.parse({"config": TIERS, "load_mod": "sync"})
    msg = str(err.value)
    assert "'load_mod'" in msg and all(k in msg for k in KNOWN_KEYS)
    assert err.value.field == "kv_connector_extra_config.load_mod" and err.value.value == "sync"


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("load_mode", "fast", "must be 'auto', 'async' or 'sync', got 'fast'"),
        ("load_mode", None, "got None"),
        ("worker_lookup_timeout_s", "soon", "number of seconds, got 'soon'"),
        ("worker_lookup_timeout_s", 0, "positive"),
        ("worker_lookup_timeout_s", -1.5, "positive"),
        ("worker_lookup_timeout_s", float("inf"), "finite"),
        ("worker_lookup_timeout_s", True, "got True"),
        ("worker_lookup_timeout_s", [1], "got [1]"),
        ("model_id", 7, "must be a non-empty string (or absent), got 7"),
        ("model_id", "", "non-empty string (or absent), got ''"),
        ("model_id", "   ", "got '   '"),
        ("weights_id", "", "non-empty string (or absent), got ''"),
        ("weights_id", ["v1"], "got ['v1']"),
        ("config", 5, "TOML path or a config object"),
        ("config", '{"tiers": [', "not valid inline JSON"),
    ],
)
def test_bad_value_names_key_and_value(key: str, value: object, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        ExtraConfig.parse({key: value})
    assert f"kv_connector_extra_config.{key}" in str(err.value) and words in str(err.value)
    assert err.value.field == f"kv_connector_extra_config.{key}"
    assert isinstance(err.value, ValueError) and isinstance(err.value, KVStrataError)


def test_bad_kvstrata_config_names_its_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="capacity"):
        ExtraConfig.parse({"config": {"tiers": [{"name": "dram", "capacity": "lots"}]}})
    with pytest.raises(ConfigError, match="not found"):
        ExtraConfig.parse({"config": str(tmp_path / "missing.toml")})


def test_from_vllm_config_model_dtype_and_parallel_facts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    s = ConnectorSettings.from_vllm_config(vllm_config({"config": TIERS}, tp=4, dp=2, instance_id="inst"))
    assert (s.model, s.kv_dtype, s.tp_size, s.dp_rank, s.instance_id) == ("/models/m", "bfloat16", 4, 2, "inst")
    assert s.config == load_config(TIERS) and isinstance(s.config, KVStrataConfig)
    assert (s.load_mode, s.worker_lookup_timeout_s) == ("auto", 1.0)
    assert s.use_vllm_hashes  # sha256 is vLLM's default
    assert s.lookup_address(3) == lookup_address("inst", 2, 3)  # a path; no key derives from the id

    s = ConnectorSettings.from_vllm_config(vllm_config({"config": TIERS}, served=["srv", "alias"], cache_dtype="fp8"))
    assert (s.model, s.kv_dtype) == ("srv", "fp8")
    s = ConnectorSettings.from_vllm_config(vllm_config({"config": TIERS, "model_id": "mine"}, served=["srv"]))
    assert s.model == "mine"
    s = ConnectorSettings.from_vllm_config(vllm_config({"config": TIERS}, served="one"))
    assert s.model == "one"


def test_hashes_are_reused_only_when_the_same_in_every_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    for algo, same in (("sha256", True), ("sha256_cbor", True), ("xxhash", False), ("xxhash_cbor", False)):
        assert ConnectorSettings.from_vllm_config(vllm_config({"config": TIERS}, algo=algo)).use_vllm_hashes is same
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert ConnectorSettings.from_vllm_config(vllm_config({"config": TIERS}, algo="xxhash")).use_vllm_hashes


def test_bad_extra_config_fails_from_vllm_config() -> None:
    with pytest.raises(ConfigError, match="unknown key 'shared_storage_path'"):
        ConnectorSettings.from_vllm_config(vllm_config({"shared_storage_path": "/x"}))


def test_instance_defaults_to_the_parent_process() -> None:
    import os

    s = ConnectorSettings.from_vllm_config(vllm_config({"config": TIERS}))
    assert s.instance_id == str(os.getppid()) and s.dp_rank == 0


def _checkpoint(root: Path, seed: int) -> Path:
    """A small real checkpoint: config.json and a safetensors file of random values."""
    import numpy as np

    root.mkdir(parents=True)
    (root / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}')
    data = np.random.default_rng(seed).standard_normal(64 * 64, dtype=np.float32).tobytes()
    header = json.dumps({"w": {"dtype": "F32", "shape": [64, 64], "data_offsets": [0, len(data)]}}).encode()
    (root / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + data)
    return root


@pytest.fixture
def fresh_weights_cache() -> Any:
    from kvstrata.integrations.vllm.weights import weights_identity

    weights_identity.cache_clear()
    yield
    weights_identity.cache_clear()


def test_weights_identity_from_the_checkpoint_vllm_loads(tmp_path: Path, fresh_weights_cache: Any) -> None:
    a, b = _checkpoint(tmp_path / "a", 1), _checkpoint(tmp_path / "b", 2)
    extra = {"config": TIERS}
    sa = ConnectorSettings.from_vllm_config(vllm_config(extra, model=a, served="llama"))
    sb = ConnectorSettings.from_vllm_config(vllm_config(extra, model=b, served="llama"))
    assert sa.model == sb.model == "llama"  # same served name ...
    assert sa.weights.source == "digest" and sa.weights.files == 2
    assert sa.weights.weights != sb.weights.weights  # ... other weights: other namespace
    shutil.copytree(a, tmp_path / "copy")
    copy = ConnectorSettings.from_vllm_config(vllm_config(extra, model=tmp_path / "copy", served="llama"))
    assert copy.weights == sa.weights
    quant = ConnectorSettings.from_vllm_config(vllm_config(extra, model=a, served="llama", quantization="fp8"))
    rev = ConnectorSettings.from_vllm_config(vllm_config(extra, model=a, served="llama", revision="v2"))
    fmt = ConnectorSettings.from_vllm_config(vllm_config(extra, model=a, served="llama", load_format="pt"))
    assert len({sa.weights.weights, quant.weights.weights, rev.weights.weights, fmt.weights.weights}) == 4


def test_model_id_is_the_whole_identity_and_weights_id_only_the_digest(
    tmp_path: Path, fresh_weights_cache: Any
) -> None:
    a, b = _checkpoint(tmp_path / "a", 1), _checkpoint(tmp_path / "b", 2)

    def settings(model: Path, **extra: Any) -> ConnectorSettings:
        return ConnectorSettings.from_vllm_config(vllm_config({"config": TIERS, **extra}, model=model, served="srv"))

    sa, sb = settings(a, model_id="llama-ft-3"), settings(b, model_id="llama-ft-3")
    assert sa.model == "llama-ft-3" and sa.weights.source == "model_id" and sa.weights.weights == ""
    assert sa.weights == sb.weights  # the operator vouches: no digest, the same namespace
    assert "model_id" in sa.weights.describe()
    wa, wb = settings(a, weights_id="2026-11"), settings(b, weights_id="2026-11")
    assert wa.model == "srv" and wa.weights.source == "weights_id"
    assert wa.weights == wb.weights != settings(a, weights_id="2026-12").weights
    both = settings(a, model_id="llama-ft-3", weights_id="2026-11")
    assert both.model == "llama-ft-3" and both.weights == wa.weights
    assert settings(a).weights.source == "digest"
