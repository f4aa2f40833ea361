"""``kvstrata bench``: tier bandwidth and lookup cost as ratios against same-run baselines."""

from __future__ import annotations

import click
from rich.table import Table

from kvstrata.cli.common import console, out, output_dir, output_file, write_json


@click.command()
@click.option(
    "--json",
    "json_out",
    type=click.Path(dir_okay=False, allow_dash=True),
    callback=output_file,
    help="Write the figures here.",
)
@click.option("--quick", is_flag=True, help="Smaller batches (64 keys) and fewer repeats.")
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False),
    callback=output_dir,
    help="Directory for the NVMe benchmark.",
)
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="cuda: the GPU paths (HBM <-> pinned DRAM, NVMe -> HBM through kvikio) instead.",
)
def bench(json_out: str | None, quick: bool, directory: str | None, device: str) -> None:
    """Measure tier bandwidth and lookup cost as ratios against baselines from the same run."""
    if device == "cuda":
        _bench_cuda(json_out, quick, directory)
        return
    from kvstrata.workload.bench import run_all

    console.print("benchmarking (Llama-3-8B-like layout, 64 KiB layer-blocks)...")
    res = run_all(quick=quick, directory=directory)
    table = Table(title="kvstrata bench (ratio = kvstrata / baseline, same run)")
    for col in ("figure", "kvstrata", "baseline", "ratio", "target"):
        table.add_column(col)
    d, n, lk = res["dram"], res["nvme"], res["lookup"]
    table.add_row(
        "dram store",
        f"{d['store_gbps']:.2f} GB/s",
        f"{d['numpy_copy_gbps']:.2f} GB/s numpy",
        f"{d['store_ratio']:.2f}x",
        ">= 0.8x",
    )
    table.add_row(
        "dram load",
        f"{d['load_gbps']:.2f} GB/s",
        f"{d['numpy_copy_gbps']:.2f} GB/s numpy",
        f"{d['load_ratio']:.2f}x",
        ">= 0.8x",
    )
    raw = "O_DIRECT" if n["raw_o_direct"] else "buffered"
    table.add_row(
        "nvme write",
        f"{n['write_gbps']:.2f} GB/s",
        f"{n['raw_write_gbps']:.2f} GB/s raw {raw}",
        f"{n['write_ratio']:.2f}x",
        ">= 0.8x",
    )
    table.add_row(
        "nvme read",
        f"{n['read_gbps']:.2f} GB/s",
        f"{n['raw_read_gbps']:.2f} GB/s raw {raw}",
        f"{n['read_ratio']:.2f}x",
        ">= 0.8x",
    )
    table.add_row("hash+lookup 128K tokens", f"{lk['lookup_128k_ms']:.2f} ms", "", "", "<= 2 ms")
    table.add_row(
        "hash vs vLLM sha256",
        f"{lk['hash_128k_ms']:.2f} ms",
        f"{lk['vllm_sha256_hash_128k_ms']:.2f} ms",
        f"{lk['hash_speedup_vs_sha256']:.1f}x faster",
        "",
    )
    out.print(table)
    write_json(json_out, res)


def _bench_cuda(json_out: str | None, quick: bool, directory: str | None) -> None:
    from kvstrata.workload.gpu_bench import require_cuda, run_gpu

    require_cuda()  # a one-line error (exit 2) where there is no CUDA
    console.print("benchmarking the GPU paths (Llama-3-8B-like layout, 64 KiB layer-blocks)...")
    res = run_gpu(quick=quick, directory=directory)
    table = Table(title=f"kvstrata bench --device cuda on {res['device']} (ratio = kvstrata / baseline)")
    for col in ("figure", "kvstrata", "baseline", "ratio", "target"):
        table.add_column(col)
    m, n = res["hbm_dram"], res["nvme_hbm"]
    table.add_row(
        "HBM -> pinned DRAM (store)",
        f"{m['store_gbps']:.2f} GB/s",
        f"{m['torch_d2h_gbps']:.2f} GB/s torch",
        f"{m['store_ratio']:.2f}x",
        ">= 0.9x",
    )
    table.add_row(
        "pinned DRAM -> HBM (load)",
        f"{m['load_gbps']:.2f} GB/s",
        f"{m['torch_h2d_gbps']:.2f} GB/s torch",
        f"{m['load_ratio']:.2f}x",
        ">= 0.9x",
    )
    if "skipped" in n:
        table.add_row("NVMe -> HBM", "skipped", n["skipped"], "", ">= 0.9x")
    else:
        mode = "GDS" if n["kvikio_compat_mode"].upper() not in ("ON", "TRUE", "YES", "1") else "compat"
        table.add_row(
            f"NVMe -> HBM (kvikio, {mode})",
            f"{n['load_gbps']:.2f} GB/s",
            f"{n['kvikio_raw_read_gbps']:.2f} GB/s kvikio raw",
            f"{n['load_ratio']:.2f}x",
            ">= 0.9x",
        )
    out.print(table)
    write_json(json_out, res)
