"""The processes of the crash matrix (``tests/test_crash_matrix.py``) and the checker that judges
what they left behind.

Run as a script: ``python tests/crash_workers.py zygote`` imports everything once and then forks
one real process per request read from stdin (one JSON object a line), so that starting the five
processes of a round costs milliseconds instead of a second of CPU each (the machine has two
cores). Nothing is opened before the fork: every child opens its own tier (its own LMDB
environment, fsspec filesystem and threads). The test kills children with SIGKILL by pid and
asks the zygote to reap them (``wait``), so a pid is never reused while the test may still kill it.

Roles (each opens the tier named by its spec through the public registry, ``TIERS.get(kind)``,
then says ``ready`` on the zygote's stdout: the test starts its kill clock then):

``writer``
    Two threads writing batches of layer-blocks of 400 B and 8 KiB whose bytes derive from their
    block id (:func:`expected`), each batch a mix of new ids and rewrites of ids the thread wrote
    earlier in the round. A ``W`` line (the ids about to be written) precedes every ``write`` and
    an ``A`` line (the ids it returned True for) follows it: the promise the checker holds the
    tier to.
``reopener``
    A writer whose main thread also closes the tier now and then with writes in flight and opens
    a new one (an engine shut down and started again inside one process).
``compactor``
    ``compact()`` in a loop (the nvme tier).
``repairer``
    ``verify --repair`` in a loop (the nvme tier), each time one of: the long-lived tier's
    ``verify(repair=True)``; :func:`kvstrata.engine.verify.verify_config` as ``kvstrata verify
    --repair`` runs it (open, sweep, verify, repair, close); ``verify(repair=True, grace_s=0)``.
    Every report is logged (``V``): one that finds damage is a false alarm, since nothing here
    damages a disk.
``deleter``
    Daemon-style deletes of ids acknowledged in earlier rounds (the ``deletable.txt`` the checker
    wrote, oldest first): ``records()``, then, like the daemon's watermarks, the oldest excess
    over a live target (and now and then a few anywhere) with ``delete_at`` (compare-and-swap on
    the locations ``records`` gave) or a plain ``delete``. An ``I`` line precedes each call, a
    ``D`` line (deleted, and for ``delete_at`` kept: the location had changed) follows it.
``gc``
    The fs tier's housekeeping process: ``maintain()`` (tombstones, compaction, collection with
    ``gc_grace_s = 0``), every fifth time ``verify(repair=True)`` instead, and deletes like the
    deleter's (of ids ``contains`` confirms).
``checker``
    Runs alone after every round (every process of it is dead): ``verify()`` without repair
    (every round or every few), then reads every block the logs or the tier's own index name and
    judges it (see :func:`check`); writes a JSON result and its verdicts.

A delete that a kill cut short (an ``I`` without its ``D``) may or may not have happened: the
checker looks (missing: deleted, present: still promised) and records what it found.

Logs: one line per event, ``<json> #<crc32>``, written with one ``os.write`` on an
``O_APPEND`` file and fdatasync-ed; a torn last line (a kill mid-write) fails its crc and is
ignored. No pickle anywhere.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import signal
import sys
import threading
import time
import traceback
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvstrata.core.keys import Namespace
from kvstrata.core.layout import KVLayout, LayerKind, LayerSpec
from kvstrata.engine.verify import verify_config
from kvstrata.errors import TierError
from kvstrata.tiers import (
    TIERS,
    BlockId,
    IndexedTier,
    ReadStatus,
    ShrinkableTier,
    Tier,
    TierContext,
    indexed,
    shrinkable,
)
from kvstrata.tiers.fs import FSTier
from kvstrata.tiers.nvme import NVMeTier, gds_available

# Layer 0: a 400-byte linear-attention state; layer 1: an 8 KiB attention block.
LAYOUT = KVLayout(
    model="crash-matrix",
    block_size=4,
    layers=(
        LayerSpec("state", LayerKind.LINEAR, (100,), "float32"),
        LayerSpec("attn", LayerKind.FULL, (2, 4, 4, 128), "float16"),
    ),
)
NAMESPACE = Namespace(
    model=LAYOUT.model, kv_dtype="float16", layout_fingerprint=LAYOUT.fingerprint(), block_size=LAYOUT.block_size
)
SIZES = tuple(LAYOUT.layer_nbytes(layer) for layer in range(LAYOUT.num_layers))
READ_BATCH = 256

Spec = dict[str, Any]  # {"kind": "nvme" | "fs", "name": ..., "capacity": int, "options": {...}}


# --------------------------------------------------------------------------- block ids and bytes


def block_id(text: str) -> BlockId:
    key, layer = text.split(".")
    return bytes.fromhex(key), int(layer)


def id_text(bid: BlockId) -> str:
    return f"{bid[0].hex()}.{bid[1]}"


_RAMP = {n: (np.arange(n) % 251).astype(np.uint8) for n in SIZES}


def expected(bid: BlockId) -> np.ndarray:
    """The bytes of block ``bid``: its key and layer, then a digest of both tiled and mixed with a
    ramp of period 251, so bytes from another block or from another offset never match."""
    key, layer = bid
    n = SIZES[layer]
    digest = hashlib.blake2b(key + bytes([layer]), digest_size=64).digest()
    data = np.frombuffer(digest * (n // 64 + 1), np.uint8, n) ^ _RAMP[n]
    data[:16] = np.frombuffer(key, np.uint8)
    data[16] = layer
    return data


def whose(data: np.ndarray) -> str:
    """Which block some wrong bytes look like (for the report)."""
    guess = (bytes(data[:16]), int(data[16]))
    if guess[1] < len(SIZES) and len(data) == SIZES[guess[1]] and np.array_equal(data, expected(guess)):
        return f"the bytes of block {id_text(guess)}"
    if not data.any():
        return "zeros"
    return "unrecognised bytes"


def new_key(*parts: object) -> bytes:
    return hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=16).digest()


# --------------------------------------------------------------------------- logs


class Log:
    """An append-only event log whose every line is one ``write`` plus an fdatasync."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def event(self, kind: str, **fields: Any) -> None:
        body = json.dumps({"t": kind, "ts": round(time.time(), 4), **fields}, separators=(",", ":"))
        os.write(self.fd, f"{body} #{zlib.crc32(body.encode()):08x}\n".encode())
        os.fdatasync(self.fd)


def read_events(path: Path) -> Iterator[dict[str, Any]]:
    """The whole lines of a log (a torn last line is skipped)."""
    if not path.exists():
        return
    for line in path.read_text(errors="replace").splitlines():
        body, sep, crc = line.rpartition(" #")
        if sep and crc == f"{zlib.crc32(body.encode()):08x}":
            yield json.loads(body)


def events(logdir: Path, pattern: str) -> Iterator[dict[str, Any]]:
    for path in sorted(logdir.glob(pattern)):
        yield from read_events(path)


# --------------------------------------------------------------------------- tiers


def open_tier(spec: Spec) -> Tier:
    cls = TIERS.get(spec["kind"])
    options = cls.Options.model_validate(spec["options"])
    return cls(spec["name"], spec["capacity"], options, TierContext(LAYOUT, NAMESPACE))


_READY_FD = -1  # a child's copy of the zygote's stdout: "ready" goes there once its tier is open


def ready() -> None:
    """Tell the test that this process has opened its tier (its kill clock starts now)."""
    global _READY_FD
    if _READY_FD >= 0:
        os.write(_READY_FD, (json.dumps({"ready": os.getpid()}) + "\n").encode())
        os.close(_READY_FD)
        _READY_FD = -1


def as_indexed(tier: Tier) -> IndexedTier:
    if indexed(tier):
        return tier
    raise TypeError(f"tier {tier.name!r} has no shared index (records, delete_at, compact)")


def as_shrinkable(tier: Tier) -> ShrinkableTier:
    if shrinkable(tier):
        return tier
    raise TypeError(f"tier {tier.name!r} has no housekeeping (maintain)")


def verify_config_of(spec: Spec) -> dict[str, Any]:
    """The config ``kvstrata verify --config`` would read for this tier."""
    return {"tiers": [{"name": spec["name"], "kind": spec["kind"], "capacity": spec["capacity"], **spec["options"]}]}


def read_blocks(tier: Tier, ids: list[BlockId]) -> Iterator[tuple[BlockId, ReadStatus, np.ndarray]]:
    for lo in range(0, len(ids), READ_BATCH):
        part = ids[lo : lo + READ_BATCH]
        bufs = [np.zeros(SIZES[layer], np.uint8) for _, layer in part]
        statuses = tier.read(list(zip(part, bufs, strict=True)))
        yield from zip(part, statuses, bufs, strict=True)


# --------------------------------------------------------------------------- roles


def writer(
    spec: Spec, logdir: Path, rnd: int, who: str, rng: random.Random, max_batches: int, reopen_s: list[float] | None
) -> None:
    """Two threads writing through one tier; with ``reopen_s`` (seconds, low and high) the main
    thread also closes the tier now and then while their writes are in flight, and opens a new one
    (an engine shut down and started again inside a process)."""
    log = Log(logdir / f"writer-{who}.log")
    current = [open_tier(spec)]
    ready()
    seeds = [rng.randrange(1 << 32) for _ in range(2)]
    threads = [
        threading.Thread(
            target=_crash_on_error, args=(current, log, rnd, f"{who}.{t}", random.Random(seeds[t]), max_batches)
        )
        for t in range(2)
    ]
    for t in threads:
        t.start()
    while reopen_s:
        time.sleep(rng.uniform(*reopen_s))
        current[0].close()
        current[0] = open_tier(spec)
        log.event("R", r=rnd)
    for t in threads:
        t.join()
    time.sleep(3600)  # done: wait for the kill


def _crash_on_error(current: list[Tier], log: Log, rnd: int, who: str, rng: random.Random, max_batches: int) -> None:
    try:
        write_batches(current, log, rnd, who, rng, max_batches)
    except BaseException:  # anything but a TierError out of write() is a crash of the process
        traceback.print_exc()
        os._exit(3)


def write_batches(current: list[Tier], log: Log, rnd: int, who: str, rng: random.Random, max_batches: int) -> None:
    """Write ``max_batches`` batches through ``current[0]`` (which another thread may replace), each
    a ``W`` line, the ``write``, an ``A`` line with what it acknowledged (``E`` for a TierError)."""
    mine: list[BlockId] = []  # acknowledged this round: candidates for rewrites
    seen: set[BlockId] = set()
    for seq in range(max_batches):
        batch: list[BlockId] = []
        for j in range(rng.randint(1, 8)):
            key = new_key(who, rnd, seq, j)
            batch += [(key, layer) for layer in rng.choice(((0, 1), (0, 1), (0,), (1,)))]
        if mine and rng.random() < 0.4:
            batch += rng.sample(mine, min(len(mine), rng.randint(1, 6)))
        batch = list(dict.fromkeys(batch))
        log.event("W", r=rnd, ids=[id_text(b) for b in batch])
        try:
            done = current[0].write([(bid, expected(bid)) for bid in batch])
        except TierError as exc:
            log.event("E", r=rnd, error=str(exc))
            time.sleep(0.01)
            continue
        acked = [bid for bid, ok in zip(batch, done, strict=True) if ok]
        log.event("A", r=rnd, ids=[id_text(b) for b in acked])
        mine += [b for b in acked if b not in seen]
        seen.update(acked)


def compactor(spec: Spec, logdir: Path, rnd: int, rng: random.Random) -> None:
    log = Log(logdir / "compactor.log")
    tier = as_indexed(open_tier(spec))
    ready()
    while True:
        try:
            log.event("C", r=rnd, gone=tier.compact())
        except TierError as exc:
            log.event("E", r=rnd, error=str(exc))
        time.sleep(rng.uniform(0, 0.02))


def repairer(spec: Spec, logdir: Path, rnd: int, rng: random.Random) -> None:
    """``verify --repair`` in a loop, each time one of: the long-lived tier's ``verify(repair=True)``;
    :func:`verify_config` as ``kvstrata verify --repair`` runs it (open, sweep, verify, repair,
    close); or ``verify(repair=True, grace_s=0)``, which also removes unregistered segment files
    however young (the tier's docstring reserves 0 for a directory nobody else uses: this is the
    O_CREAT/flock window of issue 15)."""
    log = Log(logdir / "repairer.log")
    tier = open_tier(spec)
    ready()
    while True:
        how = rng.choice(("tier", "cli", "grace0"))
        try:
            if how == "cli":
                reports = verify_config(verify_config_of(spec), repair=True)
            elif how == "grace0" and isinstance(tier, NVMeTier):
                reports = [tier.verify(repair=True, grace_s=0.0).to_dict()]
            else:
                reports = [tier.verify(repair=True).to_dict()]
        except TierError as exc:
            log.event("E", r=rnd, error=str(exc))
            continue
        for rep in reports:
            log.event(
                "V",
                r=rnd,
                via=how,
                ok=rep["ok"],
                blocks=rep.get("blocks_checked", 0),
                bad=rep.get("bad_checksums", 0),
                missing=rep.get("missing_data", 0),
                problems=rep.get("problems", [])[:5],
            )
        time.sleep(rng.uniform(0, 0.05))


def _deletable(logdir: Path) -> list[BlockId]:
    """Blocks acknowledged in earlier rounds and not deleted, oldest first (the checker writes it)."""
    path = logdir / "deletable.txt"
    return [block_id(line) for line in path.read_text().split()] if path.exists() else []


def _how_many(rng: random.Random, live: int, target: int) -> int:
    """Like the daemon's watermarks: above ``target`` live blocks, demote the excess (at most 256
    a call); below it, now and then a few."""
    return min(256, live - target) if live > target else rng.choice((0, 0, 1, rng.randint(1, 16)))


def deleter(spec: Spec, logdir: Path, rnd: int, rng: random.Random, target: int) -> None:
    """Deletes as the daemon does (``records`` then ``delete_at`` at the locations they had), mostly
    oldest first; sometimes a plain ``delete``."""
    log = Log(logdir / f"deleter-{os.getpid()}.log")
    pool = set(_deletable(logdir))
    tier = open_tier(spec)
    index = as_indexed(tier)
    ready()
    for seq in range(1 << 30):
        try:
            recs = index.records()
            mine = [(bid, loc) for bid, loc in recs if bid in pool]
            n = _how_many(rng, len(recs), target)
            start = 0 if n > 16 or rng.random() < 0.5 else rng.randrange(max(1, len(mine)))
            chosen = mine[start : start + n]
            pool.difference_update(bid for bid, _ in chosen)
            if chosen:
                delete_logged(index, tier, chosen, log, rnd, rng, f"{os.getpid()}.{seq}")
        except TierError as exc:
            log.event("E", r=rnd, error=str(exc))
        time.sleep(rng.uniform(0, 0.02))


def delete_logged(
    index: IndexedTier, tier: Tier, chosen: list[tuple[BlockId, Any]], log: Log, rnd: int, rng: random.Random, tag: str
) -> None:
    """One delete between an ``I`` and a ``D`` line: ``delete_at`` (compare-and-swap on the
    locations ``records`` gave) or a plain ``delete``."""
    ids = [id_text(b) for b, _ in chosen]
    if rng.random() < 0.75:
        log.event("I", r=rnd, tag=tag, how="delete_at", ids=ids)
        removed = index.delete_at(chosen)
        gone = [b for (b, _), ok in zip(chosen, removed, strict=True) if ok]
        kept = [b for (b, _), ok in zip(chosen, removed, strict=True) if not ok]
    else:
        log.event("I", r=rnd, tag=tag, how="delete", ids=ids)
        tier.delete([b for b, _ in chosen])
        gone, kept = [b for b, _ in chosen], []
    log.event("D", r=rnd, tag=tag, ids=[id_text(b) for b in gone], kept=[id_text(b) for b in kept])


def gc(spec: Spec, logdir: Path, rnd: int, rng: random.Random, target: int) -> None:
    """The fs tier's housekeeping process: deletes like the deleter's (so objects go sparse and
    die; of ids ``contains`` confirms), then ``maintain()`` (tombstones, compaction, collection),
    every fifth time ``verify(repair=True)`` instead."""
    log = Log(logdir / f"gc-{os.getpid()}.log")
    pool = _deletable(logdir)
    tier = open_tier(spec)
    keeper = as_shrinkable(tier)
    ready()
    for seq in range(1 << 30):
        try:
            n = _how_many(rng, sum(1 for _ in tier.scan()), target)
            start = 0 if n > 16 or rng.random() < 0.5 else rng.randrange(max(1, len(pool)))
            chosen, pool[start : start + n] = pool[start : start + n], []
            here = tier.contains(chosen) if chosen else []
            chosen = [b for b, h in zip(chosen, here or [True] * len(chosen), strict=True) if h]  # known here
            if chosen:
                tag = f"{os.getpid()}.{seq}"
                log.event("I", r=rnd, tag=tag, how="delete", ids=[id_text(b) for b in chosen])
                tier.delete(chosen)
                log.event("D", r=rnd, tag=tag, ids=[id_text(b) for b in chosen], kept=[])
            if seq % 5 == 4:
                rep = tier.verify(repair=True)
                log.event("V", r=rnd, via="tier", ok=rep.ok, blocks=rep.blocks_checked, bad=rep.bad_checksums,
                          missing=rep.missing_data, problems=rep.problems[:5])  # fmt: skip
            else:
                keeper.maintain()
                done = tier.stats() if isinstance(tier, FSTier) else {}
                log.event(
                    "M", r=rnd, compactions=done.get("compactions", 0), collected=done.get("collected_objects", 0)
                )
        except TierError as exc:
            log.event("E", r=rnd, error=str(exc))
        time.sleep(rng.uniform(0, 0.02))


# --------------------------------------------------------------------------- the checker


class History:
    """What the logs promise, as of the end of round ``rnd`` (every process of it is dead)."""

    def __init__(self, logdir: Path, rnd: int) -> None:
        self.acked: set[BlockId] = set()
        self.order: dict[BlockId, None] = {}  # acknowledged blocks, first acknowledgement first
        self.attempted: set[BlockId] = set()
        self.deleted: set[BlockId] = set()  # a delete returned saying so: must read MISSING
        self.uncertain: set[BlockId] = set()  # this round's deletes that a kill cut short
        self.writes = self.reopens = self.deletes = self.compactions = self.repairs = self.maintains = 0
        self.alarms: list[str] = []  # concurrent verify --repair runs that reported damage
        self.errors: list[str] = []
        for ev in sorted(events(logdir, "writer-*.log"), key=lambda ev: float(ev["ts"])):
            ids = {block_id(t) for t in ev.get("ids", ())}
            if ev["t"] == "W":
                self.attempted |= ids
            elif ev["t"] == "A":
                self.acked |= ids
                self.order.update(dict.fromkeys(sorted(ids)))
                self.writes += 1
            elif ev["t"] == "R":
                self.reopens += 1
            elif ev["t"] == "E":
                self.errors.append(f"round {ev['r']} writer: {ev['error']}")
        intents: dict[str, tuple[int, set[BlockId]]] = {}
        for ev in [*events(logdir, "deleter-*.log"), *events(logdir, "gc-*.log")]:
            if ev["t"] == "I":
                intents[ev["tag"]] = (ev["r"], {block_id(t) for t in ev["ids"]})
            elif ev["t"] == "D":
                intents.pop(ev["tag"], None)
                self.deleted |= {block_id(t) for t in ev["ids"]}
                self.deletes += 1
            elif ev["t"] == "M":
                self.maintains += 1
            elif ev["t"] == "E":
                self.errors.append(f"round {ev['r']} deleter/gc: {ev['error']}")
            self._repair_event(ev)
        for r, ids in intents.values():
            if r == rnd:
                self.uncertain |= ids
        self.reclaimed = 0  # nvme: segments compact() made go away; fs: objects compacted or collected
        for path in logdir.glob("gc-*.log"):  # the fs tier's counters, per process: its last M line has them
            last = [ev for ev in read_events(path) if ev["t"] == "M"][-1:]
            self.reclaimed += sum(ev["compactions"] + ev["collected"] for ev in last)
        for ev in [*read_events(logdir / "compactor.log"), *read_events(logdir / "repairer.log")]:
            self.compactions += ev["t"] == "C"
            self.reclaimed += ev.get("gone", 0)
            if ev["t"] == "E":
                self.errors.append(f"round {ev['r']}: {ev['error']}")
            self._repair_event(ev)
        verdicts = list(read_events(logdir / "checker.log"))
        self.judged = {
            t: {block_id(i) for ev in verdicts if ev["t"] == t for i in ev["ids"]} for t in (*FINDINGS, "absent")
        }
        self.absent = self.deleted | self.judged["absent"]
        self.present = self.acked - self.absent - self.uncertain - self.judged["lost"] - self.judged["wrong"]

    def ops(self) -> dict[str, int]:
        """What the round's processes did, all rounds so far (from their logs)."""
        return {
            "writes": self.writes,
            "reopens": self.reopens,
            "deletes": self.deletes,
            "compactions": self.compactions,
            "repairs": self.repairs,
            "maintains": self.maintains,
            "reclaimed": self.reclaimed,
        }

    def _repair_event(self, ev: dict[str, Any]) -> None:
        if ev["t"] == "V":
            self.repairs += 1
            if not ev["ok"]:
                self.alarms.append(f"round {ev['r']} verify --repair ({ev['via']}): {ev['problems']}")


FINDINGS = ("lost", "wrong", "resurrected", "corrupt", "unknown")


def check(spec: Spec, logdir: Path, rnd: int, out: Path, verify: bool) -> None:
    """Judge the tier after round ``rnd``: ``verify()`` (no repair) must be clean; every
    acknowledged, undeleted block must read back byte-exact (else lost); a deleted one must be
    missing (else resurrected); whatever else the tier serves must have the bytes of its id (else
    wrong) and pass its checksum (else corrupt); the tier's index holds only ids someone wrote
    (else unknown). Writes the round's findings to ``out`` and its verdicts to ``checker.log``
    (a block is reported once per finding). ``verify``: run ``verify()`` this round (the reads
    check every record too; verify also counts what no read names, like torn files)."""
    hist = History(logdir, rnd)
    tier = open_tier(spec)
    try:
        report = tier.verify(repair=False) if verify else None
        order = _stored_ids(tier)  # read in the order of the data: long runs, few reads
        stored = set(order)
        rest = (hist.present | hist.absent | hist.uncertain | hist.attempted) - stored
        found: dict[str, list[str]] = {what: [] for what in FINDINGS}
        absent_now: list[BlockId] = []
        checked = 0
        for bid, status, data in read_blocks(tier, order + sorted(rest)):
            for what, why in _judge(hist, bid, status, data, stored=bid in stored):
                if bid not in hist.judged[what]:
                    found[what].append(f"{id_text(bid)}: {why}")
            checked += bid in hist.present
            if bid in hist.uncertain and status is ReadStatus.MISSING:
                absent_now.append(bid)
        log = Log(logdir / "checker.log")
        log.event("absent", r=rnd, ids=[id_text(b) for b in absent_now])
        for what, items in found.items():
            log.event(what, r=rnd, ids=[item.split(":")[0] for item in items])
        deletable = (hist.present | hist.uncertain) - set(absent_now)
        (logdir / "deletable.txt").write_text("\n".join(id_text(b) for b in hist.order if b in deletable))
        res = {
            "round": rnd,
            **found,
            "verify_ok": report is None or report.ok,
            "verify": None if report is None else report.to_dict(),
            "checked": checked,
            "acked": len(hist.acked),
            "deleted": len(hist.absent),
            "stored": len(order),
            "ops": hist.ops(),
            "alarms": hist.alarms,
            "errors": hist.errors,
        }
    finally:
        tier.close()
    out.write_text(json.dumps(res))


def _judge(
    hist: History, bid: BlockId, status: ReadStatus, data: np.ndarray, stored: bool
) -> Iterator[tuple[str, str]]:
    """The findings about one block read back (``stored``: the tier's own index lists it)."""
    if status is ReadStatus.OK and not np.array_equal(data, expected(bid)):
        yield "wrong", f"read OK with {whose(data)}"
    if status is ReadStatus.CORRUPT:
        yield "corrupt", "failed its checksum"
    if bid in hist.present and status is not ReadStatus.OK:
        yield "lost", f"acknowledged, not deleted, read {status.value}"
    if bid in hist.absent and status is ReadStatus.OK:
        yield "resurrected", "deleted (the delete returned), read OK"
    if stored and bid not in hist.attempted:
        yield "unknown", "in the index, never written"


def _stored_ids(tier: Tier) -> list[BlockId]:
    """Every block the tier's own index holds (all writers), in the order of their records."""
    if indexed(tier):
        return [bid for bid, _ in tier.records()]
    return [bid for bid, _ in tier.scan()]


# --------------------------------------------------------------------------- the zygote


def run_role(cmd: dict[str, Any]) -> None:
    spec, logdir, rnd = cmd["spec"], Path(cmd["logdir"]), cmd["round"]
    rng = random.Random(cmd["seed"])
    role = cmd["role"]
    if role == "writer":
        writer(spec, logdir, rnd, cmd["who"], rng, cmd["max_batches"], None)
    elif role == "reopener":
        writer(spec, logdir, rnd, cmd["who"], rng, cmd["max_batches"], cmd["reopen_s"])
    elif role == "compactor":
        compactor(spec, logdir, rnd, rng)
    elif role == "repairer":
        repairer(spec, logdir, rnd, rng)
    elif role == "deleter":
        deleter(spec, logdir, rnd, rng, cmd["live_target"])
    elif role == "gc":
        gc(spec, logdir, rnd, rng, cmd["live_target"])
    elif role == "checker":
        check(spec, logdir, rnd, Path(cmd["out"]), cmd["verify"])
    else:
        raise ValueError(f"unknown role {role!r}")


def _child(cmd: dict[str, Any]) -> int:
    global _READY_FD
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    _READY_FD = os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    err = os.open(cmd["stderr"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(err, 1)
    os.dup2(err, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", force=True)
    try:
        run_role(cmd)
    except BaseException:
        traceback.print_exc()
        return 3
    return 0


def zygote(lines: Iterable[bytes]) -> None:
    """Fork a child per ``spawn`` request; reap one per ``wait``; replies are JSON lines on stdout."""

    def reply(**fields: Any) -> None:
        os.write(1, (json.dumps(fields) + "\n").encode())

    for kind in ("nvme", "fs"):  # the registry imports tiers lazily: import them once, here
        TIERS.get(kind)
    gds_available()
    with contextlib.suppress(ImportError):
        import s3fs  # noqa: F401
    for line in lines:
        cmd = json.loads(line)
        if cmd["op"] == "spawn":
            pid = os.fork()
            if pid == 0:
                code = 3
                with contextlib.suppress(BaseException):
                    code = _child(cmd)
                os._exit(code)
            reply(pid=pid)
        elif cmd["op"] == "wait":
            _, status = os.waitpid(cmd["pid"], 0)
            reply(
                pid=cmd["pid"],
                signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                code=os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            )
        elif cmd["op"] == "quit":
            return


if __name__ == "__main__":
    if sys.argv[1:] != ["zygote"]:
        sys.exit("usage: crash_workers.py zygote")
    zygote(iter(sys.stdin.buffer.readline, b""))
