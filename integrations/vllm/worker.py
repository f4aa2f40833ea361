"""The connector's worker half: a full kvstrata engine that moves KV pages in and out of vLLM.

Loads are asynchronous by default (the scheduler parks the request while the engine's I/O
threads fill its blocks) or layer-wise inside the step (``sync``: the forward waits for each
layer just before it needs it); a failed or corrupt load is reported to vLLM, which recomputes.
Stores copy the pages of newly full blocks out of the KV cache right after each layer ran, and
the engine writes them in the background, so vLLM can free blocks at once. Each worker also
serves the scheduler's lookups from its engine over a local socket
(:mod:`kvstrata.integrations.vllm.lookup`).

Each load looks up once. The socket lookup pins what it found
(:meth:`~kvstrata.engine.engine.Engine.lookup_pinned`) and keeps the plan for the load of exactly
those keys (:mod:`kvstrata.integrations.vllm.held`, with an expiry); such a load reads it and
looks nothing up. Any other confirmed load plans from the index (the socket lookup took its
blocks in); an unconfirmed one looks up pinned (adopting what other processes stored) and loads
that plan. A plan no load consumes is released, whatever fails in between.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Collection
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from kvstrata.core.buffers import Pages
from kvstrata.core.keys import Key
from kvstrata.engine.engine import Engine, LoadHandle, StoreResult
from kvstrata.errors import KVStrataError
from kvstrata.integrations.vllm.events import MEDIA, MEDIUM_STORAGE, KVStrataKVEvents, TierEvents
from kvstrata.integrations.vllm.held import HeldPlans, Sweeper
from kvstrata.integrations.vllm.lookup import LookupServer
from kvstrata.integrations.vllm.metadata import KVStrataMetadata, TransferSpec
from kvstrata.integrations.vllm.plan import ModelPlan, layer_policies, make_namespace, rank_independent, rank_keys
from kvstrata.integrations.vllm.settings import ConnectorSettings
from kvstrata.integrations.vllm.staging import StagingPool, copy_pages_out
from kvstrata.integrations.vllm.stats import TIER_COUNTERS, KVStrataConnectorStats, tier_key

log = logging.getLogger("vllm.kvstrata")


@dataclass
class _PendingLoad:
    handles: list[tuple[LoadHandle, int, list[Key]]]  # (handle, bytes of one block over the group's layers, keys)
    expected: int
    started: float


@dataclass(frozen=True)
class _Served:
    """The blocks a load restored, as :func:`~kvstrata.daemon.hints.hint_slow_hits` reads them."""

    num_blocks: int
    tiers: list[str]


class WorkerSide:
    def __init__(self, settings: ConnectorSettings, plan: ModelPlan, tp_rank: int) -> None:
        config = settings.config
        self.plan = plan
        independent = rank_independent(plan, config)
        ns = make_namespace(
            plan,
            settings.model,
            settings.kv_dtype,
            tp_rank,
            settings.tp_size,
            "",
            rank_independent=independent,
            weights=settings.weights.weights,
        )
        self.rank = 0 if independent else tp_rank
        self.engine = Engine(config, layout=plan.layout, namespace=ns, layer_policies=layer_policies(plan, config))
        self.hint_dir: str | None = None  # the daemon's state directory, when a shared tier exists
        if any(t.kind == "fs" for t in config.tiers):
            from kvstrata.daemon.state import state_dir_for

            with contextlib.suppress(Exception):
                self.hint_dir = str(state_dir_for(config))
        self.memory_tiers = {  # tiers private to this process: reading them is a memcpy
            idx.position
            for idx in self.engine.tiers
            if not (idx.tier.capabilities.persistent or idx.tier.capabilities.shared)
        }
        self.held = HeldPlans(self.engine)  # plans the socket lookups pinned, for the loads that follow
        self.sweeper = Sweeper(self.held)  # expiry also while no step runs (an idle server)
        self.server: LookupServer | None = None
        try:  # answers the scheduler's lookups from this engine (DRAM and queued stores included)
            self.server = LookupServer(settings.lookup_address(tp_rank), self._answer_lookup)  # own secret
            log.info("kvstrata: lookup server for the scheduler at %s", self.server.address)
        except OSError as exc:
            log.warning("kvstrata: no lookup server for the scheduler (%s); it will use the persistent tiers", exc)
        self.kv: dict[int, torch.Tensor] = {}  # kvstrata layer -> [num_blocks, ...] tensor
        self.loads: dict[str, _PendingLoad] = {}
        self.failed: set[str] = set()
        self.sync: list[tuple[LoadHandle, TransferSpec, int]] = []  # this step's layer-wise loads
        self.load_errors: set[int] = set()  # vLLM block ids whose sync load failed
        self.staged: dict[tuple[int, int], torch.Tensor] = {}  # (store spec, layer) -> pages copied out
        self.staged_bases: dict[tuple[int, int], torch.Tensor] = {}  # their pooled buffers
        self.staging = StagingPool(self.engine.max_pending_bytes)  # idle buffers kept: the queue budget
        self.stats = KVStrataConnectorStats()
        self._live_sent: dict[str, int] | None = None  # the gauges last reported (see stats.LIVE)
        self.source = f"worker{tp_rank}"
        self.asleep = False  # vLLM sleep mode: the KV cache is released, no loads into it
        # KV events (events.py): one rank announces blocks every rank shares (rank-independent)
        self.events: TierEvents | None = None
        if settings.kv_events and (not independent or tp_rank == 0):
            self.events = TierEvents([MEDIA.get(t.kind, (MEDIUM_STORAGE, "REMOTE")) for t in config.tiers])
            self.engine.set_block_events(self.events.hook)
            if config.daemon.kv_events_endpoint and tp_rank == 0:  # the daemon's events need vLLM's hashes
                self.events.sidecar = _block_hash_sidecar(config, ns.fingerprint)
        self._sent: dict[str, int] = {}  # monotonic counters sent so far as deltas, by stats key

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.sweeper.close()
        self.held.close()
        self.engine.close()
        if self.events is not None and self.events.sidecar is not None:
            self.events.sidecar.close()

    def _hint_slow(self, keys: list[Key], found: Any) -> None:
        """Hits served by a shared tier: tell the node's daemon this session is active again, so
        it brings the session's blocks up to NVMe before the next turn (best effort)."""
        if self.hint_dir is None:
            return
        try:
            from kvstrata.daemon.hints import hint_slow_hits

            hint_slow_hits(self.engine, keys, found, self.hint_dir)
        except Exception as exc:  # a hint is an optimisation: never fail a load over it
            log.debug("kvstrata: daemon hint failed: %s", exc)

    def _answer_lookup(self, keys: list[Key], layers: list[int]) -> tuple[int, int]:
        """Restorable blocks, and how many of them (from the start) sit in this process's memory."""
        keys = rank_keys(keys, self.rank)
        found = self.engine.lookup_pinned(keys, layers, count=False)  # pinned until the load (or expiry)
        self.held.keep(keys, layers, found.plan, found.num_blocks)
        fast = 0
        for pos in found.tier_positions:
            if pos not in self.memory_tiers:
                break
            fast += 1
        return found.num_blocks, fast

    def sleep(self) -> None:
        """Before vLLM frees the KV cache: let every load into it finish, accept no new ones."""
        self.asleep = True
        for pending in self.loads.values():
            for handle, _, _ in pending.handles:
                with contextlib.suppress(Exception):
                    handle.result()
        for handle, _, _ in self.sync:
            with contextlib.suppress(Exception):
                handle.result()

    def wake(self) -> None:
        self.asleep = False

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        index = self.plan.layer_index
        for name, tensor in kv_caches.items():
            if name not in index:
                continue
            page = int(tensor[0].numel() * tensor.element_size()) if len(tensor) else 0
            want = self.plan.layout.layer_nbytes(index[name])
            if page != want or not tensor[0].is_contiguous():  # never move bytes we cannot place exactly
                log.warning("kvstrata: layer %s has %d-byte pages, expected %d: not transferred", name, page, want)
                continue
            self.kv[index[name]] = tensor

    def _keys(self, spec: TransferSpec) -> list[Key]:
        return rank_keys(spec.keys, self.rank)

    def _pages(self, layer: int, block_ids: list[int]) -> Pages:
        """The pages of ``block_ids`` of one layer, addressed without a view each."""
        return Pages(self.kv[layer], block_ids)

    # -- loads ------------------------------------------------------------------------
    def start_loads(self, meta: KVStrataMetadata) -> None:
        self.held.sweep()
        for spec in meta.loads:
            g = self.plan.groups[spec.group]
            keys = self._keys(spec)
            try:
                handle = self._start_load(spec, keys)
            except Exception as exc:  # never raise into vLLM: the request is recomputed
                log.warning("kvstrata: load for %s failed: %s", spec.req_id, exc)
                if spec.sync:
                    self.load_errors.update(spec.block_ids)
                else:
                    self.failed.add(spec.req_id)
                continue
            block_bytes = sum(self.plan.layout.layer_nbytes(i) for i in g.layers)
            if spec.sync:
                self.sync.append((handle, spec, block_bytes))
                continue
            pending = self.loads.setdefault(spec.req_id, _PendingLoad([], 0, time.perf_counter()))
            pending.handles.append((handle, block_bytes, keys))
            pending.expected += len(keys)

    def _start_load(self, spec: TransferSpec, keys: list[Key]) -> LoadHandle:
        """One load, one lookup. The plan the scheduler's socket lookup pinned for exactly these
        keys is loaded as is. Otherwise a hit every worker confirmed is already in this engine's
        index (that lookup took it in) and goes straight to ``load``, which plans from the index;
        any other hit is looked up pinned first (adopting what other processes stored), and the
        load reads that plan. A plan is given back when the load does not start."""
        g = self.plan.groups[spec.group]
        plan = self.held.take(keys, g.layers)
        try:
            if self.asleep:
                raise KVStrataError("the KV cache is released (vLLM sleep mode)")
            if len(spec.block_ids) < len(keys):
                raise KVStrataError("vLLM allocated no block to restore into")
            bufs = {layer: self._pages(layer, spec.block_ids) for layer in g.layers if layer in self.kv}
            if len(bufs) < len(g.layers):
                raise KVStrataError(f"only {len(bufs)} of the group's {len(g.layers)} layers are registered")
            if plan is None and not spec.confirmed:
                found = self.engine.lookup_pinned(keys, g.layers)  # adopts what other processes stored
                plan = found.plan
                if found.num_blocks < len(keys):
                    raise KVStrataError(f"only {found.num_blocks} of {len(keys)} blocks are restorable now")
            return self.engine.load(keys, bufs, plan=plan)
        except BaseException:
            if plan is not None:
                self.engine.release(plan)  # idempotent: a plan the load consumed stays consumed
            raise

    def poll_loads(self, finished_req_ids: Collection[str] = ()) -> tuple[set[str], set[str]]:
        """Loads done since the last call: ``(finished_recving, failed_recving)``. ``finished_req_ids``
        (vLLM's requests finished this step) that still have a load running here were aborted
        mid-load: counted (``aborted_during_load``); their load runs to its end and is reported as
        usual, so its pins and staging are released like any other."""
        self.held.sweep()  # every step: lookups whose load never came (aborted, preempted) expire
        for req_id in finished_req_ids:
            running = self.loads.get(req_id)
            if running is not None and not all(h.done() for h, _, _ in running.handles):
                self.stats.add("aborted_during_load", 1)
        done: set[str] = set()
        failed: set[str] = set(self.failed)
        self.failed.clear()
        for req_id, pending in list(self.loads.items()):
            if not all(h.done() for h, _, _ in pending.handles):
                continue
            del self.loads[req_id]
            loaded = 0
            for h, block_bytes, keys in pending.handles:
                try:
                    res = h.result()
                except Exception:
                    continue
                loaded += res.loaded_blocks
                self._hint_slow(keys, _Served(res.loaded_blocks, res.tiers[: res.loaded_blocks]))
                self.stats.add("loaded_bytes", res.loaded_blocks * block_bytes)
                for tier in res.tiers[: res.loaded_blocks]:
                    self.stats.add(f"hits_{tier}", 1)
            self.stats.add("load_time_ms", (time.perf_counter() - pending.started) * 1e3)
            if loaded == pending.expected:
                done.add(req_id)
                self.stats.add("load_requests", 1)
                self.stats.add("loaded_blocks", loaded)
            else:
                failed.add(req_id)
        if failed:
            self.stats.add("failed_loads", len(failed))
        return done | failed, failed

    def wait_layer(self, layer_name: str) -> None:
        """Block until this step's layer-wise loads have put ``layer_name``'s pages in place."""
        layer = self.plan.layer_index.get(layer_name)
        for handle, spec, _ in self.sync:
            if layer in self.plan.groups[spec.group].layers:
                handle.wait_layer(layer)

    def finish_sync_loads(self) -> None:
        """End of step: blocks a layer-wise load did not deliver intact are reported to vLLM."""
        for handle, spec, block_bytes in self.sync:
            try:
                res = handle.result()
                n = res.loaded_blocks
                tiers = res.tiers
            except Exception:
                n, tiers = 0, []
            self._hint_slow(self._keys(spec), _Served(n, tiers[:n]))
            self.stats.add("load_time_ms", (handle.elapsed_s or 0.0) * 1e3)  # issue to bytes in place
            self.stats.add("loaded_blocks", n)
            self.stats.add("loaded_bytes", n * block_bytes)
            for tier in tiers[:n]:
                self.stats.add(f"hits_{tier}", 1)
            if n < len(spec.block_ids):
                self.load_errors.update(spec.block_ids[n:])
                self.stats.add("failed_loads", 1)
            else:
                self.stats.add("load_requests", 1)
        self.sync = []

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    # -- stores -----------------------------------------------------------------------
    def stage_layer(self, meta: KVStrataMetadata, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Copy this layer's pages of the step's stores out of the KV cache, right after the layer ran."""
        layer = self.plan.layer_index.get(layer_name)
        if layer is None:
            return
        t0 = time.perf_counter()
        for si, spec in enumerate(meta.stores):
            if layer in self.plan.groups[spec.group].layers and spec.block_ids:
                if kv_layer.device.type == "cpu":  # into a reused buffer: no page faults in the forward pass
                    base = self.staging.take(kv_layer[0], len(spec.block_ids))
                    self.staged_bases[(si, layer)] = base
                    self.staged[(si, layer)] = copy_pages_out(kv_layer, spec.block_ids, base)
                else:
                    self.staged[(si, layer)] = _copy_out(kv_layer, spec.block_ids)
        self.stats.add("save_time_ms", (time.perf_counter() - t0) * 1e3)

    def save(self, meta: KVStrataMetadata) -> None:
        """End of step: finish layer-wise loads, then hand the step's copied-out pages to the engine."""
        self.finish_sync_loads()
        t0 = time.perf_counter()
        for si, spec in enumerate(meta.stores):
            g = self.plan.groups[spec.group]
            layers = [layer for layer in g.layers if layer in self.kv]
            if not layers or not spec.block_ids:
                continue
            bufs = {}
            bases: list[torch.Tensor] = []
            for layer in layers:
                staged = self.staged.pop((si, layer), None)  # copied right after the layer ran
                bufs[layer] = staged if staged is not None else _copy_out(self.kv[layer], spec.block_ids)
                base = self.staged_bases.pop((si, layer), None)
                if base is not None:
                    bases.append(base)
            keys = self._keys(spec)
            if self.events is not None and spec.events:  # before the store: the top tier may take it at once
                for es in spec.events:
                    self.events.track(keys[es.index], es)
            try:
                future = self.engine.store(keys, bufs)
            except Exception as exc:  # a store that cannot be done is dropped and counted
                log.warning("kvstrata: store for %s failed: %s", spec.req_id, exc)
                self.stats.add("dropped_stores", 1)
                self.staging.give(bases)
                continue
            if bases:  # the engine reads the buffers until the store is done
                future.add_done_callback(functools.partial(_give_when_done, self.staging, bases))
            self.stats.add("stored_blocks", len(spec.block_ids))
            self.stats.add("saved_bytes", sum(int(b.numel() * b.element_size()) for b in bufs.values()))
        self.staged.clear()
        self.staging.give(list(self.staged_bases.values()))
        self.staged_bases.clear()
        if meta.stores:
            self.stats.add("save_time_ms", (time.perf_counter() - t0) * 1e3)

    def take_stats(self) -> KVStrataConnectorStats | None:
        """What happened since the last call (vLLM aggregates and logs it)."""
        stats = self.engine.stats()
        for name in ("dropped_stores", "dropped_blocks"):  # the engine's counters, as deltas
            self._send_delta(name, int(stats[name]))
        for tier, counters in stats["tiers"].items():  # per-tier misses and faults, as deltas
            for counter in TIER_COUNTERS:
                self._send_delta(tier_key(counter, tier), int(counters.get(counter, 0)))
        if self.events is not None:  # events and sidecar records lost to full queues
            lost = self.events.dropped + (self.events.sidecar.dropped if self.events.sidecar is not None else 0)
            self._send_delta("kv_events_dropped", lost)
        live = self.live(stats)
        if live != self._live_sent:  # gauges go out when they change (a quiet step sends nothing)
            self.stats.set_live(self.source, live)
            self._live_sent = live
        if self.stats.is_empty():
            return None
        out = KVStrataConnectorStats(data=dict(self.stats.data))
        self.stats.reset()
        return out

    def _send_delta(self, key: str, now: int) -> None:
        """Add what a monotonic counter gained since it was last sent to the stats under ``key``."""
        if now > self._sent.get(key, 0):
            self.stats.add(key, now - self._sent.get(key, 0))
            self._sent[key] = now

    def live(self, stats: dict[str, Any] | None = None) -> dict[str, int]:
        """What this worker holds right now (:data:`~kvstrata.integrations.vllm.stats.LIVE_GAUGES`)."""
        stats = self.engine.stats() if stats is None else stats
        return {
            "pinned_blocks": sum(int(t.get("pinned_blocks", 0)) for t in stats["tiers"].values()),
            "held_plans": len(self.held),
            "pending_loads": len(self.loads) + len(self.sync),
            "staging_out_bytes": self.staging.out_bytes,
            "staging_idle_bytes": self.staging.idle_bytes,
            "queued_store_bytes": int(stats["pending_bytes"]) + int(stats["waiting_bytes"]),
        }

    def take_events(self) -> KVStrataKVEvents | None:
        """The tier events since the last step, as vLLM events (None when there are none)."""
        if self.events is None or not self.events.queue:
            return None
        events = self.events.drain()
        return KVStrataKVEvents(events) if events else None


def _block_hash_sidecar(config: Any, fingerprint: str) -> Any:
    """The writer of this namespace's block hash sidecar in the daemon's state dir (None: cannot)."""
    from kvstrata.daemon.block_hashes import BlockHashWriter, sidecar_path
    from kvstrata.daemon.state import state_dir_for

    try:
        return BlockHashWriter(sidecar_path(state_dir_for(config), fingerprint), config.daemon.kv_events_tracked_keys)
    except Exception as exc:  # the daemon then publishes nothing for this process's blocks (it counts them)
        log.warning("kvstrata: no block hash sidecar for the daemon's KV events: %s", exc)
        return None


def _give_when_done(staging: StagingPool, bases: list[torch.Tensor], _future: Future[StoreResult]) -> None:
    """A store's done-callback: its staging buffers go back to the pool."""
    staging.give(bases)


def _copy_out(kv_layer: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """The pages of ``block_ids`` as a new host tensor ``[n, ...]`` (one gather, then D2H if needed)."""
    idx = torch.tensor(block_ids, dtype=torch.long, device=kv_layer.device)
    pages = kv_layer.index_select(0, idx)
    return pages.cpu() if pages.device.type != "cpu" else pages


def tp_rank() -> int:
    """This worker's tensor-parallel rank (0 outside a distributed vLLM)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:
        return 0
