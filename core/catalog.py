"""The model catalog: named models and Hugging Face configs turned into :class:`KVLayout` objects.

Every entry's geometry is hard-coded from the model's published ``config.json``;
the copies used are in ``shared/reference/model-configs/`` (file named in each
entry's ``hf_config``), and :func:`layout_from_hf_config` derives the same layout
from such a file (the test suite checks that they agree).

Layer-block shapes (one layer, one block of ``block_size`` tokens):

* full / sliding attention: ``(2, block_size, kv_heads_per_rank, head_dim)`` (K and V);
* MLA: ``(block_size, kv_lora_rank + qk_rope_head_dim)`` -- one latent per token, the
  same on every tensor-parallel rank, so ``tp_size`` does not change it;
* linear attention (Qwen3-Next / Qwen3.5 gated delta net): the recurrent state snapshot
  at a block boundary, independent of the block size. Per layer and rank it is::

      conv  = (linear_conv_kernel_dim - 1) * (2 * linear_num_key_heads * linear_key_head_dim
                                              + linear_num_value_heads * linear_value_head_dim) / tp
      ssm   = linear_num_value_heads / tp * linear_key_head_dim * linear_value_head_dim

  elements (vLLM's ``MambaStateShapeCalculator.gated_delta_net_state_shape``). The layer-block
  is the flat vector ``(conv + ssm,)`` in the state dtype, or ``(bytes,)`` of ``uint8`` when the
  SSM state and the conv state have different dtypes (e.g. an fp32 SSM state).

``kv_dtype`` overrides the dtype of attention layers (full, sliding, MLA); ``state_dtype``
overrides the dtype of the SSM part of linear-attention state. ``tp_size`` divides the KV
heads of full/sliding layers (replicated, one head per rank, when there are fewer heads
than ranks) and the heads of linear-attention state; it never changes MLA layers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstrata.core.layout import DTYPE_SIZES, KVLayout, LayerKind, LayerSpec
from kvstrata.errors import ConfigError, UnknownNameError

__all__ = [
    "LinearStateSpec",
    "ModelEntry",
    "ModelGeometry",
    "get_entry",
    "get_layout",
    "layout_from_hf_config",
    "list_models",
    "model_names",
    "normalize_dtype",
]

DEFAULT_BLOCK_SIZE = 16

_DTYPE_ALIASES: dict[str, str] = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "float8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def normalize_dtype(dtype: str | None, *, field: str = "kv_dtype") -> str | None:
    """Canonical dtype name (``"fp8"`` -> ``"float8_e4m3fn"``); ``None``/``"auto"`` -> ``None``."""
    if dtype is None:
        return None
    d = str(dtype).strip().lower().removeprefix("torch.")
    if d in ("", "auto"):
        return None
    d = _DTYPE_ALIASES.get(d, d)
    if d not in DTYPE_SIZES:
        raise ConfigError(
            f"unknown {field} {dtype!r}; known: {', '.join(DTYPE_SIZES)} (or {', '.join(_DTYPE_ALIASES)})",
            field=field,
            value=dtype,
        )
    return d


def _heads_per_rank(heads: int, tp_size: int, what: str) -> int:
    if heads >= tp_size:
        if heads % tp_size:
            raise ConfigError(
                f"{heads} {what} cannot be split evenly over tp_size={tp_size}", field="tp_size", value=tp_size
            )
        return heads // tp_size
    if tp_size % heads:
        raise ConfigError(
            f"tp_size={tp_size} is not a multiple of the {heads} {what} (needed to replicate them)",
            field="tp_size",
            value=tp_size,
        )
    return 1


@dataclass(frozen=True)
class LinearStateSpec:
    """Geometry of a gated-delta-net (linear attention) layer's recurrent state."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    ssm_dtype: str = "bfloat16"
    conv_dtype: str = "bfloat16"

    def _split(self, tp_size: int) -> tuple[int, int]:
        for heads, what in ((self.num_key_heads, "linear-attention key heads"), (self.num_value_heads, "value heads")):
            if heads % tp_size:
                raise ConfigError(
                    f"{heads} {what} cannot be split evenly over tp_size={tp_size}", field="tp_size", value=tp_size
                )
        return self.num_key_heads // tp_size, self.num_value_heads // tp_size

    def conv_elements(self, tp_size: int = 1) -> int:
        nk, nv = self._split(tp_size)
        return (self.conv_kernel - 1) * (2 * nk * self.key_head_dim + nv * self.value_head_dim)

    def ssm_elements(self, tp_size: int = 1) -> int:
        _, nv = self._split(tp_size)
        return nv * self.key_head_dim * self.value_head_dim

    def nbytes(self, tp_size: int = 1) -> int:
        return (
            self.conv_elements(tp_size) * DTYPE_SIZES[self.conv_dtype]
            + self.ssm_elements(tp_size) * DTYPE_SIZES[self.ssm_dtype]
        )

    def layer_spec(self, name: str, tp_size: int = 1) -> LayerSpec:
        if self.ssm_dtype == self.conv_dtype:
            shape = (self.conv_elements(tp_size) + self.ssm_elements(tp_size),)
            return LayerSpec(name, LayerKind.LINEAR, shape, self.ssm_dtype)
        return LayerSpec(name, LayerKind.LINEAR, (self.nbytes(tp_size),), "uint8")


@dataclass(frozen=True)
class ModelGeometry:
    """What a layout is built from: one kind per layer plus the per-kind dimensions."""

    layer_kinds: tuple[LayerKind, ...]
    num_kv_heads: int = 0  # full and sliding layers
    head_dim: int = 0
    full_kv_heads: int | None = None  # override for full layers (e.g. Gemma 4 global layers)
    full_head_dim: int | None = None
    sliding_window: int | None = None
    kv_lora_rank: int = 0  # MLA
    qk_rope_head_dim: int = 0
    linear: LinearStateSpec | None = None
    dtype: str = "bfloat16"

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    def build(
        self,
        model: str,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        kv_dtype: str | None = None,
        state_dtype: str | None = None,
        tp_size: int = 1,
    ) -> KVLayout:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ConfigError(f"block_size must be a positive integer, got {block_size!r}", field="block_size")
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size <= 0:
            raise ConfigError(f"tp_size must be a positive integer, got {tp_size!r}", field="tp_size", value=tp_size)
        attn_dtype = normalize_dtype(kv_dtype, field="kv_dtype") or self.dtype
        ssm_dtype = normalize_dtype(state_dtype, field="state_dtype")
        linear = self.linear
        if linear is not None and ssm_dtype is not None:
            linear = LinearStateSpec(
                linear.num_key_heads,
                linear.num_value_heads,
                linear.key_head_dim,
                linear.value_head_dim,
                linear.conv_kernel,
                ssm_dtype,
                linear.conv_dtype,
            )
        specs: list[LayerSpec] = []
        for i, kind in enumerate(self.layer_kinds):
            name = f"layers.{i}"
            if kind is LayerKind.MLA:
                shape: tuple[int, ...] = (block_size, self.kv_lora_rank + self.qk_rope_head_dim)
                specs.append(LayerSpec(name, kind, shape, attn_dtype))
            elif kind is LayerKind.LINEAR:
                if linear is None:
                    raise ConfigError(f"{model}: layer {i} is linear attention but no state geometry is given")
                specs.append(linear.layer_spec(name, tp_size))
            else:
                heads, dim = self.num_kv_heads, self.head_dim
                if kind is LayerKind.FULL:
                    heads = self.full_kv_heads or heads
                    dim = self.full_head_dim or dim
                heads = _heads_per_rank(heads, tp_size, "KV heads")
                window = self.sliding_window if kind is LayerKind.SLIDING else None
                specs.append(LayerSpec(name, kind, (2, block_size, heads, dim), attn_dtype, window))
        return KVLayout(model=model, block_size=block_size, layers=tuple(specs))


@dataclass(frozen=True)
class ModelEntry:
    """A named model of the catalog."""

    name: str
    description: str
    geometry: ModelGeometry
    hf_config: str | None = None  # file name in shared/reference/model-configs (informational)
    aliases: tuple[str, ...] = ()
    default_block_size: int = DEFAULT_BLOCK_SIZE

    def layout(
        self,
        *,
        block_size: int | None = None,
        kv_dtype: str | None = None,
        state_dtype: str | None = None,
        tp_size: int = 1,
    ) -> KVLayout:
        return self.geometry.build(
            self.name,
            block_size=self.default_block_size if block_size is None else block_size,
            kv_dtype=kv_dtype,
            state_dtype=state_dtype,
            tp_size=tp_size,
        )


# ----------------------------------------------------------------------------------------------
# geometry helpers

_F, _S, _L, _M = LayerKind.FULL, LayerKind.SLIDING, LayerKind.LINEAR, LayerKind.MLA


def _full(num_layers: int, kv_heads: int, head_dim: int, dtype: str = "bfloat16") -> ModelGeometry:
    return ModelGeometry((_F,) * num_layers, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)


def _mla(num_layers: int, kv_lora_rank: int, rope_dim: int) -> ModelGeometry:
    return ModelGeometry((_M,) * num_layers, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope_dim)


def _every_nth(num_layers: int, n: int, nth: LayerKind, other: LayerKind) -> tuple[LayerKind, ...]:
    """Layer ``i`` is ``nth`` when ``(i + 1) % n == 0`` (HF's ``full_attention_interval`` rule)."""
    return tuple(nth if (i + 1) % n == 0 else other for i in range(num_layers))


def _entries() -> list[ModelEntry]:
    # Each hf_config file is a copy of the published config.json (see shared/reference/model-configs).
    e: list[ModelEntry] = [
        ModelEntry(
            "tiny",
            "synthetic test model: 4 full-attention layers, 1 KV head, head_dim 16 (256 B/token in bf16)",
            _full(4, 1, 16),
        ),
        # Synthetic hybrids shaped like the real ones, small enough to replay with real bytes.
        ModelEntry(
            "tiny-swa",
            "synthetic hybrid like gpt-oss: 4 layers alternating 128-token sliding window and full attention",
            ModelGeometry(
                tuple(_S if i % 2 == 0 else _F for i in range(4)), num_kv_heads=1, head_dim=16, sliding_window=128
            ),
        ),
        ModelEntry(
            "tiny-linear",
            "synthetic hybrid like Qwen3-Next: 3 gated-delta-net layers per full-attention layer (4 layers)",
            ModelGeometry(
                _every_nth(4, 4, _F, _L), num_kv_heads=1, head_dim=16, linear=LinearStateSpec(2, 4, 32, 32, 4)
            ),
        ),
        # meta-llama--Meta-Llama-3.1-8B.json: num_hidden_layers 32, num_key_value_heads 8,
        # head_dim = hidden_size 4096 / num_attention_heads 32 = 128 (Llama 3 8B has the same geometry)
        ModelEntry(
            "llama-3-8b",
            "Llama 3 / 3.1 8B: 32 layers, GQA 8 KV heads x 128",
            _full(32, 8, 128),
            "meta-llama--Meta-Llama-3.1-8B.json",
            aliases=("llama-3.1-8b",),
        ),
        # meta-llama--Meta-Llama-3.1-70B.json: 80 layers, 8 KV heads, 8192 / 64 = 128
        ModelEntry(
            "llama-3.1-70b",
            "Llama 3.1 70B: 80 layers, GQA 8 KV heads x 128",
            _full(80, 8, 128),
            "meta-llama--Meta-Llama-3.1-70B.json",
            aliases=("llama-3-70b",),
        ),
        # meta-llama--Meta-Llama-3.1-405B.json: 126 layers, 8 KV heads, 16384 / 128 = 128
        ModelEntry(
            "llama-3.1-405b",
            "Llama 3.1 405B: 126 layers, GQA 8 KV heads x 128",
            _full(126, 8, 128),
            "meta-llama--Meta-Llama-3.1-405B.json",
        ),
        # Qwen--Qwen3-8B.json: 36 layers, 8 KV heads, head_dim 128
        ModelEntry("qwen3-8b", "Qwen3 8B: 36 layers, GQA 8 KV heads x 128", _full(36, 8, 128), "Qwen--Qwen3-8B.json"),
        # Qwen--Qwen3-32B.json: 64 layers, 8 KV heads, head_dim 128
        ModelEntry(
            "qwen3-32b", "Qwen3 32B: 64 layers, GQA 8 KV heads x 128", _full(64, 8, 128), "Qwen--Qwen3-32B.json"
        ),
        # Qwen--Qwen3-235B-A22B.json: 94 layers, 4 KV heads, head_dim 128
        ModelEntry(
            "qwen3-235b-a22b",
            "Qwen3 235B-A22B (MoE): 94 layers, GQA 4 KV heads x 128",
            _full(94, 4, 128),
            "Qwen--Qwen3-235B-A22B.json",
        ),
        # mistralai--Mixtral-8x7B-v0.1.json: 32 layers, 8 KV heads, 4096 / 32 = 128, sliding_window null
        ModelEntry(
            "mixtral-8x7b",
            "Mixtral 8x7B (MoE): 32 layers, GQA 8 KV heads x 128",
            _full(32, 8, 128),
            "mistralai--Mixtral-8x7B-v0.1.json",
        ),
        # mistralai--Mixtral-8x22B-v0.1.json: 56 layers, 8 KV heads, 6144 / 48 = 128
        ModelEntry(
            "mixtral-8x22b",
            "Mixtral 8x22B (MoE): 56 layers, GQA 8 KV heads x 128",
            _full(56, 8, 128),
            "mistralai--Mixtral-8x22B-v0.1.json",
        ),
        # openai--gpt-oss-20b.json: 24 layers, layer_types alternate sliding_attention / full_attention
        # (sliding first), sliding_window 128, 8 KV heads, head_dim 64; attention stays bf16 (mxfp4 is
        # for the MoE weights only)
        ModelEntry(
            "gpt-oss-20b",
            "gpt-oss 20B: 24 layers alternating 128-token sliding window and full attention, 8 KV heads x 64",
            ModelGeometry(
                tuple(_S if i % 2 == 0 else _F for i in range(24)), num_kv_heads=8, head_dim=64, sliding_window=128
            ),
            "openai--gpt-oss-20b.json",
        ),
        # openai--gpt-oss-120b.json: 36 layers, same pattern and dimensions as 20b
        ModelEntry(
            "gpt-oss-120b",
            "gpt-oss 120B: 36 layers alternating 128-token sliding window and full attention, 8 KV heads x 64",
            ModelGeometry(
                tuple(_S if i % 2 == 0 else _F for i in range(36)), num_kv_heads=8, head_dim=64, sliding_window=128
            ),
            "openai--gpt-oss-120b.json",
        ),
        # No config file is shared for Gemma 3. Published google/gemma-3-27b-it text_config values:
        # num_hidden_layers 62, num_key_value_heads 16, head_dim 128, sliding_window 1024,
        # sliding_window_pattern 6 (5 local layers then 1 global: layers 5, 11, ..., 59 are global).
        ModelEntry(
            "gemma-3-27b",
            "Gemma 3 27B: 62 layers, 5 local (1024-token window) : 1 global, 16 KV heads x 128",
            ModelGeometry(_every_nth(62, 6, _F, _S), num_kv_heads=16, head_dim=128, sliding_window=1024),
        ),
        # Qwen--Qwen3-Next-80B-A3B-Thinking.json: 48 layers, full_attention_interval 4 -> layers 3, 7, ...
        # are full attention (num_key_value_heads 2, head_dim 256), the other 36 are gated delta net
        # (linear_num_key_heads 16, linear_num_value_heads 32, linear_key/value_head_dim 128,
        # linear_conv_kernel_dim 4). State per linear layer: conv 3 * (2*16*128 + 32*128) = 24,576 +
        # ssm 32*128*128 = 524,288 elements = 1,097,728 bytes in bf16 (39.5 MB for all 36 layers;
        # 77.3 MB with state_dtype="float32" for the SSM part).
        ModelEntry(
            "qwen3-next-80b",
            "Qwen3-Next 80B-A3B: 12 full-attention layers (2 KV heads x 256) + 36 gated-delta-net layers",
            ModelGeometry(
                _every_nth(48, 4, _F, _L),
                num_kv_heads=2,
                head_dim=256,
                linear=LinearStateSpec(16, 32, 128, 128, 4),
            ),
            "Qwen--Qwen3-Next-80B-A3B-Thinking.json",
            aliases=("qwen3-next-80b-a3b",),
        ),
        # Qwen--Qwen3.5-397B-A17B.json (text_config): 60 layers, full_attention_interval 4 (15 full: 2 KV heads
        # x 256; 45 linear: 16 key heads, 64 value heads, 128 x 128, conv kernel 4); mamba_ssm_dtype float32,
        # so the SSM state is fp32 and the conv state bf16 (layer-block stored as raw bytes).
        ModelEntry(
            "qwen3.5-397b-a17b",
            "Qwen3.5 397B-A17B: 15 full-attention layers (2 KV heads x 256) + 45 gated-delta-net layers (fp32 SSM)",
            ModelGeometry(
                _every_nth(60, 4, _F, _L),
                num_kv_heads=2,
                head_dim=256,
                linear=LinearStateSpec(16, 64, 128, 128, 4, ssm_dtype="float32"),
            ),
            "Qwen--Qwen3.5-397B-A17B.json",
        ),
        # deepseek-ai--DeepSeek-V3.json / DeepSeek-R1.json: 61 layers, kv_lora_rank 512, qk_rope_head_dim 64
        # (the MTP layer, num_nextn_predict_layers 1, is not included)
        ModelEntry(
            "deepseek-v3",
            "DeepSeek V3: 61 MLA layers, latent 512 + rope 64 per token",
            _mla(61, 512, 64),
            "deepseek-ai--DeepSeek-V3.json",
        ),
        ModelEntry(
            "deepseek-r1",
            "DeepSeek R1: 61 MLA layers, latent 512 + rope 64 per token",
            _mla(61, 512, 64),
            "deepseek-ai--DeepSeek-R1.json",
        ),
        # moonshotai--Kimi-K2-Instruct.json: DeepSeek V3 architecture, 61 layers, 512 + 64
        ModelEntry(
            "kimi-k2",
            "Kimi K2: 61 MLA layers, latent 512 + rope 64 per token",
            _mla(61, 512, 64),
            "moonshotai--Kimi-K2-Instruct.json",
        ),
        # moonshotai--Kimi-K2.5.json (text_config): 61 layers, kv_lora_rank 512, qk_rope_head_dim 64.
        # KV per token: 61 * 576 = 35,136 elements -> 70,272 B in bf16, 35,136 B in fp8; 100K tokens in fp8
        # = 3.51 GB (3.27 GiB). The vLLM x Mooncake study quotes "~3.8 GB per 100K tokens in FP8", which only
        # fits a layout that also stores per-block quantization scales; plain fp8 latents are 3.51 GB.
        ModelEntry(
            "kimi-k2.5",
            "Kimi K2.5: 61 MLA layers, latent 512 + rope 64 per token",
            _mla(61, 512, 64),
            "moonshotai--Kimi-K2.5.json",
        ),
        # GLM-4.5 and GLM-4.7 share the attention geometry; the shared file is zai-org--GLM-4.7-FP8.json:
        # num_hidden_layers 92, num_key_value_heads 8, head_dim 128 (the MTP layer is not included).
        ModelEntry(
            "glm-4.5",
            "GLM-4.5 / 4.7 (MoE): 92 layers, GQA 8 KV heads x 128 (geometry from the GLM-4.7-FP8 config)",
            _full(92, 8, 128),
            "zai-org--GLM-4.7-FP8.json",
            aliases=("glm-4.7",),
        ),
    ]
    return e


_CATALOG: dict[str, ModelEntry] = {entry.name: entry for entry in _entries()}
_ALIASES: dict[str, str] = {alias: entry.name for entry in _CATALOG.values() for alias in entry.aliases}


def model_names(*, include_aliases: bool = False) -> list[str]:
    """Catalog names (sorted), optionally with aliases."""
    names = list(_CATALOG)
    if include_aliases:
        names += list(_ALIASES)
    return sorted(names)


def get_entry(name: str) -> ModelEntry:
    """The catalog entry for ``name`` (case-insensitive; aliases accepted)."""
    key = str(name).strip().lower()
    key = _ALIASES.get(key, key)
    try:
        return _CATALOG[key]
    except KeyError:
        raise UnknownNameError(
            f"unknown model {name!r}; known: {', '.join(model_names(include_aliases=True))}",
            field="model",
            value=name,
        ) from None


def get_layout(
    name: str,
    *,
    block_size: int | None = None,
    kv_dtype: str | None = None,
    tp_size: int = 1,
    state_dtype: str | None = None,
) -> KVLayout:
    """The KV layout of a catalog model, or of a Hugging Face ``config.json`` given by path.

    ``block_size`` defaults to the entry's default (16); ``kv_dtype`` overrides the dtype of
    attention layers (``"float8_e4m3fn"``, ``"fp8"``, ...); ``tp_size`` gives the per-rank layout.
    """
    text = str(name)
    if text.endswith(".json") and (Path(text).exists() or "/" in text or "\\" in text):
        return layout_from_hf_config(
            text,
            block_size=DEFAULT_BLOCK_SIZE if block_size is None else block_size,
            kv_dtype=kv_dtype,
            tp_size=tp_size,
            state_dtype=state_dtype,
        )
    return get_entry(name).layout(block_size=block_size, kv_dtype=kv_dtype, state_dtype=state_dtype, tp_size=tp_size)


def list_models() -> list[dict[str, Any]]:
    """One summary dict per catalog entry (default block size, default dtypes, tp_size 1)."""
    out: list[dict[str, Any]] = []
    for entry in _CATALOG.values():
        layout = entry.layout()
        kinds: dict[str, int] = {}
        for spec in layout.layers:
            kinds[spec.kind.value] = kinds.get(spec.kind.value, 0) + 1
        state = sum(s.nbytes for s in layout.layers if s.kind is LayerKind.LINEAR)
        out.append(
            {
                "name": entry.name,
                "aliases": list(entry.aliases),
                "description": entry.description,
                "hf_config": entry.hf_config,
                "num_layers": layout.num_layers,
                "kinds": kinds,
                "block_size": layout.block_size,
                "dtype": entry.geometry.dtype,
                "block_nbytes": layout.block_nbytes,
                "bytes_per_token": layout.bytes_per_token,
                # attention KV only (linear-attention state is a per-block snapshot, not per token)
                "kv_bytes_per_token": (layout.block_nbytes - state) / layout.block_size,
                "state_bytes_per_block": state,
            }
        )
    return out


# ----------------------------------------------------------------------------------------------
# Hugging Face config.json

_LAYER_TYPES: dict[str, LayerKind] = {
    "full_attention": _F,
    "attention": _F,
    "global_attention": _F,
    "sliding_attention": _S,
    "sliding_window_attention": _S,
    "local_attention": _S,
    "linear_attention": _L,
}


def _cfg_int(cfg: Mapping[str, Any], key: str, path: str, *, required: bool = True, default: int = 0) -> int:
    value = cfg.get(key)
    if value is None:
        if required:
            raise ConfigError(f"{path}: model config has no {key!r}", field=key, value=path)
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{path}: {key!r} must be a positive integer, got {value!r}", field=key, value=value)
    return value


def _cfg_dtype(value: object, default: str) -> str:
    try:
        return normalize_dtype(value if isinstance(value, str) else None) or default
    except ConfigError:
        return default


def geometry_from_hf_config(config: Mapping[str, Any], *, source: str = "<config>") -> ModelGeometry:
    """The :class:`ModelGeometry` of a parsed Hugging Face ``config.json`` (``text_config`` is used if present)."""
    cfg: dict[str, Any] = dict(config)
    if isinstance(cfg.get("text_config"), Mapping):
        cfg = {**cfg, **cfg["text_config"]}
    num_layers = _cfg_int(cfg, "num_hidden_layers", source)
    dtype = _cfg_dtype(cfg.get("torch_dtype") or cfg.get("dtype"), "bfloat16")

    if cfg.get("kv_lora_rank"):
        return ModelGeometry(
            (_M,) * num_layers,
            kv_lora_rank=_cfg_int(cfg, "kv_lora_rank", source),
            qk_rope_head_dim=_cfg_int(cfg, "qk_rope_head_dim", source),
            dtype=dtype,
        )

    heads = _cfg_int(cfg, "num_attention_heads", source)
    kv_heads = _cfg_int(cfg, "num_key_value_heads", source, required=False, default=heads)
    if cfg.get("head_dim") is not None:
        head_dim = _cfg_int(cfg, "head_dim", source)
    else:
        hidden = _cfg_int(cfg, "hidden_size", source)
        if hidden % heads:
            raise ConfigError(f"{source}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        head_dim = hidden // heads

    kinds: tuple[LayerKind, ...]
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise ConfigError(f"{source}: 'layer_types' must be a list of {num_layers} names", field="layer_types")
        unknown = sorted({str(t) for t in layer_types if t not in _LAYER_TYPES})
        if unknown:
            raise ConfigError(
                f"{source}: unsupported layer types {unknown}; known: {', '.join(_LAYER_TYPES)}",
                field="layer_types",
                value=unknown,
            )
        kinds = tuple(_LAYER_TYPES[t] for t in layer_types)
    elif cfg.get("full_attention_interval") and cfg.get("linear_num_value_heads"):
        kinds = _every_nth(num_layers, _cfg_int(cfg, "full_attention_interval", source), _F, _L)
    elif cfg.get("sliding_window") and cfg.get("sliding_window_pattern"):  # Gemma 2/3 style
        kinds = _every_nth(num_layers, _cfg_int(cfg, "sliding_window_pattern", source), _F, _S)
    elif cfg.get("sliding_window") and cfg.get("use_sliding_window", True):
        if cfg.get("max_window_layers") is not None and "use_sliding_window" in cfg:  # Qwen2 style
            first = int(cfg["max_window_layers"])
            kinds = tuple(_S if i >= first else _F for i in range(num_layers))
        else:  # Mistral style: every layer uses the window
            kinds = (_S,) * num_layers
    else:
        kinds = (_F,) * num_layers

    window = _cfg_int(cfg, "sliding_window", source) if _S in kinds else None
    linear = None
    if _L in kinds:
        linear = LinearStateSpec(
            num_key_heads=_cfg_int(cfg, "linear_num_key_heads", source),
            num_value_heads=_cfg_int(cfg, "linear_num_value_heads", source),
            key_head_dim=_cfg_int(cfg, "linear_key_head_dim", source),
            value_head_dim=_cfg_int(cfg, "linear_value_head_dim", source),
            conv_kernel=_cfg_int(cfg, "linear_conv_kernel_dim", source),
            ssm_dtype=_cfg_dtype(cfg.get("mamba_ssm_dtype"), dtype),
            conv_dtype=dtype,
        )
    full_kv_heads = full_head_dim = None
    if _F in kinds and _S in kinds:  # Gemma 4: global layers have their own KV geometry
        if cfg.get("num_global_key_value_heads"):
            full_kv_heads = _cfg_int(cfg, "num_global_key_value_heads", source)
        if cfg.get("global_head_dim"):
            full_head_dim = _cfg_int(cfg, "global_head_dim", source)
    return ModelGeometry(
        kinds,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        full_kv_heads=full_kv_heads,
        full_head_dim=full_head_dim,
        sliding_window=window,
        linear=linear,
        dtype=dtype,
    )


def layout_from_hf_config(
    path: str | Path,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_dtype: str | None = None,
    tp_size: int = 1,
    state_dtype: str | None = None,
    name: str | None = None,
) -> KVLayout:
    """The KV layout described by a Hugging Face ``config.json``.

    Handles Llama/Qwen/Mixtral-style GQA (``num_key_value_heads``, ``head_dim`` or
    ``hidden_size / num_attention_heads``), sliding windows (``layer_types`` or
    ``sliding_window`` [+ ``sliding_window_pattern`` / ``max_window_layers``]), MLA
    (``kv_lora_rank`` + ``qk_rope_head_dim``) and gated-delta-net linear attention
    (``full_attention_interval`` / ``layer_types`` + ``linear_*``). Not modelled: Gemma 4's
    ``attention_k_eq_v`` and ``num_kv_shared_layers`` (K and V are stored for every layer) and
    multi-token-prediction layers. The layout's ``model`` is ``name`` or the file name without
    ``.json``.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: cannot read model config: {exc}", field="model", value=str(p)) from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{p}: model config is not valid JSON: {exc}", field="model", value=str(p)) from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: model config must be a JSON object", field="model", value=str(p))
    geometry = geometry_from_hf_config(data, source=str(p))
    return geometry.build(
        name or p.stem, block_size=block_size, kv_dtype=kv_dtype, state_dtype=state_dtype, tp_size=tp_size
    )
