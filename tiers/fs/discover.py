"""Finding what others published: incremental and full refreshes of the catalog from listings,
headers and tombstones; the namespace's ``meta.json``."""

from __future__ import annotations

import json
import logging
import time

from kvstrata.errors import LayoutMismatchError, TierError
from kvstrata.tiers.fs.catalog import ObjectInfo, TombInfo
from kvstrata.tiers.fs.format import (
    FORMAT_VERSION,
    HEAD_PROBE,
    META,
    OBJ_SUFFIX,
    OBJECTS,
    TOMB_SUFFIX,
    TOMBS,
    FormatError,
    Name,
    epoch_of,
    header_length,
    parse_name,
    read_header,
    unpack_tomb,
)
from kvstrata.tiers.fs.options import MAX_EPOCHS, SKEW_S
from kvstrata.tiers.fs.state import FSState, _as_tier_error, _is_tmp
from kvstrata.tiers.records import check_meta, legacy_meta, meta_document

log = logging.getLogger("kvstrata.tiers.fs")


class Discovery(FSState):
    """Keeps the catalog in step with the store."""

    def _refresh(self, full: bool, timeout_s: float | None = None) -> None:
        """Learn what other processes published (and, on a full listing, removed)."""
        with self._refresh_lock:
            started = time.monotonic()
            if not full and started - self._refreshed_at < self.opts.refresh_s:
                return  # another thread refreshed while we waited for the lock
            wall = time.time()
            epochs = range(epoch_of(self._listed_wall - SKEW_S), epoch_of(wall + SKEW_S) + 1)
            full = full or started - self._full_at >= self.opts.full_refresh_s or len(epochs) > MAX_EPOCHS
            with self._lock:
                known = set(self.catalog.objects)
                known_tombs = set(self.catalog.tombs)
            faults = self.store.faults
            try:
                objects, tombs = self._list(full, epochs, timeout_s)
                self._absorb(objects, tombs, full, known, known_tombs)
            except TierError as exc:
                if self.store.faults != faults:  # a new fault, not a call the breaker skipped
                    log.warning("fs tier %s: refresh failed: %s", self.name, exc)
                raise
            self._refreshed_at = started
            self._listed_wall = wall
            with self._lock:
                self.counters.refreshes += 1
                if full:
                    self.counters.full_refreshes += 1
            if full:
                self._full_at = started
                self._full_wall = wall

    def _list(self, full: bool, epochs: range, timeout_s: float | None = None) -> tuple[dict[str, int], dict[str, int]]:
        """(object rel -> size, tombstone rel -> size) under the epochs to look at."""
        area = self.area
        if full:
            calls = [self.store.list_call(area + d, recursive=True) for d in (OBJECTS, TOMBS)]
        else:
            calls = [self.store.list_call(f"{area}{d}/{e:08x}") for d in (OBJECTS, TOMBS) for e in epochs]
        listed = self.store.run_all(calls, raise_first=True, timeout_s=timeout_s)
        objects: dict[str, int] = {}
        tombs: dict[str, int] = {}
        for rels in listed:  # anything else (directory markers some stores list) is ignored
            for rel, size in rels.items():
                if rel.startswith(f"{area}{OBJECTS}/"):
                    objects[rel] = size
                elif rel.startswith(f"{area}{TOMBS}/"):
                    tombs[rel] = size
        return objects, tombs

    def _absorb(
        self, objects: dict[str, int], tombs: dict[str, int], full: bool, known: set[str], known_tombs: set[str]
    ) -> None:
        names = {rel: parse_name(rel, OBJ_SUFFIX) for rel in objects}
        tomb_names = {rel: parse_name(rel, TOMB_SUFFIX) for rel in tombs}
        if full and self.store.local:
            self._note_tmp_files([rel for rel, n in names.items() if n is None])
        with self._lock:
            new_tombs = [n for n in tomb_names.values() if n and n.stem not in known_tombs and n.stem not in self._bad]
            new_objects = [
                (n, objects[rel]) for rel, n in names.items() if n and n.stem not in known and n.stem not in self._bad
            ]
        groups = self._fetch_tombs(new_tombs)
        infos = self._fetch_headers(new_objects)
        now = time.time()
        ttl = self.opts.ttl_s
        with self._lock:
            for tomb, group in groups:
                self.catalog.add_tomb(TombInfo(tomb, frozenset(group), now), group, now)
            for info in infos:
                if info.stem not in self.catalog.objects:
                    self.catalog.add(info, now, expired=ttl is not None and info.written_s + ttl < now)
            if full:
                listed = {n.stem for n in names.values() if n}
                for stem in known - listed:
                    self.catalog.forget(stem)  # removed by another node
                listed_tombs = {n.stem for n in tomb_names.values() if n}
                for stem in known_tombs - listed_tombs:
                    self.catalog.forget_tomb(stem)  # collected by another node

    def _fetch_tombs(self, names: list[Name]) -> list[tuple[Name, dict[str, list[bytes]]]]:
        results = self.store.run_all([self.store.get_call(n.tomb_path(self.area)) for n in names])
        out: list[tuple[Name, dict[str, list[bytes]]]] = []
        for name, res in zip(names, results, strict=True):
            if isinstance(res, FileNotFoundError):
                continue  # collected meanwhile
            if isinstance(res, BaseException):
                raise _as_tier_error(res)
            try:
                out.append((name, unpack_tomb(res, self._key, name.stem)))
            except (FormatError, UnicodeDecodeError, ValueError) as exc:
                log.warning("fs tier %s: ignoring damaged tombstone %s: %s", self.name, name.tomb_path(self.area), exc)
                with self._lock:
                    self._bad.add(name.stem)
                    if self._key is not None:
                        self.counters.auth_failures += 1
        return out

    def _fetch_headers(self, found: list[tuple[Name, int]]) -> list[ObjectInfo]:
        """One ranged GET per new object (two if its header is larger than ``HEAD_PROBE``)."""
        area = self.area
        calls = [self.store.get_call(n.object_path(area), 0, min(size, HEAD_PROBE)) for n, size in found]
        results = self.store.run_all(calls)
        out: list[ObjectInfo] = []
        for (name, size), res in zip(found, results, strict=True):
            if isinstance(res, FileNotFoundError):
                continue
            if isinstance(res, BaseException):
                raise _as_tier_error(res)
            info = ObjectInfo(name, size, {}, area=area)
            try:
                head = res
                need = header_length(head, keyed=self._key is not None)
                if need > len(head):
                    head = self.store.get(name.object_path(area), 0, need)
                info.recs, info.lineage = read_header(head, size, self._key, name.stem)
            except FileNotFoundError:
                continue
            except FormatError as exc:
                if self._key is not None:
                    with self._lock:
                        self.counters.auth_failures += 1
                self._quarantine(info, f"damaged header: {exc}")
                continue
            out.append(info)
        return out

    def _note_tmp_files(self, rels: list[str]) -> None:
        """Remember when full listings first saw temp files of local writers
        (``.<object name>.<random>.tmp``): one still there ``gc_grace_s`` later is a crashed
        writer's leftover (a live writer renames it within ``timeout_s``)."""
        now = time.time()
        with self._lock:
            seen = self._tmp_files
            self._tmp_files = {rel: seen.get(rel, now) for rel in rels if _is_tmp(rel)}

    def _check_meta(self, timeout_s: float) -> None:
        """Check ``meta.json``, or write it (with the salt as a digest only; one written before
        with the salt in clear is rewritten so)."""
        namespace = self.context.namespace
        meta = meta_document(FORMAT_VERSION, self.context.layout, namespace, kind="fs")
        try:
            raw = self.store.get(META, timeout_s=timeout_s)
        except FileNotFoundError:
            raw = None
        if raw is not None:
            try:
                check_meta(raw, meta, FORMAT_VERSION, f"{self.root_url}/{META}")
                return
            except LayoutMismatchError:
                if not legacy_meta(raw, meta, namespace):
                    raise
            log.info("fs tier %s: rewriting %s/%s without the tenant salt", self.name, self.root_url, META)
        self.store.put(META, json.dumps(meta, indent=1, sort_keys=True).encode(), timeout_s=timeout_s)
