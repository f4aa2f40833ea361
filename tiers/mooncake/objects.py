"""Planning transfers: the objects a batch touches, slab-sized batches of them, byte ranges of
records, and delivering what was read."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from kvstrata.core.buffers import Buffer, copy_bytes
from kvstrata.tiers.base import ReadStatus
from kvstrata.tiers.mooncake.format import LayerSpan, _record_bytes
from kvstrata.tiers.mooncake.staging import Unavailable
from kvstrata.tiers.records import RECORD_ALIGN, align_up

log = logging.getLogger("kvstrata.tiers.mooncake")

T = TypeVar("T")


@dataclass(eq=False)
class Obj:
    """One object touched by a batch: which of its slots, for which batch items."""

    name: str
    span: LayerSpan
    key: bytes
    slots: dict[int, list[int]] = field(default_factory=dict)  # slot -> positions in the batch
    reserved: bool = False  # this batch added the object to the space account
    seen: int = 0  # a read that failed its checks: digest of what it got

    @property
    def whole(self) -> bool:
        return len(self.slots) == len(self.span.layers)

    def read_bytes(self) -> int:
        return sum(_record_bytes(self.span.lengths[s]) for s in self.slots)


def _batches(objs: Sequence[Obj], size: Callable[[Obj], int], limit: int) -> Iterator[list[Obj]]:
    batch: list[Obj] = []
    used = 0
    for obj in objs:
        n = align_up(size(obj), RECORD_ALIGN)
        if batch and used + n > limit:
            yield batch
            batch, used = [], 0
        batch.append(obj)
        used += n
    if batch:
        yield batch


def _offsets(sizes: Sequence[int]) -> list[int]:
    out, at = [], 0
    for n in sizes:
        out.append(at)
        at += align_up(n, RECORD_ALIGN)
    return out


@dataclass
class Ranges:
    """Where one object's wanted records go in a slab: consecutive records form one range."""

    src: list[int]  # range offsets in the object
    sizes: list[int]
    dst: list[int]  # range offsets in the slab
    records: list[tuple[int, int]]  # (slot, record offset in the slab)
    end: int  # first free slab offset after this object

    @classmethod
    def plan(cls, obj: Obj, at: int) -> Ranges:
        span = obj.span
        plan = cls([], [], [], [], at)
        for s in sorted(obj.slots):
            start, extent = span.offsets[s], _record_bytes(span.lengths[s])
            if plan.src and plan.src[-1] + plan.sizes[-1] == start:  # follows the previous record
                plan.records.append((s, plan.dst[-1] + plan.sizes[-1]))
                plan.sizes[-1] += extent
            else:
                plan.src.append(start)
                plan.sizes.append(extent)
                plan.dst.append(plan.end)
                plan.records.append((s, plan.end))
            plan.end = plan.dst[-1] + plan.sizes[-1]
        return plan


def _add(objs: dict[str, Obj], where: tuple[str, LayerSpan, int], key: bytes, position: int) -> None:
    name, span, slot = where
    obj = objs.get(name)
    if obj is None:
        obj = objs[name] = Obj(name, span, key)
    obj.slots.setdefault(slot, []).append(position)


def _codes(result: list[T], n: int) -> list[T]:
    """A client call's per-object results, which must be one per object asked for."""
    if len(result) != n:
        raise Unavailable(f"the client answered {len(result)} results for {n} objects")
    return list(result)


def _set(out: list[ReadStatus], obj: Obj, status: ReadStatus) -> None:
    for positions in obj.slots.values():
        for i in positions:
            out[i] = status


def _copy_out(dsts: list[Buffer], positions: list[int], data: np.ndarray) -> ReadStatus:
    try:
        for i in positions:
            copy_bytes(dsts[i], data)
    except (RuntimeError, TypeError, ValueError) as exc:  # e.g. a non-contiguous destination
        log.warning("mooncake tier: copying a layer-block out failed: %s", exc)
        return ReadStatus.ERROR
    return ReadStatus.OK
