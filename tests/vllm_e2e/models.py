"""Tiny random-weight models for the vLLM end-to-end tests, built locally with ``transformers``.

Nothing is downloaded: each function builds a config, seeds torch, initialises the weights,
casts to bfloat16 and ``save_pretrained``\\ s into ``dir``. A directory that already holds a
``config.json`` is reused as is (the build is deterministic, so a cached model equals a fresh
one). Writes go to a sibling temporary directory first and are renamed into place, so an
interrupted build never leaves a half-written model that looks cached.

Every head dimension here is in vLLM CPU's supported list
(32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512).

The random weights use a larger ``initializer_range`` than the transformers default (0.02).
With 0.02 the logits of a tiny random model are nearly flat, so greedy argmax is decided by
differences at bf16 rounding level and can flip between numerically different but equivalent
computations (full prefill vs prefix-cache hit vs KV injected by a connector). A wider init makes
the top-1 margin large enough for exact-token comparisons to be meaningful.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: Kept in sync with ``vllm/v1/attention/backends/cpu_attn.py`` (get_supported_head_sizes).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

#: Default seed; every builder takes ``seed=`` too.
SEED = 1234

#: Default sliding window of the hybrid model, in tokens (a 1,000+-token prompt exceeds it).
SLIDING_WINDOW = 128


def _check_head_dim(head_dim: int) -> None:
    if head_dim not in CPU_HEAD_SIZES:
        raise ValueError(f"head_dim {head_dim} is not supported by vLLM's CPU attention: {CPU_HEAD_SIZES}")


def _build(
    dir: str | os.PathLike[str],
    make_config: Callable[[], Any],
    model_cls_name: str,
    seed: int,
    edit_config: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> Path:
    """Build (or reuse) the model in ``dir``; ``make_config`` is only called on a cache miss."""
    out = Path(dir)
    if (out / "config.json").exists():
        return out
    import torch
    import transformers

    cfg = make_config()
    model_cls = getattr(transformers, model_cls_name)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        torch.manual_seed(seed)
        with torch.no_grad():
            model = model_cls(cfg)
        model = model.to(torch.bfloat16).eval()
        model.save_pretrained(str(tmp))
        # Belt and braces for vLLM's dtype="auto" and for readers of the config.
        cfg_path = tmp / "config.json"
        data = json.loads(cfg_path.read_text())
        data["torch_dtype"] = "bfloat16"
        data.setdefault("dtype", "bfloat16")
        if edit_config is not None:
            data = edit_config(data)
        cfg_path.write_text(json.dumps(data, indent=2, sort_keys=True))
        try:
            os.rename(tmp, out)
        except OSError:
            # Someone else finished first (or ``out`` exists but is empty): keep theirs if valid.
            if (out / "config.json").exists():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                shutil.rmtree(out, ignore_errors=True)
                os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def make_llama(
    dir: str | os.PathLike[str],
    *,
    layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 1024,
    max_pos: int = 8192,
    intermediate: int | None = None,
    init_range: float = 0.1,
    seed: int = SEED,
) -> Path:
    """A tiny Llama (full attention in every layer). Defaults: head_dim 64, about 3 M parameters."""
    head_dim = hidden // heads
    _check_head_dim(head_dim)

    def cfg() -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=intermediate or 2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            initializer_range=init_range,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )

    return _build(dir, cfg, "LlamaForCausalLM", seed)


def make_sliding(
    dir: str | os.PathLike[str],
    *,
    layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    vocab: int = 1024,
    max_pos: int = 8192,
    window: int = SLIDING_WINDOW,
    intermediate: int | None = None,
    init_range: float = 0.1,
    seed: int = SEED,
) -> Path:
    """A tiny Mistral-style hybrid: layers alternate sliding-window attention (even indices,
    window ``window`` tokens) and full attention (odd indices).

    Weights are built with transformers' ``MinistralForCausalLM`` (which honours ``layer_types``,
    so transformers can serve as a reference), and the saved config declares
    ``MistralForCausalLM`` / ``model_type: mistral`` with ``layer_types`` and ``sliding_window``:
    vLLM has no ``MinistralForCausalLM`` but its ``MistralForCausalLM`` (the Llama code) reads
    ``layer_types`` and gives each sliding layer its window. The weight names are identical.

    vLLM puts the two layer kinds into separate KV cache groups when the hybrid KV cache manager
    (HMA) is on (no connector, or a connector that subclasses ``SupportsHMA``); with a non-HMA
    connector vLLM turns HMA off and allocates every layer as full attention.

    (Gemma-2 was tried first: it runs, but vLLM's Gemma-2 always ties the LM head to the
    sqrt(hidden)-scaled embedding, so a random-weight Gemma-2 just repeats its last token and the
    greedy output barely depends on the context - useless for catching wrong KV.)
    """
    _check_head_dim(head_dim)
    if layers % 2:
        raise ValueError("use an even number of layers so both kinds are present in equal numbers")
    layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]

    def cfg() -> Any:
        from transformers import MinistralConfig

        return MinistralConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=intermediate or 2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            sliding_window=window,
            layer_types=layer_types,
            initializer_range=init_range,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )

    def as_mistral(data: dict[str, Any]) -> dict[str, Any]:
        data["architectures"] = ["MistralForCausalLM"]
        data["model_type"] = "mistral"
        data["layer_types"] = layer_types
        data["sliding_window"] = window
        return data

    return _build(dir, cfg, "MinistralForCausalLM", seed, edit_config=as_mistral)


def make_linear_hybrid(
    dir: str | os.PathLike[str],
    *,
    layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    vocab: int = 1024,
    max_pos: int = 8192,
    init_range: float = 0.1,
    seed: int = SEED,
) -> Path:
    """A tiny Qwen3-Next: gated-delta-net (linear attention) layers with a full-attention layer
    every second layer (``full_attention_interval`` 2), and a small MoE (4 experts, 2 active).

    vLLM (CPU) runs it with the hybrid KV cache manager on: a ``MambaSpec`` group (the linear
    layers' recurrent state, ``align`` cache mode when prefix caching is on: the state slot of
    block ``p`` holds the state after ``(p + 1) * block_size`` tokens) and a full-attention
    group, both with vLLM's hybrid block size (256 tokens here). The state per layer is a conv
    state (bf16) and an SSM state (fp32 on CPU): 68,608 bytes.
    """
    _check_head_dim(head_dim)
    if layers % 2:
        raise ValueError("use an even number of layers: linear and full attention alternate")

    def cfg() -> Any:
        from transformers import Qwen3NextConfig

        return Qwen3NextConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_conv_kernel_dim=4,
            # full attention every second layer (what ``full_attention_interval=2`` derives)
            layer_types=["linear_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)],
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=128,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            max_position_embeddings=max_pos,
            initializer_range=init_range,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )

    return _build(dir, cfg, "Qwen3NextForCausalLM", seed)


def make_bench_model(
    dir: str | os.PathLike[str],
    *,
    layers: int = 8,
    hidden: int = 1024,
    heads: int = 16,
    kv_heads: int = 8,
    vocab: int = 32000,
    max_pos: int = 32768,
    intermediate: int = 2816,
    seed: int = SEED,
) -> Path:
    """The TTFT benchmark model: a Llama with 8 layers, hidden 1024, 16 heads (head_dim 64) and
    8 KV heads, bf16, ``max_position_embeddings`` 32768 (room for a 16K-token prompt).

    KV per token: 8 layers x 8 heads x 64 x 2 (K,V) x 2 bytes = 16 KiB, so 2 MiB per 128-token
    block (vLLM CPU's default block size) and 256 MiB for a 16K-token prompt.
    """
    return make_llama(
        dir,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        vocab=vocab,
        max_pos=max_pos,
        intermediate=intermediate,
        init_range=0.02,
        seed=seed,
    )


def read_config(dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The saved ``config.json`` as a dict."""
    return json.loads((Path(dir) / "config.json").read_text())


#: The projections of :func:`make_llama`'s layers a :func:`make_lora` adapter adapts.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_lora(
    dir: str | os.PathLike[str],
    base: str | os.PathLike[str],
    *,
    rank: int = 8,
    alpha: int = 16,
    b_scale: float = 0.1,
    targets: tuple[str, ...] = LORA_TARGETS,
    seed: int = SEED,
) -> Path:
    """A random LoRA adapter for the Llama in ``base`` (built by :func:`make_llama`), in PEFT
    format: ``adapter_config.json`` and ``adapter_model.safetensors`` with ``lora_A`` (``rank x
    in``) and ``lora_B`` (``out x rank``) for every layer's ``targets``.

    PEFT initialises ``lora_B`` to zeros (a fresh adapter changes nothing); here both are random,
    ``lora_B`` with standard deviation ``b_scale``, so the adapter moves the model's weights by
    about as much as their own spread and changes its greedy tokens. Different ``seed``\\ s give
    different adapters; the same seed the same bytes. Reused when ``dir`` holds a config."""
    out = Path(dir)
    if (out / "adapter_config.json").exists():
        return out
    import torch
    from safetensors.torch import save_file

    cfg = read_config(base)
    hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    head_dim = int(cfg.get("head_dim") or hidden // int(cfg["num_attention_heads"]))
    kv = int(cfg["num_key_value_heads"]) * head_dim
    shapes = {  # (in, out) of each projection
        "q_proj": (hidden, hidden),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (hidden, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    unknown = sorted(set(targets) - set(shapes))
    if unknown:
        raise ValueError(f"unknown LoRA target(s) {unknown}: known {sorted(shapes)}")
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, Any] = {}
    for layer in range(int(cfg["num_hidden_layers"])):
        for name in targets:
            fan_in, fan_out = shapes[name]
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * b_scale
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "adapter_model.safetensors"))
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "adapter_config.json").exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
