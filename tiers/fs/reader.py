"""Reading: ranged GETs planned over an object's records, each record checked before delivery."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from kvstrata.core.buffers import Buffer, copy_bytes, nbytes
from kvstrata.errors import TierError
from kvstrata.tiers.base import ReadStatus, VerifyReport
from kvstrata.tiers.fs.catalog import ObjectInfo
from kvstrata.tiers.fs.format import Rec, record_intact
from kvstrata.tiers.fs.options import MAX_READ, READ_GAP
from kvstrata.tiers.fs.state import FSState

log = logging.getLogger("kvstrata.tiers.fs")


class Reader(FSState):
    """Reads and verifies records."""

    def _fetch(
        self, jobs: list[tuple[ObjectInfo, list[tuple[int, Rec]]]], bufs: list[Buffer], out: list[ReadStatus]
    ) -> list[ObjectInfo]:
        """Ranged GETs for ``jobs``, verified and delivered into ``bufs``; returns corrupt objects."""
        runs = [(info, run) for info, recs in jobs for run in _plan_reads(recs)]
        calls = [self._checked_get(info, run) for info, run in runs]
        try:
            results = self.store.run_all(calls)
        except TierError:
            results = [TierError("store down")] * len(calls)
        corrupt: dict[str, ObjectInfo] = {}
        vanished: dict[str, ObjectInfo] = {}
        for (info, run), res in zip(runs, results, strict=True):
            if isinstance(res, FileNotFoundError):
                vanished[info.stem] = info  # collected by another node: a miss
                continue
            if isinstance(res, BaseException):
                for i, _ in run:
                    out[i] = ReadStatus.ERROR
                continue
            data, intact = res
            with self._lock:
                self.counters.range_reads += 1
                self.counters.bytes_read += len(data)
            if not self._deliver(run, data, intact, bufs, out):
                corrupt[info.stem] = info
        if vanished:
            with self._lock:
                for stem, info in vanished.items():
                    if self.catalog.objects.get(stem) is info:
                        self.catalog.forget(stem)
        return list(corrupt.values())

    def _checked_get(self, info: ObjectInfo, run: list[tuple[int, Rec]]) -> tuple[str, str, Callable[..., Any], tuple]:
        """A store call that GETs one run of ``info``'s records and checks each, on the store's
        threads (keyed BLAKE3 releases the GIL): it returns (bytes, whether each record is intact)."""
        what, rel, get, args = self.store.get_call(info.rel, run[0][1].offset, _run_end(run))
        first = run[0][1].offset

        def call(*a: Any) -> tuple[np.ndarray, list[bool]]:
            data = np.frombuffer(get(*a), dtype=np.uint8)
            intact = []
            for _, rec in run:
                bkey = info.key_at(rec.offset)
                piece = data[rec.offset - first : rec.end - first]
                intact.append(bkey is not None and record_intact(self._key, bkey, rec, piece))
            return data, intact

        return what, rel, call, args

    def _deliver(
        self,
        run: list[tuple[int, Rec]],
        data: np.ndarray,
        verdicts: list[bool],
        bufs: list[Buffer],
        out: list[ReadStatus],
    ) -> bool:
        """Copy out the records of one ranged GET that passed their check (``verdicts``); False if
        any failed its checksum or keyed check."""
        first = run[0][1].offset
        intact = True
        for (i, rec), good in zip(run, verdicts, strict=True):
            piece = data[rec.offset - first : rec.end - first]
            if not good:
                out[i] = ReadStatus.CORRUPT
                intact = False
                continue
            try:
                if nbytes(bufs[i]) != rec.length:
                    out[i] = ReadStatus.ERROR
                    continue
                copy_bytes(bufs[i], piece)
            except (ValueError, TypeError, RuntimeError):
                out[i] = ReadStatus.ERROR
                continue
            out[i] = ReadStatus.OK
        if not intact:
            failed = sum(1 for i, _ in run if out[i] is ReadStatus.CORRUPT)
            with self._lock:
                if self._key is None:
                    self.counters.checksum_failures += failed
                else:
                    self.counters.auth_failures += failed
        return intact

    def _verify_object(self, info: ObjectInfo, recs: list[Rec], report: VerifyReport, bad: list[ObjectInfo]) -> None:
        bufs: list[Buffer] = [np.empty(rec.length, dtype=np.uint8) for rec in recs]
        indexed = list(enumerate(recs))
        out = [ReadStatus.MISSING] * len(recs)
        self._fetch([(info, indexed)], bufs, out)
        missing = sum(1 for s in out if s in (ReadStatus.MISSING, ReadStatus.ERROR))
        corrupt = sum(1 for s in out if s is ReadStatus.CORRUPT)
        if missing:
            report.missing_data += missing
            report.problems.append(f"{info.rel}: {missing} records unreadable or the object is gone")
        if corrupt:
            report.bad_checksums += corrupt
            what = "their checksum" if self._key is None else "their keyed check (forged or damaged)"
            report.problems.append(f"{info.rel}: {corrupt} records fail {what}")
            bad.append(info)


def _plan_reads(recs: list[tuple[int, Rec]]) -> list[list[tuple[int, Rec]]]:
    """Group the records of one object into runs that one ranged GET covers."""
    runs: list[list[tuple[int, Rec]]] = []
    start = end = -1
    for item in sorted(recs, key=lambda t: t[1].offset):
        rec = item[1]
        if runs and rec.offset - end <= READ_GAP and max(end, rec.end) - start <= MAX_READ:
            runs[-1].append(item)
            end = max(end, rec.end)
        else:
            runs.append([item])
            start, end = rec.offset, rec.end
    return runs


def _run_end(run: list[tuple[int, Rec]]) -> int:
    return max(rec.end for _, rec in run)
