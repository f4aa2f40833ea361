"""A trace as the planner replays it: the block keys each request looks up and stores.

For every request, exactly the keys :class:`~kvstrata.workload.replay.Replayer` uses: the
chained keys of the prompt's full blocks (looked up and loaded), then the keys of the
blocks stored after the request (prompt plus output). Keys become small integers. For
Mooncake-style ``hash_ids`` requests, the stored blocks after the prompt's full blocks
hold tokens unique to the request (its partial last block and its output), so they get
fresh integers without hashing any tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvstrata.core.keys import BlockHasher, Namespace
from kvstrata.workload.traces import Request

__all__ = ["BlockTrace", "block_trace"]


@dataclass(frozen=True)
class BlockTrace:
    """Block references of a trace (CSR layout: request ``i`` owns ``keys[starts[i]:starts[i+1]]``)."""

    block_size: int
    keys: np.ndarray  # int64: per request, the prompt's full blocks, then the stored output blocks
    starts: np.ndarray  # int64, len n + 1
    n_prompt: np.ndarray  # int64, prompt full blocks per request
    input_tokens: np.ndarray  # int64, prompt tokens per request
    timestamps_ms: np.ndarray  # float64
    sessions: tuple[str | None, ...]
    num_ids: int  # keys are in [0, num_ids)

    def __len__(self) -> int:
        return len(self.n_prompt)

    @property
    def prompt_tokens(self) -> int:
        return int(self.input_tokens.sum())

    @property
    def duration_s(self) -> float:
        if len(self.timestamps_ms) < 2:
            return 0.0
        return float(self.timestamps_ms.max() - self.timestamps_ms.min()) / 1000.0

    def request_keys(self, i: int) -> list[int]:
        return self.keys[self.starts[i] : self.starts[i + 1]].tolist()  # type: ignore[no-any-return]

    def is_prompt(self) -> np.ndarray:
        """Boolean mask over ``keys``: True for prompt blocks (the ones a lookup can hit)."""
        pos = np.arange(len(self.keys)) - np.repeat(self.starts[:-1], np.diff(self.starts))
        return pos < np.repeat(self.n_prompt, np.diff(self.starts))


def _hasher(block_size: int) -> BlockHasher:
    return BlockHasher(Namespace(model="kvstrata-planner", kv_dtype="-", layout_fingerprint="-", block_size=block_size))


def block_trace(requests: Iterable[Request], block_size: int) -> BlockTrace:
    """Turn requests into block references at ``block_size`` tokens per block."""
    hasher = _hasher(block_size)
    ids: dict[bytes, int] = {}
    counter = [0]

    def intern(key: bytes) -> int:
        got = ids.get(key)
        if got is None:
            got = ids[key] = counter[0]
            counter[0] += 1
        return got

    keys: list[int] = []
    starts = [0]
    n_prompt: list[int] = []
    tokens: list[int] = []
    stamps: list[float] = []
    sessions: list[str | None] = []
    for req in requests:
        n_full = req.input_length // block_size
        if req.hash_ids is not None and req.hash_block_size == block_size and req.output_span is None:
            keys.extend(map(intern, req.keys(hasher)))
            extra = (req.input_length - n_full * block_size + req.output_length) // block_size
            if req.output_length and extra:
                keys.extend(range(counter[0], counter[0] + extra))  # unique to this request
                counter[0] += extra
        else:
            keys.extend(map(intern, req.keys(hasher, include_output=True)))
        starts.append(len(keys))
        n_prompt.append(n_full)
        tokens.append(req.input_length)
        stamps.append(req.timestamp_ms)
        sessions.append(req.session)
    return BlockTrace(
        block_size=block_size,
        keys=np.asarray(keys, dtype=np.int64),
        starts=np.asarray(starts, dtype=np.int64),
        n_prompt=np.asarray(n_prompt, dtype=np.int64),
        input_tokens=np.asarray(tokens, dtype=np.int64),
        timestamps_ms=np.asarray(stamps, dtype=np.float64),
        sessions=tuple(sessions),
        num_ids=counter[0],
    )
