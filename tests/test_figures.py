"""Figures a paper can use: the summary figure of a reproduction, grouped bars for categorical sweeps, widths
capped, vector output beside PNG, no per-run figures inside a reproduction."""

from __future__ import annotations

import json

import matplotlib.image as mpimg
import pytest

from fedmtl.cli import main
from fedmtl.config import read_toml
from fedmtl.runs.report import MAX_WIDTH_IN, plot_bars, run_figures


def _png_width(path) -> int:
    return int(mpimg.imread(path).shape[1])


@pytest.mark.slow
def test_grouped_bars_of_many_methods_and_datasets_stay_within_the_width_cap(tmp_path):
    """30 methods x 3 datasets x 2 series: one PNG (and its PDF) no wider than MAX_WIDTH_IN at 120 dpi (plus the
    legend's and labels' margin that bbox_inches='tight' keeps)."""
    panels = {f"dataset {d}": {f"method-{m:02d}": {"average": (50.0 + m, 1.0), "bottom decile (p10)": (30.0 + m, None)}
                               for m in range(30)} for d in range(3)}
    plot_bars(tmp_path / "bars.png", panels, "accuracy (%)", "30 methods", horizontal=True)
    assert (tmp_path / "bars.pdf").read_bytes()[:4] == b"%PDF"
    assert _png_width(tmp_path / "bars.png") <= MAX_WIDTH_IN * 120 + 200


@pytest.mark.slow
def test_reproduction_draws_one_summary_figure_and_no_per_run_figures(tmp_path, monkeypatch):
    """``run_methods`` (what the reproductions run) keeps each dataset's final average and bottom-decile accuracy
    (mean and std over seeds) in figure.json, equal to the runs' summaries; ``summary_figure`` draws summary.png and
    .pdf from it; inside ``run_figures(False)`` no run writes accuracy.png."""
    from fedmtl.experiments.common import AVG, P10, run_methods, summary_figure
    from fedmtl.resources import config_path

    methods = {"FedAvg": ["algorithm.name=fedavg"], "Local": ["algorithm.name=local"]}
    ov = ["data.num_clients=6", "data.n_test=20", "run.rounds=2", "run.eval_every=2", "run.checkpoint_every=0"]
    with run_figures(False):
        res = run_methods(tmp_path / "syn", config_path("synthetic/fedavg"), methods, ov, seeds=[1, 2])
    assert not list(tmp_path.rglob("accuracy.png"))
    panels = json.loads((tmp_path / "syn" / "figure.json").read_text())["panels"]
    (title, rows), = panels.items()
    assert "fedem_synthetic" in title and set(rows) == {"FedAvg", "Local"}
    for label, r in res.items():
        assert rows[label][AVG][0] == pytest.approx(100 * r["final"]["seen_test_acc_mean"])
        assert rows[label][AVG][1] == pytest.approx(100 * r["final_std"]["seen_test_acc_mean"])
        assert rows[label][P10][0] == pytest.approx(100 * r["final"]["seen_test_acc_p10"])
    assert summary_figure(tmp_path, "two methods") == tmp_path / "summary.png"
    assert (tmp_path / "summary.png").stat().st_size > 5000 and (tmp_path / "summary.pdf").exists()
    assert summary_figure(tmp_path / "syn" / "runs", "nothing") is None  # no panels: no figure


@pytest.mark.slow
def test_a_categorical_sweep_draws_grouped_bars_titled_with_algorithm_and_dataset(tmp_path, monkeypatch):
    """Sweeping a categorical key (the algorithm) draws bars, one group per value, never lines joining methods;
    the title names the algorithms and the dataset."""
    import fedmtl.runs.report as report

    drawn = {}

    def spy(path, panels, value_label, title, horizontal=False, vector=True):
        drawn.update(panels=panels, title=title)
        return plot_bars(path, panels, value_label, title, horizontal, vector)

    monkeypatch.setattr(report, "plot_bars", spy)
    raw = read_toml("synthetic/fedavg")
    raw["data"].update(num_clients=6, n_test=20)
    raw["run"].update(rounds=2, eval_every=2, checkpoint_every=0)
    from fedmtl.config import dumps

    cfg = tmp_path / "c.toml"
    cfg.write_text(dumps(raw))
    out = tmp_path / "sweep"
    assert main(["sweep", str(cfg), "--set", "algorithm.name=fedavg,local", "--out", str(out), "-q"]) == 0
    (panel,) = drawn["panels"].values()
    assert list(panel) == ["fedavg", "local"] and drawn["title"].startswith("fedavg/local on fedem_synthetic")
    assert (out / "sweep.png").exists() and (out / "sweep.pdf").exists()
