"""Parameter sweeps: ``fedmtl sweep CONFIG --set table.key=v1,v2,... [--set ...] --out DIR``.

Every ``--set`` whose value lists several comma-separated values (commas inside brackets do not
split) is swept; several swept keys run their cartesian product.  Each setting is a full run in
``DIR/<key>=<value>/``; ``DIR/sweep.json`` and ``DIR/sweep.csv`` hold the final metrics and
``DIR/sweep.png`` plots test accuracy (mean and 10th percentile over clients) against the first swept
key, as in Figure 1 of Marfoq et al. (2021).
"""

from __future__ import annotations

import csv
import itertools
from pathlib import Path
from typing import Any

from .config import ConfigError, load, parse_override
from .engine.driver import run_experiment
from .report import plot_curves, write_json


def split_top_level(text: str) -> list[str]:
    """Split at commas that are not inside brackets or quotes."""
    parts, depth, quote, cur = [], 0, "", ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
            continue
        cur += ch
    parts.append(cur.strip())
    return parts


def plan(sets: list[str]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """Fixed overrides and swept (key, [value texts]) pairs."""
    fixed, swept = [], []
    for s in sets:
        if "=" not in s:
            raise ConfigError(f"--set {s!r}: expected table.key=value")
        key, value = s.split("=", 1)
        values = split_top_level(value)
        if len(values) > 1:
            swept.append((key.strip(), values))
        else:
            fixed.append(s)
    if not swept:
        raise ConfigError("nothing to sweep: give at least one --set table.key=v1,v2,...")
    return fixed, swept


def run_sweep(config: str | Path, sets: list[str], out: str | Path, progress: bool = True) -> list[dict[str, Any]]:
    out = Path(out)
    fixed, swept = plan(sets)
    combos = list(itertools.product(*[[(k, v) for v in vals] for k, vals in swept]))
    cfgs = [load(config, fixed + [f"{k}={v}" for k, v in combo]) for combo in combos]  # validate all first
    rows = []
    for combo, cfg in zip(combos, cfgs, strict=True):
        name = ",".join(f"{k}={v}" for k, v in combo).replace("/", "_")
        has_ckpt = (out / name / "checkpoint.pt").exists()  # a finished or interrupted earlier sweep
        summary = run_experiment(cfg, out / name, resume=has_ckpt, overwrite=not has_ckpt, progress=progress).summary
        row: dict[str, Any] = {k: parse_override(f"{k}={v}")[2] for k, v in combo}
        row.update({k: v for k, v in summary["final"].items()})
        rows.append(row)
        print(name, " ".join(f"{k}={100 * summary['final'][k]:.2f}"
                             for k in ("seen_test_acc_mean", "seen_test_acc_p10") if k in summary["final"]))
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "sweep.json", {"swept": [k for k, _ in swept], "fixed": fixed, "results": rows})
    keys = list(rows[0].keys())
    with open(out / "sweep.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    first = swept[0][0]
    others = [k for k, _ in swept[1:]]
    curves: dict[str, tuple[list[float], list[float]]] = {}
    for metric, label in (("seen_test_acc_mean", "test acc (mean)"), ("seen_test_acc_p10", "test acc (10th pct)")):
        groups: dict[str, list[dict[str, Any]]] = {}
        for r in rows:
            groups.setdefault(",".join(f"{k}={r[k]}" for k in others), []).append(r)
        for gname, grows in groups.items():
            xs = [r[first] for r in grows]
            if not all(isinstance(x, int | float) for x in xs):
                xs = list(range(len(grows)))
            curves[f"{label} {gname}".strip()] = (xs, [100 * r.get(metric, float("nan")) for r in grows])
    plot_curves(out / "sweep.png", curves, "accuracy (%)", f"sweep of {first}", xlabel=first)
    return rows
