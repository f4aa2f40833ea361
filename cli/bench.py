"""``kvstrata bench``: tier bandwidth and lookup cost as ratios against same-run baselines;
``--scaling``: how they scale with batch, block, prompt, index and trace sizes (tables and a PNG)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click
from rich.table import Table

from kvstrata.cli.common import console, out, output_dir, output_file, write_json, writing

if TYPE_CHECKING:
    from kvstrata.workload.scaling import Curve

SCALING_PNG = "kvstrata-scaling.png"


@click.command()
@click.option(
    "--json",
    "json_out",
    type=click.Path(dir_okay=False, allow_dash=True),
    callback=output_file,
    help="Write the figures here.",
)
@click.option("--quick", is_flag=True, help="Smaller batches (64 keys) and fewer rounds; with --scaling, fewer points.")
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
@click.option("--scaling", is_flag=True, help="Measure the scaling curves instead (tables and a PNG).")
@click.option(
    "--plot",
    "plot_out",
    type=click.Path(dir_okay=False),
    callback=output_file,
    help=f"With --scaling: where the PNG goes (default {SCALING_PNG}).",
)
def bench(
    json_out: str | None, quick: bool, directory: str | None, device: str, scaling: bool, plot_out: str | None
) -> None:
    """Measure tier bandwidth and lookup cost as ratios against baselines from the same run."""
    if device == "cuda":
        _bench_cuda(json_out, quick, directory)
        return
    if scaling:
        _scaling(json_out, quick, directory, plot_out or SCALING_PNG)
        return
    from kvstrata.workload.bench import run_all

    console.print("benchmarking (DRAM at 1 KiB, 64 KiB and 1 MiB layer-blocks; NVMe; hash + lookup)...")
    res = run_all(quick=quick, directory=directory)
    out.print(_figures_table(res))
    write_json(json_out, res)


def _figures_table(res: dict[str, Any]) -> Table:
    path = f"{res['code_path']} path: {res['code_path_reason']}" if "code_path" in res else "?"
    table = Table(title=f"kvstrata bench ({path}; ratio = kvstrata / baseline, same run; medians \\[range] of rounds)")
    for col in ("figure", "kvstrata", "baseline", "ratio", "vs numpy copies", "target"):
        table.add_column(col)
    rows = [*res["dram_by_layer_bytes"].items(), *res.get("dram_2threads_by_layer_bytes", {}).items()]
    for size, d in rows:
        threads = d.get("copy_threads")
        how = "" if threads is None else f", {threads} copy thread" + ("s" if threads > 1 else "")
        label = f"{int(size) // 1024} KiB x {d['keys']} keys{how}"
        for who, op in (("engine", "store"), ("engine", "load"), ("tier", "store"), ("tier", "load")):
            g = d["gbps"][f"{who}_{op}"]
            one, two = d[f"{who}_{op}_vs_1thread"], d[f"{who}_{op}_vs_2thread"]
            np1, np2 = d[f"{who}_{op}_vs_numpy_1thread"], d[f"{who}_{op}_vs_numpy_2thread"]
            kinds = "numpy or streaming" if d.get("streaming_copies") else "numpy"
            table.add_row(
                f"dram {op}, {label}" + ("" if who == "engine" else " (tier alone)"),
                f"{g['median']:.2f} GB/s",
                f"{d['best_1thread_gbps']['median']:.2f} / {d['best_2thread_gbps']['median']:.2f} GB/s "
                f"best 1- / 2-thread copy ({kinds})",
                f"{one['median']:.2f}x / {two['median']:.2f}x [{two['min']:.2f}-{two['max']:.2f}]",
                f"{np1['median']:.2f}x / {np2['median']:.2f}x",
                ">= 0.9x",
            )
    n = res["nvme"]
    raw = "O_DIRECT" if n["raw_o_direct"] else "buffered, cache dropped"
    label = f"{n['keys']} keys x 32 x 64 KiB"
    for who, op, mine, base in (
        ("tier", "write", "tier_write", "raw_write"),
        ("tier", "write_aligned", "tier_write_aligned", "raw_write"),
        ("tier", "read", "tier_read", "raw_read"),
        ("tier", "read_aligned", "tier_read_aligned", "raw_read_aligned"),
        ("engine", "store", "engine_store", "raw_write"),
        ("engine", "load", "engine_load", "raw_read"),
        ("engine", "load_layerwise", "engine_load_layerwise", "raw_read"),
    ):
        if mine not in n["gbps"]:
            continue
        r = n[f"{op}_vs_raw"] if who == "tier" else n[f"engine_{op}_vs_raw"]
        what = op.replace("_aligned", ", page-aligned caller memory, zero copy")
        what = what.replace("_layerwise", ", layer by layer (the connector's)")
        table.add_row(
            f"nvme {what}, {label}" + (" (tier alone)" if who == "tier" else ""),
            f"{n['gbps'][mine]['median']:.2f} GB/s",
            f"{n['gbps'][base]['median']:.2f} GB/s raw {raw}, depth {n['queue_depth']}",
            f"{r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}]",
            "",
            ">= 0.9x",
        )
    lk = res["lookup"]
    table.add_row("hash+lookup 128K tokens, uniform", f"{lk['lookup_128k_ms']:.2f} ms", "", "", "", "<= 0.5 ms")
    table.add_row(
        "hash+lookup 128K tokens, per-layer", f"{lk['per_layer_lookup_128k_ms']:.2f} ms", "", "", "", "<= 1 ms"
    )
    table.add_row(
        "hash vs vLLM sha256",
        f"{lk['hash_128k_ms']:.2f} ms",
        f"{lk['vllm_sha256_hash_128k_ms']:.2f} ms",
        f"{lk['hash_speedup_vs_sha256']:.1f}x faster",
        "",
        "",
    )
    return table


def _scaling(json_out: str | None, quick: bool, directory: str | None, plot_out: str) -> None:
    from kvstrata.workload.scaling import render_png, run_scaling

    console.print("measuring scaling curves" + (" (quick)" if quick else "") + "...")
    res = run_scaling(quick=quick, directory=directory, more=[_planner_curve])
    for curve in res["curves"]:
        out.print(_curve_table(curve))
    with writing(plot_out):
        render_png(res, plot_out)
    console.print(f"plot: {plot_out}")
    res["plot"] = plot_out
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


def _curve_table(curve: dict[str, Any]) -> Table:
    slopes = ", ".join(f"{name} {s:+.2f}" for name, s in curve["slopes"].items())
    title = f"{curve['name']}: expect {curve['expect']}; log-log slope of the last points: {slopes}"
    table = Table(title=title, caption=curve.get("note") or None)
    table.add_column(curve["x_label"])
    for name in curve["series"]:
        table.add_column(f"{name} ({curve['y_label']})")
    for i, x in enumerate(curve["x"]):
        table.add_row(f"{x:,.0f}", *(f"{ys[i]:.3g}" for ys in curve["series"].values()))
    return table


def _planner_curve(quick: bool) -> Curve:
    """``kvstrata plan`` time against the length of a synthetic agentic trace (tiny model)."""
    import time

    from kvstrata.planner.command import PlanRequest, run_plan
    from kvstrata.workload.scaling import Curve

    sessions, turns, points = ([1, 2, 4], 4, 4) if quick else ([2, 4, 8, 16, 32], 8, 10)
    rows = []
    for s in sessions:
        req = PlanRequest(
            synth=f"sessions={s},turns={turns},shared-tokens=4000,first-turn-tokens=2000,turn-tokens=512",
            model="tiny",
            tiers="hbm=16MiB,dram=64MiB,nvme=1GiB",
            sweep_points=points,
        )
        t0 = time.perf_counter()
        plan = run_plan(req)
        rows.append({"sessions": s, "requests": plan.sim.requests, "seconds": time.perf_counter() - t0})
    x = [float(r["requests"]) for r in rows]
    series = {"kvstrata plan": [r["seconds"] for r in rows]}
    return Curve("planner time against trace length", "requests in the trace", x, "s", series, "linear", points=rows)
