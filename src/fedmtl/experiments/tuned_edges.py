"""Beyond the ends of the searched ranges: ``fedmtl reproduce tuned --out DIR --probe-edges``.

A tuned value at an end of its range (``Param.edge``) says the optimum may lie outside the range searched.  For each
such value of a stored tuned table (``DIR/summary.json``), this measures the same objective as the study (one trial
on the validation split, the study's tuning seeds, no pruning) at the tuned value and beyond that end, every other
value as tuned:

* a range: the value times 2 and 4 past a high end, divided by 2 and 4 past a low end (integers rounded);
* numeric choices (a paper's grid): one and two grid steps past the lowest or highest choice, geometric where
  every choice is positive (0.001, 0.01, ... continues with 0.0001, 0.00001), else arithmetic (0, 2, 4 with 6, 8).

A value the config refuses (a probability above 1, ...) is recorded with the refusal and not run.  The re-measured
objective at the tuned value equals the study's best value (the same config and seed), which the page shows beside
it.  ``DIR/edges/<federation>/<method>/<key>/<hash>/`` keeps each probe's study (the folder named by what it runs),
so an interrupted call continues; ``DIR/edges.json`` and ``DIR/edges.md`` hold the results (a call on some methods
keeps the other methods' rows of an earlier call).  Nothing is tuned and the table is not changed.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError, apply_overrides, read_toml, validate
from ..resources import config_path
from ..runs.report import markdown_table, write_json, write_table
from .common import show
from .tuned import BUDGET, FEDERATIONS, METHODS, method_space, study_sets

#: how far past an end a range is probed (a factor on the value)
FACTORS = (2, 4)
#: a probe beyond the end counts as better when its objective exceeds the tuned value's by more than this (half a
#: point of validation accuracy: about the spread of one seed's objective between neighbouring values)
MARGIN = 0.005


def beyond(param: Any, value: Any, end: str, factors: tuple[int, ...] = FACTORS) -> list[Any]:
    """The values past ``end`` ("low" / "high") of ``param`` (a ``runs.tune.Param``) at which to measure, nearest
    first; none repeats ``value`` or another."""
    out: list[Any] = []
    if param.choices is not None:
        nums = sorted(float(c) for c in param.choices)
        a, b = (nums[0], nums[1]) if end == "low" else (nums[-1], nums[-2])
        is_int = all(isinstance(c, int) for c in param.choices)
        geometric = nums[0] > 0  # hyperparameter grids of positive values are spaced by ratios (MOON's 0.1, 1, 5, 10)
        for k in range(1, len(factors) + 1):
            v = a * (a / b) ** k if geometric else a + k * (a - b)
            out.append(int(round(v)) if is_int else float(f"{v:.6g}"))
    else:
        for f in factors:
            v = float(value) * f if end == "high" else float(value) / f
            out.append(int(round(v)) if param.is_int else v)
    seen: list[Any] = []
    for v in out:
        if v != value and v not in seen and not (isinstance(v, float) and not math.isfinite(v)):
            seen.append(v)
    return seen


def _space_text(key: str, value: Any) -> str:
    from ..runs.tune import toml_value

    table, _, rest = key.partition(".")
    return f"[{table}]\n{rest} = {{ choices = [{toml_value(value)}] }}\n"


def _measure(root: Path, federation: str, fed_sets: list[str], method: str, best: dict[str, Any], key: str,
             value: Any, objective: str, device: str | None) -> dict[str, Any]:
    """The study's objective with ``key`` at ``value`` and the other values as tuned: one unpruned trial in a
    folder of ``root`` named by everything it runs (read back where it holds it finished; a row rebuilt with other
    values gets new folders, never another row's trial)."""
    from ..runs.tune import overrides as value_sets
    from ..runs.tune import tune

    src = config_path(FEDERATIONS[federation]["config"])
    sets = study_sets(federation, method, fed_sets, device, {k: v for k, v in best.items() if k != key})
    try:  # the config's own check of the value (its declared range), before anything runs
        validate(apply_overrides(read_toml(src), [*sets, *value_sets({key: value})]), str(src))
    except ConfigError as e:
        return {"value": value, "refused": str(e).splitlines()[0]}
    what = json.dumps([str(FEDERATIONS[federation]["config"]), sets, key, value, objective, BUDGET["seed"]])
    folder = root / hashlib.sha256(what.encode()).hexdigest()[:16]
    done = folder / "tune.json"
    if not done.exists():
        folder.mkdir(parents=True, exist_ok=True)
        space = folder.parent / f"{folder.name}.space.toml"
        space.write_text(_space_text(key, value))
        tune(src, space, trials=1, seed=int(BUDGET["seed"]), out=folder, sets=sets, resume=True,
             objective=objective, prune=False)
    try:
        s = json.loads(done.read_text())
        s.get("best_value")
    except (ValueError, AttributeError):
        raise ConfigError(f"{done}: not a study summary (a damaged probe: delete {folder} to run it again)") from None
    if s.get("best_value") is None:  # a failed trial: its recorded reason (a divergence, ...)
        reason = next((t.get("reason") for t in s.get("trials", []) if t.get("reason")), None)
        return {"value": value, "failed": (reason or "the trial did not complete").splitlines()[0],
                "seconds": s.get("trial_seconds")}
    return {"value": value, "objective": s["best_value"], "seconds": s.get("trial_seconds")}


def probe(out: Path, methods: list[str] | None = None, federations: list[str] | None = None,
          device: str | None = None) -> dict[str, Any]:
    """Every tuned value at an end of its range in the table ``out/summary.json`` (its rows of ``methods`` on
    ``federations``, or all), measured there and beyond; ``out/edges.json`` and ``out/edges.md`` written.
    ``device``: where the trials run (as ``fedmtl reproduce tuned --device``)."""
    from ..runs.tune import check_objective, space_params

    path = out / "summary.json"
    if not path.is_file():
        raise ConfigError(f"--out {out}: holds no tuned table (summary.json); --probe-edges reads one written by "
                          "fedmtl reproduce tuned")
    try:
        summary = json.loads(path.read_text())
        tables = summary["federations"]
        objective = summary["objective"]
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: not a tuned table's summary ({type(e).__name__}: {e})") from None
    direction = check_objective(objective, None)
    result: dict[str, Any] = {"objective": objective, "direction": direction, "margin": MARGIN,
                              "factors": list(FACTORS), "quick": bool(summary.get("quick")),
                              "tune_seeds": BUDGET["tune_seeds"], "device": device or "cpu",
                              "torch": torch.__version__, "federations": {}}
    if not isinstance(tables, dict) or not all(isinstance(t, dict) and isinstance(t.get("methods", {}), dict)
                                               for t in tables.values()):
        raise ConfigError(f"{path}: not a tuned table's summary (federations: {{name: {{methods: {{...}}}}}})")
    for name in federations or []:
        if name not in tables:
            raise ConfigError(f"--federations {name}: {path} holds {', '.join(tables) or 'no federation'}")
    probed = [t for f, t in tables.items() if federations is None or f in federations]
    for name in methods or []:
        if not any(name in t.get("methods", {}) for t in probed):
            raise ConfigError(f"--methods {name}: {path} has no row of it"
                              + (f" on {', '.join(federations)}" if federations is not None else ""))
    kept = _earlier(out, objective)  # rows of an earlier call outside this call's methods and federations
    for fed, table in tables.items():
        if federations is not None and fed not in federations:
            if fed in kept:
                result["federations"][fed] = kept[fed]
            continue
        if fed not in FEDERATIONS:
            raise ConfigError(f"{path}: federation {fed!r} is not in this version's tuned.toml")
        rows: list[dict[str, Any]] = []
        for m, row in table.get("methods", {}).items():
            if methods is not None and m not in methods:  # an earlier call's rows, where the table's row is the same
                rows += [r for r in kept.get(fed, {}).get("rows", []) if isinstance(r, dict) and r.get("method") == m
                         and isinstance(row, dict) and r.get("study_best_value") == row.get("best_value")
                         and r.get("value") == (row.get("best_params") or {}).get(r.get("key"))]
                continue
            if not isinstance(row, dict) or "best_params" not in row:
                continue  # a method that failed in the table: nothing tuned
            if not isinstance(row["best_params"], dict):
                raise ConfigError(f"{path}: {fed}/{m}: best_params must be a table of values")
            space = row.get("space") or (method_space(m, fed) if m in METHODS else {})
            params = {p.key: p for p in space_params(space, f"{path}: {fed}/{m}")} if space else {}
            for key, value in row["best_params"].items():
                end = params[key].edge(value) if key in params else None
                if end is None:
                    continue
                print(f"[{fed}] {m}: {key} = {value:.4g} ({end} end)" if isinstance(value, float)
                      else f"[{fed}] {m}: {key} = {value} ({end} end)", flush=True)
                where = out / "edges" / fed / m / key
                at = _measure(where, fed, list(table.get("sets", [])), m, row["best_params"], key, value,
                              objective, device)
                probes = [_measure(where, fed, list(table.get("sets", [])), m, row["best_params"], key, v,
                                   objective, device) for v in beyond(params[key], value, end)]
                rows.append({"method": m, "key": key, "end": end, "value": value,
                             "study_best_value": row.get("best_value"), "tuned": at, "beyond": probes,
                             "better_beyond": _better(at, probes, direction)})
        result["federations"][fed] = {"title": table.get("title", fed), "rows": rows}
    # the probes' own measured times (the same when a later call reads them back)
    result["seconds"] = sum(p.get("seconds") or 0.0 for f in result["federations"].values() for r in f["rows"]
                            for p in (r["tuned"], *r["beyond"]))
    write_json(out / "edges.json", result)
    md = edges_markdown(out)
    write_table(out / "edges.md", md)
    show(md)
    return result


def _earlier(out: Path, objective: str) -> dict[str, Any]:
    """The federations of ``out/edges.json`` written by an earlier call on the same objective (a call on some methods
    keeps the others' rows); empty where there is none or it is unreadable."""
    try:
        data = json.loads((out / "edges.json").read_text())
        if data.get("objective") == objective and isinstance(data.get("federations"), dict):
            return {f: v for f, v in data["federations"].items()
                    if isinstance(v, dict) and isinstance(v.get("rows"), list)}
    except (OSError, ValueError, AttributeError):
        pass
    return {}


def _better(at: dict[str, Any], probes: list[dict[str, Any]], direction: str) -> bool | None:
    """Whether a probe beyond the end beats the tuned value by more than ``MARGIN`` (a diverged probe does not;
    None: nothing ran beyond the end, or the tuned value's own trial failed)."""
    if "objective" not in at or not any("objective" in p or "failed" in p for p in probes):
        return None
    sign = 1.0 if direction == "maximize" else -1.0
    return any(sign * (p["objective"] - at["objective"]) > MARGIN for p in probes if "objective" in p)


def _shown(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _objective_cell(p: dict[str, Any], scale: float) -> str:
    if "refused" in p:
        return f"{_shown(p['value'])}: refused by the config"
    if "failed" in p:
        return f"{_shown(p['value'])}: diverged" if "Diverged" in p["failed"] else f"{_shown(p['value'])}: failed"
    return f"{_shown(p['value'])}: {p['objective'] * scale:.1f}"


def edges_markdown(results: Path | dict[str, Any]) -> str:
    """The table of ``edges.json`` (a folder holding it, or its contents): per value at an end, the objective
    there and beyond."""
    data = results if isinstance(results, dict) else json.loads((results / "edges.json").read_text())
    scale = 100.0 if "acc" in data["objective"] else 1.0
    unit = " (%)" if scale == 100.0 else ""
    factors = " and x".join(map(str, data["factors"]))
    lines = [f"# Beyond the ends of the searched ranges{' (QUICK run)' if data.get('quick') else ''}", "",
             f"Objective: {data['objective']}{unit} on the validation split, tuning seeds {data['tune_seeds']}, one "
             f"unpruned trial per value, every other value as tuned; past a range's end x{factors} "
             f"(or /), past a grid's end one and two grid steps. \"yes\": a value beyond the end scored more than "
             f"{data['margin'] * scale:g}{' points' if scale == 100.0 else ''} better. {data['seconds'] / 60:.0f} "
             f"minutes of trials on {data['device']}.", ""]
    for fed in data["federations"].values():
        lines += [f"## {fed['title']}", ""]
        if not fed["rows"]:
            lines += ["No tuned value lies at an end of its range.", ""]
            continue
        body = []
        for r in fed["rows"]:
            at = r["tuned"]
            study = r.get("study_best_value")
            body.append([r["method"], f"{r['key']} ({r['end']} end)", _objective_cell(at, scale),
                         f"{study * scale:.1f}" if isinstance(study, float) else "",
                         "; ".join(_objective_cell(p, scale) for p in r["beyond"]),
                         {True: "yes", False: "no", None: ""}[r["better_beyond"]]])
        lines += [markdown_table(["method", "key", "tuned value: objective", "study's best", "beyond the end",
                                  "better beyond"], body)]
    return "\n".join(lines).rstrip() + "\n"


__all__ = ["FACTORS", "MARGIN", "beyond", "edges_markdown", "probe"]
