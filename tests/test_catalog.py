from __future__ import annotations

import json
from pathlib import Path

import pytest
from shared_files import MODEL_CONFIGS

from kvstrata.core.catalog import (
    ModelEntry,
    get_entry,
    get_layout,
    layout_from_hf_config,
    list_models,
    model_names,
    normalize_dtype,
)
from kvstrata.core.layout import KVLayout, LayerKind
from kvstrata.errors import ConfigError, UnknownNameError

CONFIGS = MODEL_CONFIGS
needs_configs = pytest.mark.needs_shared(CONFIGS)

ALL_NAMES = model_names(include_aliases=True)


@pytest.mark.parametrize("name", ALL_NAMES)
@pytest.mark.parametrize("tp_size", [1, 2])
def test_every_entry_builds(name: str, tp_size: int) -> None:
    layout = get_layout(name, tp_size=tp_size)
    assert isinstance(layout, KVLayout)
    assert layout.model == get_entry(name).name
    assert layout.block_size == 16
    assert layout.num_layers > 0 and layout.block_nbytes > 0
    assert KVLayout.from_dict(layout.to_dict()).fingerprint() == layout.fingerprint()
    for spec in layout.layers:
        if spec.kind in (LayerKind.FULL, LayerKind.SLIDING):
            assert spec.block_shape[:2] == (2, 16) and len(spec.block_shape) == 4
        elif spec.kind is LayerKind.MLA:
            assert spec.block_shape[0] == 16 and len(spec.block_shape) == 2


# bf16 bytes per token from shared/reference/model-configs/README.md (attention KV only)
README_BYTES_PER_TOKEN = {
    "llama-3-8b": 131_072,
    "llama-3.1-70b": 327_680,
    "llama-3.1-405b": 516_096,
    "qwen3-8b": 147_456,
    "qwen3-32b": 262_144,
    "qwen3-235b-a22b": 192_512,
    "mixtral-8x7b": 131_072,
    "mixtral-8x22b": 229_376,
    "deepseek-v3": 70_272,
    "deepseek-r1": 70_272,
    "kimi-k2": 70_272,
    "kimi-k2.5": 70_272,
    "glm-4.5": 376_832,
}


@pytest.mark.parametrize(("name", "expected"), README_BYTES_PER_TOKEN.items())
def test_bytes_per_token_match_reference(name: str, expected: int) -> None:
    assert get_layout(name).bytes_per_token == expected


def test_llama_3_8b_layer_block_is_64_kib() -> None:
    layout = get_layout("llama-3-8b")
    assert layout.num_layers == 32
    assert {s.nbytes for s in layout.layers} == {65536}
    assert layout.layers[0].block_shape == (2, 16, 8, 128)
    assert layout.block_nbytes == 32 * 65536
    assert get_layout("llama-3.1-8b").layers == layout.layers
    assert get_layout("LLaMA-3-8B").layers == layout.layers


def test_tiny_is_a_few_hundred_bytes_per_token() -> None:
    layout = get_layout("tiny")
    assert layout.bytes_per_token == 256
    assert layout.num_layers == 4
    assert layout.layers[0].block_shape == (2, 16, 1, 16)


@pytest.mark.parametrize(("name", "layers"), [("gpt-oss-20b", 24), ("gpt-oss-120b", 36)])
def test_gpt_oss_has_sliding_and_full_groups(name: str, layers: int) -> None:
    layout = get_layout(name)
    assert layout.num_layers == layers
    kinds = {g.kind: g for g in layout.groups}
    assert set(kinds) == {LayerKind.SLIDING, LayerKind.FULL}
    assert kinds[LayerKind.SLIDING].window == 128
    assert kinds[LayerKind.SLIDING].layers == tuple(range(0, layers, 2))
    assert kinds[LayerKind.FULL].layers == tuple(range(1, layers, 2))
    full = [s for s in layout.layers if s.kind is LayerKind.FULL]
    assert full[0].block_shape == (2, 16, 8, 64)
    # README: full-attention layers only -> 36,864 / 24,576 B per token
    assert sum(s.nbytes for s in full) / 16 == {24: 24_576, 36: 36_864}[layers]


def test_gemma_3_27b_five_local_to_one_global() -> None:
    layout = get_layout("gemma-3-27b")
    assert layout.num_layers == 62
    full = [i for i, s in enumerate(layout.layers) if s.kind is LayerKind.FULL]
    assert full == list(range(5, 62, 6))
    sliding = [s for s in layout.layers if s.kind is LayerKind.SLIDING]
    assert len(sliding) == 52 and {s.window for s in sliding} == {1024}
    assert sum(layout.layers[i].nbytes for i in full) / 16 == 81_920  # README, global layers only
    # README: + 436 MB for the 1024-token local layers
    assert sum(s.nbytes for s in sliding) / 16 * 1024 == pytest.approx(436e6, rel=0.01)


def test_qwen3_next_linear_state() -> None:
    layout = get_layout("qwen3-next-80b")
    full = [s for s in layout.layers if s.kind is LayerKind.FULL]
    linear = [s for s in layout.layers if s.kind is LayerKind.LINEAR]
    assert len(full) == 12 and len(linear) == 36
    assert [i for i, s in enumerate(layout.layers) if s.kind is LayerKind.FULL] == list(range(3, 48, 4))
    assert sum(s.nbytes for s in full) / 16 == 24_576
    conv = 3 * (2 * 16 * 128 + 32 * 128)
    ssm = 32 * 128 * 128
    assert {s.nbytes for s in linear} == {(conv + ssm) * 2}
    assert sum(s.nbytes for s in linear) == 39_518_208  # README: 39.5 MB
    # state does not depend on the block size
    big = get_layout("qwen3-next-80b", block_size=256)
    assert [s for s in big.layers if s.kind is LayerKind.LINEAR] == linear
    assert layout.with_block_size(256) == big
    # fp32 SSM state (conv state stays bf16): README's 77 MB
    f32 = get_layout("qwen3-next-80b", state_dtype="float32")
    assert sum(s.nbytes for s in f32.layers if s.kind is LayerKind.LINEAR) == 36 * (conv * 2 + ssm * 4)
    # fp8 KV leaves the state alone
    fp8 = get_layout("qwen3-next-80b", kv_dtype="fp8")
    assert [s for s in fp8.layers if s.kind is LayerKind.LINEAR] == linear
    # tp=2 halves the heads of the state too
    tp2 = get_layout("qwen3-next-80b", tp_size=2)
    assert sum(s.nbytes for s in tp2.layers if s.kind is LayerKind.LINEAR) == 39_518_208 // 2


def test_mla_shape_and_tp() -> None:
    layout = get_layout("deepseek-v3")
    assert layout.num_layers == 61
    assert {s.block_shape for s in layout.layers} == {(16, 576)}
    assert {s.kind for s in layout.layers} == {LayerKind.MLA}
    for tp in (2, 4, 8, 16):
        assert get_layout("deepseek-v3", tp_size=tp).bytes_per_token == layout.bytes_per_token
    assert get_layout("deepseek-r1", block_size=64).layers[0].block_shape == (64, 576)


def test_llama_per_rank_bytes_halve_with_tp() -> None:
    one = get_layout("llama-3-8b")
    two = get_layout("llama-3-8b", tp_size=2)
    assert two.bytes_per_token == one.bytes_per_token / 2
    assert two.layers[0].block_shape == (2, 16, 4, 128)
    assert two.fingerprint() != one.fingerprint()
    # more ranks than KV heads: heads are replicated, one per rank
    assert get_layout("llama-3-8b", tp_size=16).layers[0].block_shape == (2, 16, 1, 128)
    assert get_layout("tiny", tp_size=4).layers[0].block_shape == (2, 16, 1, 16)
    with pytest.raises(ConfigError, match="tp_size"):
        get_layout("llama-3-8b", tp_size=3)
    with pytest.raises(ConfigError, match="tp_size"):
        get_layout("llama-3-8b", tp_size=0)


@pytest.mark.parametrize("name", ["llama-3-8b", "deepseek-v3", "gpt-oss-20b", "gemma-3-27b"])
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "fp8", "float8_e5m2"])
def test_fp8_halves_bytes(name: str, dtype: str) -> None:
    bf16 = get_layout(name)
    fp8 = get_layout(name, kv_dtype=dtype)
    assert fp8.bytes_per_token == bf16.bytes_per_token / 2
    assert {s.dtype for s in fp8.layers} == {normalize_dtype(dtype)}
    assert fp8.fingerprint() != bf16.fingerprint()


def test_kimi_k25_fp8_per_100k_tokens() -> None:
    fp8 = get_layout("kimi-k2.5", kv_dtype="fp8")
    assert fp8.bytes_per_token == 61 * 576
    assert fp8.bytes_per_token * 100_000 == 3_513_600_000  # 3.51 GB, not the study's ~3.8 GB


def test_bad_dtype_and_block_size() -> None:
    with pytest.raises(ConfigError, match="kv_dtype"):
        get_layout("llama-3-8b", kv_dtype="float7")
    with pytest.raises(ConfigError, match="block_size"):
        get_layout("llama-3-8b", block_size=0)
    assert get_layout("llama-3-8b", kv_dtype="auto") == get_layout("llama-3-8b")


def test_block_size_override_matches_with_block_size() -> None:
    for name in ("llama-3-8b", "gpt-oss-20b", "deepseek-v3", "qwen3-next-80b"):
        assert get_layout(name, block_size=64) == get_layout(name).with_block_size(64)


def test_unknown_name_lists_known_names() -> None:
    with pytest.raises(UnknownNameError) as info:
        get_layout("llama-9-1t")
    err = info.value
    assert "llama-9-1t" in str(err)
    for name in ("tiny", "llama-3-8b", "deepseek-v3", "qwen3-next-80b"):
        assert name in str(err)
    assert err.field == "model" and err.value == "llama-9-1t"
    assert isinstance(err, KeyError) and isinstance(err, ConfigError)


def test_list_models() -> None:
    models = list_models()
    names = [m["name"] for m in models]
    assert len(set(names)) == len(names)
    assert set(names) == set(model_names())
    by_name = {m["name"]: m for m in models}
    for required in ("tiny", "llama-3-8b", "deepseek-r1", "kimi-k2.5", "glm-4.5", "gpt-oss-120b", "gemma-3-27b"):
        assert required in by_name
    m = by_name["llama-3-8b"]
    assert m["bytes_per_token"] == 131_072 and m["num_layers"] == 32 and m["kinds"] == {"full": 32}
    assert m["description"]
    q = by_name["qwen3-next-80b"]
    assert q["kinds"] == {"linear": 36, "full": 12}
    assert q["kv_bytes_per_token"] == 24_576 and q["state_bytes_per_block"] == 39_518_208


def test_entries_are_model_entries() -> None:
    for name in model_names():
        entry = get_entry(name)
        assert isinstance(entry, ModelEntry)
        assert entry.layout() == get_layout(name)


# ---- Hugging Face configs -------------------------------------------------------------------


@needs_configs
def test_hf_config_llama_matches_catalog() -> None:
    path = CONFIGS / "meta-llama--Meta-Llama-3.1-8B.json"
    from_file = layout_from_hf_config(path)
    assert from_file.model == "meta-llama--Meta-Llama-3.1-8B"
    assert from_file.layers == get_layout("llama-3-8b").layers
    assert get_layout(str(path)).layers == from_file.layers
    named = layout_from_hf_config(path, name="llama-3-8b")
    assert named == get_layout("llama-3-8b")
    assert named.fingerprint() == get_layout("llama-3-8b").fingerprint()


@needs_configs
@pytest.mark.parametrize("name", [n for n in model_names() if get_entry(n).hf_config])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_every_hf_config_matches_catalog(name: str, tp_size: int) -> None:
    entry = get_entry(name)
    assert entry.hf_config is not None
    path = CONFIGS / entry.hf_config
    assert path.is_file(), path
    expected = get_layout(name, tp_size=tp_size, kv_dtype="fp8")
    got = layout_from_hf_config(path, name=name, tp_size=tp_size, kv_dtype="fp8")
    assert got == expected


@needs_configs
def test_hf_config_other_shared_files_load() -> None:
    for path in sorted(CONFIGS.glob("*.json")):
        layout = layout_from_hf_config(path)
        assert layout.num_layers > 0
    gemma4 = layout_from_hf_config(CONFIGS / "google--gemma-4-26B-A4B.json")
    full = [s for s in gemma4.layers if s.kind is LayerKind.FULL]
    sliding = [s for s in gemma4.layers if s.kind is LayerKind.SLIDING]
    assert full[0].block_shape == (2, 16, 2, 512) and sliding[0].block_shape == (2, 16, 8, 256)


def _write(tmp_path: Path, cfg: object, name: str = "config.json") -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(cfg))
    return p


def test_hf_config_variants(tmp_path: Path) -> None:
    mistral = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512}
    mistral["sliding_window"] = 4096
    layout = layout_from_hf_config(_write(tmp_path, mistral))
    assert {s.kind for s in layout.layers} == {LayerKind.SLIDING}
    assert layout.layers[0].window == 4096 and layout.layers[0].block_shape == (2, 16, 2, 64)

    qwen2 = {**mistral, "use_sliding_window": False}
    assert {s.kind for s in layout_from_hf_config(_write(tmp_path, qwen2)).layers} == {LayerKind.FULL}

    gemma3 = {**mistral, "sliding_window": 1024, "sliding_window_pattern": 2, "head_dim": 32, "torch_dtype": "float32"}
    layout = layout_from_hf_config(_write(tmp_path, gemma3), block_size=8)
    assert [s.kind for s in layout.layers] == [LayerKind.SLIDING, LayerKind.FULL] * 2
    assert layout.layers[0].block_shape == (2, 8, 2, 32) and layout.layers[0].dtype == "float32"

    mla = {"num_hidden_layers": 3, "kv_lora_rank": 256, "qk_rope_head_dim": 32, "num_attention_heads": 16}
    layout = layout_from_hf_config(_write(tmp_path, mla), tp_size=8)
    assert {s.block_shape for s in layout.layers} == {(16, 288)}

    nested = {"text_config": {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256}}
    assert layout_from_hf_config(_write(tmp_path, nested)).layers[0].block_shape == (2, 16, 4, 64)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (None, "cannot read"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"num_attention_heads": 8}', "num_hidden_layers"),
        ('{"num_hidden_layers": 2}', "num_attention_heads"),
        ('{"num_hidden_layers": -2, "num_attention_heads": 8, "hidden_size": 64}', "num_hidden_layers"),
        ('{"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 64, "layer_types": ["x", "y"]}', "x"),
        (
            '{"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 64, "layer_types": ["full_attention"]}',
            "list of 2",
        ),
        (
            '{"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 64,'
            ' "layer_types": ["sliding_attention", "full_attention"]}',
            "sliding_window",
        ),
    ],
)
def test_hf_config_errors_name_the_path(tmp_path: Path, content: str | None, match: str) -> None:
    p = tmp_path / "bad-config.json"
    if content is not None:
        p.write_text(content)
    with pytest.raises(ConfigError, match=match) as info:
        layout_from_hf_config(p)
    assert str(p) in str(info.value)
    if content is not None:
        with pytest.raises(ConfigError):
            get_layout(str(p))


def test_get_layout_missing_json_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        get_layout(str(tmp_path / "nope.json"))
