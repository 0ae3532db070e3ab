"""Parameter sweeps: ``fedmtl sweep CONFIG --set table.key=v1,v2,... [--set ...] --out DIR``.

Every ``--set`` whose value lists several comma-separated values (commas inside brackets do not
split) is swept; several swept keys run their cartesian product.  Each setting is a full run in
``DIR/<key>=<value>/``; ``DIR/sweep.json`` and ``DIR/sweep.csv`` hold the final metrics and
``DIR/sweep.png`` plots test accuracy (mean and 10th percentile over clients) against the first swept
key, as in Figure 1 of Marfoq et al. (2021): strings on a categorical axis, numbers spanning two decades or
more on a log axis (symlog with 0), and with ``--seeds`` / ``run.seeds`` every setting runs every seed and
the plot shows the seeds' mean with a +-1 std band.  A folder that holds files is refused unless ``--resume``
(continue an interrupted sweep) or ``--overwrite`` (start every setting over).  Before the first run: a key given
twice or a value listed twice is refused, every setting's config is validated (and, where a model or data key is
swept, its data and model are built), and ``sweep.json`` records the grid, which ``--resume`` must repeat.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ConfigError, load, parse_override
from ..engine.evaluation import SEEN_TEST_ACC_MEAN, SEEN_TEST_ACC_P10
from ..files import atomic, read_json
from ..machine import torch_device
from ..schema import shown
from .driver import run_experiment
from .report import save_figure, style, write_json

#: at most this many settings (the product of the swept values) in one sweep
MAX_SETTINGS = 1000
#: the largest sweep.json read back (a plan to compare on --resume)
MAX_SWEEP_JSON_BYTES = 1 << 24


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
    """Fixed overrides and swept (key, [value texts]) pairs.  A key given twice (its settings would overlap or one
    would drop the other) and a swept key listing a value twice (one setting run twice) are refused."""
    fixed, swept, seen = [], [], set()
    for s in sets:
        if "=" not in s:
            raise ConfigError(f"--set {shown(s)}: expected table.key=value")
        key, value = s.split("=", 1)
        key = key.strip()
        if key in seen:
            raise ConfigError(f"--set {shown(key)}: given twice" + (" (--seeds sets run.seeds)" if key == "run.seeds"
                              else "") + f"; list all its values in one --set {key}=v1,v2,...")
        seen.add(key)
        values = split_top_level(value)
        if len(values) > 1:
            parsed: list[Any] = []
            for v in values:
                p = parse_override(f"{key}={v}")[2]
                if any(type(q) is type(p) and q == p for q in parsed):
                    raise ConfigError(f"--set {shown(key)}: the value {shown(v)} is listed twice; list each value once")
                parsed.append(p)
            swept.append((key, values))
        else:
            fixed.append(s)
    if not swept:
        raise ConfigError("nothing to sweep: give at least one --set table.key=v1,v2,...")
    return fixed, swept


def plan_record(fixed: list[str], swept: list[tuple[str, list[str]]]) -> dict[str, Any]:
    """What ``sweep.json`` records of a sweep's plan from its start: the swept keys, each with its values as
    written, and the fixed overrides."""
    return {"swept": [k for k, _ in swept], "grid": [[k, list(vals)] for k, vals in swept], "fixed": list(fixed)}


def _shown_plan(r: dict[str, Any]) -> str:
    """A plan as the --set options that give it (a plan that recorded only its swept keys: their values as ...)."""
    grid = r.get("grid") or [[k, ["..."]] for k in r.get("swept") or []]
    return " ".join([f"--set {k}={','.join(map(str, v))}" for k, v in grid]
                    + [f"--set {f}" for f in r.get("fixed") or []])


def check_plan(out: Path, record: dict[str, Any]) -> bool:
    """Refuse to continue (``--resume``) the sweep in ``out`` with another plan: its ``sweep.json`` must record the
    same grid and fixed overrides (one written before the grid was recorded: the same swept keys and fixed
    overrides).  Whether ``out`` holds a plan."""
    path = out / "sweep.json"
    if not path.is_file():
        return False
    old = read_json(path, MAX_SWEEP_JSON_BYTES, "sweep table", ConfigError)
    if not isinstance(old, dict):
        raise ConfigError(f"{path}: not a sweep table (a JSON object)")
    keys = ("grid", "fixed") if "grid" in old else ("swept", "fixed")
    if any(old.get(k) != record[k] for k in keys):
        raise ConfigError(f"{out} holds a sweep of another plan ({_shown_plan(old)}), not this one "
                          f"({_shown_plan(record)}); nothing was changed: resume it with its own --set, or choose "
                          "another out directory (--out)")
    return True


def check_builds(config: str | Path, names: list[str], cfgs: list[Any]) -> None:
    """Build every distinct data and model of the settings (a sweep of a model or data key) and refuse, before the
    first run, one the dataset or the model refuses (e.g. an image model on vector features)."""
    def key(obj: Any) -> str:
        return json.dumps(obj, sort_keys=True, default=str)

    by_data: dict[str, list[tuple[str, Any]]] = {}
    for name, cfg in zip(names, cfgs, strict=True):
        by_data.setdefault(key([cfg.data, cfg.run.val_fraction]), []).append((name, cfg))
    for group in by_data.values():
        data = _built(config, group[0][0], group[0][1].build_data)
        models: dict[str, tuple[str, Any]] = {}
        for name, cfg in group:
            models.setdefault(key(cfg.model), (name, cfg))  # each model once, named by its first setting
        for name, cfg in models.values():
            _built(config, name, cfg.build_model, data.feature_shape, data.num_classes, data.meta)


def _built(config: str | Path, name: str, build: Callable[..., Any], *args: Any) -> Any:
    """``build(*args)``, its refusal a one-line ConfigError naming the setting."""
    try:
        return build(*args)
    except ConfigError as e:
        raise ConfigError(f"{name}: {e}") from None
    except ValueError as e:  # DataError, ModelError
        raise ConfigError(f"{config}: {name}: {e}") from None


def run_sweep(config: str | Path, sets: list[str], out: str | Path, progress: bool | str = True,
              resume: bool = False, overwrite: bool = False) -> list[dict[str, Any]]:
    """Run every setting into ``out/<key>=<value>/`` and write the sweep's table and figure; its rows.  A folder that
    already holds files is refused unless ``resume`` (the same grid as the sweep there: settings with a checkpoint
    continue, finished ones are read back, the others start, over if interrupted without a checkpoint) or
    ``overwrite`` (every setting starts over)."""
    from .rundir import check_output

    out = Path(out)
    fixed, swept = plan(sets)
    count = math.prod(len(vals) for _, vals in swept)
    if count > MAX_SETTINGS:  # counted before a single setting is built or validated
        raise ConfigError(f"--set: {' x '.join(str(len(v)) for _, v in swept)} = {count} settings to sweep; a sweep "
                          f"runs at most {MAX_SETTINGS} (sweep fewer values, or split it into several sweeps)")
    combos = list(itertools.product(*[[(k, v) for v in vals] for k, vals in swept]))
    cfgs = [load(config, fixed + [f"{k}={v}" for k, v in combo]) for combo in combos]  # validate all first
    for device in sorted({c.run.device for c in cfgs}):  # and their devices: none missing halfway through
        try:
            torch_device(device)
        except ValueError as e:
            raise ConfigError(f"{config}: {e}") from None
    check_output(out, overwrite=overwrite, resume=resume)
    record = plan_record(fixed, swept)
    planned = resume and check_plan(out, record)  # --resume: the same plan, refused before anything runs
    names = [",".join(f"{k}={v}" for k, v in combo).replace("/", "_") for combo in combos]
    if any(k.startswith(("model.", "data.")) or k == "run.val_fraction" for k, _ in swept):
        check_builds(config, names, cfgs)  # every data and model the settings build, before the first run
    if not planned:  # the plan, from the start: a later --resume must give the same one
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "sweep.json", {**record, "results": []})
    rows = []
    for name, combo, cfg in zip(names, combos, cfgs, strict=True):
        row: dict[str, Any] = {k: parse_override(f"{k}={v}")[2] for k, v in combo}
        d = out / name
        if cfg.run.seeds:  # every setting with every seed: the seeds' mean, and their std for the bands
            from .seeds import run_seeds

            # resume: a setting whose seeds hold checkpoints continues (an earlier, interrupted sweep), a finished
            # one without checkpoints (run.checkpoint_every = 0) is read back, an interrupted one starts over
            has_ckpt = resume and any(d.glob("seed-*/checkpoint.pt"))
            if resume and not has_ckpt and (d / "summary.json").is_file():
                seed_final = finished(d, cfg, list(cfg.run.seeds))
            else:
                restart = resume and not has_ckpt and d.exists()
                seed_final = run_seeds(cfg, out=d, resume=has_ckpt, overwrite=overwrite or restart,
                                       progress=progress).final
            row.update({k: st["mean"] for k, st in seed_final.items()})
            row.update({f"{k}_std": st["std"] for k, st in seed_final.items()})
            final = {k: st["mean"] for k, st in seed_final.items()}
        else:
            has_ckpt = resume and (d / "checkpoint.pt").exists()  # a finished or interrupted earlier sweep
            if resume and not has_ckpt and (d / "summary.json").is_file():  # finished, run.checkpoint_every = 0
                final = finished(d, cfg, None)
            else:  # --resume: a setting interrupted without a checkpoint starts over
                restart = resume and not has_ckpt and d.exists()
                final = run_experiment(cfg, d, resume=has_ckpt, overwrite=overwrite or restart,
                                       progress=progress).summary["final"]
            row.update(final)
        rows.append(row)
        print(name, " ".join(f"{k}={100 * final[k]:.2f}" for k in (SEEN_TEST_ACC_MEAN, SEEN_TEST_ACC_P10)
                             if isinstance(final.get(k), float)))
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "sweep.json", {**record, "results": rows})
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with atomic(out / "sweep.csv") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    algs = sorted({str(c.algorithm["name"]) for c in cfgs})
    plot_sweep(out / "sweep.png", rows, [k for k, _ in swept], f"{'/'.join(algs)} on {cfgs[0].data['name']}")
    return rows


def finished(path: Path, cfg: Any, seeds: list[int] | None) -> dict[str, Any]:
    """The final metrics of the finished run in ``path`` (its ``summary.json``; with ``seeds``: per metric the
    seeds' mean and std), after checking that it ran ``cfg`` (and these seeds)."""
    from .rundir import check_resumable

    check_resumable(path, cfg.raw, seeds, True, False,
                    None if seeds is None else (lambda s: cfg.with_seed(s).raw), cfg.source)
    summary = read_json(path / "summary.json", MAX_SWEEP_JSON_BYTES, "run summary", ConfigError)
    final = summary.get("final") if isinstance(summary, dict) else None
    if not isinstance(final, dict) or (seeds is not None and not all(isinstance(v, dict) for v in final.values())):
        raise ConfigError(f"{path / 'summary.json'}: no final metrics to read back; start the setting over with "
                          "--overwrite, or choose another out directory (--out)")
    return final


def axis_kind(values: list[Any]) -> str:
    """How a swept key's values sit on an axis: "category" (any non-number), "log" (positive numbers spanning
    two decades or more), "symlog" (such numbers plus zero), else "linear"."""
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return "category"
    pos = [float(v) for v in values if v > 0]
    if len(pos) >= 2 and max(pos) / min(pos) >= 100 and all(v >= 0 for v in values):
        return "log" if len(pos) == len(values) else "symlog"
    return "linear"


def plot_sweep(path: Path, rows: list[dict[str, Any]], swept: list[str], what: str = "") -> None:
    """Test accuracy (mean and 10th percentile over clients) against the first swept key: one line per setting of
    the others for a numeric key (a band of +-1 std where the sweep ran several seeds), grouped bars with +-1 std
    error bars for a categorical one (methods, aggregators: no line joins them).  ``what``: the algorithm and
    dataset, for the title.  PNG and PDF."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first, others = swept[0], swept[1:]
    values = list(dict.fromkeys(r[first] for r in rows))
    kind = axis_kind(values)
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(",".join(f"{k}={r[k]}" for k in others), []).append(r)
    seeds = any(f"{SEEN_TEST_ACC_MEAN}_std" in r for r in rows)
    title = f"{what}: sweep of {first}" if what else f"sweep of {first}"
    metrics = ((SEEN_TEST_ACC_MEAN, "average"), (SEEN_TEST_ACC_P10, "bottom decile (p10)"))
    if kind == "category":
        from .report import plot_bars

        panel: dict[str, dict[str, tuple[float, float | None]]] = {}
        for metric, label in metrics:
            for gname, grows in groups.items():
                for r in grows:
                    sd = r.get(f"{metric}_std")
                    panel.setdefault(str(r[first]), {})[f"{label} {gname}".strip()] = (
                        100 * r.get(metric, float("nan")), None if sd is None else 100 * sd)
        plot_bars(path, {first: panel}, "test accuracy across clients (%)",
                  title + (" (error bars: +-1 std over seeds)" if seeds else ""))
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    i = 0
    for metric, label in metrics:
        for gname, grows in groups.items():
            xs = [float(r[first]) for r in grows]
            ys = np.array([100 * r.get(metric, float("nan")) for r in grows])
            (line,) = ax.plot(xs, ys, marker="o", ms=4, label=f"{label} {gname}".strip(), **style(i))
            i += 1
            if all(r.get(f"{metric}_std") is not None for r in grows):
                sd = np.array([100 * r[f"{metric}_std"] for r in grows])
                ax.fill_between(xs, ys - sd, ys + sd, color=line.get_color(), alpha=0.2, linewidth=0)
    if kind == "log":
        ax.set_xscale("log")
    elif kind == "symlog":
        ax.set_xscale("symlog", linthresh=min(float(v) for v in values if v > 0))
    ax.set_xlabel(first)
    ax.set_ylabel("test accuracy across clients (%)")
    ax.set_title(title + (" (band: +-1 std over seeds)" if seeds else ""), fontsize=10)
    ax.grid(alpha=0.3)
    if i > 6:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    else:
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, vector=True)
