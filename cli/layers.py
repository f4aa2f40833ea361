"""``kvstrata layers``: bytes stored per tier under uniform and per-layer policies."""

from __future__ import annotations

from typing import Any

import click
from rich.table import Table

from kvstrata.cli.common import out, output_file, write_json
from kvstrata.units import format_size


@click.command("layers")
@click.option("--model", "models_", multiple=True, required=True, help="Catalog model (repeat for several).")
@click.option(
    "--context", default=100_000, show_default=True, type=click.IntRange(30_000, 1 << 24), help="Context tokens."
)
@click.option("--tp", default=1, show_default=True, type=click.IntRange(1, 1024), help="Tensor-parallel ranks.")
@click.option("--config", type=click.Path(), help="kvstrata config: its tiers and [[policies.layers]] rules.")
@click.option("--tiers", "tier_names", default="dram,nvme,fs", show_default=True, help="Tier names (no --config).")
@click.option("--rule", "rules_", multiple=True, help="A layer rule MATCH=TIER[+TIER...], e.g. 'sliding=dram'.")
@click.option(
    "--json",
    "json_out",
    type=click.Path(dir_okay=False, allow_dash=True),
    callback=output_file,
    help="Write the rows here.",
)
def layers(
    models_: tuple[str, ...],
    context: int,
    tp: int,
    config: str | None,
    tier_names: str,
    rules_: tuple[str, ...],
    json_out: str | None,
) -> None:
    """Bytes stored per tier for one agentic session of CONTEXT tokens: uniform vs per-layer policies.

    The session is the agentic synthetic trace's (20K shared + 10K first turn, then 2,048 + 900
    tokens a turn); every tier is unbounded and written through, so each holds what its policy
    lets it, and every row restores the same prefixes (its token hit rate is shown)."""
    from kvstrata.workload.layer_bytes import compare_policies

    rules: Any = None
    tiers = [(name.strip(), name.strip()) for name in tier_names.split(",") if name.strip()]
    if config is None:
        from kvstrata.tiers import TIERS

        if not tiers:
            raise click.BadParameter(f"{tier_names!r} names no tier (e.g. dram,nvme,fs)", param_hint="'--tiers'")
        for _name, kind in tiers:
            TIERS.get(kind)  # an unknown kind: a clear error naming it
    else:
        from kvstrata.config import load_config

        cfg = load_config(config)
        tiers = [(t.name, t.kind) for t in cfg.tiers]
        rules = cfg.policies
    if rules_:
        rules = _layer_rules(rules_, [t for t, _ in tiers], rules)
    rows = [
        row
        for m in models_
        for row in compare_policies(m, context_tokens=context, tp_size=tp, tiers=tiers, rules=rules)
    ]
    table = Table(title=f"bytes stored per {context:,}-token context (tp {tp})")
    for col in ("model", "policy", *[t for t, _ in tiers], "total", "token hit rate"):
        table.add_column(col, justify="left" if col in ("model", "policy") else "right")
    for r in rows:
        per = r["bytes_stored"]["per_tier"]
        table.add_row(
            r["model"],
            r["policy"],
            *[format_size(per[t]) for t, _ in tiers],
            format_size(r["bytes_stored"]["total"]),
            f"{r['token_hit_rate']:.1%}",
        )
    out.print(table)
    write_json(json_out, rows)


def _layer_rules(texts: tuple[str, ...], tier_names: list[str], base: Any) -> Any:
    """``--rule MATCH=TIER+TIER`` options appended to ``base``'s rules, validated like a config."""
    from pydantic import ValidationError

    from kvstrata.config import PoliciesConfig, _format_validation_error
    from kvstrata.errors import ConfigError

    layers = [r.model_dump() for r in getattr(base, "layers", ())]
    for text in texts:
        match, sep, tiers = text.partition("=")
        names = [t.strip() for t in tiers.split("+") if t.strip()]
        if not sep or not names:
            raise ConfigError(f"--rule {text!r}: expected MATCH=TIER[+TIER...], e.g. 'sliding=dram'", field="rule")
        unknown = [t for t in names if t not in tier_names]
        if unknown:
            raise ConfigError(
                f"--rule {text!r}: tier {unknown[0]!r} is not configured (tiers: {', '.join(tier_names)})",
                field="rule",
                value=text,
            )
        layers.append({"match": match, "tiers": names})
    try:
        return PoliciesConfig.model_validate({"layers": layers})
    except ValidationError as exc:
        raise _format_validation_error(exc, "--rule") from None
