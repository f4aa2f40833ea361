"""A tiny Llama with a real tokenizer, both made locally, for ``vllm serve`` with text clients.

Nothing is downloaded. The tokenizer is a byte-level BPE trained with the ``tokenizers``
package on text that ships with Python itself (``pydoc_data/topics.py``, the interpreter's help
topics, and ``LICENSE.txt``), saved in Hugging Face format (``tokenizer.json``,
``tokenizer_config.json`` with a chat template, ``special_tokens_map.json``) next to a
random-weight ``LlamaForCausalLM`` whose vocabulary is the tokenizer's. The build is
deterministic; a directory that already holds both is reused.
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: Special tokens, at ids 0, 1, 2 (the model's pad, bos and eos).
SPECIALS = ("<pad>", "<s>", "</s>")

#: A minimal chat template: role headers, the turns, ``</s>`` after each, and the generation prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def corpus_files() -> list[Path]:
    """The training text: Python's own help topics and licence (both ship with every CPython)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / "pydoc_data" / "topics.py", stdlib / "LICENSE.txt"]
    found = [f for f in files if f.is_file()]
    if not found:
        raise FileNotFoundError(f"no training text for the tokenizer: none of {[str(f) for f in files]} exists")
    return found


def corpus_words() -> list[str]:
    """The corpus's short alphabetic words (for seeded prompt text)."""
    words: list[str] = []
    for f in corpus_files():
        words.extend(w for w in f.read_text(errors="replace").split() if w.isalpha() and len(w) < 14)
    return words


def _lines(files: list[Path]) -> Iterator[str]:
    for f in files:
        yield from f.read_text(encoding="utf-8", errors="replace").splitlines()


def train_tokenizer(out: Path, vocab: int) -> None:
    """Train a byte-level BPE of ``vocab`` tokens and save it in Hugging Face format in ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_lines(corpus_files()), trainer=trainer)
    if tok.get_vocab_size() > vocab:
        raise ValueError(f"trained {tok.get_vocab_size()} tokens, more than the model's vocabulary {vocab}")
    tok.save(str(out / "tokenizer.json"))
    pad, bos, eos = SPECIALS
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": None,
        "add_bos_token": False,
        "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": bos, "eos_token": eos, "pad_token": pad}, indent=2)
    )


def make_served_model(
    dir: str | os.PathLike[str],
    *,
    layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 1024,
    max_pos: int = 8192,
    seed: int = 1234,
) -> Path:
    """Build (or reuse) the model and tokenizer in ``dir``. Head dim ``hidden // heads`` must be one
    vLLM's CPU attention supports (64 by default)."""
    out = Path(dir)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        cfg: Any = LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=hidden // heads,
            max_position_embeddings=max_pos,
            initializer_range=0.1,
            tie_word_embeddings=False,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
        torch.manual_seed(seed)
        with torch.no_grad():
            model: Any = LlamaForCausalLM(cfg)
        model = model.to(torch.bfloat16).eval()
        model.save_pretrained(str(tmp))
        cfg_path = tmp / "config.json"
        data = json.loads(cfg_path.read_text())
        data["torch_dtype"] = "bfloat16"
        cfg_path.write_text(json.dumps(data, indent=2, sort_keys=True))
        # A random model never picks eos on purpose; generation_config must not stop it early either.
        (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
        train_tokenizer(tmp, vocab)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
