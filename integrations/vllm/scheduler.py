"""The connector's scheduler half: restorable-prefix lookups and the per-step transfer plan.

It lives in vLLM's scheduler (EngineCore) process, which holds no KV cache. "How many tokens can
you restore?" is asked first of the workers themselves over a local socket
(:mod:`kvstrata.integrations.vllm.lookup`): a worker's engine also sees its DRAM tier and the
stores it has queued, so a prompt re-sent right after it was stored hits at once. For a worker
that does not answer in time, the persistent tiers answer through a light
:class:`~kvstrata.integrations.vllm.prober.TierProber` over their shared index, so every hit
reported is something any worker on the node can read, whichever instance stored it.

Keys (:mod:`kvstrata.integrations.vllm.plan`): vLLM's block hashes where they are the same in
every process, else kvstrata's own over token ids and vLLM's extra keys. A request whose extra keys
cannot be computed or encoded is declined (no hit, no store; vLLM computes it), logged once per
reason and counted (``declined_requests``, scheduler-side connector stats).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvstrata.core.keys import BlockHasher, Key
from kvstrata.core.layout import LayerKind
from kvstrata.integrations.vllm.events import EventGate, EventSpec, block_info, external_hashes
from kvstrata.integrations.vllm.lookup import LookupClient
from kvstrata.integrations.vllm.metadata import KVStrataMetadata, TransferSpec
from kvstrata.integrations.vllm.plan import (
    DeclinedRequest,
    ExtraKeys,
    ExtraKeysFn,
    GroupPlan,
    ModelPlan,
    RequestKeys,
    group_keys,
    lcm_block,
    make_namespace,
    rank_independent,
    rank_keys,
)
from kvstrata.integrations.vllm.prober import TierProber, persistent_tiers
from kvstrata.integrations.vllm.settings import ConnectorSettings
from kvstrata.integrations.vllm.stats import LIVE

log = logging.getLogger("vllm.kvstrata")


def vllm_extra_keys_fn() -> ExtraKeysFn | None:
    """vLLM's ``generate_block_hash_extra_keys``, or None where this vLLM has none."""
    try:
        from vllm.v1.core import kv_cache_utils
    except ImportError:
        return None
    fn = getattr(kv_cache_utils, "generate_block_hash_extra_keys", None)
    return fn if callable(fn) else None


def key_path_summary(use_vllm_hashes: bool, extra_keys_fn: ExtraKeysFn | None) -> str:
    """The start-up line: which keys, which requests are keyed, which declined."""
    if use_vllm_hashes:
        return (
            "kvstrata keys: vLLM's block hashes (the same in every process: prefix_caching_hash_algo "
            "sha256/sha256_cbor or PYTHONHASHSEED set), namespaced; keyed: plain text, cache_salt tenants, "
            "LoRA, multimodal, prompt embeds (vLLM mixes their extra keys into its hashes); declined: none"
        )
    head = (
        "kvstrata keys: kvstrata's own (chained xxh3-128 over token ids; vLLM's block hashes differ per "
        "process with an xxhash algorithm and no PYTHONHASHSEED)"
    )
    if extra_keys_fn is None:
        return (
            f"{head}; vLLM has no generate_block_hash_extra_keys here, so keyed: plain text, cache_salt "
            "tenants; declined (computed by vLLM, never restored or stored): LoRA, multimodal, prompt embeds"
        )
    return (
        f"{head} plus vLLM's extra keys (generate_block_hash_extra_keys); keyed: plain text, cache_salt "
        "tenants, LoRA, multimodal, prompt embeds; declined (computed by vLLM, never restored or stored): "
        "requests whose extra keys fail or have no canonical encoding"
    )


@dataclass
class _RequestState:
    request: Any
    keys: RequestKeys
    block_ids: list[list[int]] = field(default_factory=list)  # per vLLM group
    stored: dict[int, int] = field(default_factory=dict)  # plan group -> group blocks handled
    lookup_start: int = 0  # tokens computed locally when the external hit was counted
    load_failed: bool = False  # a load failed: recompute this request, never offer it hits again
    sync_load: bool = False  # its hits load layer-wise inside the step (see load_mode)
    confirmed: bool = False  # every rank's worker answered its lookup (see TransferSpec.confirmed)
    declined: bool = False  # cannot be keyed safely: never restored, never stored
    announced: int = 0  # KV events, hybrid models: anchor-group blocks announced up to a restore point


class SchedulerSide:
    def __init__(self, settings: ConnectorSettings, plan: ModelPlan) -> None:
        config = settings.config
        self.plan = plan
        self.model, self.kv_dtype, self.weights = settings.model, settings.kv_dtype, settings.weights.weights
        self.rank_independent = rank_independent(plan, config)
        self.tp_size = 1 if self.rank_independent else settings.tp_size
        self.use_vllm_hashes = settings.use_vllm_hashes
        self.extra_keys = None if self.use_vllm_hashes else ExtraKeys(vllm_extra_keys_fn())
        self._declined: Counter[str] = Counter()  # since the last stats report, by reason
        self._live_sent: dict[str, int] | None = None  # the gauges last reported (see stats.LIVE)
        self.declined_total = 0
        self._logged_reasons: set[str] = set()
        log.info(key_path_summary(self.use_vllm_hashes, self.extra_keys.fn if self.extra_keys else None))
        timeout = settings.worker_lookup_timeout_s
        self.workers = [LookupClient(settings.lookup_address(r), timeout_s=timeout) for r in range(self.tp_size)]
        self.prober: TierProber | None = None
        persistent = persistent_tiers(config)
        if persistent and not plan.unsupported:
            namespaces = [
                make_namespace(
                    plan,
                    self.model,
                    self.kv_dtype,
                    r,
                    self.tp_size,
                    "",
                    rank_independent=self.rank_independent,
                    weights=self.weights,
                )
                for r in range(self.tp_size)
            ]
            self.prober = TierProber(config, plan.layout, namespaces)
        elif not persistent:
            log.warning(
                "kvstrata: no persistent tier configured; hits come only from this instance's workers "
                "(their DRAM), never from other instances"
            )
        self.requests: dict[str, _RequestState] = {}
        self.pending_loads: list[TransferSpec] = []
        # "sync": layer-wise loads inside the step (failures reported per block, which vLLM
        # supports for one KV cache group only); "async": the request waits for its load while
        # others run; "auto" (default): sync when every hit is in the workers' memory (a memcpy,
        # faster than a scheduling round trip), async when any comes from disk or the network
        self.load_mode = settings.load_mode if len(plan.groups) == 1 else "async"
        self._all_fast = True  # during one lookup: every block found so far is in worker memory
        self._all_answered = True  # during one lookup: every worker asked has answered
        self.step_block = lcm_block(plan)
        # KV events (events.py): the anchor group's blocks are announced, at restore points
        self.events = EventGate(self.tp_size) if settings.kv_events else None
        kinds = [g.kind for g in plan.groups]
        full = [i for i, k in enumerate(kinds) if k in (LayerKind.FULL, LayerKind.MLA)]
        sparse = [i for i, k in enumerate(kinds) if k is LayerKind.LINEAR] or [
            i for i, k in enumerate(kinds) if k is LayerKind.SLIDING
        ]
        self.anchor: int | None = full[0] if full else None
        self.point: int | None = sparse[0] if sparse and full else None

    def close(self) -> None:
        for client in self.workers:
            client.close()
        if self.prober is not None:
            self.prober.close()

    def _state(self, request: Any) -> _RequestState:
        st = self.requests.get(request.request_id)
        if st is None:
            salt = str(getattr(request, "cache_salt", None) or "")
            ns = make_namespace(self.plan, self.model, self.kv_dtype, 0, 1, salt, weights=self.weights)
            own = None if self.use_vllm_hashes else BlockHasher(ns)
            st = _RequestState(request, RequestKeys(ns.seed, own, extra_keys=self.extra_keys))
            self.requests[request.request_id] = st
        return st

    def _keys(self, st: _RequestState) -> list[Key] | None:
        """The request's hash-block keys so far; None once it is declined."""
        if st.declined:
            return None
        try:
            return st.keys.update(st.request)
        except DeclinedRequest as exc:
            st.declined = True
            self._declined[exc.reason] += 1
            self.declined_total += 1
            if exc.reason not in self._logged_reasons:  # once per reason, not per request
                self._logged_reasons.add(exc.reason)
                log.warning(
                    "kvstrata: declined request %s (%s): %s. vLLM computes it; kvstrata neither restores "
                    "nor stores it. Later requests declined for this reason are only counted "
                    "(declined_requests, reason=%s)",
                    st.request.request_id,
                    exc.reason,
                    exc.detail,
                    exc.reason,
                )
            return None

    def take_stats(self) -> dict[str, Any] | None:
        """Scheduler-side connector stats since the last call: ``declined_requests`` and
        ``declined_<reason>`` per reason, and the ``tracked_requests`` gauge when it changed
        (``stats.LIVE``); None when there is nothing to report."""
        data: dict[str, Any] = {}
        if self.events is not None and self.events.dropped:
            data["kv_events_dropped"], self.events.dropped = self.events.dropped, 0
        live = {"tracked_requests": len(self.requests)}
        if live != self._live_sent:  # gauges (stats.LIVE) go out when they change
            data[LIVE] = {"scheduler": live}
            self._live_sent = live
        if not self._declined:
            return data or None
        data.update({f"declined_{reason}": n for reason, n in self._declined.items()})
        data["declined_requests"] = sum(self._declined.values())
        self._declined.clear()
        return data

    def _namespaced(self, keys: list[Key], rank: int) -> list[Key]:
        return rank_keys(keys, 0 if self.rank_independent else rank)

    # -- lookup ---------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        st = self._state(request)  # stores need the state even when nothing can be looked up
        if not self.plan.groups or st.load_failed or self.plan.unsupported:
            return 0, False
        hash_keys = self._keys(st)
        if hash_keys is None:
            return 0, False
        usable = (request.num_tokens - 1) // self.plan.hash_block_size  # leave a token to compute
        self._all_fast = self._all_answered = True
        tokens = self._restorable_tokens(hash_keys[:usable])
        ext = max(0, tokens - num_computed_tokens)
        st.lookup_start = num_computed_tokens
        st.sync_load = self.load_mode == "sync" or (self.load_mode == "auto" and self._all_fast)
        st.confirmed = self._all_answered
        return ext, ext > 0 and not st.sync_load

    def _restorable_tokens(self, hash_keys: list[Key]) -> int:
        """Longest prefix (tokens, a multiple of every group's block size) every group can restore."""
        limit = len(hash_keys) * self.plan.hash_block_size
        sparse = (LayerKind.LINEAR, LayerKind.SLIDING)  # state groups first: one key to check
        for g in self.plan.groups:
            if g.kind not in sparse:
                nb = limit // g.block_size
                found = self._found(g, group_keys(g, hash_keys, range(nb)))
                limit = min(limit, found * g.block_size)
        limit -= limit % self.step_block
        points = sorted((g for g in self.plan.groups if g.kind in sparse), key=lambda g: sparse.index(g.kind))
        while limit > 0:  # state and sliding groups: the snapshot / window at the restore point
            if all(self._window_ok(g, hash_keys, limit) for g in points):
                return limit
            limit -= self.step_block
        return 0

    def _window_ok(self, g: GroupPlan, hash_keys: list[Key], end_tokens: int) -> bool:
        blocks = g.window_blocks(end_tokens)
        keys = group_keys(g, hash_keys, blocks)
        return self._found(g, keys) == len(keys)

    def _found(self, g: GroupPlan, keys: list[Key]) -> int:
        """Blocks of ``keys`` every rank can restore now. Each rank's worker answers from its
        engine (DRAM, queued stores, and what other processes put in shared tiers); for a worker
        that does not answer, the persistent tiers do, where a group's first layer stands for all
        (a group is written in one batch; the worker checks every layer, and reports a failed load)."""
        n = len(keys)
        for rank in range(self.tp_size):
            if n == 0:
                break
            answer = self.workers[rank].lookup(keys[:n], g.layers)
            if answer is None:
                self._all_fast = self._all_answered = False
                if self.prober is None or rank >= self.prober.ranks:
                    return 0
                got = len(self.prober.probe(rank, self._namespaced(keys[:n], rank), g.layers[:1]))
            else:
                got, fast = answer
                self._all_fast &= fast >= got
            n = min(n, got)
        return n

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        st = self._state(request)
        ids = blocks.get_block_ids()
        hash_keys = self._keys(st)
        if hash_keys is None:
            return
        start, end = st.lookup_start, st.lookup_start + num_external_tokens
        salt = str(getattr(request, "cache_salt", None) or "")
        for gi, g in enumerate(self.plan.groups):
            table = ids[g.group_id]
            wanted = [i for i in g.window_blocks(end) if i >= start // g.block_size]
            pairs = [(i, table[i]) for i in wanted if i < len(table) and table[i] != 0]
            if g.kind is LayerKind.LINEAR and len(pairs) < len(wanted):
                # no slot to put the state in: a load of nothing, which fails and is recomputed
                keys = group_keys(g, hash_keys, wanted)
                self.pending_loads.append(TransferSpec(request.request_id, gi, keys, [], salt, st.sync_load))
            elif pairs:
                keys = group_keys(g, hash_keys, [i for i, _ in pairs])
                spec = TransferSpec(
                    request.request_id, gi, keys, [b for _, b in pairs], salt, st.sync_load, st.confirmed
                )
                self.pending_loads.append(spec)
        for gi, g in enumerate(self.plan.groups):  # what we load counts as stored
            st.stored[gi] = max(st.stored.get(gi, 0), end // g.block_size)

    # -- per-step metadata -----------------------------------------------------------
    def build_connector_meta(self, so: Any) -> KVStrataMetadata:
        meta = KVStrataMetadata(loads=self.pending_loads)
        self.pending_loads = []
        if not self.plan.groups or self.plan.unsupported:
            return meta
        for new in so.scheduled_new_reqs:
            st = self.requests.get(new.req_id)
            if st is None:
                continue
            st.block_ids = [list(b) for b in new.block_ids]
            for gi, g in enumerate(self.plan.groups):
                first = new.num_computed_tokens // g.block_size
                st.stored[gi] = min(st.stored.get(gi, first), first) if gi in st.stored else first
            self._stores(meta, st, new.num_computed_tokens + so.num_scheduled_tokens.get(new.req_id, 0))
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self.requests.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    st.block_ids = [list(b) for b in new_ids]
                else:
                    for table, extra in zip(st.block_ids, new_ids, strict=False):
                        table.extend(extra)
            done = cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(req_id, 0)
            self._stores(meta, st, done)
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        return meta

    def _stores(self, meta: KVStrataMetadata, st: _RequestState, computed_tokens: int) -> None:
        hash_keys = self._keys(st)
        if hash_keys is None:
            return
        ext: dict[int, list[Any]] | None = {} if self.events is not None and self.anchor is not None else None
        step_end = computed_tokens  # where this step's forward stops
        computed_tokens = min(computed_tokens, len(hash_keys) * self.plan.hash_block_size)
        salt = str(getattr(st.request, "cache_salt", None) or "")
        for gi, g in enumerate(self.plan.groups):
            upto = computed_tokens // g.block_size
            lo = st.stored.get(gi, 0)
            if upto <= lo or g.group_id >= len(st.block_ids):
                continue
            keep = g.window_blocks(computed_tokens)  # sliding: only blocks a restore point here needs
            if g.kind is LayerKind.LINEAR and step_end != upto * g.block_size:
                keep = range(upto, upto)  # the state slot holds a boundary state only when the step ends there
            table = st.block_ids[g.group_id]
            pairs = [(i, table[i]) for i in range(max(lo, keep.start), upto) if i < len(table) and table[i] != 0]
            st.stored[gi] = upto
            if pairs:
                keys = group_keys(g, hash_keys, [i for i, _ in pairs])
                spec = TransferSpec(st.request.request_id, gi, keys, [b for _, b in pairs], salt)
                if ext is not None:
                    spec.events = self._event_specs(st, gi, [i for i, _ in pairs], ext) or None
                meta.stores.append(spec)

    def _event_specs(self, st: _RequestState, gi: int, blocks: list[int], ext: dict[int, list[Any]]) -> list[EventSpec]:
        """KV events for a store of group ``gi``'s ``blocks``: blocks of the anchor group (the first
        full-attention one), announced as stored only at restore points. A model of full attention
        only restores at every block; a hybrid one where the point group (its first linear, else
        sliding, group) stores a block: there the anchor blocks since the last point are announced
        with the point key (stored and removed with it), and each anchor block's own removal too."""
        anchor = self.plan.groups[self.anchor or 0]
        if gi != self.anchor and gi != self.point:
            return []
        bs = anchor.block_size
        if bs not in ext:
            ext[bs] = external_hashes(st.request, self.plan.hash_block_size, bs)
        hashes = ext[bs]

        def info(i: int) -> Any:
            return block_info(st.request, hashes, i, bs, anchor.group_id)

        specs: list[EventSpec] = []
        if gi == self.anchor:
            for j, i in enumerate(blocks):
                if i < len(hashes):
                    specs.append(EventSpec(j, (info(i),), removed_only=self.point is not None))
            return specs
        g = self.plan.groups[gi]
        j, last = len(blocks) - 1, blocks[-1]
        end = (last + 1) * g.block_size  # tokens the point key restores
        upto = min(end // bs, len(hashes))
        if end % self.step_block or upto <= st.announced:
            return specs
        specs.append(EventSpec(j, tuple(info(i) for i in range(st.announced, upto))))
        st.announced = upto
        return specs

    def on_events(self, output: Any) -> None:
        events = getattr(output, "kv_cache_events", None)
        if self.events is not None and events is not None:
            self.events.add(list(events.get_all_events()))

    def take_events(self) -> list[Any]:
        return self.events.take() if self.events is not None else []

    def forget(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    def on_output(self, output: Any) -> None:
        self.on_events(output)
        for req_id in getattr(output, "failed_recving", None) or ():
            st = self.requests.get(req_id)
            if st is not None:
                st.load_failed = True
