"""The cost model: what a hit saves (prefill compute) and what it costs (moving bytes per tier).

Assumptions, all stated in the plan's output and overridable:

* **Prefill compute.** Prefilling ``n`` new tokens after a cached prefix of ``m`` tokens costs
  ``2 * P * n`` FLOPs for the weights (``P``: active parameters per token, the LM head
  included) plus, per attention layer, ``2 * heads * (d_qk + d_v)`` FLOPs per pair of a new
  token and a token it attends to: ``n * m + n * (n + 1) / 2`` pairs for full attention,
  each token's window for sliding-window layers, none for linear-attention layers. The GPU
  runs at ``mfu`` (default 0.5) of its dense peak, split over ``tp`` GPUs.
* **Loads.** A hit costs its bytes over the serving tier's link: ``hbm`` hits are free (the
  KV is already in GPU memory); ``dram`` moves over the GPU's host link; ``nvme``, ``mooncake``
  and ``fs`` over the node's drive or NIC shared by its ``tp`` GPUs, and never faster than
  the host link (GPUDirect for ``mooncake``: NIC only). Sizes are per tensor-parallel rank.
* **TTFT** of a request = compute of its missed tokens + the loads of its hits, one after
  the other (no overlap of loads with compute: conservative); queueing is not modelled.
  The no-cache baseline recomputes every prompt token.
* **Prefill throughput** over the trace = no-cache compute / max(compute with the cache,
  busiest link's load time): loads of one request overlap other requests' compute.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvstrata.core.catalog import get_entry
from kvstrata.errors import ConfigError
from kvstrata.planner.kinds import kind_capabilities

__all__ = [
    "GPUS",
    "LINKS",
    "CostModel",
    "CostReport",
    "GPUProfile",
    "ModelCompute",
    "model_compute",
    "parse_bandwidth",
]

GB = 1e9


@dataclass(frozen=True)
class GPUProfile:
    """Dense peak TFLOPS (bf16, fp8) and the one-way host<->device copy bandwidth (GB/s)."""

    name: str
    bf16_tflops: float
    fp8_tflops: float
    host_link_gbps: float
    hbm_gib: float
    source: str = ""


GPUS: dict[str, GPUProfile] = {
    g.name: g
    for g in (
        GPUProfile("h100", 989, 1979, 50, 80, "H100 SXM datasheet; ~50 GB/s H2D copy engine at 2 MB blocks"),
        GPUProfile("h200", 989, 1979, 50, 141, "H200 SXM datasheet; PCIe Gen5 x16 like H100"),
        GPUProfile("b200", 2250, 4500, 55, 180, "B200 datasheet (dense); PCIe Gen5 x16 host link"),
        GPUProfile("a100", 312, 312, 24, 80, "A100 SXM datasheet (no fp8); PCIe Gen4 x16"),
        GPUProfile("l40s", 362, 733, 24, 48, "L40S datasheet (dense); PCIe Gen4 x16"),
        GPUProfile("mi300x", 1307, 2615, 50, 192, "MI300X datasheet (dense); PCIe Gen5 x16"),
    )
}


@dataclass(frozen=True)
class LinkProfile:
    """Read bandwidth (GB/s) of a drive array or NIC, per node."""

    name: str
    kind: str  # nvme | nic | fs
    read_gbps: float
    source: str = ""


LINKS: dict[str, LinkProfile] = {
    p.name: p
    for p in (
        LinkProfile("nvme-gen4", "nvme", 7.0, "one PCIe Gen4 x4 NVMe SSD, sequential read"),
        LinkProfile("nvme-gen5", "nvme", 14.0, "one PCIe Gen5 x4 NVMe SSD, sequential read"),
        LinkProfile("nvme-array", "nvme", 37.6, "striped NVMe array, NIXL GDS ~35 GiB/s into GPU memory"),
        LinkProfile("rdma-4x200g", "nic", 87.0, "Mooncake transfer engine on 4x200 Gb RoCE"),
        LinkProfile("rdma-8x400g", "nic", 190.0, "Mooncake transfer engine on 8x400 Gb"),
        LinkProfile("eth-100g", "nic", 11.0, "one 100 Gb NIC, TCP"),
        LinkProfile("3fs-400g", "fs", 42.9, "3FS ~40 GiB/s per client node with one 400 Gb NIC"),
        LinkProfile("nfs-100g", "fs", 10.0, "NFS over one 100 Gb NIC"),
        LinkProfile("s3", "fs", 1.0, "object store, one client, large objects"),
    )
}

DEFAULT_LINKS = {"nvme": "nvme-gen5", "mooncake": "rdma-4x200g", "fs": "3fs-400g"}


def parse_bandwidth(text: str) -> float:
    """``"50GB/s"``, ``"12.5 GiB/s"``, ``"400Gb/s"`` (bits) or a number of bytes/s."""
    t = str(text).strip().replace(" ", "")
    units = {"gib/s": 1024**3, "gb/s": 1e9, "mib/s": 1024**2, "mb/s": 1e6, "gbit/s": 1e9 / 8, "b/s": 1.0}
    low = t.lower()
    if low.endswith("gb/s") and t[-4] == "G" and t[-3] == "b":  # "Gb/s": bits
        mult, num = 1e9 / 8, t[:-4]
    else:
        for unit, m in units.items():
            if low.endswith(unit):
                mult, num = m, t[: -len(unit)]
                break
        else:
            mult, num = 1.0, t
    try:
        value = float(num) * mult
    except ValueError:
        msg = f"not a bandwidth: {text!r} (expected e.g. '50GB/s')"
        raise ConfigError(msg, field="bandwidth", value=text) from None
    if not value > 0:
        raise ConfigError(f"bandwidth must be positive: {text!r}", field="bandwidth", value=text)
    return value


@dataclass(frozen=True)
class AttentionGroup:
    """``layers`` attention layers costing ``coef`` FLOPs per attended pair; ``window`` for sliding ones."""

    layers: int
    coef: float
    window: int | None = None


@dataclass(frozen=True)
class ModelCompute:
    """What prefill compute costs for one model (see the module doc)."""

    active_params: float
    attention: tuple[AttentionGroup, ...]
    source: str = ""

    def prefill_flops(self, new: np.ndarray, cached: np.ndarray) -> np.ndarray:
        """FLOPs to prefill ``new`` tokens after ``cached`` tokens (element-wise arrays)."""
        n = np.asarray(new, dtype=np.float64)
        m = np.asarray(cached, dtype=np.float64)
        flops = 2.0 * self.active_params * n
        for g in self.attention:
            if g.window is None:
                pairs = n * m + n * (n + 1) / 2
            else:
                w = float(g.window)
                lo, hi = m + 1, m + n  # context lengths of the new tokens, each capped at the window
                a = np.minimum(hi, w)
                ramp = np.where(a >= lo, (lo + a) * (a - lo + 1) / 2, 0.0)
                pairs = ramp + np.maximum(0.0, hi - np.maximum(lo - 1, w)) * w
            flops += g.coef * g.layers * pairs
        return flops


def _gqa(layers: int, heads: int, head_dim: int, window: int | None = None) -> AttentionGroup:
    return AttentionGroup(layers, 2.0 * heads * 2 * head_dim, window)


def _mla(layers: int, heads: int) -> AttentionGroup:
    return AttentionGroup(layers, 2.0 * heads * ((128 + 64) + 128))  # qk: nope 128 + rope 64, v: 128


#: Active parameters (the LM head included) and attention shapes of the catalog models, computed
#: from their published config.json (shared/reference/model-configs) with :func:`estimate_from_hf_config`,
#: rounded; Gemma 3 27B from its published text_config.
_COMPUTE: dict[str, ModelCompute] = {
    "tiny": ModelCompute(2.3e6, (_gqa(4, 4, 16),), "synthetic: hidden 64, 4 heads x 16"),
    "llama-3-8b": ModelCompute(7.5e9, (_gqa(32, 32, 128),)),
    "llama-3.1-70b": ModelCompute(69.5e9, (_gqa(80, 64, 128),)),
    "llama-3.1-405b": ModelCompute(403.8e9, (_gqa(126, 128, 128),)),
    "qwen3-8b": ModelCompute(7.6e9, (_gqa(36, 32, 128),)),
    "qwen3-32b": ModelCompute(32.0e9, (_gqa(64, 64, 128),)),
    "qwen3-235b-a22b": ModelCompute(21.5e9, (_gqa(94, 64, 128),)),
    "mixtral-8x7b": ModelCompute(12.75e9, (_gqa(32, 32, 128),)),
    "mixtral-8x22b": ModelCompute(38.95e9, (_gqa(56, 48, 128),)),
    "gpt-oss-20b": ModelCompute(3.6e9, (_gqa(12, 64, 64), _gqa(12, 64, 64, 128))),
    "gpt-oss-120b": ModelCompute(5.1e9, (_gqa(18, 64, 64), _gqa(18, 64, 64, 128))),
    "gemma-3-27b": ModelCompute(27.0e9, (_gqa(10, 32, 128), _gqa(52, 32, 128, 1024))),
    "qwen3-next-80b": ModelCompute(3.4e9, (_gqa(12, 16, 256),)),
    "qwen3.5-397b-a17b": ModelCompute(15.7e9, (_gqa(15, 32, 256),)),
    "deepseek-v3": ModelCompute(36.5e9, (_mla(61, 128),)),
    "deepseek-r1": ModelCompute(36.5e9, (_mla(61, 128),)),
    "kimi-k2": ModelCompute(31.5e9, (_mla(61, 64),)),
    "kimi-k2.5": ModelCompute(31.5e9, (_mla(61, 64),)),
    "glm-4.5": ModelCompute(32.8e9, (_gqa(92, 96, 128),)),
}


def _get(cfg: Mapping[str, Any], *names: str, default: int = 0) -> int:
    for name in names:
        v = cfg.get(name)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return default


def estimate_from_hf_config(config: Mapping[str, Any]) -> ModelCompute:
    """Active parameters and attention shapes from a Hugging Face ``config.json`` (rough: dense
    and MoE MLPs, GQA, MLA and gated-delta-net layers; norms and biases ignored)."""
    cfg = dict(config)
    if isinstance(cfg.get("text_config"), Mapping):
        cfg = {**cfg, **cfg["text_config"]}
    h = _get(cfg, "hidden_size")
    layers = _get(cfg, "num_hidden_layers")
    heads = _get(cfg, "num_attention_heads")
    if not (h and layers and heads):
        raise ConfigError("model config lacks hidden_size / num_hidden_layers / num_attention_heads", field="model")
    kv = _get(cfg, "num_key_value_heads", default=heads)
    hd = _get(cfg, "head_dim", default=h // heads)
    vocab = _get(cfg, "vocab_size", default=32000)
    kinds = cfg.get("layer_types") if isinstance(cfg.get("layer_types"), list) else None
    interval = _get(cfg, "full_attention_interval")
    n_linear = 0
    if kinds is not None:
        n_linear = sum(1 for k in kinds if k == "linear_attention")
        n_sliding = sum(1 for k in kinds if "sliding" in str(k) or k == "local_attention")
    else:
        n_linear = layers - layers // interval if interval and cfg.get("linear_num_value_heads") else 0
        pattern = _get(cfg, "sliding_window_pattern")
        n_sliding = layers - layers // pattern if pattern and cfg.get("sliding_window") else 0
    n_full = layers - n_linear - n_sliding
    attention: list[AttentionGroup] = []
    if cfg.get("kv_lora_rank"):
        nope, rope, vdim = _get(cfg, "qk_nope_head_dim"), _get(cfg, "qk_rope_head_dim"), _get(cfg, "v_head_dim")
        q_lora, kv_lora = _get(cfg, "q_lora_rank"), _get(cfg, "kv_lora_rank")
        q = h * q_lora + q_lora * heads * (nope + rope) if q_lora else h * heads * (nope + rope)
        attn = q + h * (kv_lora + rope) + kv_lora * heads * (nope + vdim) + heads * vdim * h
        attention.append(AttentionGroup(n_full, 2.0 * heads * (nope + rope + vdim)))
    else:
        attn = h * hd * (2 * heads + 2 * kv)
        if n_full:
            attention.append(_gqa(n_full, heads, hd))
        if n_sliding:
            attention.append(_gqa(n_sliding, heads, hd, _get(cfg, "sliding_window", default=4096)))
    linear_attn = 0
    if n_linear:
        nk, nv = _get(cfg, "linear_num_key_heads"), _get(cfg, "linear_num_value_heads")
        dk, dv = _get(cfg, "linear_key_head_dim"), _get(cfg, "linear_value_head_dim")
        linear_attn = h * (2 * nk * dk + 2 * nv * dv) + nv * dv * h
    experts = _get(cfg, "num_experts_per_tok", "moe_k")
    dense_mlp = 3 * h * _get(cfg, "intermediate_size", default=4 * h)
    if experts and (cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts")):
        moe_i = _get(cfg, "moe_intermediate_size", "intermediate_size", default=4 * h)
        shared = _get(cfg, "n_shared_experts") * 3 * h * moe_i + 3 * h * _get(cfg, "shared_expert_intermediate_size")
        moe_mlp = experts * 3 * h * moe_i + shared
        dense_layers = _get(cfg, "first_k_dense_replace")
        mlp = dense_layers * dense_mlp + (layers - dense_layers) * moe_mlp
    else:
        mlp = layers * dense_mlp
    params = (layers - n_linear) * attn + n_linear * linear_attn + mlp + vocab * h
    return ModelCompute(float(params), tuple(attention), "estimated from config.json")


def model_compute(model: str, active_params: float | None = None) -> ModelCompute:
    """The compute of a catalog model or a ``config.json`` path (``active_params`` overrides)."""
    text = str(model)
    if text.endswith(".json") and (Path(text).exists() or "/" in text):
        try:
            data = json.loads(Path(text).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{text}: cannot read model config: {exc}", field="model", value=text) from None
        if not isinstance(data, dict):
            raise ConfigError(f"{text}: model config must be a JSON object", field="model", value=text)
        mc = estimate_from_hf_config(data)
    else:
        mc = _COMPUTE.get(get_entry(text).name) or ModelCompute(1e9, (), "unknown: 1B parameters assumed")
    if active_params is not None:
        mc = ModelCompute(float(active_params), mc.attention, f"{mc.source}; active parameters given")
    return mc


@dataclass
class CostReport:
    """TTFT and throughput under the cost model, with and without the cache."""

    ttft_mean_s: float
    ttft_mean_nocache_s: float
    ttft_p50_s: float
    ttft_p50_nocache_s: float
    ttft_p90_s: float
    ttft_p90_nocache_s: float
    ttft_speedup: float
    prefill_throughput_speedup: float
    bottleneck: str
    load_time_s: dict[str, float]
    compute_time_s: float
    compute_time_nocache_s: float
    assumptions: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class CostModel:
    """Hardware and model figures; :meth:`evaluate` turns per-request hits into TTFT and throughput."""

    compute: ModelCompute
    gpu: GPUProfile
    tp: int = 1
    mfu: float = 0.5
    compute_dtype: str = "bf16"
    links: Mapping[str, LinkProfile] = field(default_factory=dict)  # tier kind -> link
    overrides: Mapping[str, float] = field(default_factory=dict)  # tier name -> bytes/s per rank

    @property
    def flops_per_s(self) -> float:
        peak = self.gpu.fp8_tflops if self.compute_dtype == "fp8" else self.gpu.bf16_tflops
        return peak * 1e12 * self.mfu * self.tp

    def tier_bandwidth(self, name: str, kind: str) -> float | None:
        """Bytes/s one rank loads from a tier (``None``: free, the ``hbm`` tier)."""
        if name in self.overrides:
            return float(self.overrides[name])
        host = self.gpu.host_link_gbps * GB
        caps = kind_capabilities(kind)
        if caps is not None and caps.device_memory:  # already in GPU memory
            return None
        if caps is not None and caps.space == "slots":  # a memory arena in host memory: the host link
            return host
        # No capability says that a pool's NIC bypasses the host link: the mooncake kind by name.
        link = self.links.get(kind) or LINKS[DEFAULT_LINKS.get(kind, "nvme-gen5")]
        per_rank = link.read_gbps * GB / self.tp
        return per_rank if kind == "mooncake" else min(per_rank, host)

    def evaluate(
        self,
        input_tokens: np.ndarray,
        hit_blocks: np.ndarray,
        tiers: Sequence[tuple[str, str]],
        block_size: int,
        block_bytes: int,
        load_bytes: np.ndarray | None = None,
    ) -> CostReport:
        """``hit_blocks[i, k]``: blocks request ``i`` loaded from tier ``k`` (``tiers``: names, kinds);
        ``load_bytes[i, k]``: the bytes it read there, when not ``block_bytes`` a block (per-layer
        policies: a restore reads the full-attention layers of every block, the window before the
        prefix's end and the last block's state snapshot)."""
        n_in = np.asarray(input_tokens, dtype=np.float64)
        hit_tok = hit_blocks.sum(axis=1).astype(np.float64) * block_size
        compute_nc = self.compute.prefill_flops(n_in, np.zeros_like(n_in)) / self.flops_per_s
        compute = self.compute.prefill_flops(n_in - hit_tok, hit_tok) / self.flops_per_s
        load = np.zeros_like(n_in)
        per_tier: dict[str, float] = {}
        for k, (name, kind) in enumerate(tiers):
            bw = self.tier_bandwidth(name, kind)
            if bw is None:
                t = np.zeros_like(n_in)
            elif load_bytes is not None:
                t = load_bytes[:, k].astype(np.float64) / bw
            else:
                t = hit_blocks[:, k] * float(block_bytes) / bw
            load += t
            per_tier[name] = float(t.sum())
        ttft = compute + load
        busiest = max(per_tier.items(), key=lambda kv: kv[1], default=("", 0.0))
        denom = max(float(compute.sum()), busiest[1])
        bottleneck = "compute" if float(compute.sum()) >= busiest[1] else f"{busiest[0]} link"
        mean = float(ttft.mean()) if len(ttft) else 0.0
        mean_nc = float(compute_nc.mean()) if len(ttft) else 0.0
        return CostReport(
            ttft_mean_s=mean,
            ttft_mean_nocache_s=mean_nc,
            ttft_p50_s=_pct(ttft, 50),
            ttft_p50_nocache_s=_pct(compute_nc, 50),
            ttft_p90_s=_pct(ttft, 90),
            ttft_p90_nocache_s=_pct(compute_nc, 90),
            ttft_speedup=mean_nc / mean if mean > 0 else 1.0,
            prefill_throughput_speedup=float(compute_nc.sum()) / denom if denom > 0 else 1.0,
            bottleneck=bottleneck,
            load_time_s=per_tier,
            compute_time_s=float(compute.sum()),
            compute_time_nocache_s=float(compute_nc.sum()),
            assumptions=self.assumptions(tiers),
        )

    def assumptions(self, tiers: Sequence[tuple[str, str]]) -> dict[str, Any]:
        bws = {}
        for name, kind in tiers:
            bw = self.tier_bandwidth(name, kind)
            bws[name] = "free (already in GPU memory)" if bw is None else f"{bw / GB:.1f} GB/s per rank"
        return {
            "gpu": self.gpu.name,
            "gpu_source": self.gpu.source,
            "tp": self.tp,
            "mfu": self.mfu,
            "compute_dtype": self.compute_dtype,
            "peak_tflops_per_gpu": self.gpu.fp8_tflops if self.compute_dtype == "fp8" else self.gpu.bf16_tflops,
            "active_params": self.compute.active_params,
            "compute_source": self.compute.source or "catalog table (from published config.json)",
            "load_bandwidth": bws,
            "ttft": "compute of missed tokens + loads of hits, serial; no queueing",
            "throughput": "no-cache compute / max(compute with cache, busiest link's load time)",
        }


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else 0.0
