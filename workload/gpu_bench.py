"""``kvstrata bench --device cuda``: the GPU paths against plain copies of the same bytes.

* HBM <-> pinned DRAM: engine stores from CUDA tensors into a pinned ``dram`` tier and loads back
  into CUDA tensors, against ``torch`` copies of the same blocks between the same kinds of memory
  (block by block, as the engine copies them; one contiguous copy per layer is reported beside).
* NVMe -> HBM: engine loads from an ``nvme`` tier into CUDA tensors (kvikio, GDS or its
  compatibility mode), against kvikio's own read of the same segment files into CUDA memory.

Layout and batch as ``kvstrata bench`` (64 KiB layer-blocks, 32 layers); each figure is the best of
``repeats`` runs, the same treatment on both sides of every ratio.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

from kvstrata.engine.engine import Engine
from kvstrata.errors import ConfigError
from kvstrata.workload.benchkit import GB, batch, best, llama8b_layout, salted_keys

NO_CUDA = "--device cuda: CUDA is not available here (torch.cuda.is_available() is false)"


def require_cuda() -> None:
    """Raise a one-line :class:`ConfigError` where there is no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(NO_CUDA, field="device", value="cuda")


def _synced(fn: Callable[[], object]) -> Callable[[], None]:
    import torch

    def run() -> None:
        fn()
        torch.cuda.synchronize()

    return run


def bench_hbm_dram(keys: int = 256, repeats: int = 3) -> dict[str, float]:
    import torch

    layout = llama8b_layout()
    src = {layer: torch.from_numpy(a).cuda() for layer, a in batch(layout, keys, 0).items()}
    dst = {layer: torch.zeros_like(a) for layer, a in src.items()}
    host = {layer: torch.empty(a.shape, dtype=torch.uint8, pin_memory=True) for layer, a in src.items()}
    total = sum(a.numel() for a in src.values())
    pairs = [(layer, i) for layer in src for i in range(keys)]

    def d2h_blocks() -> None:
        for layer, i in pairs:
            host[layer][i].copy_(src[layer][i])

    def h2d_blocks() -> None:
        for layer, i in pairs:
            dst[layer][i].copy_(host[layer][i])

    def d2h_contiguous() -> None:
        for layer in src:
            host[layer].copy_(src[layer])

    d2h_s = best(_synced(d2h_blocks), repeats)
    h2d_s = best(_synced(h2d_blocks), repeats)
    contiguous_s = best(_synced(d2h_contiguous), repeats)
    cfg = {
        "engine": {"max_pending_bytes": 4 * total},
        "tiers": [{"name": "dram", "capacity": 2 * total, "pin_memory": "on", "eviction": "lru"}],
    }
    with Engine(cfg, layout=layout) as engine:
        rounds = [salted_keys(engine, keys, r) for r in range(repeats)]
        it = iter(rounds)
        store_s = best(_synced(lambda: engine.store_sync(next(it), src)), repeats)
        for layer in dst:
            dst[layer].zero_()
        load_s = best(_synced(lambda: engine.load_sync(rounds[-1], dst)), repeats)
        ok = all(torch.equal(dst[layer], src[layer]) for layer in src)
    return {
        "bytes": total,
        "torch_d2h_gbps": total / d2h_s / GB,
        "torch_h2d_gbps": total / h2d_s / GB,
        "torch_d2h_contiguous_gbps": total / contiguous_s / GB,
        "store_gbps": total / store_s / GB,
        "load_gbps": total / load_s / GB,
        "store_ratio": d2h_s / store_s,
        "load_ratio": h2d_s / load_s,
        "bytes_ok": float(ok),
    }


def bench_nvme_hbm(keys: int = 256, repeats: int = 3, directory: str | None = None) -> dict[str, Any]:
    if importlib.util.find_spec("kvikio") is None:
        return {"skipped": "kvikio is not installed (kvstrata[gds]; on the GPU machine: make gpu-wheels)"}
    import kvikio
    import torch

    layout = llama8b_layout()
    src = batch(layout, keys, 1)
    dst = {layer: torch.zeros(a.shape, dtype=torch.uint8, device="cuda") for layer, a in src.items()}
    total = sum(a.nbytes for a in src.values())
    with tempfile.TemporaryDirectory(prefix="kvstrata-gpu-bench-", dir=directory) as tmp:
        tier = {"name": "nvme", "capacity": 4 * total, "path": os.path.join(tmp, "nvme"), "direct_io": "auto"}
        with Engine({"engine": {"max_pending_bytes": 4 * total}, "tiers": [tier]}, layout=layout) as engine:
            keys_ = salted_keys(engine, keys, 0)
            engine.store_sync(keys_, src)
            engine.flush()
            nvme = engine.tiers[0].tier
            load_s = best(_synced(lambda: engine.load_sync(keys_, dst)), repeats)
            ok = all(torch.equal(dst[layer].cpu(), torch.from_numpy(src[layer])) for layer in src)
            seg_dir = nvme.segment_dir  # type: ignore[attr-defined]
            files = [os.path.join(seg_dir, f) for f in sorted(os.listdir(seg_dir))]
            files = [f for f in files if os.path.isfile(f) and os.path.getsize(f) > 0]
            file_bytes = sum(os.path.getsize(f) for f in files)
            raw = torch.empty(max(os.path.getsize(f) for f in files), dtype=torch.uint8, device="cuda")

            def kvikio_raw() -> None:
                for f in files:
                    with kvikio.CuFile(f, "r") as handle:
                        handle.read(raw[: os.path.getsize(f)])

            raw_s = best(_synced(kvikio_raw), repeats)
            gpu_direct = bool(nvme.capabilities.gpu_direct)
            direct_io = bool(nvme.capabilities.direct_io)
    raw_gbps = file_bytes / raw_s / GB
    load_gbps = total / load_s / GB
    return {
        "bytes": total,
        "file_bytes": file_bytes,
        "gpu_direct": gpu_direct,
        "direct_io": direct_io,
        "kvikio_compat_mode": os.environ.get("KVIKIO_COMPAT_MODE", "AUTO"),
        "load_gbps": load_gbps,
        "kvikio_raw_read_gbps": raw_gbps,
        "load_ratio": load_gbps / raw_gbps,
        "bytes_ok": float(ok),
    }


def run_gpu(quick: bool = False, directory: str | None = None) -> dict[str, Any]:
    require_cuda()
    import torch

    keys, repeats = (64, 2) if quick else (256, 3)
    t0 = time.perf_counter()
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "hbm_dram": bench_hbm_dram(keys, repeats),
        "nvme_hbm": bench_nvme_hbm(keys, repeats, directory),
    }
    res["targets"] = {"hbm_dram_ratio": 0.9, "nvme_hbm_ratio": 0.9}
    res["seconds"] = time.perf_counter() - t0
    return res
