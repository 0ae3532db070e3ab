"""``fedmtl compare`` over run directories whose files are wrong: refused in one line naming the file and the key
(exit 2) before anything is written, so a comparison ``--out`` already holds stays as it was."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fedmtl.cli import main

METRICS_CSV = "round,seen_test_acc_mean,seen_train_loss\n1,0.4,0.9\n2,0.5,0.7\n"
CLIENTS_CSV = "group,client,split,n,acc,loss\nseen,0,test,10,0.5,0.7\nseen,1,test,10,0.6,0.6\n"


def _run(d: Path, final: dict[str, Any] | None = None, **summary: Any) -> Path:
    """A finished run directory written by hand: summary.json, metrics.csv, clients.csv."""
    d.mkdir(parents=True)
    body = {"algorithm": "fedavg", "final": final or {"seen_test_acc_mean": 0.5, "seen_train_loss": 0.7},
            "config": {"data": {"name": "toy"}}, **summary}
    (d / "summary.json").write_text(json.dumps(body))
    (d / "metrics.csv").write_text(METRICS_CSV)
    (d / "clients.csv").write_text(CLIENTS_CSV)
    return d


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], *names: str) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for n in names:
        assert n in err, (n, err)
    return err


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.mark.parametrize("bad", ["metrics field", "clients acc"])
def test_a_failed_compare_leaves_the_old_comparison_and_writes_nothing(tmp_path, capsys, bad):
    good, broken = _run(tmp_path / "good"), _run(tmp_path / "broken")
    if bad == "metrics field":
        with (broken / "metrics.csv").open("a") as f:
            f.write("3," + "x" * 200_000 + "\n")
    else:
        (broken / "clients.csv").write_text(CLIENTS_CSV + "seen,2,test,10,7.5,0.1\n")
    cx, cy = tmp_path / "cx", tmp_path / "cy"
    assert main(["compare", str(good), "--out", str(cx)]) == 0
    before = _files(cx)
    assert {"compare.md", "compare.json", "curves.png", "clients.png"} <= set(before)
    _refused(["compare", str(broken), "--out", str(cx), "--overwrite"], capsys, str(broken))
    assert _files(cx) == before  # the old comparison, whole, and nothing beside it
    _refused(["compare", str(broken), "--out", str(cy)], capsys, str(broken))
    assert not cy.exists() or not list(cy.iterdir())
    assert main(["compare", str(good), "--out", str(cy)]) == 0  # a retry is not blocked by a half-written folder


def test_overwrite_removes_plots_the_new_comparison_has_not(tmp_path):
    a = _run(tmp_path / "a")
    b = _run(tmp_path / "b")
    (b / "metrics.csv").unlink()
    (b / "clients.csv").unlink()
    out = tmp_path / "cmp"
    assert main(["compare", str(a), "--out", str(out)]) == 0
    assert (out / "curves.png").exists()
    assert main(["compare", str(b), "--out", str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["compare.json", "compare.md"]


@pytest.mark.parametrize("config", ["x", [1, 2], 3])
def test_a_config_that_is_not_a_table_is_refused_by_name(tmp_path, capsys, config):
    r = _run(tmp_path / "r", config=config)
    _refused(["compare", str(r), "--out", str(tmp_path / "cmp")], capsys, "summary.json", "config")
    assert not (tmp_path / "cmp").exists()


@pytest.mark.parametrize(("key", "value"), [("seen_test_acc_mean", 1e308), ("seen_test_acc_mean", -3.5),
                                            ("seen_test_acc_p10", 1.5), ("seen_train_loss", -0.1)])
def test_impossible_summary_values_are_refused_by_name(tmp_path, capsys, key, value):
    r = _run(tmp_path / "r", final={"seen_test_acc_mean": 0.5, "seen_test_acc_p10": 0.2, "seen_train_loss": 0.7,
                                    key: value})
    _refused(["compare", str(r), "--out", str(tmp_path / "cmp")], capsys, "summary.json", key)


@pytest.mark.parametrize("acc", ["1e308", "-3.5", "inf"])
def test_impossible_client_accuracies_are_refused_by_name(tmp_path, capsys, acc):
    r = _run(tmp_path / "r")
    (r / "clients.csv").write_text(CLIENTS_CSV + f"seen,2,test,10,{acc},0.1\n")
    _refused(["compare", str(r), "--out", str(tmp_path / "cmp")], capsys, "clients.csv", "acc")


def test_a_loss_above_one_is_a_loss(tmp_path, capsys):
    r = _run(tmp_path / "r", final={"seen_test_acc_mean": 0.5, "seen_train_loss": 12.5})
    assert main(["compare", str(r), "--out", str(tmp_path / "cmp"), "--metric", "seen_train_loss"]) == 0
    assert "| 12.5000 |" in (tmp_path / "cmp" / "compare.md").read_text()


def test_the_same_run_directory_twice_is_refused(tmp_path, capsys):
    r = _run(tmp_path / "r")
    (tmp_path / "link").symlink_to(r)
    for argv in ([str(r), str(r)], [str(r), str(tmp_path / "link")], [str(r), str(r / ".." / "r")]):
        _refused(["compare", *argv, "--out", str(tmp_path / "cmp")], capsys, "twice")
    assert not (tmp_path / "cmp").exists()


def test_a_seed_folder_listed_twice_is_refused(tmp_path, capsys):
    top = tmp_path / "seeds"
    _run(top / "seed-1")
    (top / "summary.json").write_text(json.dumps({"algorithm": "fedavg", "final": {}, "seeds": [1, 1],
                                                  "runs": ["seed-1", "seed-1"]}))
    _refused(["compare", str(top), "--out", str(tmp_path / "cmp")], capsys, "summary.json", "seed-1")


def test_an_algorithm_name_cannot_break_the_table(tmp_path, capsys):
    a = _run(tmp_path / "a", algorithm="fed|avg\n| x | y |")
    b = _run(tmp_path / "b", algorithm="local")
    out = tmp_path / "cmp"
    assert main(["compare", str(a), str(b), "--out", str(out)]) == 0
    rows = (out / "compare.md").read_text().split("\n\n", 1)[1].strip().splitlines()
    assert len(rows) == 4  # header, rule, one row per run
    cells = [len(row.replace("\\|", "").split("|")) for row in rows]
    assert len(set(cells)) == 1, rows
    assert json.loads((out / "compare.json").read_text())["algorithms"]["a"] == "fed|avg\n| x | y |"


def test_a_loss_metric_is_a_number_sorted_lowest_first(tmp_path, capsys):
    low = _run(tmp_path / "low", final={"seen_test_acc_mean": 0.4, "seen_train_loss": 0.25})
    high = _run(tmp_path / "high", final={"seen_test_acc_mean": 0.6, "seen_train_loss": 0.75})
    out = tmp_path / "cmp"
    assert main(["compare", str(high), str(low), "--out", str(out), "--metric", "seen_train_loss"]) == 0
    md = (out / "compare.md").read_text()
    rows = [r for r in md.splitlines() if r.startswith("| low") or r.startswith("| high")]
    assert rows[0].startswith("| low |") and "| 0.2500 |" in rows[0], md
    assert "| 25.00 |" not in md and "| 0.7500 |" in rows[1]
    assert json.loads((out / "compare.json").read_text())["order"] == ["low", "high"]
    # an accuracy stays in percent, highest first
    assert main(["compare", str(low), str(high), "--out", str(out), "--overwrite"]) == 0
    assert json.loads((out / "compare.json").read_text())["order"] == ["high", "low"]
