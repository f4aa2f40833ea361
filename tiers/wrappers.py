"""Explicit wrapper tiers: a real tier inside, one behaviour added on top (zarr's ``WrapperStore``).

A wrapper is built around an existing tier instance and forwards every method of
the :class:`~kvstrata.tiers.base.Tier` interface to it, by name, with no
``__getattr__`` magic:

* :class:`WrapperTier` forwards everything unchanged (subclass it to add a behaviour);
* :class:`FaultInjectingTier` fails, corrupts or refuses operations on demand;
* :class:`LatencyTier` sleeps before reads and writes (a slow disk or a remote pool);
* :class:`GateTier` holds reads or writes until a test opens the gate (deterministic
  "transfer in flight" states without sleeping).

A wrapper reports the inner tier's capabilities (:class:`~kvstrata.tiers.base.TierCapabilities`,
the instance's set, so an NVMe tier's GPUDirect flag too). The optional zero-copy ``peek``
exists on a wrapper exactly when ``capabilities.peek``; the other optional methods
(``records``/``delete_at``/``compact``/``refresh_used``, ``shrink``/``maintain``,
``connected``) are forwarded and refuse with ``TierError`` when the inner tier lacks them.

To put a wrapper under an engine, build the engine with it: ``Engine.with_tiers(config,
layout=..., wrap={0: lambda t: FaultInjectingTier(t, fail_reads=1.0)})`` opens the config's
tiers and wraps tier 0, or pass every tier yourself (``Engine(config, layout=..., tiers=[...])``,
built with the engine's :class:`~kvstrata.tiers.base.TierContext`, e.g. from
:func:`~kvstrata.engine.slots.build_tiers`). To change a behaviour later (open a gate, start
failing), keep the wrapper object and set its attributes::

    engine = Engine.with_tiers(config, layout=layout, wrap={0: FaultInjectingTier})
    fault = engine.tiers[0].tier  # the wrapper
    fault.fail_reads = 1.0  # reads of tier 0 fail from now on
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import numpy as np

from kvstrata.core.buffers import Buffer, host_bytes, is_device
from kvstrata.core.keys import Key
from kvstrata.errors import TierError
from kvstrata.tiers.base import (
    BlockId,
    IndexedTier,
    ReadStatus,
    ShrinkableTier,
    Tier,
    VerifyReport,
    connectable,
    indexed,
    peekable,
    shrinkable,
)

PeekFn = Callable[[Sequence[BlockId]], list[Buffer | None]]


class WrapperTier(Tier):
    """Forwards every call to ``inner``. Name, capacity, options and context are the inner tier's."""

    # Present only when the inner tier declares it (see the module docstring); declared, not defined.
    peek: PeekFn

    def __init__(self, inner: Tier) -> None:
        super().__init__(inner.name, inner.capacity, inner.options, inner.context)
        self.inner = inner
        self.closed = False
        self.capabilities = inner.capabilities  # the inner instance's set (it may refine its class's)
        if self.capabilities.peek:
            self.peek = self._peek

    def write(self, items: Sequence[tuple[BlockId, Buffer]]) -> list[bool]:
        return self.inner.write(items)

    def read(self, items: Sequence[tuple[BlockId, Buffer]]) -> list[ReadStatus]:
        return self.inner.read(items)

    def _peek(self, ids: Sequence[BlockId]) -> list[Buffer | None]:
        inner = self.inner
        if not peekable(inner):
            raise TierError(f"tier {self.name!r} has no peek")
        return inner.peek(ids)

    def delete(self, ids: Sequence[BlockId]) -> None:
        self.inner.delete(ids)

    @property
    def used_bytes(self) -> int:
        return self.inner.used_bytes

    def has_room(self, sizes: Sequence[int], live_bytes: int) -> bool:
        return self.inner.has_room(sizes, live_bytes)

    def scan(self) -> Iterator[tuple[BlockId, int]]:
        return self.inner.scan()

    def verify(self, repair: bool = False) -> VerifyReport:
        return self.inner.verify(repair=repair)

    def close(self) -> None:
        self.closed = True
        self.inner.close()

    # -- optional abilities, forwarded (callers check capabilities first) ----------------
    def _indexed(self) -> IndexedTier:
        inner = self.inner
        if not indexed(inner):
            raise TierError(f"tier {self.name!r} has no shared index (capabilities.records)")
        return inner

    def records(self) -> list[tuple[BlockId, Any]]:
        return self._indexed().records()

    def delete_at(self, records: Sequence[tuple[BlockId, Any]]) -> list[bool]:
        return self._indexed().delete_at(records)

    def compact(self) -> int:
        return self._indexed().compact()

    def refresh_used(self) -> int:
        return self._indexed().refresh_used()

    def _shrinkable(self) -> ShrinkableTier:
        inner = self.inner
        if not shrinkable(inner):
            raise TierError(f"tier {self.name!r} cannot shrink (capabilities.shrink)")
        return inner

    def shrink(self, target_bytes: int, why: str = "below the low watermark") -> int:
        return self._shrinkable().shrink(target_bytes, why)

    def maintain(self, now: float | None = None) -> None:
        self._shrinkable().maintain(now)

    @property
    def connected(self) -> bool:
        inner = self.inner
        return connectable(inner) and inner.connected

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"


class FaultInjectingTier(WrapperTier):
    """Injects faults into an inner tier; every knob is a plain attribute that may change at runtime.

    * ``down``: every call (including ``used_bytes`` and ``has_room``) raises :class:`TierError`,
      like a server that went away; ``close`` still reaches the inner tier.
    * ``fail_writes`` / ``fail_reads``: probability that one layer-block fails. A failed write
      stores nothing and reports ``False`` (or raises ``TierError`` for the whole batch when
      ``raise_errors``); a failed read reports ``ReadStatus.ERROR`` (or raises).
    * ``corrupt_reads``: probability that a read delivers scrambled bytes and reports
      ``ReadStatus.CORRUPT``, as a checksumming tier does; a ``peek`` of it returns ``None``.
    * ``targets``: when not ``None``, faults hit only blocks whose key, or whose exact
      ``(key, layer)`` id, is in it.

    Draws come from ``random.Random(seed)``, so a run is repeatable for a given call order.
    ``injected`` counts the faults delivered, per kind.
    """

    def __init__(
        self,
        inner: Tier,
        *,
        fail_writes: float = 0.0,
        fail_reads: float = 0.0,
        corrupt_reads: float = 0.0,
        raise_errors: bool = False,
        seed: int = 0,
        targets: Collection[Key | BlockId] | None = None,
    ) -> None:
        super().__init__(inner)
        for knob, value in (("fail_writes", fail_writes), ("fail_reads", fail_reads), ("corrupt_reads", corrupt_reads)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{knob} must be a probability in [0, 1], got {value!r}")
        self.fail_writes = fail_writes
        self.fail_reads = fail_reads
        self.corrupt_reads = corrupt_reads
        self.raise_errors = raise_errors
        self.targets: Collection[Key | BlockId] | None = targets
        self.down = False
        self.injected = {"down": 0, "write": 0, "read": 0, "corrupt": 0}
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    # -- fault decisions -------------------------------------------------------------
    def _check_up(self, op: str) -> None:
        if self.down:
            with self._lock:
                self.injected["down"] += 1
            raise TierError(f"tier {self.name!r} is down ({op}; injected)")

    def _hit(self, bid: BlockId, probability: float) -> bool:
        if probability <= 0.0:
            return False
        if self.targets is not None and bid[0] not in self.targets and bid not in self.targets:
            return False
        with self._lock:
            return self._rng.random() < probability

    def _count(self, kind: str, n: int) -> None:
        if n:
            with self._lock:
                self.injected[kind] += n

    # -- bytes -----------------------------------------------------------------------
    def write(self, items: Sequence[tuple[BlockId, Buffer]]) -> list[bool]:
        self._check_up("write")
        fail = [self._hit(bid, self.fail_writes) for bid, _ in items]
        self._count("write", sum(fail))
        if any(fail) and self.raise_errors:
            raise TierError(f"tier {self.name!r}: write failed ({sum(fail)} of {len(items)} layer-blocks; injected)")
        keep = [it for it, bad in zip(items, fail, strict=True) if not bad]
        done = iter(self.inner.write(keep) if keep else [])
        return [False if bad else next(done) for bad in fail]

    def read(self, items: Sequence[tuple[BlockId, Buffer]]) -> list[ReadStatus]:
        self._check_up("read")
        fail = [self._hit(bid, self.fail_reads) for bid, _ in items]
        self._count("read", sum(fail))
        if any(fail) and self.raise_errors:
            raise TierError(f"tier {self.name!r}: read failed ({sum(fail)} of {len(items)} layer-blocks; injected)")
        keep = [it for it, bad in zip(items, fail, strict=True) if not bad]
        got = iter(self.inner.read(keep) if keep else [])
        out: list[ReadStatus] = []
        for (bid, dst), bad in zip(items, fail, strict=True):
            status = ReadStatus.ERROR if bad else next(got)
            if status is ReadStatus.OK and self._hit(bid, self.corrupt_reads):
                _scramble(dst)
                self._count("corrupt", 1)
                status = ReadStatus.CORRUPT
            out.append(status)
        return out

    def _peek(self, ids: Sequence[BlockId]) -> list[Buffer | None]:
        self._check_up("peek")
        views = super()._peek(ids)
        out: list[Buffer | None] = []
        for bid, view in zip(ids, views, strict=True):
            if view is not None and (self._hit(bid, self.fail_reads) or self._hit(bid, self.corrupt_reads)):
                self._count("read", 1)
                view = None
            out.append(view)
        return out

    def delete(self, ids: Sequence[BlockId]) -> None:
        self._check_up("delete")
        super().delete(ids)

    @property
    def used_bytes(self) -> int:
        self._check_up("used_bytes")
        return self.inner.used_bytes

    def has_room(self, sizes: Sequence[int], live_bytes: int) -> bool:
        self._check_up("has_room")
        return super().has_room(sizes, live_bytes)

    def scan(self) -> Iterator[tuple[BlockId, int]]:
        self._check_up("scan")
        return super().scan()

    def verify(self, repair: bool = False) -> VerifyReport:
        self._check_up("verify")
        return super().verify(repair=repair)


class LatencyTier(WrapperTier):
    """Sleeps ``read_s`` before each read batch and ``write_s`` before each write batch.

    Both are attributes and may change at runtime. ``peek`` (zero-copy) is not delayed.
    """

    def __init__(self, inner: Tier, read_s: float = 0.0, write_s: float = 0.0) -> None:
        super().__init__(inner)
        if read_s < 0 or write_s < 0:
            raise ValueError(f"latencies must not be negative, got read_s={read_s!r}, write_s={write_s!r}")
        self.read_s = read_s
        self.write_s = write_s

    def write(self, items: Sequence[tuple[BlockId, Buffer]]) -> list[bool]:
        if self.write_s:
            time.sleep(self.write_s)
        return super().write(items)

    def read(self, items: Sequence[tuple[BlockId, Buffer]]) -> list[ReadStatus]:
        if self.read_s:
            time.sleep(self.read_s)
        return super().read(items)


class GateTier(WrapperTier):
    """Holds every read (``reads``) or write (``writes``) batch until its gate is open.

    Both gates are ``threading.Event`` objects, open when set; they start open. A held
    call waits at most ``max_wait_s`` and then raises :class:`TierError`, so a test that
    forgets to open a gate fails instead of hanging.
    """

    def __init__(self, inner: Tier, *, max_wait_s: float = 30.0) -> None:
        super().__init__(inner)
        self.reads = threading.Event()
        self.writes = threading.Event()
        self.reads.set()
        self.writes.set()
        self.max_wait_s = max_wait_s
        self.waiting = {"read": 0, "write": 0}  # calls currently held at each gate
        self._lock = threading.Lock()

    def _pass(self, gate: threading.Event, op: str) -> None:
        if gate.is_set():
            return
        with self._lock:
            self.waiting[op] += 1
        try:
            if not gate.wait(self.max_wait_s):
                raise TierError(f"tier {self.name!r}: {op} gate stayed closed for {self.max_wait_s}s")
        finally:
            with self._lock:
                self.waiting[op] -= 1

    def write(self, items: Sequence[tuple[BlockId, Buffer]]) -> list[bool]:
        self._pass(self.writes, "write")
        return super().write(items)

    def read(self, items: Sequence[tuple[BlockId, Buffer]]) -> list[ReadStatus]:
        self._pass(self.reads, "read")
        return super().read(items)


def _scramble(dst: Buffer) -> None:
    """Flip every bit of a destination buffer, so corrupt bytes can never pass for good ones."""
    if is_device(dst):
        import torch

        dst.detach().reshape(-1).view(torch.uint8).bitwise_not_()
        return
    view = host_bytes(dst)
    np.bitwise_xor(view, np.uint8(0xFF), out=view)


__all__ = ["FaultInjectingTier", "GateTier", "LatencyTier", "WrapperTier"]
