"""A read call's staged runs read by the extension's threads, which never take the GIL.

:class:`~kvstrata._native.RunReader` has a thread per staging buffer: it takes the next run fed,
``pread`` s it into its buffer (at most ``IO_DEPTH`` reads in flight), checks each record's xxh3_64
there and copies it out to its destination, then takes the next run. The Python pipeline
(:mod:`~kvstrata.tiers.nvme.lanes`) moves the same runs through threads that each take the GIL
between runs; while the caller looked up and planned the next part of a 256 MiB read (6-12 ms of
Python), a thread whose ``pread`` had returned waited for the GIL before it could start the next
one, and the disk idled.

Taken by the runs of a tier without a secret (a keyed tag is checked in Python) whose records all
go to host memory of their size (:func:`~kvstrata.tiers.fileio.record_addresses`) and whose read
fits a staging buffer, except runs that zero-copy reads take (every destination at the alignment
they need and whole pages long, see :mod:`~kvstrata.tiers.nvme.reader`). Every other run, and a run that came back short
or met an error, goes through the Python pipeline (``fallback``), which tells a truncated record
from an I/O error. ``KVSTRATA_NVME_NATIVE_READS=0`` turns it off.

A part's lookup and planning now run beside its predecessors' reads with no thread waiting on
them, so a large read is cut into parts of doubling size (:func:`~kvstrata.tiers.nvme.tier.read_cuts`):
256 MiB of 64 KiB records read at 1.02x of raw ``O_DIRECT`` (median of 6 runs, 0.77-1.04) against
0.86x (0.83-0.89) through the pipeline with its two parts, interleaved in one process (README,
*Benchmarks*)."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Protocol

import numpy as np

from kvstrata.core import native
from kvstrata.core.buffers import Buffer
from kvstrata.errors import ConfigError
from kvstrata.tiers.base import ReadStatus
from kvstrata.tiers.fileio import AlignedBufferPool, record_addresses
from kvstrata.tiers.records import ALIGN
from kvstrata.tiers.segments import Loc, run_span

__all__ = ["NATIVE_READS_ENV", "NativeRuns", "native_reads_enabled"]

NATIVE_READS_ENV = "KVSTRATA_NVME_NATIVE_READS"
Work = list[tuple[int, list[tuple[int, Loc]]]]  # (fd, run of (batch position, location))
_OK, _CORRUPT = 1, 2  # the extension's record statuses; 3 (past a short read) and 4 (an error): read again


class Runs(Protocol):
    def feed(self, work: Work) -> None: ...
    def finish(self) -> None: ...
    def close(self) -> None: ...


def native_reads_enabled() -> bool:
    """Whether staged reads go through the extension's threads (``KVSTRATA_NVME_NATIVE_READS``,
    default 1; 0 where the extension is not built)."""
    raw = os.environ.get(NATIVE_READS_ENV, "1").strip()
    if raw not in ("0", "1"):
        raise ConfigError(f"{NATIVE_READS_ENV}={raw!r}: use 1 (read runs in the extension's threads) or 0")
    return raw == "1" and native.NATIVE is not None and hasattr(native.NATIVE, "RunReader")


class NativeRuns:
    """The runs of one read call (see the module docstring); :meth:`feed`, :meth:`finish` and
    :meth:`close` as the Python pipeline's, which takes the runs this one does not."""

    def __init__(
        self,
        pool: AlignedBufferPool,
        threads: int,
        depth: int,
        align: int,
        zero_copy: int,
        bufs: list[Buffer],
        out: list[ReadStatus],
        fallback: Runs,
        many: bool,
    ) -> None:
        """``threads`` threads, each with a staging buffer of ``pool`` (fewer for a call of fewer
        runs, unless ``many``: more parts will be fed), at most ``depth`` reads in flight; a run is
        read as its records' range widened to multiples of ``align``. ``zero_copy``: the memory
        alignment at which the tier reads a record straight into its destination (0: never); a run
        whose destinations all have it is left to the fallback, which does."""
        self.pool, self.threads, self.depth, self.align, self.many = pool, threads, depth, align, many
        self.zero_copy = zero_copy
        self.bufs, self.out, self.fallback = bufs, out, fallback
        self.fed: Work = []
        self.stack = contextlib.ExitStack()
        self.reader: Any = None  # the extension's RunReader, once a run is fed
        self.done = False
        self.delivered = 0  # records read, checked and copied out by the extension's threads

    def feed(self, work: Work) -> None:
        spans = [run_span(run, self.align) for _, run in work]
        lengths = [loc.length for _, run in work for _, loc in run]
        addrs = record_addresses([self.bufs[i] for _, run in work for i, _ in run], lengths, 1)
        if addrs is None:  # pragma: no cover - enabled only with the extension
            self.fallback.feed(work)
            return
        mine: Work = []
        rows: list[tuple[int, int, int, int]] = []
        recs: list[np.ndarray] = []
        other: Work = []
        whole = np.asarray(lengths, np.int64) % ALIGN == 0
        at = 0
        for (fd, run), (first, n) in zip(work, spans, strict=True):
            here = addrs[at : at + len(run)]
            direct = bool(self.zero_copy) and not (here % self.zero_copy).any() and whole[at : at + len(run)].all()
            at += len(run)
            if n > self.pool.chunk or not here.all() or direct:
                other.append((fd, run))
                continue
            mine.append((fd, run))
            rows.append((fd, first, n, len(run)))
            fields = np.array([loc[1:4] for _, loc in run], np.uint64)
            recs.append(np.column_stack((fields, here)))
        if other:
            self.fallback.feed(other)
        if not mine:
            return
        if self.reader is None:
            count = self.threads if self.many else min(self.threads, len(mine))
            stages = [self.stack.enter_context(self.pool.borrow(self.pool.chunk)) for _ in range(count)]
            addresses = np.array([s.ctypes.data for s in stages], np.uint64)
            ext = native.NATIVE
            assert ext is not None, "NativeRuns needs kvstrata._native: check native_reads_enabled() first"
            self.reader = ext.RunReader(addresses, self.pool.chunk, self.depth)
        self.fed += mine
        self.reader.feed(np.array(rows, np.int64), np.ascontiguousarray(np.concatenate(recs)))

    def finish(self) -> None:
        """Wait for every run; the records that came short or met an error go through the fallback,
        which is then finished too."""
        self.done = True
        if self.reader is not None:
            status = np.frombuffer(self.reader.finish(), np.uint8)
            again: Work = []
            at = 0
            out, ok, bad = self.out, ReadStatus.OK, ReadStatus.CORRUPT
            for fd, run in self.fed:
                codes = status[at : at + len(run)].tolist()
                at += len(run)
                if any(c not in (_OK, _CORRUPT) for c in codes):
                    again.append((fd, run))
                    continue
                for (i, _), c in zip(run, codes, strict=True):
                    out[i] = ok if c == _OK else bad
                self.delivered += codes.count(_OK)
            if again:
                self.fallback.feed(again)
        self.fallback.finish()

    def close(self) -> None:
        try:
            if self.reader is not None and not self.done:
                with contextlib.suppress(Exception):
                    self.reader.finish()
            self.fallback.close()
        finally:
            self.stack.close()
