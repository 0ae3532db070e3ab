"""``fedmtl reproduce robustness``: FedAvg, FedEM and Ditto under attack with every robust aggregator, and a
privacy-utility curve, on the synthetic FedEM data and Fashion-MNIST (``configs/robust/*.toml``).

For each dataset and method: the clean run; then every attack (``scale`` with strength -100, ``sign_flip``
with strength 4, ``gaussian`` with strength 1, ``label_flip``) at 10% and 30% attackers under each aggregator
(``mean``, ``median``, ``trimmed_mean`` with ``trim`` = the attacker fraction, ``krum`` and ``multi_krum`` with
``num_byzantine`` = the number of attackers).  Privacy: Poisson sampling of 20% of the clients per round,
``clip_norm`` 1, noise multipliers 0.5 / 1 / 2 / 4, epsilon at delta = 1e-5 against accuracy.  Every number is
the final round's mean test accuracy over clients (never a best round).  Writes ``robustness.md``,
``robustness.json``, ``privacy.png`` and ``summary.json`` into the output folder; runs are kept under ``runs/``
and a re-run continues from them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..report import markdown_table, plot_curves, write_json, write_table

METHODS = {"fedavg": ["algorithm.name=fedavg"],
           "fedem": ["algorithm.name=fedem", "algorithm.num_components=3"],
           "ditto": ["algorithm.name=ditto", "algorithm.lam=0.1"]}
ATTACKS = {"scale": -100.0, "sign_flip": 4.0, "gaussian": 1.0, "label_flip": 1.0}
AGGREGATORS = ("mean", "median", "trimmed_mean", "krum", "multi_krum")
FRACTIONS = (0.1, 0.3)
NOISE = (0.5, 1.0, 2.0, 4.0)


def _settings(num_clients: int, quick: bool) -> dict[str, list[str]]:
    """label -> --set overrides of every attacked run."""
    out: dict[str, list[str]] = {}
    attacks = {"scale": ATTACKS["scale"]} if quick else ATTACKS
    for kind, strength in attacks.items():
        for frac in ((0.3,) if quick else FRACTIONS):
            f = int(round(frac * num_clients))
            for agg in AGGREGATORS:
                out[f"{kind}/{int(100 * frac)}%/{agg}"] = [
                    f"attack.kind={kind}", f"attack.fraction={frac}", f"attack.strength={strength}",
                    f"robust.aggregator={agg}", f"robust.trim={frac}", f"robust.num_byzantine={f}"]
    return out


def run(out: Path, quick: bool = False, datasets: tuple[str, ...] = ("synthetic", "fmnist"),
        config_dir: Path | None = None) -> dict[str, Any]:
    from ..config import load
    from ..reproduce import run_methods
    from ..resources import configs_root

    config_dir = config_dir or configs_root() / "robust"
    out.mkdir(parents=True, exist_ok=True)
    quick_ov = ["run.rounds=6", "run.eval_every=3", "run.checkpoint_every=3"] if quick else []
    result: dict[str, Any] = {"quick": quick}
    for ds in datasets:
        base = config_dir / f"{ds}.toml"
        n = load(base, []).data.get("num_clients", 100)
        settings = {"clean": [], **_settings(int(n), quick)}
        table: dict[str, dict[str, float | None]] = {}
        for method, msets in METHODS.items():
            labels = {f"{method}:{label}": [*msets, *sets] for label, sets in settings.items()}
            res = run_methods(out / ds, base, labels, quick_ov, allow_diverged=True)
            for label, s in res.items():
                acc = s["final"]["seen_test_acc_mean"]
                table.setdefault(label.split(":", 1)[1], {})[method] = None if s.get("diverged") else 100 * acc
            noise = NOISE[:2] if quick else NOISE
            priv = {f"{method}:dp{z}": [*msets, "privacy.clip_norm=1.0", f"privacy.noise_multiplier={z}",
                                        "run.sampling_rate=0.2"] for z in noise}
            pres = run_methods(out / ds, base, priv, quick_ov, allow_diverged=True)
            pts = sorted((float(s["epsilon"]), 100 * s["final"]["seen_test_acc_mean"]) for s in pres.values()
                         if not s.get("diverged"))
            result.setdefault(ds, {})[f"{method}_privacy"] = [{"epsilon": e, "acc": a} for e, a in pts]
        result.setdefault(ds, {})["accuracy"] = table
        clean = table["clean"]
        worst_gap: dict[str, float | None] = {}
        for method in METHODS:
            for kind in (["scale"] if quick else list(ATTACKS)):
                key = f"{kind}/30%"
                ok = [v[method] for lbl, v in table.items() if lbl.startswith(key + "/") and v[method] is not None]
                worst_gap[f"{method} {key}"] = clean[method] - max(ok) if ok else None  # type: ignore[operator]
        result[ds]["clean_minus_best_robust"] = worst_gap
    write_report(out, result)
    return result


def write_report(out: Path, result: dict[str, Any]) -> None:
    """``robustness.md``, ``robustness.json``, ``summary.json`` and ``privacy.png`` from a study's results."""
    quick = bool(result.get("quick"))
    md = [f"# Robustness{' (quick: 6 rounds, scale attack only)' if quick else ''}: final mean test accuracy (%) per "
          "method; clean run, then attack / attackers / aggregator; `–`: training diverged (every update NaN/Inf "
          "for 3 rounds)\n"]
    curves: dict[str, tuple[list[float], list[float]]] = {}
    for ds, r in result.items():
        if not isinstance(r, dict):
            continue
        table = r["accuracy"]
        md.append(f"\n## {ds}\n\n" + condensed(table, quick))
        md.append("\nEvery setting:\n\n" + markdown_table(["setting", *METHODS], [[lbl, *(v[m] for m in METHODS)]
                                                                         for lbl, v in table.items()]))
        md.append("\nClean accuracy minus the best aggregator's accuracy under 30% attackers (points):\n\n"
                  + markdown_table(["method / attack", "gap"],
                                   [[k, v] for k, v in r["clean_minus_best_robust"].items()]))
        for method in METHODS:
            pts = r.get(f"{method}_privacy", [])
            curves[f"{ds} {method}"] = ([p["epsilon"] for p in pts], [p["acc"] for p in pts])
    plot_curves(out / "privacy.png", curves, "final mean test accuracy (%)",
                f"privacy-utility{' (quick)' if quick else ''}: epsilon at delta = 1e-5 (RDP)", xlabel="epsilon")
    write_table(out / "robustness.md", "\n".join(md) + "\n")
    write_json(out / "robustness.json", result)
    write_json(out / "summary.json", result)
    print("\n".join(md))


def condensed(table: dict[str, dict[str, float | None]], quick: bool = False) -> str:
    """Per attack at 30% attackers: each method's accuracy under the plain mean and under its best robust
    aggregator (named), beside the clean accuracy."""

    def fmt(v: float | None) -> str:
        return "diverged" if v is None else f"{v:.1f}"

    rows = [["clean", *(fmt(table["clean"][m]) for m in METHODS)]]
    for kind in (["scale"] if quick else list(ATTACKS)):
        key = f"{kind}/30%/"
        cells = []
        for m in METHODS:
            mean = table.get(key + "mean", {}).get(m)
            robust = [(v[m], lbl[len(key):]) for lbl, v in table.items()
                      if lbl.startswith(key) and not lbl.endswith("/mean") and v[m] is not None]
            best = max(robust) if robust else None
            cells.append(f"{fmt(mean)} -> {'diverged' if best is None else f'{best[0]:.1f} ({best[1]})'}")
        rows.append([f"{kind}, 30% attackers", *cells])
    return ("Final mean test accuracy (%): clean; under each attack with 30% attackers, the plain mean -> the best "
            "robust aggregator (which):\n\n" + markdown_table(["setting", *METHODS], rows))


__all__ = ["condensed", "run", "write_report"]
