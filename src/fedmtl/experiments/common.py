"""What the reproductions share: their method tables (TOML package data next to the modules) and the runs of
one config with per-method overrides, continued from the checkpoints a previous call left (``fedmtl reproduce
--resume``), or started over (``--overwrite``: ``starting_over``)."""

from __future__ import annotations

import contextlib
import time
import tomllib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from importlib import resources
from pathlib import Path
from typing import Any

from ..config import ConfigError, load, parse_override
from ..engine.evaluation import SEEN_TEST_ACC_MEAN, SEEN_TEST_ACC_P10
from ..engine.round import TrainingDiverged
from ..runs.checkpoint import CheckpointError
from ..runs.driver import build_data, run_experiment
from ..runs.progress import Progress
from ..runs.rundir import RunDirError


def read_tables(name: str) -> dict[str, Any]:
    """The TOML file ``name`` of this package (``fedem.toml``, ``robustness.toml``, ...)."""
    return tomllib.loads((resources.files(__package__) / name).read_text(encoding="utf-8"))


def overrides(tables: dict[str, Any]) -> list[str]:
    """A method's config tables as ``--set`` overrides, in the order written:
    ``{"algorithm": {"name": "ditto", "lam": 0.1}}`` -> ``["algorithm.name=ditto", "algorithm.lam=0.1"]``.
    Each override reads back as the value of the table (checked)."""
    out = []
    for table, keys in tables.items():
        if not isinstance(keys, dict):
            raise ConfigError(f"method table: {table!r} must be a table of config keys, got {keys!r}")
        for key, value in keys.items():
            text = f"{table}.{key}={_value(value, top=True)}"
            if parse_override(text) != (table, key, value):
                raise ConfigError(f"method table: {table}.{key} = {value!r} does not read back from {text!r}")
            out.append(text)
    return out


def method_overrides(methods: dict[str, Any]) -> dict[str, list[str]]:
    """``[methods.LABEL]`` tables -> {label: ``--set`` overrides}."""
    return {label: overrides(tables) for label, tables in methods.items()}


def _value(v: Any, top: bool = False) -> str:
    """``v`` in ``--set`` syntax: TOML, with a string bare where a bare word reads back as that string."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        if top and v == v.strip() and v and _bare(v):
            return v
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, int | float):
        return repr(v)
    raise ConfigError(f"method table: {v!r} is not a scalar or a list")


def _bare(text: str) -> bool:
    try:
        tomllib.loads(f"v = {text}")
    except tomllib.TOMLDecodeError:
        return True
    return False


# whether a reproduction's runs start over (``--overwrite``) rather than continue the checkpoints they find
_START_OVER: ContextVar[bool] = ContextVar("fedmtl_start_over", default=False)


@contextlib.contextmanager
def starting_over(on: bool = True) -> Iterator[None]:
    """Within: every run of ``run_one`` and ``run_method_seeds`` starts over, replacing what its directory holds
    (``fedmtl reproduce --overwrite``)."""
    token = _START_OVER.set(on)
    try:
        yield
    finally:
        _START_OVER.reset(token)


def is_starting_over() -> bool:
    """Whether the calling reproduction runs within ``starting_over`` (``--overwrite``)."""
    return _START_OVER.get()


def run_one(cfg: Any, run_dir: Path, data: Any) -> dict[str, Any]:
    """One run (continued if its directory holds a checkpoint of the same config, unless ``starting_over``): its
    summary, history and per-client metrics."""
    if _START_OVER.get():
        res = run_experiment(cfg, run_dir, overwrite=True, data=data)
        return {**res.summary, "history": res.history, "per_client": res.per_client}
    has_ckpt = (run_dir / "checkpoint.pt").exists()
    try:
        res = run_experiment(cfg, run_dir, resume=has_ckpt, overwrite=not has_ckpt, data=data)
    except (ConfigError, CheckpointError, RunDirError):  # an older run with another config or format: start over
        res = run_experiment(cfg, run_dir, overwrite=True, data=data)
    return {**res.summary, "history": res.history, "per_client": res.per_client}


def run_method_seeds(cfg: Any, run_dir: Path, data: Any, seeds: list[int]) -> dict[str, Any]:
    """One config with several seeds (batched; seeds with a checkpoint continue): the seeds' mean as ``final``,
    their std as ``final_std``, the per-round means as ``history`` (with ``*_std``)."""
    from ..runs.seeds import history_stats
    from ..runs.seeds import run_seeds as run_batched

    try:  # the seeds with a checkpoint continue, the others start
        if _START_OVER.get():
            res = run_batched(cfg, seeds, run_dir, overwrite=True, data=data)
        else:
            res = run_batched(cfg, seeds, run_dir, resume=True, data=data)
    except (ConfigError, CheckpointError, RunDirError):  # an older run with another config or format: start over
        res = run_batched(cfg, seeds, run_dir, overwrite=True, data=data)
    hist = []
    for h in history_stats([r.history for r in res.runs]):
        row = {"round": h["round"]}
        row.update({k[:-5]: v for k, v in h.items() if k.endswith("_mean") and v is not None})
        row.update({k: v for k, v in h.items() if k.endswith("_std")})
        hist.append(row)
    return {**res.summary, "final": {k: st["mean"] for k, st in res.final.items()},
            "final_std": {k: st["std"] for k, st in res.final.items()},
            "final_values": {k: st["values"] for k, st in res.final.items()}, "history": hist}


def run_methods(out: Path, base: Path, methods: dict[str, list[str]], overrides: list[str],
                allow_diverged: bool = False, seeds: list[int] | None = None) -> dict[str, Any]:
    """Run one base config with per-method overrides (label -> ``--set`` list); {label: summary}.
    ``seeds``: each method with these seeds as one batched run (``final`` the seeds' mean, ``final_std`` their std).
    ``allow_diverged``: a run whose training diverges (``TrainingDiverged``: every update NaN/Inf for 3 rounds,
    e.g. under an attack no aggregator stops) is a result, ``{"diverged": True}`` with NaN accuracies."""
    results: dict[str, Any] = {}
    data, data_key = None, None
    start = time.perf_counter()
    for k, (label, sets) in enumerate(methods.items()):
        if k:  # method k/N and the time the others would take at the mean pace so far
            eta = (time.perf_counter() - start) / k * (len(methods) - k)
            print(f"[{k + 1}/{len(methods)}] {label} (about {eta / 60:.0f} min left)", flush=True)
        else:
            print(f"[1/{len(methods)}] {label}", flush=True)
        cfg = load(base, [*sets, *overrides])
        key = repr(sorted(cfg.data.items()))
        if key != data_key:
            data, data_key = build_data(cfg, Progress()), key
        t0 = time.perf_counter()
        try:
            results[label] = (run_method_seeds(cfg, out / "runs" / label, data, seeds) if seeds
                              else run_one(cfg, out / "runs" / label, data))
        except TrainingDiverged as e:
            if not allow_diverged:
                raise
            nan = float("nan")
            results[label] = {"diverged": True, "reason": str(e), "history": [],
                              "final": {SEEN_TEST_ACC_MEAN: nan, SEEN_TEST_ACC_P10: nan}}
            print(f"{label:14s} diverged ({time.perf_counter() - t0:.0f} s)", flush=True)
            continue
        f = results[label]["final"]
        sd = results[label].get("final_std", {}).get(SEEN_TEST_ACC_MEAN)
        spread = f" ± {100 * sd:4.1f}" if sd is not None else ""
        print(f"{label:14s} avg {100 * f[SEEN_TEST_ACC_MEAN]:5.1f}{spread}  p10 {100 * f[SEEN_TEST_ACC_P10]:5.1f}  "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    if results and data is not None:
        record_figure(out, f"{data.name} ({base.stem})", results)
    return results


FIGURE = "figure.json"  # a reproduction folder's panels of its summary figure (final accuracy per method)
AVG, P10 = "average", "bottom decile (p10)"


def record_figure(out: Path, panel: str, results: dict[str, Any]) -> None:
    """Keep ``panel`` (a dataset or setting: its title) of the summary figure in ``out/figure.json``: per method, its
    final average and bottom-decile test accuracy over clients (%), mean and std over seeds where it ran several."""
    from ..runs.report import write_json

    rows: dict[str, Any] = {}
    for label, r in results.items():
        f, sd = r.get("final", {}), r.get("final_std", {})
        rows[label] = {name: [100 * f[key] if key in f else None, 100 * sd[key] if sd.get(key) is not None else None]
                       for name, key in ((AVG, SEEN_TEST_ACC_MEAN), (P10, SEEN_TEST_ACC_P10))}
    panels = _panels(out / FIGURE)
    panels[panel] = rows
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / FIGURE, {"panels": panels})


def _panels(path: Path) -> dict[str, Any]:
    import json

    try:
        got = json.loads(path.read_text()).get("panels", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return got if isinstance(got, dict) else {}


def summary_figure(top: Path, title: str) -> Path | None:
    """``top/summary.png`` and ``summary.pdf``: every panel kept in ``top`` and its sub-folders (``record_figure``),
    methods down the side, average and bottom-decile accuracy as bars with +-1 std error bars; None without panels."""
    from ..runs.report import plot_bars

    panels: dict[str, Any] = {}
    for f in [top / FIGURE, *sorted(top.glob(f"*/{FIGURE}"))]:
        panels.update(_panels(f))
    if not panels:
        return None
    bars = {name: {m: {s: (v[0] if v[0] is not None else float("nan"), v[1]) for s, v in row.items()}
                   for m, row in rows.items()} for name, rows in panels.items()}
    plot_bars(top / "summary.png", bars, "final test accuracy across clients (%)", title, horizontal=True)
    return top / "summary.png"


__all__ = ["method_overrides", "overrides", "read_tables", "record_figure", "run_method_seeds", "run_methods",
           "run_one", "show", "summary_figure"]


def publish(out: Path, table: str, summary: Any, markdown: Callable[[Path], str]) -> str:
    """Write ``out/summary.json``, then ``out/table``: what ``markdown`` makes of it (the function ``fedmtl tables``
    regenerates the stored table with); print the table and return it."""
    from ..runs.report import write_json, write_table

    write_json(out / "summary.json", summary)
    md = markdown(out)
    write_table(out / table, md)
    show(md)
    return md


def show(text: str) -> None:
    """Print a result table on the terminal: no blank lines around or inside it (the stored file keeps them)."""
    print("\n".join(ln for ln in text.strip().splitlines() if ln.strip()), flush=True)
