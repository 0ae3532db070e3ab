"""``fedmtl reproduce tuned``: every registered method has a search space, the tuning never reads the test split,
the reruns' standard errors are std/sqrt(n) of their seeds, the tuned configs run, an interrupted call continues."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("optuna")

from fedmtl.cli import EXIT_INPUT, main  # noqa: E402
from fedmtl.config import load  # noqa: E402
from fedmtl.experiments import tuned  # noqa: E402
from fedmtl.resources import config_path  # noqa: E402
from fedmtl.runs.tune import read_space  # noqa: E402

from .conftest import built_once  # noqa: E402

METHODS = ["fedavg", "ditto"]
FED = "synthetic_mixture"


def test_every_registered_method_has_a_space_or_a_reason():
    """A method added to the registry without an entry in tuned.toml (or an [unfit] reason) fails here."""
    reg = tuned.registered()
    missing = [m for m in reg if m not in tuned.METHODS and m not in tuned.UNFIT]
    assert not missing, f"registered methods with no space in experiments/tuned.toml: {missing}"
    assert all(tuned.METHODS[m].get("source") for m in tuned.METHODS), "every range cites where it comes from"


def test_every_space_applies_to_every_federation(tmp_path):
    """Every bound and choice of every space builds a valid config of every federation, as fedmtl tune checks."""
    for m in tuned.plan()["methods"]:
        for fed, spec in tuned.FEDERATIONS.items():
            path = tmp_path / f"{m}.toml"
            path.write_text(tuned.space_toml(tuned.method_space(m, fed)))
            params = read_space(path)
            searched = [q.key for q in params]
            assert ("optim.lr" in searched) == tuned.METHODS[m].get("optim_lr", True), (m, searched)
            assert params[0].log and len(searched) >= 1
            sets = [*spec["sets"], *tuned.method_settings(m, fed)]
            for p in params:
                for v in p.candidates():
                    cfg = load(config_path(spec["config"]), [*sets, f"{p.key}={v}"])
                    assert cfg.algorithm.get("name", m) == m


def test_options_of_tuned_only_and_unknown_names_refused(tmp_path, capsys):
    assert main(["reproduce", "perfedavg", "--out", str(tmp_path / "a"), "--trials", "3"]) == EXIT_INPUT
    assert "fedmtl reproduce tuned only" in capsys.readouterr().err
    assert main(["reproduce", "tuned", "--out", str(tmp_path / "b"), "--methods", "nope"]) == EXIT_INPUT
    assert "--methods nope" in capsys.readouterr().err
    assert main(["reproduce", "tuned", "--out", str(tmp_path / "c"), "--federations", "mars"]) == EXIT_INPUT
    for option in ("--methods", "--federations"):  # naming nothing: refused, not read as "all"
        for empty in ("", ","):
            assert main(["reproduce", "tuned", "--quick", "--out", str(tmp_path / "d"), option, empty]) == EXIT_INPUT
            assert f"{option} '{empty}': names nothing" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists() and not (tmp_path / "d").exists()
    full = tmp_path / "full"
    full.mkdir()
    (full / "summary.json").write_text('{"quick": false, "federations": {}}')
    assert main(["reproduce", "tuned", "--out", str(full), "--quick", "--resume"]) == EXIT_INPUT
    assert "holds a full-budget table" in capsys.readouterr().err
    assert sorted(x.name for x in full.iterdir()) == ["summary.json"]
    (full / "summary.json").write_text('{"quick": false, "federations": {"synthetic_mix')  # cut short
    assert main(["reproduce", "tuned", "--out", str(full), "--resume", "--methods", "fedavg"]) == EXIT_INPUT
    assert "summary.json: unreadable" in capsys.readouterr().err
    assert (full / "summary.json").read_text().endswith("synthetic_mix")


@pytest.mark.slow
def test_optim_lr_is_searched_for_exactly_the_methods_that_read_it():
    """A method that never reads ``optim.lr`` would have a dimension of its study that changes nothing (as
    Per-FedAvg's once did: its outer step is its own ``beta``): every method in tuned.toml trained a round at two
    rates, its server and client states must differ iff its space searches ``optim.lr``."""
    import torch

    from fedmtl import tree as T
    from fedmtl.algorithms import ALGORITHMS
    from fedmtl.optim import SGD
    from fedmtl.testing import all_client_states, run_rounds, simulator, toy_data, toy_model

    data = toy_data()
    wrong = []
    for m in tuned.plan()["methods"]:
        cls = ALGORITHMS[m]
        states = []
        for lr in (0.01, 0.1):
            eng = simulator(cls(**dict(cls.toy.kwargs)), data, toy_model(cls, data), SGD(lr=lr), rounds=1)
            st, _ = run_rounds(eng, 1)
            states.append(T.leaves((st.server, all_client_states(eng))))
        reads = any(a.shape != b.shape or not torch.equal(a, b) for a, b in zip(*states, strict=True))
        if reads != tuned.METHODS[m].get("optim_lr", True):
            wrong.append((m, "reads optim.lr" if reads else "never reads optim.lr"))
    assert not wrong, f"tuned.toml's optim_lr disagrees with training: {wrong}"


def test_standard_error_is_std_over_sqrt_n():
    v = [61.0, 64.5, 63.0, 59.5, 66.0]
    assert tuned.se(v) == pytest.approx(np.std(v, ddof=1) / math.sqrt(5), rel=1e-12)
    assert tuned.se([1.0]) is None


@pytest.fixture(scope="session")
def quick(tmp_path_factory):
    """Two calls into one folder, the second (ditto) run while the first (fedavg) is between its study and its
    rerun, as two processes building one table would: the table keeps both rows (each call reads the stored table
    again, under the folder's lock, before it writes).  Built once per test run (``built_once``): the folder is
    shared, a test that writes there works on a copy (``_copy``)."""
    out, argv = built_once(tmp_path_factory, "tuned", _two_calls)
    return Path(out), argv


def _two_calls(folder: Path) -> tuple[str, list[str]]:
    out = folder / "q"
    base = ["reproduce", "tuned", "--out", str(out), "--quick", "--trials", "2", "--federations", FED]
    real, meanwhile = tuned.rerun, []

    def rerun_while_another_call_runs(*args, **kwargs):
        if not meanwhile:
            meanwhile.append(True)
            assert main([*base, "--methods", METHODS[1], "--resume"]) == 0  # a folder in use: --resume
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tuned, "rerun", rerun_while_another_call_runs)
        assert main([*base, "--methods", METHODS[0]]) == 0
    assert meanwhile
    return str(out), [*base, "--methods", ",".join(METHODS)]


def _copy(quick: tuple[Path, list[str]], to: Path) -> tuple[Path, list[str]]:
    """``quick``'s folder copied to ``to`` and its command aimed at the copy: for a test that writes there."""
    import shutil

    out, argv = quick
    shutil.copytree(out, to)
    return to, [str(to) if a == str(out) else a for a in argv]


@pytest.mark.slow
def test_quick_writes_table_json_and_configs(quick):
    out, _ = quick
    s = json.loads((out / "summary.json").read_text())
    assert s["quick"] and s["trials"] == 2 and s["seeds"] == tuned.QUICK["seeds"]
    rows = s["federations"][FED]["methods"]
    assert list(rows) == METHODS and s["federations"][FED]["rounds"] == 2  # both calls' rows, in tuned.toml's order
    assert s["command"] == f"fedmtl reproduce tuned --out DIR --quick --methods {','.join(METHODS)} --federations {FED}"
    md = (out / "tuned.md").read_text()
    assert md.startswith("# QUICK") and "| ditto |" in md
    assert md == tuned.tuned_markdown(out)
    for m in METHODS:
        assert set(rows[m]["best_params"]) == {k for t, ks in tuned.method_space(m, FED).items()
                                               for k in (f"{t}.{x}" for x in ks)}
        text = (out / "configs" / FED / f"{m}.toml").read_text()
        assert "QUICK" in text and "fedmtl reproduce tuned" in text and f'name = "{m}"' in text
        cfg = load(out / "configs" / FED / f"{m}.toml")
        assert cfg.run.rounds == 50 and cfg.optim.lr == pytest.approx(rows[m]["best_params"]["optim.lr"])


@pytest.mark.slow
def test_standard_errors_from_the_reruns_per_seed_values(quick):
    """avg/p10 and their standard errors are those of the rerun seeds' own final summaries."""
    out, _ = quick
    rows = json.loads((out / "summary.json").read_text())["federations"][FED]["methods"]
    for m in METHODS:
        per_seed = [json.loads((out / "reruns" / FED / m / "runs" / f"seed-{s}" / "summary.json").read_text())
                    for s in tuned.QUICK["seeds"]]
        avg = [100 * r["final"]["seen_test_acc_mean"] for r in per_seed]
        p10 = [100 * r["final"]["seen_test_acc_p10"] for r in per_seed]
        n = len(avg)
        assert rows[m]["avg"] == pytest.approx(np.mean(avg), abs=1e-9)
        assert rows[m]["avg_se"] == pytest.approx(np.std(avg, ddof=1) / math.sqrt(n), abs=1e-9)
        assert rows[m]["p10_se"] == pytest.approx(np.std(p10, ddof=1) / math.sqrt(n), abs=1e-9)


@pytest.mark.slow
def test_test_split_read_in_the_reruns_only(quick):
    out, _ = quick
    for m in METHODS:
        trials = sorted((out / "studies" / FED / m / "trials").glob("*/seed-1/metrics.csv"))
        assert trials
        for f in trials:
            header = f.read_text().splitlines()[0]
            assert "seen_val_acc_mean" in header and "test" not in header
        rerun = (out / "reruns" / FED / m / "runs" / "seed-1" / "metrics.csv").read_text().splitlines()[0]
        assert "seen_test_acc_mean" in rerun


@pytest.mark.slow
def test_tuned_config_runs_and_a_second_call_reads_back(quick, tmp_path):
    out, argv = _copy(quick, tmp_path / "q")  # the call below takes the folder's lock and may write there
    cfg = out / "configs" / FED / "ditto.toml"
    assert main(["run", str(cfg), "--out", str(tmp_path / "run"), "--set", "run.rounds=1",
                 "--set", "data.num_clients=5", "--quiet"]) == 0
    assert (tmp_path / "run" / "summary.json").exists()
    done = out / "reruns" / FED / "ditto" / "result.json"
    before = (done.stat().st_mtime_ns, json.loads((out / "summary.json").read_text()))
    assert main([*argv, "--resume"]) == 0  # every study complete, every rerun finished: nothing runs again
    assert done.stat().st_mtime_ns == before[0]
    assert json.loads((out / "summary.json").read_text()) == before[1]
    db = out / "studies" / FED / "ditto" / "tune.json"
    assert json.loads(db.read_text())["n_trials"]["complete"] + json.loads(db.read_text())["n_trials"]["pruned"] == 2


def test_bundled_tuned_configs_name_their_study():
    root = config_path("tuned/x").parent
    files = sorted(root.glob("*/*.toml"))
    assert files, "no bundled tuned configs"
    for f in files:
        head = f.read_text().splitlines()[:4]
        assert any("fedmtl reproduce tuned" in ln for ln in head), f"{f}: no study named in its header"
        assert f.parent.name in tuned.FEDERATIONS
        assert load(f"tuned/{f.parent.name}/{f.stem}").algorithm["name"] == f.stem  # fedmtl run tuned/FED/METHOD


def test_per_federation_entries_replace_the_methods(monkeypatch):
    entry = {"source": "x", "space": {"algorithm": {"head_epochs": {"low": 1, "high": 10, "int": True}}},
             "federations": {"fmnist_cnn": {"space": {"algorithm": {"head_epochs": {"low": 1, "high": 3, "int": True}}},
                                            "settings": {"run": {"local_epochs": 2}}}}}
    monkeypatch.setitem(tuned.METHODS, "fedrep", entry)
    assert tuned.method_space("fedrep", "fmnist_cnn")["algorithm"]["head_epochs"]["high"] == 3
    assert tuned.method_space("fedrep", "fmnist_mlp")["algorithm"]["head_epochs"]["high"] == 10
    assert tuned.method_space("fedrep", "fmnist_mlp")["optim"]["lr"] == tuned.FEDERATIONS["fmnist_mlp"]["lr"]
    assert tuned.method_settings("fedrep", "fmnist_cnn") == ["algorithm.name=fedrep", "run.local_epochs=2"]
    assert tuned.method_settings("fedrep", "fmnist_mlp") == ["algorithm.name=fedrep"]


def test_tuned_values_name_a_best_value_at_an_end_of_its_range():
    """The table's second part: each tuned value, marked where it lies at an end of the range searched (the row's
    stored space, else this version's tuned.toml)."""
    space = {"optim": {"lr": {"low": 0.005, "high": 0.5, "log": True}},
             "algorithm": {"mu": {"choices": [0.001, 0.01, 0.1, 1.0]}}}
    row = {"best_params": {"optim.lr": 0.0051, "algorithm.mu": 0.01}, "space": space}
    assert tuned.tuned_values("fedprox", "fmnist_mlp", row) == "lr = 0.0051 (low end), mu = 0.01"
    old = {"best_params": {"optim.lr": 0.05, "algorithm.mu": 1.0}}  # a row stored before spaces were kept
    assert tuned.tuned_values("fedprox", "fmnist_mlp", old) == "lr = 0.05, mu = 1 (high end)"
    md = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "tuned" / "fmnist_mlp" / "tuned.md"
    text = md.read_text()
    rows = json.loads((md.parent / "summary.json").read_text())["federations"]["fmnist_mlp"]["methods"]
    assert rows
    for m, r in rows.items():
        assert f"| {m} | {tuned.tuned_values(m, 'fmnist_mlp', r)} |" in text


def test_device_option_checked_first_and_recorded(tmp_path, capsys):
    """``--device``: tuned only, its value checked (and that the machine has it) before anything is written; the CPU
    adds no setting (a study begun without ``--device`` is the same study); a row measured elsewhere is named in the
    table's header."""
    import torch

    assert main(["reproduce", "perfedavg", "--out", str(tmp_path / "a"), "--device", "cpu"]) == EXIT_INPUT
    assert "--device: options of fedmtl reproduce tuned only" in capsys.readouterr().err
    assert main(["reproduce", "tuned", "--out", str(tmp_path / "b"), "--device", "gpu"]) == EXIT_INPUT
    assert "--device must be" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["reproduce", "tuned", "--out", str(tmp_path / "c"), "--device", "cuda"]) == EXIT_INPUT
        assert "no CUDA device" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
    assert tuned.device_sets(None) == tuned.device_sets("cpu") == []
    spec = tuned.FEDERATIONS["fmnist_cnn"]
    cfg = load(config_path(spec["config"]), [*spec["sets"], *tuned.device_sets("cuda:1")])
    assert cfg.run.device == "cuda:1"  # the setting as the trials and reruns get it (checked, not built, here)
    row = {"avg": 80.0, "p10": 60.0, "seconds": 3600.0}
    fed = {"title": "t", "clients": 5, "rounds": 2, "methods": {"fedavg": {**row, "device": "cuda"},
                                                                 "local": dict(row)}}
    (tmp_path / "summary.json").write_text(json.dumps(
        {"quick": False, "trials": 20, "seeds": [1], "objective": "o", "tune_seeds": [1], "command": "c",
         "federations": {"fmnist_cnn": fed}}))
    assert "2 rounds, 2.00 h (measured on cpu, cuda)" in tuned.tuned_markdown(tmp_path)
    del fed["methods"]["fedavg"]
    (tmp_path / "summary.json").write_text(json.dumps(
        {"quick": False, "trials": 20, "seeds": [1], "objective": "o", "tune_seeds": [1], "command": "c",
         "federations": {"fmnist_cnn": fed}}))
    assert "2 rounds, 1.00 h (the measured time" in tuned.tuned_markdown(tmp_path)


def test_values_beyond_an_end_of_a_range_or_a_grid():
    """Past a range's end: x2 and x4 (or /), integers rounded; past a grid's end: one and two grid steps, geometric
    where the choices are positive, else arithmetic; nothing repeats the tuned value."""
    from fedmtl.experiments.tuned_edges import beyond
    from fedmtl.runs.tune import Param

    assert beyond(Param("optim.lr", 0.01, 1.0, log=True), 0.98, "high") == [1.96, 3.92]
    assert beyond(Param("optim.lr", 0.01, 1.0, log=True), 0.01, "low") == [0.005, 0.0025]
    assert beyond(Param("algorithm.k", 1, 5, is_int=True), 5, "high") == [10, 20]
    assert beyond(Param("algorithm.k", 1, 5, is_int=True), 1, "low") == [0]  # 1/2 and 1/4 both round to 0
    assert beyond(Param("algorithm.mu", choices=(0.001, 0.01, 0.1, 1.0)), 0.001, "low") == [0.0001, 1e-05]
    assert beyond(Param("algorithm.mu", choices=(0.001, 0.01, 0.1, 1.0)), 1.0, "high") == [10.0, 100.0]
    assert beyond(Param("algorithm.m", choices=(0, 2, 4)), 4, "high") == [6, 8]
    assert beyond(Param("algorithm.m", choices=(0, 2, 4)), 0, "low") == [-2, -4]  # the config refuses them
    assert beyond(Param("algorithm.mu", choices=(0.1, 1.0, 5.0, 10.0)), 0.1, "low") == [0.01, 0.001]


@pytest.mark.slow
def test_probe_edges_remeasures_the_study_and_goes_past_the_end(quick, tmp_path, capsys):
    """``--probe-edges`` on a stored table: only the values at an end are probed; at the tuned value it measures
    the study's best value again (the same config and seed), past the end it measures or names the config's
    refusal; a second call reads every probe back; the options that do not apply are refused before any work."""
    from fedmtl.experiments import tuned_edges
    from fedmtl.runs import tune as tune_module

    src, _ = quick
    summary = json.loads((src / "summary.json").read_text())
    rows = summary["federations"][FED]["methods"]
    lr = rows["fedavg"]["best_params"]["optim.lr"]
    # FedAvg's rate at the low end of the stored space, and a sampling rate at its highest (its own value, 1.0)
    rows["fedavg"]["space"] = {"optim": {"lr": {"low": lr, "high": lr * 100, "log": True}},
                               "run": {"sampling_rate": {"low": 0.1, "high": 1.0}}}
    rows["fedavg"]["best_params"]["run.sampling_rate"] = 1.0
    ditto = rows["ditto"]["best_params"]  # Ditto's values in the middle of their stored ranges: not probed
    rows["ditto"]["space"] = {"optim": {"lr": {"low": ditto["optim.lr"] / 10, "high": ditto["optim.lr"] * 10,
                                               "log": True}},
                              "algorithm": {"lam": {"low": ditto["algorithm.lam"] / 10,
                                                    "high": ditto["algorithm.lam"] * 10, "log": True}}}
    out = tmp_path / "table"
    out.mkdir()
    (out / "summary.json").write_text(json.dumps(summary))
    before = (out / "summary.json").read_text()

    for bad, says in ((["reproduce", "perfedavg", "--out", str(out), "--probe-edges"], "of fedmtl reproduce tuned"),
                      (["reproduce", "tuned", "--out", str(out), "--probe-edges", "--quick"], "--quick does not"),
                      (["reproduce", "tuned", "--out", str(tmp_path / "none"), "--probe-edges"], "summary.json"),
                      (["reproduce", "tuned", "--out", str(out), "--probe-edges", "--federations", "fmnist_mlp"],
                       "holds synthetic_mixture"),
                      (["reproduce", "tuned", "--out", str(out), "--probe-edges", "--methods", "nosuch"],
                       "--methods nosuch: ")):
        assert main(bad) == EXIT_INPUT
        assert says in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"]

    assert main(["reproduce", "tuned", "--out", str(out), "--probe-edges"]) == 0
    edges = json.loads((out / "edges.json").read_text())
    assert (out / "summary.json").read_text() == before  # the table is not changed
    probed = edges["federations"][FED]["rows"]
    assert [(r["method"], r["key"], r["end"]) for r in probed] == [("fedavg", "optim.lr", "low"),
                                                                   ("fedavg", "run.sampling_rate", "high")]
    for r in probed:
        assert r["tuned"]["objective"] == pytest.approx(rows["fedavg"]["best_value"], abs=1e-9)
        assert r["study_best_value"] == rows["fedavg"]["best_value"]
    assert [p["value"] for p in probed[0]["beyond"]] == [lr / 2, lr / 4]
    assert all(0 < p["objective"] <= 1 for p in probed[0]["beyond"])
    assert probed[0]["better_beyond"] == any(p["objective"] > probed[0]["tuned"]["objective"] + tuned_edges.MARGIN
                                             for p in probed[0]["beyond"])
    assert [p["value"] for p in probed[1]["beyond"]] == [2.0, 4.0]
    assert all("sampling_rate" in p["refused"] for p in probed[1]["beyond"]) and probed[1]["better_beyond"] is None
    md = (out / "edges.md").read_text()
    assert md == tuned_edges.edges_markdown(out) and "| fedavg | optim.lr (low end) |" in md
    assert "refused by the config" in md and "| ditto |" not in md

    def no_trial(*args, **kwargs):
        raise AssertionError("a finished probe ran again")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tune_module, "tune", no_trial)
        assert main(["reproduce", "tuned", "--out", str(out), "--probe-edges", "--methods", "fedavg"]) == 0
        assert json.loads((out / "edges.json").read_text()) == edges  # the probes' own times included
        # a call on another method keeps fedavg's rows (its table row unchanged)
        assert main(["reproduce", "tuned", "--out", str(out), "--probe-edges", "--methods", "ditto"]) == 0
        assert json.loads((out / "edges.json").read_text()) == edges
    bad = tmp_path / "bad"
    bad.mkdir()
    rows["fedavg"]["best_params"] = [1, 2]
    (bad / "summary.json").write_text(json.dumps(summary))
    assert main(["reproduce", "tuned", "--out", str(bad), "--probe-edges"]) == EXIT_INPUT
    assert "fedavg: best_params must be a table" in capsys.readouterr().err
    assert edges["seconds"] == pytest.approx(sum(p["seconds"] for r in probed for p in (r["tuned"], *r["beyond"])
                                                 if "seconds" in p))
