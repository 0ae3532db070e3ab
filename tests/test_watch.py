"""``fedmtl watch``: following a run while it runs, a finished run, a stopped one, a run with several seeds."""

from __future__ import annotations

import io
import json
import re
import threading

import pytest

import fedmtl
from fedmtl.cli import main
from fedmtl.config import read_toml
from fedmtl.runs import driver
from fedmtl.runs.watch import WatchError, status, watch


def _raw(rounds: int = 12) -> dict:
    raw = read_toml("synthetic/fedavg")
    raw["data"].update(num_clients=8, n_test=20)
    raw["run"].update(rounds=rounds, eval_every=4, checkpoint_every=4)
    return raw


def test_watch_follows_a_running_run_to_its_final_evaluation(tmp_path, monkeypatch):
    """While the run trains in another thread, watch prints a line each time metrics.csv grows (rounds rising), and
    ends with the run's final evaluation, equal to summary.json's, exit 0."""
    monkeypatch.setattr(driver, "LIVE_EVERY", 0.0)  # a live write after every round
    out = tmp_path / "run"
    started = threading.Event()
    result: dict = {}

    def train() -> None:
        started.set()
        result["r"] = fedmtl.run(_raw(), out=out)

    t = threading.Thread(target=train)
    t.start()
    started.wait()
    buf = io.StringIO()
    code = watch(out, interval=0.05, stream=buf, wait=120)
    t.join()
    lines = buf.getvalue().splitlines()
    rounds = [int(m.group(1)) for ln in lines if (m := re.search(r"round (\d+)/12", ln))]
    assert code == 0 and rounds == sorted(rounds) and rounds[-1] == 12, lines
    final = result["r"].summary["final"]
    assert lines[-1].startswith("fedavg on fedem_synthetic  round 12/12")
    assert f"acc {100 * final['seen_test_acc_mean']:.2f}%" in lines[-1] and "finished" in lines[-1]
    assert f"p10 {100 * final['seen_test_acc_p10']:.2f}%" in lines[-1]
    progress = json.loads((out / "progress.json").read_text())
    # brought to the last round when the run finished (it was written every 2 s while it ran: round 1 stayed)
    assert progress["round"] == progress["rounds"] == 12 and progress["seconds_per_round"] > 0


def test_watch_names_a_stopped_run_and_how_to_resume_it(tmp_path):
    """A run interrupted after its round-4 checkpoint (no summary, no live lock): watch shows round 4/12 with the
    last evaluation and the NaN/straggler counts of metrics.csv, then the resume command, exit 1."""
    out = tmp_path / "run"
    fedmtl.run(_raw(), out=out)
    (out / "summary.json").unlink()
    rows = (out / "metrics.csv").read_text().splitlines()
    (out / "metrics.csv").write_text("\n".join(rows[:5]) + "\n")  # the header and rounds 1-4
    (out / "progress.json").unlink()
    st = status(out)
    assert (st.round, st.rounds, st.finished, st.running, st.eval_round) == (4, 12, False, False, 4)
    buf = io.StringIO()
    assert watch(out, interval=0.05, stream=buf) == 1
    text = buf.getvalue()
    assert "round 4/12" in text and "dropped 0  excluded 0" in text
    assert f"continue it with: fedmtl run --resume --out {out}" in text
    # a run whose lock a live process holds is running, not stopped
    import os
    import socket

    (out / ".lock").write_text(f"{socket.gethostname()} {os.getpid()}")
    assert status(out).running is True


@pytest.mark.slow
def test_watch_once_on_a_run_with_several_seeds_and_on_nothing(tmp_path, capsys):
    """--once prints one line per seed of a finished run with several seeds (exit 0); a folder with no run is a
    one-line error naming it, exit 2."""
    out = tmp_path / "seeds"
    fedmtl.run(_raw(4), out=out, seeds=[1, 2])
    assert main(["watch", str(out), "--once"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all("round 4/4" in ln and "finished" in ln for ln in lines)
    assert "[seed-1]" in lines[0] and "[seed-2]" in lines[1]
    with pytest.raises(WatchError, match="no run here yet"):
        watch(tmp_path / "nothing", once=True)
    assert main(["watch", str(tmp_path / "nothing"), "--once"]) == 2
    assert "no run here yet" in capsys.readouterr().err


def _finished_run(tmp_path):
    out = tmp_path / "run"
    fedmtl.run(_raw(4), out=out)
    return out


def test_watch_shows_corrupt_fields_as_unreadable_and_never_fails(tmp_path, capsys):
    """Hostile or corrupt contents (a round of 1e400 in progress.json, inf in metrics.csv, a huge seconds_per_round,
    "final": [1] in summary.json): the line shows "?" for the accuracy and names the fields it left out; exit codes
    as for a sound directory."""
    out = _finished_run(tmp_path)
    good = status(out)
    assert good.unreadable == () and good.finished and good.round == 4
    (out / "summary.json").write_text(json.dumps({"rounds": 4, "final": [1]}))
    st = status(out)
    assert "acc ?" in st.line() and "unreadable: summary.json final" in st.line() and st.finished
    (out / "summary.json").unlink()
    (out / "progress.json").write_text('{"round": 1e400, "seconds_per_round": 1e300}')
    rows = (out / "metrics.csv").read_text().splitlines()
    head = rows[0].split(",")
    last = rows[-1].split(",")
    last[head.index("seen_test_acc_mean")] = "inf"
    last[head.index("dropped")] = "1e400"
    (out / "metrics.csv").write_text("\n".join([*rows[:-1], ",".join(last)]) + "\n")
    st = status(out)
    line = st.line()
    assert st.round == 4 and st.seconds_per_round is None and st.eta is None and "acc ?" not in line
    for name in ("progress.json round", "progress.json seconds_per_round", "metrics.csv dropped"):
        assert name in st.unreadable, st.unreadable
    assert "inf" not in line and "\n" not in line
    assert main(["watch", str(out), "--once"]) == 1  # unfinished, no process holds it
    text = capsys.readouterr().out
    assert "round 4/4" in text and "unreadable: " in text
    # an evaluated row whose accuracy is out of [0, 1] (the last one with a number): "?"
    last[head.index("seen_test_acc_mean")] = "7.5"
    (out / "metrics.csv").write_text("\n".join([*rows[:-1], ",".join(last)]) + "\n")
    assert "acc ?" in status(out).line() and "metrics.csv seen_test_acc_mean" in status(out).unreadable
    # a lock of absurd size or pid, a config name with control characters and no rounds
    (out / ".lock").write_text(f"{__import__('socket').gethostname()} {'9' * 400}")
    (out / "config.toml").write_text('[algorithm]\nname = "a\\u001b[2Jb"\n[data]\nname = "d"\n[run]\nrounds = inf\n')
    st = status(out)
    assert st.running is False and st.rounds is None and "\x1b" not in st.line() and st.label == "a?[2Jb on d"
    assert "config.toml rounds" in st.unreadable


@pytest.mark.slow
@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1", "1e9", "0.001"])
def test_watch_interval_out_of_range_is_one_line_exit_2(tmp_path, capsys, value):
    out = _finished_run(tmp_path)
    assert main(["watch", str(out), "--once", "--interval", value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--interval {float(value):g}" in err and "from 0.01 to 3600" in err
    assert main(["watch", str(out), "--once", "--interval", "0.5"]) == 0


def _toml_value(v) -> str | None:
    """A JSON-like value as TOML text (None: left out; TOML has no null)."""
    if v is None:
        return None
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if v != v else ("inf" if v > 0 else "-inf") if v in (float("inf"), float("-inf")) else repr(v)
    if isinstance(v, int | str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(t for x in v if (t := _toml_value(x)) is not None) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {t}" for k, x in v.items() if (t := _toml_value(x)) is not None) + "}"


def _set_key(cfg: str, table: str, key: str, text: str) -> str:
    """``cfg`` (a config.toml) with ``[table] key = text``."""
    lines, where = cfg.splitlines(), None
    for i, ln in enumerate(lines):
        if ln.strip() == f"[{table}]":
            where = i
        elif where is not None and ln.startswith(f"{key} = "):
            lines[i] = f"{key} = {text}"
            return "\n".join(lines) + "\n"
        elif where is not None and ln.startswith("["):
            break
    raise AssertionError(f"no [{table}] {key} in the config")


@pytest.mark.slow
def test_watch_never_raises_on_any_json_value_in_any_field(tmp_path):
    """Property: whatever JSON value stands in each field watch reads (progress.json round and seconds_per_round,
    summary.json rounds, final and its accuracies, the whole file; metrics.csv's round, dropped, excluded and
    accuracy cells; config.toml's names and rounds), status() and its line never raise, and the numbers shown are
    in range."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    out = _finished_run(tmp_path)
    rows = (out / "metrics.csv").read_text().splitlines()
    head = rows[0].split(",")
    base_cfg = (out / "config.toml").read_text()
    floats = st.floats(allow_nan=True, allow_infinity=True)
    scalars = st.none() | st.booleans() | st.integers(-(10**30), 10**30) | floats | st.text(max_size=30) | \
        st.sampled_from(["1e400", "-1e400", "NaN", "inf", "1" * 80, "0.5", "3"])
    values = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c,
                                                                                       max_size=3), max_leaves=6)
    cell = st.one_of(values.map(lambda v: v if isinstance(v, str) else json.dumps(v)), st.text(max_size=20))

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(prog_round=values, spr=values, s_rounds=values, final=values, acc=values, whole=values,
           cells=st.dictionaries(st.sampled_from(["round", "dropped", "excluded", "seen_test_acc_mean",
                                                  "seen_test_acc_p10"]), cell, max_size=5),
           names=st.tuples(values, values, values), use_summary=st.booleans(), whole_file=st.booleans())
    def check(prog_round, spr, s_rounds, final, acc, whole, cells, names, use_summary, whole_file):
        (out / "progress.json").write_text(json.dumps({"round": prog_round, "seconds_per_round": spr}))
        if use_summary:
            fin = {"seen_test_acc_mean": acc, "seen_test_acc_p10": acc} if isinstance(final, dict) else final
            (out / "summary.json").write_text(json.dumps(whole if whole_file else {"rounds": s_rounds,
                                                                                   "final": fin}))
        else:
            (out / "summary.json").unlink(missing_ok=True)
        last = rows[-1].split(",")
        for k, v in cells.items():
            last[head.index(k)] = '"' + v.replace('"', '""') + '"'
        (out / "metrics.csv").write_text("\n".join([*rows[:-1], ",".join(last)]) + "\n")
        cfg = base_cfg
        for (table, key), v in zip([("algorithm", "name"), ("data", "name"), ("run", "rounds")], names, strict=True):
            t = _toml_value(v)
            cfg = _set_key(cfg, table, key, t if t is not None else '"left out"')
        (out / "config.toml").write_text(cfg)
        s = status(out)
        line = s.line()
        rest = line[len(s.label):].lower()  # the label is the config's names, which may read "inf"
        assert line.startswith(s.label) and "\n" not in line and "nan" not in rest and "inf" not in rest
        assert 0 <= s.round <= 10**12 and (s.acc is None or 0 <= s.acc <= 1) and (s.p10 is None or 0 <= s.p10 <= 1)
        assert s.seconds_per_round is None or 0 <= s.seconds_per_round <= 1e7
        assert watch(out, once=True, stream=io.StringIO()) in (0, 1)

    check()
