"""The Mooncake conversation trace as ``kvstrata experiment serve``'s workload (``--trace FILE``).

The trace's hash ids stand for 512-token prefix blocks; 2 cores cannot prefill its prompts (27
blocks, ~14K tokens, on average), so it is scaled down:

* the ``conversations`` longest conversations are kept (a conversation: the requests that share
  their first two hash ids; the 8 longest of the FAST'25 conversation trace have 192 requests, 87%
  of whose blocks an earlier request already had), all their requests in trace order;
* every hash id becomes ``block_tokens`` tokens of text (seeded per row, drawn from the tokenizer's
  corpus), so a prompt is its blocks' texts in order and equal ids mean an equal prefix; the last
  block is cut to the request's length, scaled the same way; requests longer than the instances'
  ``max_model_len`` are left out (counted);
* arrival times are compressed so that the kept requests span ``duration_s`` seconds, and aiperf
  replays them on that fixed schedule (its ``mooncake_trace`` dataset with ``text_input``);
  outputs are capped at the setup's ``output_tokens``.

The ideal token hit rate counts, per request, the leading blocks an earlier request had, rounded
down to vLLM's 128-token blocks, over all prompt tokens (this tokenizer's counts).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstrata.workload.serve_procs import BLOCK_TOKENS
from kvstrata.workload.traces import Request, read_trace

__all__ = ["TraceSetup", "select_conversations", "write_trace_dataset"]

#: Tokens the chat template and the request framing add to a prompt (kept out of the length budget).
TEMPLATE_TOKENS = 48


@dataclass(frozen=True)
class TraceSetup:
    path: str
    conversations: int = 8
    block_tokens: int = 16
    duration_s: float = 120.0

    def __post_init__(self) -> None:
        if self.conversations < 1:
            raise ValueError(f"trace conversations must be at least 1, got {self.conversations}")
        if not 1 <= self.block_tokens <= 512:
            raise ValueError(f"trace block tokens must be in 1..512, got {self.block_tokens}")
        if not self.duration_s > 0:
            raise ValueError(f"trace duration must be positive, got {self.duration_s}")


def _conversation(r: Request) -> tuple[int, ...]:
    ids = r.hash_ids or []
    return tuple(ids[:2])


def select_conversations(requests: Sequence[Request], n: int) -> list[Request]:
    """The requests of the ``n`` longest conversations, in trace order (ties: the earlier first)."""
    by: dict[tuple[int, ...], list[Request]] = {}
    for r in requests:
        by.setdefault(_conversation(r), []).append(r)
    top = sorted(by.values(), key=lambda rs: (-len(rs), rs[0].index))[:n]
    return sorted((r for rs in top for r in rs), key=lambda r: r.index)


def write_trace_dataset(
    path: Path, trace: TraceSetup, *, max_model_len: int, output_tokens: int, tokenizer_dir: Path, seed: int
) -> dict[str, Any]:
    """aiperf's ``mooncake_trace`` JSONL (``timestamp`` ms, ``text_input``, ``output_length``) for the
    scaled-down trace; returns the counts (requests kept and left out, prompt tokens, ideal hits)."""
    from tokenizers import Tokenizer

    from kvstrata.workload.fleet_model import corpus_words

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    words = corpus_words()
    rng = random.Random(seed)
    src = read_trace(trace.path)
    picked = select_conversations(src.requests, trace.conversations)
    if not picked:
        raise ValueError(f"{trace.path}: no request has hash ids")
    blocks: dict[int, list[int]] = {}

    def block(h: int) -> list[int]:
        if h not in blocks:
            ids: list[int] = []
            while len(ids) < trace.block_tokens:
                ids += tok.encode(" " + " ".join(rng.choice(words) for _ in range(16))).ids
            blocks[h] = ids[: trace.block_tokens]
        return blocks[h]

    budget = max_model_len - output_tokens - TEMPLATE_TOKENS
    t0 = picked[0].timestamp_ms
    span = max(1.0, picked[-1].timestamp_ms - t0)
    seen: set[int] = set()
    kept = left_out = prompt_tokens = ideal = 0
    with open(path, "w") as f:
        for r in picked:
            hash_ids = r.hash_ids or []
            per = r.hash_block_size or 512
            length = max(1, round(r.input_length * trace.block_tokens / per))
            length = min(length, len(hash_ids) * trace.block_tokens)
            if length > budget:
                left_out += 1
                continue
            ids = [t for h in hash_ids for t in block(h)][:length]
            lead = 0
            for h in hash_ids:
                if h not in seen:
                    break
                lead += 1
            seen.update(hash_ids)
            ideal += (min(lead * trace.block_tokens, length - 1) // BLOCK_TOKENS) * BLOCK_TOKENS
            prompt_tokens += length
            kept += 1
            row = {
                "timestamp": int((r.timestamp_ms - t0) / span * trace.duration_s * 1000),
                "text_input": tok.decode(ids),
                "output_length": max(1, min(r.output_length, output_tokens)),
            }
            f.write(json.dumps(row) + "\n")
    if not kept:
        raise ValueError(
            f"every selected request of {trace.path} is longer than max_model_len {max_model_len} allows: "
            "use a smaller --trace-block-tokens or a larger --max-model-len"
        )
    return {
        "requests": kept,
        "left_out": left_out,
        "prompt_tokens": prompt_tokens,
        "ideal_hit_tokens": ideal,
        "working_set_tokens": len(blocks) * trace.block_tokens,
    }
