"""Every registered method tuned, then measured: ``fedmtl reproduce tuned --out DIR [--quick] [--trials N]
[--methods a,b] [--federations f,g] [--device cuda]``.

For each federation of ``tuned.toml`` and each registered method that fits it, ``fedmtl tune`` searches the
method's learning rate and its own main hyperparameter (the spaces are data: ``tuned.toml`` beside this module)
with the same number of trials for every method, on a validation split of the training examples (the test split is
left out of the data during tuning: ``runs.tune``).  The best trial's config is then rerun with 5 seeds on the test
split: the mean over clients (``avg``) and the 10th percentile over clients (``p10``) of the final round, their mean
over seeds and standard error (sample std over seeds / sqrt(seeds)).

``DIR/studies/<federation>/<method>/`` holds each study (``--resume`` of ``fedmtl tune``: an interrupted reproduction
continues them), ``DIR/reruns/<federation>/<method>/`` each rerun (a finished rerun is read back, not run again),
``DIR/configs/<federation>/<method>.toml`` each tuned config (the bundled ``configs/tuned/`` are copies), and
``DIR/summary.json`` / ``DIR/tuned.md`` the table.
"""

from __future__ import annotations

import functools
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

from ..config import ConfigError, apply_overrides, dumps, load, read_toml, validate
from ..engine.evaluation import SEEN_TEST_ACC_MEAN, SEEN_TEST_ACC_P10
from ..engine.round import TrainingDiverged
from ..files import locked
from ..machine import torch_device
from ..resources import config_path
from ..runs.report import markdown_table, quick_mode, write_json
from .common import is_starting_over, overrides, publish, read_tables

_TABLES = read_tables("tuned.toml")
BUDGET: dict[str, Any] = _TABLES["budget"]
QUICK: dict[str, Any] = _TABLES["quick"]
#: federation name -> {config, sets, lr, quick_sets, title}
FEDERATIONS: dict[str, dict[str, Any]] = _TABLES["federations"]
#: method name -> {source, settings, space, federations}
METHODS: dict[str, dict[str, Any]] = _TABLES["methods"]
#: method name -> why it does not fit these federations
UNFIT: dict[str, str] = {n: t["reason"] for n, t in _TABLES["unfit"].items() if "federations" not in t}
#: federation -> {method: why it does not fit that federation} (the method runs on the others)
UNFIT_IN: dict[str, dict[str, str]] = {f: {n: t["reason"] for n, t in _TABLES["unfit"].items()
                                          if f in t.get("federations", [])} for f in _TABLES["federations"]}
#: the marker of a --quick run in its outputs
QUICK_MARK = "QUICK"


def registered() -> list[str]:
    """The registered algorithms' names, read at run time (plugins and newly added methods included)."""
    from .. import algorithms  # noqa: F401  (registers the built-ins)
    from ..registry import ALGORITHMS

    return sorted(ALGORITHMS)


def method_space(method: str, federation: str) -> dict[str, Any]:
    """The search space of ``method`` on ``federation`` in ``fedmtl tune --space`` format: the federation's
    learning-rate range unless the method gives its own or never reads ``optim.lr`` (``optim_lr = false``:
    Per-FedAvg's own rates), and the method's keys (per-federation entries replace them)."""
    entry = METHODS[method]
    own = entry.get("federations", {}).get(federation, {})
    space: dict[str, Any] = {"optim": {"lr": dict(FEDERATIONS[federation]["lr"])}} if entry.get("optim_lr", True) \
        else {}
    for table, keys in own.get("space", entry.get("space", {})).items():
        space.setdefault(table, {}).update(keys)
    return space


def method_settings(method: str, federation: str) -> list[str]:
    """The ``--set`` overrides that select ``method`` with its fixed settings on ``federation``."""
    entry = METHODS[method]
    own = entry.get("federations", {}).get(federation, {})
    tables: dict[str, Any] = {"algorithm": {"name": method}}
    for table, keys in own.get("settings", entry.get("settings", {})).items():
        tables.setdefault(table, {}).update(keys)
    return overrides(tables)


def space_toml(space: dict[str, Any]) -> str:
    """A space as the TOML text ``fedmtl tune --space`` reads."""
    from ..runs.tune import toml_value

    lines = []
    for table, keys in space.items():
        lines.append(f"[{table}]")
        for key, spec in keys.items():
            inner = ", ".join(f"{k} = [{', '.join(toml_value(c) for c in v)}]" if isinstance(v, list)
                              else f"{k} = {toml_value(v)}" for k, v in spec.items())
            lines.append(f"{key} = {{ {inner} }}")
    return "\n".join(lines) + "\n"


def plan(methods: list[str] | None = None, federations: list[str] | None = None) -> dict[str, Any]:
    """What a reproduction runs: per federation the methods tuned, the methods that do not fit (with the reason)
    and the methods with a space entry that are not registered (skipped)."""
    reg = registered()
    feds = federations or list(FEDERATIONS)
    for f in feds:
        if f not in FEDERATIONS:
            raise ConfigError(f"--federations {f}: one of {', '.join(FEDERATIONS)}")
    if methods:
        for m in methods:
            if m not in reg:
                raise ConfigError(f"--methods {m}: not a registered algorithm")
            if m not in METHODS and m not in UNFIT:
                raise ConfigError(f"--methods {m}: no space entry in experiments/tuned.toml")
    chosen = methods or reg
    unfit = {m: UNFIT[m] for m in chosen if m in UNFIT}
    run = [m for m in chosen if m in METHODS and m not in UNFIT]
    missing = [] if methods else sorted(m for m in METHODS if m not in reg)
    return {"federations": feds, "methods": run, "unfit": unfit, "not_registered": missing}


def _base_sets(federation: str, quick: bool) -> list[str]:
    fed = FEDERATIONS[federation]
    return [*fed["sets"], *(QUICK["sets"] + fed.get("quick_sets", []) if quick else [])]


def se(values: list[float]) -> float | None:
    """The standard error of the mean of ``values``: the sample std (ddof = 1) over sqrt(n); None under 2 values."""
    if len(values) < 2:
        return None
    m = sum(values) / len(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1)) / math.sqrt(len(values))


def check_device_option(device: str | None) -> None:
    """``--device``: a device name (``cpu``, ``cuda``, ``cuda:N``) that this machine has, else ``ConfigError``."""
    if device is not None:
        try:
            torch_device(device, "--device")
        except ValueError as e:
            raise ConfigError(str(e)) from None


def device_sets(device: str | None) -> list[str]:
    """The ``--set`` that runs a reproduction's trials and reruns on ``device``: none for the CPU (the configs'
    own device), so that a study begun without ``--device`` and one with ``--device cpu`` are the same study.  The
    device is part of a study's config (its numbers differ from one device to another): a study continues on the
    device it began on."""
    return [] if device in (None, "cpu") else [f"run.device={json.dumps(device)}"]


def study_sets(federation: str, method: str, base: list[str], device: str | None,
               values: dict[str, Any] | None = None) -> list[str]:
    """The ``--set`` overrides of ``method``'s study on ``federation``: the federation's ``base`` sets, the method's
    settings, fixed ``values`` (``--probe-edges``: the other tuned values), the tuning seeds and the device."""
    from ..runs.tune import overrides as value_sets

    return [*base, *method_settings(method, federation), *value_sets(values or {}),
            f"run.seeds={BUDGET['tune_seeds']}", *device_sets(device)]


def tune_one(out: Path, federation: str, method: str, trials: int, quick: bool,
             device: str | None = None) -> dict[str, Any]:
    """The study of ``method`` on ``federation`` (continued if ``out`` holds it), its trials on ``device``: its
    ``tune.json`` summary."""
    from ..runs.tune import tune

    out.mkdir(parents=True, exist_ok=True)
    space = out.parent / f"{method}.space.toml"
    space.write_text(space_toml(method_space(method, federation)))
    sets = study_sets(federation, method, _base_sets(federation, quick), device)
    tune(config_path(FEDERATIONS[federation]["config"]), space, trials=trials, seed=int(BUDGET["seed"]),
         out=out, sets=sets, resume=True, objective=BUDGET["objective"])
    stored: dict[str, Any] = json.loads((out / "tune.json").read_text())
    return stored


def tuned_config(federation: str, method: str, best: dict[str, Any]) -> str:
    """The tuned config of ``method`` on ``federation`` at the federation's full length: the bundled config, the
    federation's and method's settings and the best trial's values (a --quick study's shortening left out)."""
    from ..runs.tune import overrides as value_sets

    src = config_path(FEDERATIONS[federation]["config"])
    sets = [*_base_sets(federation, False), *method_settings(method, federation), *value_sets(best)]
    cfg = validate(apply_overrides(read_toml(src), sets), str(src))
    return dumps(cfg.raw)


def config_header(federation: str, method: str, trials: int, quick: bool, summary: dict[str, Any]) -> str:
    """The comment that heads a tuned config: the study that produced it and the command that rebuilds it."""
    rounds = next((x.split("=", 1)[1] for x in QUICK["sets"] if x.startswith("run.rounds=")), "?")
    budget = f"{QUICK_MARK}: a {trials}-trial smoke study of {rounds} rounds, not a tuned config" if quick else (
        f"{trials} trials")
    lines = [f"# {method} on {federation} ({FEDERATIONS[federation]['title']}), tuned by fedmtl reproduce tuned:",
             f"# {budget} (TPE, median pruning, sampler seed {BUDGET['seed']}), objective {BUDGET['objective']} "
             f"on a validation split of the training examples,",
             f"# best value {summary['best_value']:.4f} (trial {summary['best_trial']}); the values searched: "
             + ", ".join(f"{k} = {v:.4g}" if isinstance(v, float) else f"{k} = {v}"
                         for k, v in summary["best_params"].items()),
             f"# Rebuilt by: fedmtl reproduce tuned --out DIR{' --quick' if quick else ''} --methods {method} "
             f"--federations {federation}"]
    return "\n".join(lines) + "\n"


def rerun(out: Path, config_text: str, seeds: list[int], sets: list[str]) -> dict[str, Any]:
    """The tuned config rerun with ``seeds`` on the test split (``sets``: a --quick run's shortening, as its study
    had); a rerun that finished with the same config, seeds and sets is read back from ``out/result.json``."""
    from ..runs.driver import build_data
    from ..runs.progress import Progress
    from .common import run_method_seeds

    done = out / "result.json"
    if done.exists():
        stored: dict[str, Any] = json.loads(done.read_text())
        if stored.get("config") == config_text and stored.get("seeds") == seeds and stored.get("sets") == sets:
            return stored
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(config_text)
    cfg = load(out / "config.toml", sets)
    t0 = time.perf_counter()
    res = run_method_seeds(cfg, out / "runs", build_data(cfg, Progress()), seeds)
    values = res["final_values"]
    avg = [100 * v for v in values[SEEN_TEST_ACC_MEAN]]
    p10 = [100 * v for v in values[SEEN_TEST_ACC_P10]]
    result = {"config": config_text, "seeds": seeds, "sets": sets, "rounds": cfg.run.rounds,
              "avg_values": avg, "p10_values": p10, "avg": sum(avg) / len(avg), "avg_se": se(avg),
              "p10": sum(p10) / len(p10), "p10_se": se(p10), "seconds": time.perf_counter() - t0}
    write_json(done, result)
    return result


def run(out: Path, quick: bool = False, trials: int | None = None, methods: list[str] | None = None,
        federations: list[str] | None = None, device: str | None = None) -> dict[str, Any]:
    """Tune every registered method that fits on every federation (or those named), rerun each best config with the
    budget's seeds on the test split; write ``DIR/summary.json`` and ``DIR/tuned.md`` and each tuned config in
    ``DIR/configs/<federation>/<method>.toml``.  ``device``: where the trials and reruns run (``run.device``; the
    tuned configs keep the federation's own device, and each row records the one it was measured on).  Continues
    whatever ``out`` holds of an earlier call; several calls on different methods or federations may run at once
    into one ``out``: each adds its rows to the stored table (``_record``), none drops another's."""
    from ..data.federated import DataError

    p = plan(methods, federations)  # unknown names refused before anything is written
    check_device_option(device)  # and a device this machine lacks
    held = _stored(out, not quick)
    if held:  # the other budget's table: its studies and reruns would be replaced by this call's
        raise ConfigError(f"--out {out}: holds a {'smoke (--quick)' if held['quick'] else 'full-budget'} table; a "
                          f"{'--quick' if quick else 'full-budget'} call would replace its reruns: choose another "
                          "folder")
    out.mkdir(parents=True, exist_ok=True)
    n_trials = trials or int(QUICK["trials"] if quick else BUDGET["trials"])
    seeds = list(QUICK["seeds"] if quick else BUDGET["seeds"])
    record = functools.partial(_record, out, quick, n_trials, seeds, p)  # this call's rows into the stored table
    for fed in p["federations"]:
        probe = load(config_path(FEDERATIONS[fed]["config"]), _base_sets(fed, quick))
        try:
            probe.build_data()
        except DataError as e:
            print(f"{fed} skipped: {e}", flush=True)
            continue
        cfg = probe
        meta = {"config": FEDERATIONS[fed]["config"], "sets": _base_sets(fed, quick),
                "title": FEDERATIONS[fed]["title"], "rounds": cfg.run.rounds,
                "clients": int(cfg.data.get("num_clients", 0))}
        record(fed, meta)
        fed_sets = FEDERATIONS[fed]["sets"]
        for k, m in enumerate(p["methods"]):
            if m in UNFIT_IN[fed]:
                record(fed, meta, m, None)
                continue
            print(f"[{fed} {k + 1}/{len(p['methods'])}] {m}", flush=True)
            if is_starting_over():  # --overwrite: this method's study and rerun start over
                for d in (out / "studies" / fed / m, out / "reruns" / fed / m):
                    shutil.rmtree(d, ignore_errors=True)
            try:
                study = tune_one(out / "studies" / fed / m, fed, m, n_trials, quick, device)
            except (ValueError, TrainingDiverged) as e:  # a method that cannot run here: its row says why
                row: dict[str, Any] = {"error": f"{type(e).__name__}: {e}".splitlines()[0]}
                print(f"  {m}: {row['error']}", flush=True)
                record(fed, meta, m, row)
                continue
            if study["best_value"] is None:
                row = {"error": "no trial completed", "tune_seconds": study["trial_seconds"],
                       "seconds": study["trial_seconds"]}
                record(fed, meta, m, row)
                continue
            text = tuned_config(fed, m, study["best_params"])
            header = config_header(fed, m, n_trials, quick, study)
            path = out / "configs" / fed / f"{m}.toml"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(header + text)
            try:
                res = rerun(out / "reruns" / fed / m, text, seeds,
                            [*_base_sets(fed, quick)[len(fed_sets):], *device_sets(device)])
            except (ValueError, TrainingDiverged) as e:
                row = {"error": f"rerun: {type(e).__name__}: {e}".splitlines()[0]}
                print(f"  {m}: {row['error']}", flush=True)
                record(fed, meta, m, row)
                continue
            row = {"avg": res["avg"], "avg_se": res["avg_se"], "p10": res["p10"], "p10_se": res["p10_se"],
                   "avg_values": res["avg_values"], "p10_values": res["p10_values"],
                   "best_params": study["best_params"], "best_value": study["best_value"],
                   "space": method_space(m, fed),
                   "trials": study["n_trials"], "tune_seconds": study["trial_seconds"],
                   "rerun_seconds": res["seconds"], "quick": quick, "n_trials": n_trials, "seeds": seeds,
                   "device": device or "cpu",
                   # the trials' and the rerun's own measured times (stable when a resumed call reads them back)
                   "seconds": study["trial_seconds"] + res["seconds"]}
            print(f"  {m}: avg {res['avg']:.1f}  p10 {res['p10']:.1f}  best {study['best_params']}", flush=True)
            record(fed, meta, m, row)  # an interruption keeps it
    return record(publish_table=True)  # with what other calls added meanwhile


#: the lock that calls adding rows to one folder's table take in turn
SUMMARY_LOCK = ".summary.lock"


def _stored(out: Path, quick: bool) -> dict[str, Any]:
    """``out/summary.json`` as stored, or {} where there is none or its budget (quick or full) is the other one; a
    file that is not a table's JSON is refused (its rows would be lost by writing over it)."""
    path = out / "summary.json"
    if not path.exists():
        return {}
    try:
        stored = json.loads(path.read_text())
        if not (isinstance(stored, dict) and isinstance(stored.get("federations"), dict)
                and all(isinstance(f, dict) and isinstance(f.get("methods"), dict)
                        for f in stored["federations"].values())):
            raise ValueError("not a table of federations and their methods' rows")
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: unreadable ({type(e).__name__}: {e}); move it away (its studies and reruns in "
                          f"{out} rebuild it with --resume)") from None
    return stored if stored.get("quick") == quick else {}


def _order(methods: dict[str, Any]) -> dict[str, Any]:
    """Rows in tuned.toml's order (global methods first, then the personalized ones), others (plugins) after."""
    known = list(METHODS)
    return dict(sorted(methods.items(), key=lambda kv: (known.index(kv[0]) if kv[0] in known else len(known),
                                                        kv[0])))


def _record(out: Path, quick: bool, trials: int, seeds: list[int], p: dict[str, Any], fed: str | None = None,
            meta: dict[str, Any] | None = None, method: str | None = None,
            row: dict[str, Any] | None = None, publish_table: bool = False) -> dict[str, Any]:
    """Under the folder's lock, the stored table read again, ``fed``'s description set and ``method``'s row set
    (removed where ``row`` is None), and the table written back: calls into one folder keep each other's rows.
    ``publish_table``: ``tuned.md`` written from it too, and shown."""
    with locked(out / SUMMARY_LOCK):
        stored = _stored(out, quick)
        table: dict[str, Any] = stored.get("federations", {})
        if fed is not None:
            entry = table.setdefault(fed, {"methods": {}})
            entry.update(meta or {})
            entry["methods"] = entry.pop("methods")  # the rows after the description, as written before
            if method is not None:
                if row is None:
                    entry["methods"].pop(method, None)
                else:
                    entry["methods"][method] = row
                entry["methods"] = _order(entry["methods"])
        summary = _summary(quick, trials, seeds, table, p, stored)
        if not publish_table:
            write_json(out / "summary.json", summary)
            return summary
        with quick_mode(False):  # the table marks a --quick run itself, from its JSON (so `fedmtl tables` agrees)
            publish(out, "tuned.md", summary, tuned_markdown)
        return summary


def _command(quick: bool, trials: int, table: dict[str, Any]) -> str:
    """The command that rebuilds ``table``: its federations and methods, named where they are not all of them."""
    feds = list(table)
    done = list(_order({m: None for f in table.values() for m in f["methods"]}))
    known = [f for f in feds if f in FEDERATIONS]
    everything = set(plan(None, known)["methods"]) - {m for f in known for m in UNFIT_IN[f]}
    default = int(QUICK["trials"] if quick else BUDGET["trials"])
    return " ".join(["fedmtl reproduce tuned --out DIR", *(["--quick"] if quick else []),
                     *([f"--trials {trials}"] if trials != default else []),
                     *([f"--methods {','.join(done)}"] if done and not everything <= set(done) else []),
                     *([f"--federations {','.join(feds)}"] if feds and set(feds) != set(FEDERATIONS) else [])])


def _summary(quick: bool, trials: int, seeds: list[int], table: dict[str, Any], p: dict[str, Any],
             stored: dict[str, Any] | None = None) -> dict[str, Any]:
    """The table's JSON: ``table`` and what this call's plan and the stored summary (other calls') say is left out."""
    stored = stored or {}
    unfit = {**stored.get("unfit", {}), **p["unfit"]}
    unfit_in = {f: {**stored.get("unfit_in", {}).get(f, {}),
                    **{m: why for m, why in UNFIT_IN[f].items() if m in p["methods"]}} for f in table}
    return {"quick": quick, "trials": trials, "seeds": seeds, "objective": BUDGET["objective"],
            "tune_seeds": BUDGET["tune_seeds"], "federations": table, "unfit": unfit, "unfit_in": unfit_in,
            "not_registered": p["not_registered"], "command": _command(quick, trials, table)}


def _cell(r: dict[str, Any], key: str) -> str:
    if "error" in r:
        return "failed"
    s = r.get(f"{key}_se")
    return f"{r[key]:.1f} ± {s:.1f}" if s is not None else f"{r[key]:.1f}"


def tuned_values(method: str, federation: str, row: dict[str, Any]) -> str:
    """The best trial's values of a row, each marked "(low end)" / "(high end)" where it lies at an end of its
    searched range (``Param.edge``): the row's stored space, else the method's space in this version's tuned.toml."""
    from ..runs.tune import space_params

    space = row.get("space") or (method_space(method, federation)
                                 if method in METHODS and federation in FEDERATIONS else {})
    params = {p.key: p for p in space_params(space, f"{federation}/{method}")} if space else {}
    cells = []
    for key, v in row.get("best_params", {}).items():
        end = params[key].edge(v) if key in params else None
        shown = f"{v:.3g}" if isinstance(v, float) else str(v)
        cells.append(f"{key.rsplit('.', 1)[-1]} = {shown}" + (f" ({end} end)" if end else ""))
    return ", ".join(cells)


def tuned_markdown(results: Path) -> str:
    """``tuned.md`` from the stored ``summary.json`` (``fedmtl tables`` regenerates it)."""
    s = json.loads((results / "summary.json").read_text())
    feds: dict[str, Any] = s["federations"]
    mark = f"{QUICK_MARK} (smoke budget, not the tuned table): " if s["quick"] else ""
    methods: list[str] = []
    for f in feds.values():
        methods += [m for m in f["methods"] if m not in methods]
    header = ["method"]
    for name in feds:
        header += [f"{name}: avg", f"{name}: p10"]
    rows = []
    for m in methods:
        row = [m]
        for f in feds.values():
            r = f["methods"].get(m)
            row += ["—", "—"] if r is None else [_cell(r, "avg"), _cell(r, "p10")]
        rows.append(row)
    def hours(f: dict[str, Any]) -> str:
        h = f"{sum(r.get('seconds', 0.0) for r in f['methods'].values()) / 3600:.2f} h"
        devices = sorted({r.get("device", "cpu") for r in f["methods"].values() if "error" not in r})
        return h if devices in ([], ["cpu"]) else f"{h} (measured on {', '.join(devices)})"

    detail = "; ".join(f"{name} ({f['title']}): {f['clients']} clients, {f['rounds']} rounds, {hours(f)}"
                       for name, f in feds.items())
    text = (f"# {mark}Every method tuned: test accuracy (%) of the final round, mean over clients (avg) and 10th "
            f"percentile (p10), mean ± standard error over seeds {s['seeds']}\n\n"
            f"{s['trials']} trials per method and federation ({s['objective']} on a validation split, seeds "
            f"{s['tune_seeds']}), then the best config rerun on the test split. {detail} (the measured time: "
            f"every trial's and rerun's own seconds, summed). Rebuilt by `{s['command']}`.\n\n"
            + markdown_table(header, rows))
    values = [[m, *(tuned_values(m, fn, f["methods"][m]) if "best_params" in f["methods"].get(m, {}) else "—"
                    for fn, f in feds.items())] for m in methods]
    text = text.rstrip("\n") + (
        "\n\nThe tuned values (the best trial's; \"low end\" / \"high end\": within 5% of that end of the range "
        "searched, in its own scale, or its lowest / highest choice, so the optimum may lie outside the range):"
        "\n\n" + markdown_table(["method", *feds], values))
    if s.get("unfit"):
        text += "\n\nNot run (the method does not fit these federations):\n\n" + "\n".join(
            f"- {m}: {why}" for m, why in s["unfit"].items())
    for fed, why_not in s.get("unfit_in", {}).items():
        if why_not:
            text += f"\n\nNot run on {fed}:\n\n" + "\n".join(f"- {m}: {why}" for m, why in why_not.items())
    if s.get("not_registered"):
        text += ("\n\nWith a space entry but not registered in this version (skipped): "
                 + ", ".join(s["not_registered"]))
    failed = [(fn, m, r["error"]) for fn, f in feds.items() for m, r in f["methods"].items() if "error" in r]
    if failed:
        text += "\n\nFailed:\n\n" + "\n".join(f"- {m} on {fn}: {e}" for fn, m, e in failed)
    return text


__all__ = ["FEDERATIONS", "METHODS", "UNFIT", "UNFIT_IN", "method_settings", "method_space", "plan", "registered",
           "run", "se", "tuned_config", "tuned_markdown"]
