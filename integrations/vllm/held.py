"""Pinned plans a worker's socket lookup keeps for the load that follows (no vLLM import).

The scheduler asks a worker "how many of these blocks can you restore?"
(:mod:`kvstrata.integrations.vllm.lookup`); the worker answers with
:meth:`~kvstrata.engine.engine.Engine.lookup_pinned`, so the blocks it promised cannot be
evicted before the load arrives, and the load reads that plan without looking anything up
again. A plan is kept only where a load can use it as is: every asked block was found (a load
is for exactly the keys and layers a plan was made for). Anything else is given back at once.

Requests are aborted, preempted or rescheduled, so a kept plan may never be asked for:
each expires ``hold_s`` after its lookup (swept on every lookup, load and poll, and by
:class:`Sweeper` once a second, so an idle worker, which runs no steps, lets them go too), a new
lookup of the same keys replaces the old plan, at most ``max_plans`` are kept (the oldest go
first), and :meth:`HeldPlans.close` gives every one back. No plan stays pinned.

The scheduler looks up a request's blocks from the first, but loads only those vLLM has not
computed itself: with a prefix in vLLM's own cache the load is for a later run of the looked-up
keys, and none at all when vLLM holds everything kvstrata found. A load of a run inside a kept
plan's keys (same layers) gives that plan back at once, since its request is loading now (seen on
``vllm serve``: 32 plans, 34 blocks, stayed pinned on an idle server after a load). Another
request's plan over the same prefix may go back with it; its load then plans from the index (a
block evicted meanwhile is a failed load, which vLLM recomputes).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvstrata.core.keys import Key
from kvstrata.engine.engine import Engine, LoadPlan

HOLD_S = 10.0  # a scheduler lookup is followed by its load within a step or two
MAX_PLANS = 256

_PlanKey = tuple[tuple[Key, ...], tuple[int, ...]]


class HeldPlans:
    """``keep`` a lookup's pinned plan, ``take`` it for the load of the same keys and layers."""

    def __init__(
        self,
        engine: Engine,
        hold_s: float = HOLD_S,
        max_plans: int = MAX_PLANS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.hold_s = hold_s
        self.max_plans = max_plans
        self.clock = clock
        self._plans: OrderedDict[_PlanKey, tuple[LoadPlan, float]] = OrderedDict()  # oldest first
        self._lock = threading.Lock()
        self.kept = self.taken = self.expired = self.superseded = 0

    @staticmethod
    def _key(keys: Sequence[Key], layers: Sequence[int]) -> _PlanKey:
        return tuple(keys), tuple(sorted(set(layers)))

    def keep(self, keys: Sequence[Key], layers: Sequence[int], plan: LoadPlan | None, found: int) -> None:
        """After a pinned lookup of ``keys``: keep its plan when all ``found`` of them hit, else give it back."""
        if plan is None:
            return
        if found < len(keys) or not keys:  # no load is for exactly these keys: nothing to keep it for
            self.engine.release(plan)
            return
        drop: list[LoadPlan] = []
        with self._lock:
            old = self._plans.pop(self._key(keys, layers), None)
            if old is not None:  # the scheduler asked again (the request is still waiting)
                drop.append(old[0])
            self._plans[self._key(keys, layers)] = (plan, self.clock() + self.hold_s)
            self.kept += 1
            while len(self._plans) > self.max_plans:
                drop.append(self._plans.popitem(last=False)[1][0])
            drop += self._expired()
        self._release(drop)

    def take(self, keys: Sequence[Key], layers: Sequence[int]) -> LoadPlan | None:
        """The kept plan for a load of exactly ``keys`` and ``layers`` (it leaves the store), or None;
        kept plans whose keys hold ``keys`` as a run (the same request, loading part of what it
        looked up) are given back."""
        with self._lock:
            key = self._key(keys, layers)
            held = self._plans.pop(key, None)
            drop = self._expired()
            if held is None and keys:
                drop += self._covering(key)
            if held is not None and held[1] < self.clock():
                drop.append(held[0])
                held = None
            if held is not None:
                self.taken += 1
        self._release(drop)
        return None if held is None else held[0]

    def sweep(self) -> None:
        """Give back every plan past its expiry."""
        with self._lock:
            drop = self._expired()
        self._release(drop)

    def __len__(self) -> int:
        return len(self._plans)

    def _covering(self, key: _PlanKey) -> list[LoadPlan]:
        """Lock held: remove and return the plans for ``key``'s layers whose keys hold ``key``'s as a run."""
        want, layers = key
        out: list[LoadPlan] = []
        for pk in list(self._plans):
            keys, pl = pk
            if pl != layers or len(keys) < len(want):
                continue
            try:
                at = keys.index(want[0])
            except ValueError:
                continue
            if keys[at : at + len(want)] == want:
                out.append(self._plans.pop(pk)[0])
        self.superseded += len(out)
        return out

    def _expired(self) -> list[LoadPlan]:
        """Lock held: remove and return the plans past their expiry (kept oldest first)."""
        now = self.clock()
        out: list[LoadPlan] = []
        while self._plans:
            key, (plan, until) = next(iter(self._plans.items()))
            if until >= now:
                break
            del self._plans[key]
            out.append(plan)
        self.expired += len(out)
        return out

    def _release(self, plans: list[LoadPlan]) -> None:
        for plan in plans:
            self.engine.release(plan)

    def close(self) -> None:
        """Give back every kept plan (before the engine closes)."""
        with self._lock:
            plans = [plan for plan, _ in self._plans.values()]
            self._plans.clear()
        self._release(plans)


class Sweeper:
    """Sweeps ``held`` every ``interval_s`` on a daemon thread until :meth:`close`."""

    def __init__(self, held: HeldPlans, interval_s: float = 1.0) -> None:
        self.held = held
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstrata-held-sweep", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.held.sweep()
            except Exception:  # the engine closed under it: nothing is left to give back
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
