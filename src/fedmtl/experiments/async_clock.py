"""``fedmtl reproduce async``: synchronous rounds against FedAsync and FedBuff on the simulated clock.

FedAvg on FedEM's synthetic federation (300 clients, legacy generator) with low-power devices (1e7 FLOP/s) of
highly variable speed (``[systems] variability = "high"``: U[0.1, 1]) over LTE, 50 clients training at once, 6,000
client updates in all, 3 seeds (``configs/synthetic/fedbuff.toml``):

* ``sync (deadline)``: synchronous rounds of 50 sampled clients; a round lasts one clock cycle and stragglers do the
  share of their local steps their speed allows (MOCHA's flexible local work);
* ``sync (wait)``: synchronous rounds of 50 clients that all finish their work; a round lasts as long as its slowest
  client;
* ``fedbuff``: FedBuff, a server step after every K = 10 updates, weights 1 / sqrt(1 + staleness);
* ``fedasync``: FedAsync, every update mixed in at once with alpha = 0.6 and the same staleness weights.

Reported: the final accuracy (mean over clients and bottom decile, mean ± std over seeds), the simulated time the
6,000 updates took, and the simulated time at whose evaluation each mode first reached a level all of them reach
(1 point below the lowest final accuracy); the figure plots the accuracy against the simulated clock.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..engine.evaluation import SEEN_TEST_ACC_MEAN, SEEN_TEST_ACC_P10
from ..resources import config_path
from ..runs.report import markdown_table, plot_bands
from .common import publish, run_methods

SEEDS = [1, 2, 3]
UPDATES = 6000
#: label -> ``--set`` overrides on configs/synthetic/fedbuff.toml (50 clients at once, 6,000 updates each)
MODES: dict[str, list[str]] = {
    "sync (deadline)": ["async.mode=off", "run.clients_per_round=50", "run.rounds=120", "run.eval_every=12"],
    "sync (wait)": ["async.mode=off", "systems.mode=wait", "run.clients_per_round=50", "run.rounds=120",
                    "run.eval_every=12"],
    "fedbuff": ["run.rounds=600", "run.eval_every=60"],
    "fedasync": ["async.mode=fedasync", "async.mixing=0.6", "run.rounds=6000", "run.eval_every=600",
                 "run.checkpoint_every=1000"],
}


def _curve(history: list[dict[str, Any]]) -> tuple[list[float], list[float], list[float]]:
    rows = [r for r in history if r.get(SEEN_TEST_ACC_MEAN) is not None and r.get("est_time_s") is not None]
    return ([float(r["est_time_s"]) for r in rows], [100 * float(r[SEEN_TEST_ACC_MEAN]) for r in rows],
            [100 * float(r.get(f"{SEEN_TEST_ACC_MEAN}_std") or 0.0) for r in rows])


def run(out: Path, quick: bool = False) -> dict[str, Any]:
    """Run the four modes (``MODES``) with seeds ``SEEDS``; writes ``DIR/async.md``, ``async.png`` and
    ``summary.json``."""
    out.mkdir(parents=True, exist_ok=True)
    modes = MODES
    if quick:  # a tenth of the updates
        modes = {k: [o.replace("=120", "=12").replace("=600", "=60").replace("=6000", "=600")
                     .replace("eval_every=12", "eval_every=4").replace("eval_every=60", "eval_every=20")
                     for o in v] for k, v in MODES.items()}
    res = run_methods(out, config_path("synthetic/fedbuff"), modes, [], seeds=SEEDS)
    curves = {name: _curve(r["history"]) for name, r in res.items()}
    # a level every mode reaches: 1 point below the lowest final accuracy
    target = min(100 * r["final"][SEEN_TEST_ACC_MEAN] for r in res.values()) - 1.0
    rows = {}
    for name, r in res.items():
        t, acc, _ = curves[name]
        reached = [ti for ti, a in zip(t, acc, strict=True) if a >= target]
        rows[name] = {"avg": 100 * r["final"][SEEN_TEST_ACC_MEAN], "avg_std": 100 * r["final_std"][SEEN_TEST_ACC_MEAN],
                      "bottom_decile": 100 * r["final"][SEEN_TEST_ACC_P10],
                      "bottom_decile_std": 100 * r["final_std"][SEEN_TEST_ACC_P10],
                      "simulated_s": t[-1], "time_to_target_s": reached[0] if reached else None,
                      "curve": {"t": t, "acc": acc},
                      "overrides": modes[name]}
    plot_bands(out / "async.png", {n: curves[n] for n in res}, "test accuracy, mean over clients (%)",
               f"FedAvg on synthetic data, {UPDATES // (10 if quick else 1)} updates: synchronous vs asynchronous",
               "simulated time (s)")
    publish(out, "async.md", {"modes": rows, "seeds": SEEDS, "target": target, "quick": quick},
            async_markdown)
    return rows


def async_markdown(results: Path) -> str:
    """``async.md`` from the stored ``summary.json`` (``fedmtl tables`` regenerates it)."""
    stored = json.loads((results / "summary.json").read_text())
    rows: dict[str, Any] = stored["modes"]
    target = stored["target"]
    return (f"# FedAvg on the simulated clock: synchronous rounds, FedBuff and FedAsync, mean ± std over seeds "
            f"{stored['seeds']}\n\n"
            + markdown_table(["mode", "avg (%)", "p10 (%)", "simulated time (s)", f"time to {target:.1f}% (s)"],
                             [[n, f"{r['avg']:.1f} ± {r['avg_std']:.1f}",
                               f"{r['bottom_decile']:.1f} ± {r['bottom_decile_std']:.1f}", f"{r['simulated_s']:.1f}",
                               "—" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}"]
                              for n, r in rows.items()]))


__all__ = ["MODES", "SEEDS", "async_markdown", "run"]
