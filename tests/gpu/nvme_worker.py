"""The nvme tier with buffers on a device: write, read back into the device and the host, reopen,
corrupt one record on disk. Byte-exact by xxh3 checksums; counts the reads kvikio served.

Run in-process by test_gpu_nvme.py, and as ``python nvme_worker.py ROOT`` in a process of its own
per kvikio mode (``KVIKIO_COMPAT_MODE`` is read once, when kvikio starts): it prints
``probe-ok`` once kvikio read a file into CUDA memory, then one JSON line of results.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: the tests directory holds ``gpu`` and ``conformance``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conformance import TierFactory, raw_block_keys

from gpu.helpers import device_bytes, items_on, on_device, wrong_blocks
from kvstrata.core.layout import KVLayout, uniform_layout
from kvstrata.tiers import BlockId, ReadStatus
from kvstrata.tiers.nvme import reader
from kvstrata.tiers.records import block_key


def nvme_layout() -> KVLayout:
    """Two layers of 64 KiB layer-blocks (Llama-3-8B's shape): reads GDS serves whole pages of."""
    return uniform_layout("gpu-nvme", num_layers=2, num_kv_heads=8, head_dim=128, block_size=16)


@contextmanager
def counting_gds_reads() -> Iterator[list[int]]:
    """Count the records :func:`kvstrata.tiers.nvme.reader._gds_read` was asked for."""
    count = [0]
    real = reader._gds_read

    def counted(path: str, items: list) -> list[ReadStatus]:
        count[0] += len(items)
        return real(path, items)

    reader._gds_read = counted  # type: ignore[assignment]
    try:
        yield count
    finally:
        reader._gds_read = real  # type: ignore[assignment]


def round_trip(root: Path, device: str) -> dict[str, Any]:
    """Everything the tests assert, asserted here; returns what was seen."""
    layout = nvme_layout()
    factory = TierFactory("nvme", {"path": str(root), "direct_io": "auto"}, layout)
    ids = [(k, layer) for k in raw_block_keys(8, seed=3) for layer in range(layout.num_layers)]
    seen: dict[str, Any] = {"device": device, "kvikio_compat_mode": os.environ.get("KVIKIO_COMPAT_MODE")}
    try:
        tier = factory.make(64 * 1024**2)
        seen["gpu_direct"] = bool(tier.capabilities.gpu_direct)
        seen["direct_io"] = bool(tier.capabilities.direct_io)
        assert tier.write(items_on(layout, ids, device)) == [True] * len(ids)
        with counting_gds_reads() as gds:
            for where in dict.fromkeys([device, "cpu"]):
                bufs = [on_device(layout, layer, where) for _, layer in ids]
                assert tier.read(list(zip(ids, bufs, strict=True))) == [ReadStatus.OK] * len(ids)
                assert wrong_blocks(layout, ids, bufs) == [], f"wrong bytes read into {where}"
            tier = factory.reopen(tier)
            bufs = [on_device(layout, layer, device) for _, layer in ids]
            assert tier.read(list(zip(ids, bufs, strict=True))) == [ReadStatus.OK] * len(ids)
            assert wrong_blocks(layout, ids, bufs) == [], "wrong bytes after a reopen"
            victim = ids[5]
            corrupt_one(tier, victim)
            bufs = [on_device(layout, layer, device) for _, layer in ids]
            statuses = tier.read(list(zip(ids, bufs, strict=True)))
            assert statuses[5] is ReadStatus.CORRUPT, statuses[5]
            assert statuses[:5] + statuses[6:] == [ReadStatus.OK] * (len(ids) - 1)
            assert wrong_blocks(layout, ids[:5] + ids[6:], bufs[:5] + bufs[6:]) == []
            assert tier.stats()["checksum_failures"] == 1  # type: ignore[attr-defined]
            again = on_device(layout, victim[1], device)
            assert tier.read([(victim, again)]) == [ReadStatus.MISSING]  # dropped from the index
            assert not device_bytes(again).any()
        seen["gds_reads"] = gds[0]
        if device == "cuda" and seen["gpu_direct"]:
            assert gds[0] == 3 * len(ids), (
                f"kvikio served {gds[0]} records"
            )  # 3 device reads; the dropped one is not read
        else:
            assert gds[0] == 0
    finally:
        factory.close_all()
    return seen


def corrupt_one(tier: Any, bid: BlockId) -> None:
    """Flip one payload byte of ``bid``'s record in its segment file."""
    loc = tier._lookup([block_key(bid)])[0]
    with open(tier._segment_path(loc.seg), "r+b") as f:
        f.seek(loc.offset + loc.length // 2)
        byte = f.read(1)
        f.seek(loc.offset + loc.length // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())


def probe(root: Path) -> None:
    """Read a 64 KiB file into CUDA memory with kvikio itself (raises where kvikio cannot)."""
    import kvikio

    path = root / "probe.bin"
    root.mkdir(parents=True, exist_ok=True)
    data = os.urandom(65536)
    path.write_bytes(data)
    dst = torch.zeros(65536, dtype=torch.uint8, device="cuda")
    with kvikio.CuFile(str(path), "r") as f:
        assert f.read(dst) == 65536
    assert bytes(dst.cpu().numpy()) == data


def main() -> None:
    root = Path(sys.argv[1])
    probe(root / "probe")
    print("probe-ok", flush=True)
    print(json.dumps(round_trip(root / "tier", "cuda")), flush=True)


if __name__ == "__main__":
    main()
