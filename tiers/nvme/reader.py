"""Reading records: look up, plan runs, read (``pread`` or GPUDirect Storage), verify, deliver."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Sequence
from typing import NamedTuple

import lmdb
import numpy as np

from kvstrata.core.buffers import Buffer, is_device, nbytes
from kvstrata.errors import TierError
from kvstrata.tiers.base import ReadStatus
from kvstrata.tiers.fileio import aligned_buffer, hash_at, preadv_all, record_addresses, stage_out
from kvstrata.tiers.nvme.lanes import Pipeline, cpu_workers
from kvstrata.tiers.nvme.native_reads import NativeRuns, Runs
from kvstrata.tiers.nvme.options import CHUNK_BYTES, IO_DEPTH, READ_GAP
from kvstrata.tiers.nvme.state import NVMeState
from kvstrata.tiers.records import ALIGN
from kvstrata.tiers.segments import Loc, copy_staged, plan_runs, pread_or_error, run_span

log = logging.getLogger("kvstrata.tiers.nvme")

MIN_RUN = 1024 * 1024  # the least bytes a read covers when a call is split into runs (see run_bytes)
RUNS_PER_LANE = 4  # runs per lane that a small call is split into
Check = Callable[[int, Loc, np.ndarray], bool]  # (batch position, location, bytes read) -> intact


class Reader(NVMeState):
    """Reads and verifies records of any writer's segments."""

    def _lookup(self, keys: list[bytes | None]) -> list[Loc | None]:
        """Where each record is; None for absent ones and for those this tier cannot check
        (written with another secret, or without one when it has one: never served here). Asked of
        the shared index in one read transaction, never of this process's mirror: another process
        may have overwritten or deleted an entry since this one cached it (a record this tier wrote
        and someone without the secret then replaced must not be served)."""
        present = [k for k in keys if k is not None]
        fresh = iter(self._index.get_many(present) if present else [])
        locs = [None if k is None else next(fresh) for k in keys]
        return [loc if loc is not None and self._ours(loc) else None for loc in locs]

    def _fetch(self, keys: list[bytes]) -> list[Loc | None]:
        """Current index entries of ``keys``; refreshes the mirror with them."""
        with self._index.write_lock:
            fresh = self._index.get_many(keys)
            with self._lock:
                for key, loc in zip(keys, fresh, strict=True):
                    if loc is None:
                        self._mirror_pop(key)
                    else:
                        self._mirror_set(key, loc)
        return fresh

    def _retry_moved(
        self,
        gone: list[int],
        locs: list[Loc | None],
        keys: list[bytes | None],
        bufs: list[Buffer],
        out: list[ReadStatus],
    ) -> None:
        """Segment files vanished under us: re-read moved records, drop lost ones."""
        gone_keys = [k for k in (keys[i] for i in gone) if k is not None]
        fresh = self._fetch(gone_keys)
        retry = [
            (i, loc)
            for i, loc in zip(gone, fresh, strict=True)
            if loc is not None and loc != locs[i] and self._ours(loc)
        ]
        lost = [
            (k, loc) for i, k, loc in zip(gone, gone_keys, fresh, strict=True) if loc is not None and loc == locs[i]
        ]
        if lost:
            log.warning("nvme tier %s: %d blocks point at missing segment files", self.name, len(lost))
            self._drop([k for k, _ in lost], [loc for _, loc in lost])
        for i in gone:
            out[i] = ReadStatus.MISSING
        self._read_jobs(retry, keys, bufs, out)

    def _read_jobs(
        self, jobs: list[tuple[int, Loc]], keys: list[bytes | None], bufs: list[Buffer], out: list[ReadStatus]
    ) -> list[int]:
        """Read, verify and deliver; returns the items whose segment file is missing."""
        return self._read_parts([lambda: jobs], keys, bufs, out)

    def _read_parts(
        self,
        parts: Sequence[Callable[[], list[tuple[int, Loc]]]],
        keys: list[bytes | None],
        bufs: list[Buffer],
        out: list[ReadStatus],
    ) -> list[int]:
        """Read, verify and deliver the jobs that each of ``parts`` gives, called in turn: the runs
        of a part go to the disk as soon as they are planned, so a later part's index lookup and
        planning run while the earlier parts' runs are read (a 256 MiB read's lookup and plan of
        4,096 records took 6-7 ms before its first ``pread``). Returns the items whose segment
        file is missing."""
        gone: list[int] = []
        fds: dict[int, int] = {}
        seen: list[tuple[int, Loc]] = []

        def check(i: int, loc: Loc, data: np.ndarray) -> bool:
            key = keys[i]
            return key is not None and self._intact(key, loc, data)

        many = len(parts) > 1
        runs: Runs = _Runs(self, bufs, out, check, many)
        if self._native_reads:  # staged runs read by the extension's threads, the others by the pipeline
            threads = IO_DEPTH + cpu_workers(IO_DEPTH)
            runs = NativeRuns(
                self.staging_pool, threads, IO_DEPTH, self._read_align, self._mem_align, bufs, out, runs, many
            )
        try:
            for p, part in enumerate(parts):
                jobs = part()
                seen += jobs
                by_seg: dict[int, list[tuple[int, Loc]]] = {}
                for job in self._gds_jobs(jobs, bufs, out, check) if self._gds else jobs:
                    by_seg.setdefault(job[1].seg, []).append(job)
                work: list[tuple[int, list[tuple[int, Loc]]]] = []
                most = part_run_bytes(
                    sum(loc.length for group in by_seg.values() for _, loc in group), len(jobs), len(keys)
                )
                for seg, group in by_seg.items():
                    fd = fds.get(seg, -1)
                    if fd < 0 and (fd := self._open_for_read(seg, group, gone, out)) >= 0:
                        fds[seg] = fd
                    if fd >= 0:
                        work += [(fd, run) for run in plan_runs(group, most, READ_GAP, self._read_align)]
                if work:
                    runs.feed(_tapered(work) if p == len(parts) - 1 else work)
            runs.finish()
            if isinstance(runs, NativeRuns) and runs.delivered:
                with self._lock:
                    self.native_reads += runs.delivered
        finally:
            runs.close()
            for fd in fds.values():
                os.close(fd)
        corrupt = [(k, loc) for i, loc in seen if out[i] is ReadStatus.CORRUPT and (k := keys[i]) is not None]
        if corrupt:
            self._quarantine(corrupt)
        return gone

    def _open_for_read(self, seg: int, group: list[tuple[int, Loc]], gone: list[int], out: list[ReadStatus]) -> int:
        path = self._segment_path(seg)
        try:
            return os.open(path or "", os.O_RDONLY | os.O_CLOEXEC | self._odirect)
        except FileNotFoundError:
            gone.extend(i for i, _ in group)
        except OSError:
            for i, _ in group:
                out[i] = ReadStatus.ERROR
        return -1

    def _gds_jobs(
        self, jobs: list[tuple[int, Loc]], bufs: list[Buffer], out: list[ReadStatus], check: Check
    ) -> list[tuple[int, Loc]]:
        """Serve device destinations with GPUDirect Storage (kvikio), one open file per segment;
        returns the other jobs."""
        rest: list[tuple[int, Loc]] = []
        by_seg: dict[int, list[tuple[int, Loc]]] = {}
        for i, loc in jobs:
            (by_seg.setdefault(loc.seg, []) if is_device(bufs[i]) else rest).append((i, loc))
        for seg, group in by_seg.items():
            path = self._segment_path(seg)
            if path is None:
                rest += group
                continue
            try:
                got = _gds_read(path, [(loc, bufs[i], functools.partial(check, i, loc)) for i, loc in group])
            except FileNotFoundError:
                rest += group  # the host path notices the file is gone
                continue
            except (OSError, RuntimeError) as exc:
                log.warning("nvme tier %s: GDS read failed: %s", self.name, exc)
                got = [ReadStatus.ERROR] * len(group)
            for (i, _), status in zip(group, got, strict=True):
                out[i] = status
        return rest

    def _quarantine(self, corrupt: list[tuple[bytes, Loc]]) -> None:
        with self._lock:
            if self._key is None:
                self.checksum_failures += len(corrupt)
            else:
                self.auth_failures += len(corrupt)
        what = "their checksum" if self._key is None else "their keyed check (forged or damaged)"
        log.warning("nvme tier %s: %d blocks failed %s; dropped from the index", self.name, len(corrupt), what)
        try:
            self._drop([k for k, _ in corrupt], [loc for _, loc in corrupt])
        except lmdb.Error as exc:
            log.warning("nvme tier %s: could not drop corrupt blocks: %s", self.name, exc)


class _Runs:
    """The runs of one read call through a :class:`~kvstrata.tiers.nvme.lanes.Pipeline`:
    ``IO_DEPTH`` I/O threads read runs into free staging buffers, one after another; CPU workers
    (the caller among them) check and deliver each run read. Started by the first :meth:`feed`."""

    def __init__(self, tier: Reader, bufs: list[Buffer], out: list[ReadStatus], check: Check, many: bool) -> None:
        self.tier, self.bufs, self.out, self.check, self.many = tier, bufs, out, check, many
        self.work: list[tuple[int, list[tuple[int, Loc]]]] = []
        self.spans: list[tuple[int, int]] = []
        self.direct: list[_Direct | None] = []  # per run: read straight into the destinations, or staged
        self.big: dict[int, np.ndarray] = {}  # runs larger than a staging buffer (records past CHUNK_BYTES)
        self.stack = contextlib.ExitStack()
        self.pipe: Pipeline[None] | None = None
        self.done = False

    def feed(self, work: list[tuple[int, list[tuple[int, Loc]]]]) -> None:
        align = self.tier._read_align
        first = len(self.work)
        self.work += work
        spans = [run_span(run, align) for _, run in work]
        self.spans += spans
        self.direct += self._direct_plans(work, spans)
        if self.pipe is None:
            cpu = cpu_workers(IO_DEPTH)
            count = IO_DEPTH + cpu + 1 if self.many else min(len(work), IO_DEPTH + cpu + 1)
            pool = self.tier.staging_pool
            stages = [self.stack.enter_context(pool.borrow(pool.chunk)) for _ in range(count)]
            self.pipe = Pipeline(self.tier._io_pool, stages, IO_DEPTH, cpu, self._read, after=self._deliver)
            self.pipe.start()
        self.pipe.feed(range(first, len(self.work)))

    def finish(self) -> None:
        self.done = True
        if self.pipe is not None:
            self.pipe.finish()

    def close(self) -> None:
        """After an exception between the first :meth:`feed` and :meth:`finish`: let every thread
        stop (no new run starts) before the buffers and files go."""
        try:
            if not self.done and self.pipe is not None:
                self.pipe.failed.append(TierError("read abandoned"))
                with contextlib.suppress(Exception):
                    self.pipe.finish()
        finally:
            self.stack.close()

    def _direct_plans(
        self, work: list[tuple[int, list[tuple[int, Loc]]]], spans: list[tuple[int, int]]
    ) -> list[_Direct | None]:
        """For each run, how it is read straight into its records' destinations, or None (staged):
        only for a tier without a secret (its xxh3_64 is checked where the bytes land), where
        every destination of the run is host memory at the alignment ``O_DIRECT`` takes and every
        record and gap is whole pages."""
        tier = self.tier
        none: list[_Direct | None] = [None] * len(work)
        if not tier._mem_align or tier._key is not None:
            return none
        addrs = record_addresses(
            [self.bufs[i] for _, run in work for i, _ in run],
            [loc.length for _, run in work for _, loc in run],
            tier._mem_align,
        )
        if addrs is None or not addrs.any():
            return none
        room = tier.staging_pool.chunk  # the gaps between records are read into a staging buffer
        plans, at = none, 0
        for r, ((_, run), (first, n)) in enumerate(zip(work, spans, strict=True)):
            plans[r] = _direct_plan(run, addrs[at : at + len(run)], first, n, room)
            at += len(run)
        return plans

    def _read(self, k: int, stage: np.ndarray) -> int:
        (fd, _), (first, n) = self.work[k], self.spans[k]
        plan = self.direct[k]
        if plan is not None:
            try:
                pieces = np.where(plan.pieces == 0, np.uint64(stage.ctypes.data), plan.pieces)
                got = preadv_all(fd, pieces, plan.sizes, first)
            except OSError:
                got = -1
            if got == n:
                return got
            self.direct[k] = None  # staged again: the record-by-record path tells a truncated record from an error
        if n > len(stage):
            stage = self.big[k] = aligned_buffer(n)
        return pread_or_error(fd, stage[:n], first)

    def _deliver(self, k: int, stage: np.ndarray, got: int) -> None:
        records, first = self.work[k][1], self.spans[k][0]
        plan = self.direct[k]
        if plan is not None:
            out, ok, bad = self.out, ReadStatus.OK, ReadStatus.CORRUPT
            for (i, _), good in zip(records, (hash_at(plan.addrs, plan.lengths) == plan.expect).tolist(), strict=True):
                out[i] = ok if good else bad
            with self.tier._lock:
                self.tier.zero_copy_reads += len(records)
            return
        stage = self.big.pop(k, stage)
        bufs, out = self.bufs, self.out
        if not (self.tier._key is None and _deliver_checked(records, stage, first, got, bufs, out)):
            intact = _checked(stage, first, got, records, self.check)
            _deliver_run(records, stage, first, got, intact, bufs, out)


class _Direct(NamedTuple):
    """A run read straight into its records' destinations: one scattered read of the run's
    ``pieces`` (addresses; 0 for a gap, read into the staging buffer) of ``sizes`` bytes, then
    each record's xxh3_64 (at ``addrs``, ``lengths`` bytes) checked against ``expect`` where it
    landed. A record that fails its check is CORRUPT and its destination holds the bytes read
    (as with GPUDirect Storage): a miss for the caller, never its bytes."""

    pieces: np.ndarray
    sizes: np.ndarray
    addrs: np.ndarray
    lengths: np.ndarray
    expect: np.ndarray


def _direct_plan(run: list[tuple[int, Loc]], addrs: np.ndarray, first: int, n: int, room: int) -> _Direct | None:
    """How ``run`` (``n`` bytes from file offset ``first``) is read straight into its records'
    destinations at ``addrs``; None where one is not taken (0) or a record or a gap is not whole
    pages (``O_DIRECT`` reads whole sectors into each piece), a gap is larger than ``room`` or
    two records overlap (one record asked for twice)."""
    if not addrs.all():
        return None
    pieces: list[int] = []
    sizes: list[int] = []
    pos = first
    for (_, loc), addr in zip(run, addrs.tolist(), strict=True):
        gap = loc.offset - pos
        if gap:
            if gap < 0 or gap % ALIGN or gap > room:
                return None
            pieces.append(0)
            sizes.append(gap)
        if loc.length % ALIGN:
            return None
        pieces.append(addr)
        sizes.append(loc.length)
        pos = loc.offset + loc.length
    tail = first + n - pos
    if tail:
        if tail < 0 or tail % ALIGN or tail > room:
            return None
        pieces.append(0)
        sizes.append(tail)
    lengths = [loc.length for _, loc in run]
    return _Direct(
        np.array(pieces, np.uint64),
        np.array(sizes, np.int64),
        addrs,
        np.array(lengths, np.int64),
        np.array([loc.checksum for _, loc in run], np.uint64),
    )


def run_bytes(total: int) -> int:
    """The most bytes one read of a call that reads ``total`` bytes covers: :data:`CHUNK_BYTES`, less
    for a small call, so that it is still read in several runs (``RUNS_PER_LANE`` per lane, of at
    least ``MIN_RUN``) that overlap (an engine's layer-wise load reads one layer of a prefix, a
    few MiB, per call)."""
    return max(MIN_RUN, min(CHUNK_BYTES, -(-total // ((IO_DEPTH + 1) * RUNS_PER_LANE))))


def part_run_bytes(part: int, items: int, total_items: int) -> int:
    """The most bytes one read of a part of a call covers (``part`` bytes in ``items`` of the call's
    ``total_items``): :func:`run_bytes` of the whole call, estimated, so the early parts of a large
    read (parts of doubling size, see :func:`~kvstrata.tiers.nvme.tier.read_cuts`) are not read in
    the small runs of a small call; but no more than half the part (or a small call's runs), so
    that both lanes start on it. A 512 MiB read's first parts were read in 1 MiB runs (~0.7 GB/s a
    stream here against ~1.5 GB/s for 16 MiB ones): 94 ``pread`` s, 0.78-0.79x of raw ``O_DIRECT``
    against 0.82-0.86x now (medians of 40 interleaved rounds, twice)."""
    whole = part * max(1, total_items) // max(1, items)
    return min(run_bytes(whole), max(run_bytes(part), -(-part // IO_DEPTH)))


def _tapered(work: list[tuple[int, list[tuple[int, Loc]]]]) -> list[tuple[int, list[tuple[int, Loc]]]]:
    """``work`` with its last runs cut into runs of halving size (down to about :data:`MIN_RUN`),
    largest first: a run is checked and delivered after its read, and the deliveries of the runs
    read last are not overlapped by any read. The runs cut are the last ones that hold
    :data:`IO_DEPTH` times the largest run's bytes: ``IO_DEPTH`` reads are in flight at once, so
    that many full runs ended together (cutting only the last run, often a short remainder of a
    segment, left 3-8 ms of a 256 MiB read after its last ``pread``). Cuts fall between records,
    so every part is whole records."""
    if not work:
        return work
    sizes = [_span(run) for _, run in work]
    want, got, k = IO_DEPTH * max(sizes), 0, len(work)
    while k > 0 and got < want:
        k -= 1
        got += sizes[k]
    tail = [(fd, part) for fd, run in work[k:] for part in _halving(run)]
    tail.sort(key=lambda job: -_span(job[1]))  # stable: equal sizes stay in file order
    return [*work[:k], *tail]


def _span(run: list[tuple[int, Loc]]) -> int:
    return run[-1][1].end - run[0][1].offset


def _halving(run: list[tuple[int, Loc]]) -> list[list[tuple[int, Loc]]]:
    parts: list[list[tuple[int, Loc]]] = []
    while len(run) > 1:
        span = _span(run)
        if span <= 2 * MIN_RUN:
            break
        half = run[0][1].offset + span // 2  # the first half of the bytes goes first, then the rest again
        cut = next((j for j, (_, loc) in enumerate(run) if loc.offset >= half), len(run))
        if cut in (0, len(run)):
            break
        parts.append(run[:cut])
        run = run[cut:]
    return [*parts, run]


def _checked(stage: np.ndarray, first: int, got: int, run: list[tuple[int, Loc]], check: Check) -> list[bool]:
    """Whether each record of a run read into ``stage`` (``got`` bytes from file offset ``first``,
    -1 for an I/O error) came whole and intact."""
    intact = []
    for i, loc in run:
        rel = loc.offset - first
        intact.append(got >= 0 and rel + loc.length <= got and check(i, loc, stage[rel : rel + loc.length]))
    return intact


def _deliver_checked(
    run: list[tuple[int, Loc]], stage: np.ndarray, first: int, got: int, bufs: list[Buffer], out: list[ReadStatus]
) -> bool:
    """:func:`_checked` and :func:`_deliver_run` of a run of xxh3_64-checked records in one call of
    the extension (:func:`~kvstrata.tiers.fileio.stage_out`, without the GIL); False (nothing
    done) without it or after an I/O error, for the caller to go record by record."""
    if got < 0:
        return False
    whole = []
    for i, loc in run:
        if loc.offset - first + loc.length <= got:
            whole.append((i, loc))
        else:
            out[i] = ReadStatus.ERROR  # truncated segment
    status = stage_out(
        stage,
        [loc.offset - first for _, loc in whole],
        [bufs[i] for i, _ in whole],
        [loc.length for _, loc in whole],
        [loc.checksum for _, loc in whole],
    )
    if status is None:
        return False
    for (i, loc), st in zip(whole, status.tolist(), strict=True):
        if st == 1:
            out[i] = ReadStatus.OK
        elif st == 0:
            out[i] = ReadStatus.CORRUPT
        else:  # intact, for a destination the extension cannot fill (a torch tensor, another size)
            rel = loc.offset - first
            out[i] = _deliver(stage[rel : rel + loc.length], loc, bufs[i])
    return True


def _deliver_run(
    run: list[tuple[int, Loc]],
    stage: np.ndarray,
    first: int,
    got: int,
    intact: list[bool],
    bufs: list[Buffer],
    out: list[ReadStatus],
) -> None:
    for (i, loc), good in zip(run, intact, strict=True):
        rel = loc.offset - first
        if got < 0:
            out[i] = ReadStatus.ERROR
        elif rel + loc.length > got:
            out[i] = ReadStatus.ERROR  # truncated segment
        else:
            out[i] = _deliver(stage[rel : rel + loc.length], loc, bufs[i]) if good else ReadStatus.CORRUPT


def _gds_read(path: str, items: list[tuple[Loc, Buffer, Callable[[np.ndarray], bool]]]) -> list[ReadStatus]:
    """GPUDirect Storage reads (kvikio ``CuFile.pread``) of records of one segment file straight
    into device memory, all in flight at once. Runs under GDS or kvikio's POSIX compatibility mode
    (``KVIKIO_COMPAT_MODE``) alike; tests/gpu covers both on a CUDA machine.

    Work queued on the destinations' torch stream (a fill, a kernel) is waited for first: kvikio
    copies on its own streams. Each checksum is verified on a device-to-host copy, which costs as
    much PCIe traffic as the host bounce it replaces; it spares host staging memory only. A record
    that fails its check is CORRUPT, and its destination holds the bytes read."""
    import kvikio
    import torch

    flats = [dst.detach().reshape(-1).view(torch.uint8) for _, dst, _ in items]
    out = [
        ReadStatus.ERROR if flat.numel() != loc.length else ReadStatus.OK
        for (loc, _, _), flat in zip(items, flats, strict=True)
    ]
    for device in {flat.device for flat in flats}:
        torch.cuda.current_stream(device).synchronize()
    with kvikio.CuFile(path, "r") as f:
        futures = [
            f.pread(flat, loc.length, loc.offset) if status is ReadStatus.OK else None
            for (loc, _, _), flat, status in zip(items, flats, out, strict=True)
        ]
        got = [_io_result(fut) for fut in futures]  # every read is over before the file closes
    for k, ((loc, _, check), flat) in enumerate(zip(items, flats, strict=True)):
        if out[k] is ReadStatus.OK:
            if got[k] != loc.length:
                out[k] = ReadStatus.ERROR
            elif not check(flat.cpu().numpy()):
                out[k] = ReadStatus.CORRUPT
    return out


def _io_result(future: object | None) -> int:
    """Bytes a kvikio read moved; -1 for none issued or a failed one (logged)."""
    if future is None:
        return -1
    try:
        return int(future.get())  # type: ignore[attr-defined]
    except (OSError, RuntimeError) as exc:
        log.warning("GDS read failed: %s", exc)
        return -1


def _deliver(data: np.ndarray, loc: Loc, dst: Buffer) -> ReadStatus:
    """Copy checked bytes out."""
    try:
        if nbytes(dst) != loc.length:
            return ReadStatus.ERROR
        copy_staged(dst, data)
    except (ValueError, TypeError, RuntimeError):
        return ReadStatus.ERROR
    return ReadStatus.OK
