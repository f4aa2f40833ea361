"""Checking a directory: every indexed record read and verified; repair drops bad entries; an index
that cannot be opened or was lost is rebuilt from the segment files (:mod:`.rebuild`)."""

from __future__ import annotations

import os

from kvstrata.tiers.auth import record_key
from kvstrata.tiers.base import TierContext, TierOptions, VerifyReport
from kvstrata.tiers.nvme.options import CHUNK_BYTES, GRACE_S, READ_GAP, _coerce_options
from kvstrata.tiers.nvme.rebuild import rebuild_index
from kvstrata.tiers.nvme.reclaim import Reclaimer
from kvstrata.tiers.nvme.root import prepare_root
from kvstrata.tiers.segments import Loc, SegInfo, plan_runs, pread_or_error, referenced_bytes, run_span

_RECHECKS = 4  # rounds that follow records compaction moves while verify runs


class Verifier(Reclaimer):
    """The checks of ``NVMeTier.verify``, and the rebuild of its index."""

    @classmethod
    def rebuild_index(
        cls, name: str, options: TierOptions, context: TierContext, force: bool = False
    ) -> VerifyReport | None:
        """Rebuild the index of this namespace's directory from its segment files when it cannot be
        opened or registers no segment while old segment files exist (``force``: in any case); no
        process may have it open meanwhile (``TierError`` if one does). See :mod:`.rebuild`."""
        opts = _coerce_options(options)
        root = prepare_root(opts.path, context.layout, context.namespace, opts.file_mode, opts.dir_mode)
        key = record_key(opts, context.namespace, "nvme", name, os.path.dirname(root), warn=False)
        lengths = [context.layout.layer_nbytes(layer) for layer in range(context.layout.num_layers)]
        done = rebuild_index(root, key, lengths, opts.lmdb_map_size, opts.file_mode, opts.dir_mode, GRACE_S, force)
        return None if done is None else done.report(name)

    def _verify(self, repair: bool, grace_s: float) -> VerifyReport:
        report = VerifyReport(tier=self.name)
        files = self._list_files()  # before the index snapshot: a listed file is registered or young
        entries = self._index.blocks()
        segs = self._index.segments()  # after the blocks: each segment they name was registered then
        foreign = sum(1 for _, loc in entries if not self._ours(loc))
        report.blocks_checked = len(entries) - foreign
        if foreign:
            how = "with this tier's secret" if self._key is not None else "without a secret"
            report.problems.append(f"{foreign} records not written {how}: not checked, never served here")
        bad: list[tuple[bytes, Loc]] = []
        referenced: dict[str, int] = {}
        todo = entries
        for _ in range(_RECHECKS):
            moved: list[tuple[bytes, Loc]] = []
            for seg, recs in _by_segment(todo).items():
                name = self._segment_name(seg, segs)
                size = files.get(name, (-1, 0.0))[0]
                referenced[name] = referenced.get(name, 0) + self._verify_segment(name, recs, size, report, bad, moved)
            if not moved:
                break
            todo = moved
        else:
            report.problems.append(f"{len(moved)} records kept moving (compaction) while verify ran: not checked")
        report.orphan_bytes = sum(max(0, size - referenced.get(n, 0)) for n, (size, _) in files.items())
        if not segs and self._index_lost(files, set(), GRACE_S):
            report.unindexed_files = len(files)
            report.problems.append(
                f"the index registers no segment but {len(files)} segment files exist: it was lost or replaced; "
                "`kvstrata verify --repair` rebuilds it from them"
            )
        if repair:
            self._repair(bad, files, grace_s)
            report.repaired = True
        return report

    def _segment_name(self, seg: int, segs: dict[int, SegInfo]) -> str:
        """A segment's file name, from the snapshot or (a segment made since) the index now."""
        info = segs.get(seg) or self._index.segment(seg)
        if info is None:
            return f"<unregistered segment {seg}>"
        segs[seg] = info
        return info.name

    def _verify_segment(
        self,
        name: str,
        recs: list[tuple[bytes, Loc]],
        size: int,
        report: VerifyReport,
        bad: list[tuple[bytes, Loc]],
        moved: list[tuple[bytes, Loc]],
    ) -> int:
        """Check one segment's records; returns the bytes they reference. Records of a file that
        is gone are looked up again first: those compaction moved (or a delete removed) since the
        snapshot are not lost; the moved ones go to ``moved`` to be checked where they are now."""
        path = os.path.join(self.segment_dir, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | self._odirect)
        except FileNotFoundError:
            lost = self._recheck_gone(recs, report, moved)
            if lost:
                report.missing_data += len(lost)
                report.problems.append(f"{path}: missing, {len(lost)} blocks lost")
                bad.extend(lost)
            return 0
        except OSError as exc:  # unreadable is not lost: reported, never dropped by repair
            report.missing_data += len(recs)
            report.problems.append(f"{path}: cannot open ({exc.strerror or exc}), {len(recs)} blocks not checked")
            return 0
        try:
            for run in plan_runs(list(enumerate(loc for _, loc in recs)), CHUNK_BYTES, READ_GAP, self._read_align):
                self._verify_run(fd, path, [(recs[i][0], loc) for i, loc in run], report, bad)
        finally:
            os.close(fd)
        return referenced_bytes([loc for _, loc in recs], size)

    def _recheck_gone(
        self, recs: list[tuple[bytes, Loc]], report: VerifyReport, moved: list[tuple[bytes, Loc]]
    ) -> list[tuple[bytes, Loc]]:
        """Of records whose file was found missing, those the index still places there (lost: a
        segment file is unlinked only after the index stops naming it, so this read is final)."""
        fresh = self._index.get_many([k for k, _ in recs])
        lost: list[tuple[bytes, Loc]] = []
        for (key, loc), now in zip(recs, fresh, strict=True):
            if now == loc:
                lost.append((key, loc))
            elif now is not None and self._ours(now):
                moved.append((key, now))
            elif self._ours(loc):
                report.blocks_checked -= 1  # deleted (or rewritten with another secret) since the snapshot
        return lost

    def _verify_run(
        self, fd: int, path: str, run: list[tuple[bytes, Loc]], report: VerifyReport, bad: list[tuple[bytes, Loc]]
    ) -> None:
        first, span = run_span(run, self._read_align)
        with self._pool.borrow(span) as stage:
            got = pread_or_error(fd, stage[:span], first)
            if got < 0:  # an I/O error is no verdict on the records: reported, never dropped by repair
                mine = sum(1 for _, loc in run if self._ours(loc))
                report.missing_data += mine
                report.problems.append(f"{path}@{first}: read failed, {mine} blocks not checked")
                return
            for key, loc in run:
                rel = loc.offset - first
                if not self._ours(loc):
                    continue  # another secret's record: its owner checks it
                if rel + loc.length > got:
                    report.missing_data += 1
                    report.problems.append(f"{path}@{loc.offset}: truncated (key {key[:16].hex()})")
                elif not self._intact(key, loc, stage[rel : rel + loc.length]):
                    report.bad_checksums += 1
                    what = "checksum mismatch" if self._key is None else "keyed check failed (forged or damaged)"
                    report.problems.append(f"{path}@{loc.offset}: {what} (key {key[:16].hex()})")
                else:
                    continue
                bad.append((key, loc))

    def _repair(self, bad: list[tuple[bytes, Loc]], files: dict[str, tuple[int, float]], grace_s: float) -> None:
        if bad:
            self._drop([k for k, _ in bad], [loc for _, loc in bad])
        infos = self._index.recount()
        with self._lock:
            self._forget_mirror()  # entries changed under it
        for seg, info in infos.items():
            self._reclaim_segment(seg, info)
        self._remove_unregistered(files, {info.name for info in infos.values()}, grace_s)
        self._rescan()


def _by_segment(records: list[tuple[bytes, Loc]]) -> dict[int, list[tuple[bytes, Loc]]]:
    by_seg: dict[int, list[tuple[bytes, Loc]]] = {}
    for key, loc in records:
        by_seg.setdefault(loc.seg, []).append((key, loc))
    return by_seg
