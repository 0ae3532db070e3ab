"""The main job (``make run``): every method on FedEM's synthetic data beside the paper's Table 1.

Runs each config of ``configs/synthetic/`` on the legacy generator (the data the paper measured)
and on the corrected generator, then writes ``OUT/main.md`` and ``OUT/main.json`` with average and
bottom-decile test accuracy (final round) beside the published Synthetic row of Marfoq et al. (2021).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from .config import ConfigError, load
from .experiment import run_experiment
from .report import markdown_table, write_json

#: Marfoq et al. (NeurIPS 2021), Table 1, Synthetic: average / bottom decile test accuracy (%).
PAPER_SYNTHETIC: dict[str, tuple[float, float]] = {
    "local": (65.7, 58.4),
    "fedavg": (68.2, 58.9),
    "fedprox": (68.2, 59.0),
    "fedavg+": (68.9, 60.2),
    "clustered": (69.1, 59.0),
    "pfedme": (69.2, 61.2),
    "fedem": (74.7, 66.7),
}
ORDER = ["local", "fedavg", "fedprox", "fedavg+", "clustered", "pfedme", "fedem"]


def _configs(config_dir: Path) -> list[Path]:
    files = sorted(config_dir.glob("*.toml"))
    if not files:
        raise ConfigError(f"{config_dir}: no *.toml configs found")
    rank = {n: i for i, n in enumerate(ORDER)}
    return sorted(files, key=lambda p: (rank.get(p.stem, len(ORDER)), p.stem))


def run_suite(out: Path, config_dir: Path, variants: dict[str, bool], overrides: list[str]) -> dict[str, Any]:
    """Run every config for each data variant (name -> legacy flag); returns the results dict."""
    results: dict[str, Any] = {}
    data_cache: dict[str, Any] = {}
    for variant, legacy in variants.items():
        results[variant] = {}
        for path in _configs(config_dir):
            cfg = load(path, [*overrides, f"data.legacy={'true' if legacy else 'false'}"])
            key = repr(sorted(cfg.data.items()))
            if key not in data_cache:
                data_cache.clear()
                data_cache[key] = cfg.build_data()
            run_dir = out / "runs" / variant / path.stem
            t0 = time.perf_counter()
            try:
                summary = run_experiment(cfg, run_dir, resume=True, data=data_cache[key])
            except ConfigError:  # an older run with another config: start over
                shutil.rmtree(run_dir)
                summary = run_experiment(cfg, run_dir, data=data_cache[key])
            f = summary["final"]
            name = cfg.algorithm["name"]
            results[variant][name] = {
                "avg": 100 * f["seen_test_acc_mean"],
                "bottom_decile": 100 * f["seen_test_acc_p10"],
                "bottom10_mean": 100 * f["seen_test_acc_bottom10_mean"],
                "unseen_avg": 100 * f["unseen_test_acc_mean"] if "unseen_test_acc_mean" in f else None,
                "rounds": summary["rounds"],
                "seconds": time.perf_counter() - t0,
                "seconds_per_round": summary["seconds_per_round"],
            }
            r = results[variant][name]
            print(f"[{variant}] {name:10s} avg {r['avg']:5.1f}  p10 {r['bottom_decile']:5.1f}  "
                  f"worst-10% mean {r['bottom10_mean']:5.1f}  ({r['seconds']:.0f} s)", flush=True)
    return results


def render(results: dict[str, Any], rounds_note: str) -> str:
    md = [f"# FedEM synthetic data: test accuracy (%) across clients, final round ({rounds_note})\n",
          "`avg` = unweighted mean over clients; `p10` = 10th percentile (our bottom-decile definition); "
          "`worst10` = mean of the worst 10% of clients. Paper = Marfoq et al. 2021, Table 1, Synthetic.\n"]
    for variant, rows in results.items():
        md.append(f"\n## data: {variant} generator\n")
        body = []
        for name, r in rows.items():
            paper = PAPER_SYNTHETIC.get(name, (None, None))
            body.append([name, r["avg"], r["bottom_decile"], r["bottom10_mean"], paper[0], paper[1],
                         f"{r['seconds_per_round'] * 1000:.0f} ms" if r.get("seconds_per_round") else "–"])
        md.append(markdown_table(["method", "avg", "p10", "worst10", "paper avg", "paper bottom", "time/round"], body))
    return "\n".join(md)


def main_job(out: Path, config_dir: Path, quick: bool = False) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    overrides = ["run.rounds=20", "run.eval_every=10", "run.checkpoint_every=10"] if quick else []
    t0 = time.perf_counter()
    results = run_suite(out, config_dir, {"legacy": True, "correct": False}, overrides)
    md = render(results, "quick: 20 rounds" if quick else "200 rounds")
    (out / "main.md").write_text(md)
    write_json(out / "main.json", {"results": results, "paper": PAPER_SYNTHETIC,
                                   "total_seconds": time.perf_counter() - t0})
    print()
    print(md)
    print(f"written: {out / 'main.md'}, {out / 'main.json'}  ({time.perf_counter() - t0:.0f} s)")
    return results
