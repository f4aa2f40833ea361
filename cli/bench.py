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
def bench(json_out: str | None, quick: bool, directory: str | None) -> None:
    """Measure tier bandwidth and lookup cost as ratios against baselines from the same run."""
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
