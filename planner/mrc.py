"""Hit rate against capacity from one pass over a trace, and the offline optimum (Belady).

**Stack distances.** Every request references its blocks in order (the prompt's full
blocks, then the blocks stored after it), as the engine's loads and stores touch them.
The LRU stack distance of a reference is the number of distinct other blocks referenced
since the previous reference to the same block; an LRU cache of ``C`` blocks holds the
block then iff the distance is below ``C``. The distances are exact and computed for the
whole trace at once, with numpy: for a reference at ``t`` whose previous reference is at
``p``, ``d = (t - p - 1) - B(t) + S(p)``, where ``B(t)`` counts the references before ``t``
that repeat an earlier one and ``S(p)`` counts the ``j < p`` whose next reference comes
before ``t`` (a per-element inversion count, by a bottom-up merge sort). ``O(n log n)``,
no sampling, so the curves carry no sampling error.

**Prefix rule.** A prompt block counts as a hit only if every block before it in the
prompt hits too (a KV prefix is useful only whole), so a block hits at capacity ``C`` iff
the running maximum of the distances along its prompt is below ``C``; one sorted array of
those maxima gives the token hit rate at every capacity.

**Policies.** ``lru``: references in prompt order (exact for a single LRU cache).
``prefix-aware``: each request's blocks referenced deepest first, so a chain leaves the
cache from its end, as the prefix-aware policy evicts it (an approximation; the simulator
is exact at the configured capacities, and the plan reports the difference there).

**Belady.** The offline optimum for a cache of ``C`` blocks: on a miss, keep the block
unless every cached block is needed sooner, else evict the one needed furthest in the
future; blocks never needed again are not kept. One pass per capacity (a heap).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvstrata.planner.workload import BlockTrace

__all__ = ["HitCurve", "belady_hit_tokens", "hit_curve", "next_use", "stack_distances"]


def _prev_next(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index of the previous / next reference to the same key (-1 / len(keys) when none)."""
    n = len(keys)
    order = np.argsort(keys, kind="stable")
    sk = keys[order]
    same = sk[1:] == sk[:-1]
    prev = np.full(n, -1, dtype=np.int64)
    nxt = np.full(n, n, dtype=np.int64)
    prev[order[1:][same]] = order[:-1][same]
    nxt[order[:-1][same]] = order[1:][same]
    return prev, nxt


def next_use(keys: np.ndarray) -> np.ndarray:
    """Index of the next reference to the same key (``len(keys)`` when there is none)."""
    return _prev_next(np.asarray(keys, dtype=np.int64))[1]


def _count_smaller_before(values: np.ndarray) -> np.ndarray:
    """For each ``i``: how many ``j < i`` have ``values[j] < values[i]`` (values distinct, >= 0)."""
    n = len(values)
    out = np.zeros(n, dtype=np.int64)
    if n < 2:
        return out
    vals = values.astype(np.int64, copy=True)
    orig = np.arange(n, dtype=np.int64)
    pos = np.arange(n, dtype=np.int64)
    big = int(vals.max()) + 1
    width = 1
    while width < n:
        pair = pos // (2 * width)
        right = ((pos // width) & 1).astype(bool)
        key = pair * big + vals  # runs of `width` are sorted: left runs are sorted globally
        left = key[~right]
        cnt = np.searchsorted(left, key[right]) - pair[right] * width
        out[orig[right]] += cnt
        order = np.argsort(key, kind="stable")  # merges each pair of sorted runs
        vals = vals[order]
        orig = orig[order]
        width *= 2
    return out


def stack_distances(keys: np.ndarray, request_start: np.ndarray | None = None) -> np.ndarray:
    """LRU stack distance of every reference; ``len(keys)`` (never a hit) for first references.

    With ``request_start`` (the stream position where each reference's request begins), the
    distance is taken when that request begins (its lookup), not at the reference itself:
    the distinct keys referenced between the previous reference and the request's start.
    """
    keys = np.asarray(keys, dtype=np.int64)
    n = len(keys)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    prev, nxt = _prev_next(keys)
    # next reference times, made distinct where there is none (n + i), for the inversion count
    a = np.where(nxt < n, nxt, n + np.arange(n))
    smaller = _count_smaller_before(a)
    has_prev = prev >= 0
    repeats_before = np.concatenate(([0], np.cumsum(has_prev)))  # repeats_before[t]: repeats at < t
    t = np.arange(n, dtype=np.int64)
    dist = np.full(n, n, dtype=np.int64)
    if request_start is None:
        p = prev[has_prev]
        dist[has_prev] = (t[has_prev] - p - 1) - repeats_before[t[has_prev]] + smaller[p]
        return dist
    s = np.asarray(request_start, dtype=np.int64)
    # references u in [s, t) (this request, before t) whose previous reference is before prev(t):
    # count them as "smaller before" of the value req * big + prev(u), first references last
    req = np.cumsum(np.concatenate(([0], (s[1:] != s[:-1]).astype(np.int64))))
    big = 2 * n + 2
    part = np.where(has_prev, prev, n + (t - s))
    within = _count_smaller_before(req * big + part) - s
    p = prev
    d = (s - p - 1) - repeats_before[s] + smaller[np.maximum(p, 0)] - within
    same_request = has_prev & (p >= s)
    dist[has_prev] = d[has_prev]
    dist[same_request] = 0  # seen earlier in this very request
    return dist


def _stream_order(trace: BlockTrace, reverse: bool, members: np.ndarray | None = None) -> np.ndarray:
    """Positions into ``trace.keys`` in reference order (optionally only requests ``members``)."""
    starts, ends = trace.starts[:-1], trace.starts[1:]
    if members is not None:
        starts, ends = starts[members], ends[members]
    lengths = ends - starts
    base = np.repeat(starts, lengths)
    within = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    if reverse:
        within = np.repeat(lengths, lengths) - 1 - within
    return base + within


def _request_starts(trace: BlockTrace, members: np.ndarray | None) -> np.ndarray:
    """For each reference of the stream: the stream position where its request begins."""
    lengths = np.diff(trace.starts)
    if members is not None:
        lengths = lengths[members]
    first = np.cumsum(lengths) - lengths
    return np.repeat(first, lengths)


@dataclass(frozen=True)
class HitCurve:
    """Token hit rate of one cache against its capacity in blocks (one pass, see the module doc)."""

    block_size: int
    prompt_tokens: int
    maxima: np.ndarray  # sorted running maxima of the distances along prompts; >= `never` means a miss
    never: int  # distance of a first reference
    policy: str

    def hit_tokens(self, capacity_blocks: float) -> int:
        """Token hits of a cache of ``capacity_blocks`` (first references never hit, whatever the size)."""
        cap = self.never if capacity_blocks >= self.never else int(capacity_blocks)
        return int(np.searchsorted(self.maxima, cap, side="left")) * self.block_size

    def hit_rate(self, capacity_blocks: float) -> float:
        return self.hit_tokens(capacity_blocks) / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def max_hit_rate(self) -> float:
        """The hit rate of an unbounded cache (every block seen before and whose prefix was too)."""
        return self.hit_rate(float("inf"))

    @property
    def saturation_blocks(self) -> int:
        """The smallest capacity reaching :attr:`max_hit_rate`."""
        finite = self.maxima[self.maxima < self.never]
        return int(finite[-1]) + 1 if len(finite) else 1

    def blocks_for(self, target: float) -> int | None:
        """Smallest capacity (blocks) with a hit rate >= ``target``; ``None`` if no capacity reaches it."""
        need = -(-round(target * self.prompt_tokens * 1e6) // (self.block_size * 1_000_000))
        if need <= 0:
            return 0
        finite = self.maxima[self.maxima < self.never]
        if need > len(finite):
            return None
        return int(finite[need - 1]) + 1


def hit_curve(trace: BlockTrace, policy: str = "lru", groups: Sequence[np.ndarray] | None = None) -> HitCurve:
    """The hit curve of ``trace`` for one cache per group of requests (``groups``: request
    indices per instance; one cache seeing every request when ``None``), evaluated at the
    same capacity for every cache and summed."""
    reverse = policy != "lru"
    is_prompt = trace.is_prompt()
    req_of = np.repeat(np.arange(len(trace), dtype=np.int64), np.diff(trace.starts))
    parts = []
    never = len(trace.keys) + 1
    for members in groups if groups is not None else [None]:
        pos = _stream_order(trace, reverse, members)
        dist = np.full(len(trace.keys), never, dtype=np.int64)
        d = stack_distances(trace.keys[pos], _request_starts(trace, members))
        d[d >= len(pos)] = never
        dist[pos] = d
        sel = np.sort(pos)  # this group's references, in key order (prompt blocks first per request)
        seg = req_of[sel]
        running = np.maximum.accumulate(dist[sel] + seg * (never + 1)) - seg * (never + 1)
        parts.append(running[is_prompt[sel]])
    maxima = np.sort(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)
    return HitCurve(trace.block_size, trace.prompt_tokens, maxima, never, policy)


def belady_hit_tokens(trace: BlockTrace, capacity_blocks: float) -> int:
    """Token hits of the offline optimum (Belady, prefix rule) with one cache of ``capacity_blocks``."""
    keys = trace.keys
    n = len(keys)
    nxt = next_use(keys)
    if capacity_blocks == float("inf") or capacity_blocks >= n:
        hit = np.zeros(n, dtype=bool)
        _, first = np.unique(keys, return_index=True)
        hit[:] = True
        hit[first] = False
    else:
        hit = _belady(keys.tolist(), nxt.tolist(), n, int(capacity_blocks))
    return _prefix_hits(trace, hit) * trace.block_size


def _belady(keys: list[int], nxt: list[int], never: int, cap: int) -> np.ndarray:
    hit = np.zeros(len(keys), dtype=bool)
    if cap <= 0:
        return hit
    due: dict[int, int] = {}  # cached key -> its next reference
    heap: list[tuple[int, int]] = []  # (-next reference, key), stale entries skipped
    push, pop = heapq.heappush, heapq.heappop
    for t, (key, nu) in enumerate(zip(keys, nxt, strict=True)):
        if key in due:
            hit[t] = True
            if nu == never:
                del due[key]  # never needed again: free its place
            else:
                due[key] = nu
                push(heap, (-nu, key))
            continue
        if nu == never:
            continue  # never needed again: not worth a place
        if len(due) >= cap:
            while True:
                far, victim = heap[0]
                if due.get(victim) == -far:
                    break
                pop(heap)
            if -far <= nu:
                continue  # every cached block is needed sooner: bypass
            pop(heap)
            del due[victim]
        due[key] = nu
        push(heap, (-nu, key))
    return hit


def _prefix_hits(trace: BlockTrace, hit: np.ndarray) -> int:
    """Prompt blocks that hit with every earlier block of their prompt."""
    is_prompt = trace.is_prompt()
    req_of = np.repeat(np.arange(len(trace), dtype=np.int64), np.diff(trace.starts))
    miss = (~hit).astype(np.int64)
    running = np.maximum.accumulate(miss + req_of * 2) - req_of * 2
    return int(((running == 0) & is_prompt).sum())
