"""``fedmtl.register_aggregator`` / ``fedmtl.register_attack``: a user's aggregator or attack is usable from a config
(``[robust] aggregator``, ``[attack] kind``), and a registration that breaks the contract is refused, naming why.
One that passes its registration check but breaks the contract in a run (NaN, a wrong shape or dtype, None, an
exception, a wrong row count) stops the run with a ``RegistryError`` naming it (the CLI: one line, exit 2), and a
plugin module that refuses a registration or calls ``sys.exit()`` at import is named."""

from __future__ import annotations

import math

import pytest
import torch

import fedmtl
from fedmtl import registry
from fedmtl import tree as T
from fedmtl.cli import main
from fedmtl.config import ConfigError, dumps
from fedmtl.registry import AGGREGATORS, ATTACKS, RegistryError, field_table, import_plugins, load_plugins
from fedmtl.robust import AttackConfig, RobustConfig
from fedmtl.robust.aggregators import BUILT_IN_AGGREGATORS
from fedmtl.testing import toy_data


@pytest.fixture(autouse=True)
def registries():
    """Every test leaves the registries as it found them."""
    before = dict(AGGREGATORS), dict(ATTACKS)
    yield
    for reg, old in zip((AGGREGATORS, ATTACKS), before, strict=True):
        reg.clear()
        reg.update(old)


@pytest.fixture(scope="module")
def data():
    return toy_data()


def _run(data, **tables):
    cfg = {"model": {"name": "linear"}, "algorithm": {"name": "fedavg"}, "optim": {"lr": 0.1, "momentum": 0.9},
           "run": {"rounds": 2, "batch_size": 16, "eval_every": 2, "seed": 5, "checkpoint_every": 0}, **tables}
    return fedmtl.run(cfg, data=data)


def _max_gap(a, b) -> float:
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(T.leaves(a), T.leaves(b), strict=True))


def my_mean(updates, weights, config):
    """The weighted mean of the rows of positive weight, written by hand."""
    keep = torch.nonzero(weights > 0).flatten()
    w = weights[keep] / weights[keep].sum()
    return T.tmap(lambda x: torch.tensordot(w.to(x.dtype), x[keep], dims=1), updates)


def test_a_registered_aggregator_runs_from_a_config_and_equals_the_plain_mean(data):
    assert fedmtl.register_aggregator("test_mean")(my_mean) is my_mean
    assert "test_mean" in AGGREGATORS and "'test_mean'" in field_table(RobustConfig)[0][1]
    plain = _run(data)
    mine = _run(data, robust={"aggregator": "test_mean"})
    assert mine.summary["config"]["robust"]["aggregator"] == "test_mean"
    assert _max_gap(mine.server, plain.server) < 1e-6
    assert abs(mine.final["seen_test_acc_mean"] - plain.final["seen_test_acc_mean"]) < 1e-6
    # and it is really the one called: one that returns the first valid update differs
    calls = []

    @fedmtl.register_aggregator
    def test_first(updates, weights, config):
        calls.append(config.aggregator)
        return T.tmap(lambda x: x[int(torch.nonzero(weights > 0)[0])], updates)

    first = _run(data, robust={"aggregator": "test_first"})
    assert calls and set(calls) == {"test_first"} and _max_gap(first.server, plain.server) > 1e-4


def test_an_unknown_aggregator_is_refused_listing_the_registered_ones(data):
    with pytest.raises(ConfigError, match=r"\[robust\]\.aggregator: must be one of \['mean', 'median'.*'centered_clip'"
                                          r"\], got 'test_nope' \(fedmtl.register_aggregator adds one\)"):
        _run(data, robust={"aggregator": "test_nope"})
    with pytest.raises(ValueError, match="robust.aggregator must be one of mean, median"):
        RobustConfig(aggregator="test_nope")
    fedmtl.register_aggregator("test_nope")(my_mean)
    assert RobustConfig(aggregator="test_nope").aggregator == "test_nope"


def _ignores_weights(updates, weights, config):
    return T.tmap(lambda x: x.mean(0), updates)  # the excluded row (weight 0, NaN) poisons it


def _mutates(updates, weights, config):
    weights.mul_(2)
    return my_mean(updates, weights, config)


def _raises(updates, weights, config):
    raise KeyError("no such leaf")


def _wrong_structure(updates, weights, config):
    return torch.zeros(3)


@pytest.mark.parametrize("fn,message", [
    (42, "register_aggregator needs a function \\(updates, weights, config\\) -> update"),
    (lambda updates, weights: updates, "must be a function \\(updates, weights, config\\) -> update; .* cannot take 3"),
    (_ignores_weights, "must return the update itself when every update is the same \\(and ignore rows of weight 0"),
    (_mutates, "changed its input"),
    (_raises, "raised KeyError: 'no such leaf' on five identical updates"),
    (_wrong_structure, "must return the update itself"),
])
def test_a_broken_aggregator_is_refused_and_left_unregistered(fn, message):
    with pytest.raises(RegistryError, match=message):
        fedmtl.register_aggregator("test_broken")(fn)
    assert "test_broken" not in AGGREGATORS
    with pytest.raises(ValueError, match="must be one of"):
        RobustConfig(aggregator="test_broken")


def test_a_taken_aggregator_name_is_refused_unless_replaced():
    with pytest.raises(RegistryError, match="aggregator 'median' is already registered .*replace=True"):
        fedmtl.register_aggregator("median")(my_mean)
    fedmtl.register_aggregator("test_twice")(my_mean)
    with pytest.raises(RegistryError, match="'test_twice' is already registered"):
        fedmtl.register_aggregator("test_twice")(lambda u, w, c: my_mean(u, w, c))
    fedmtl.register_aggregator("test_twice", replace=True)(lambda u, w, c: my_mean(u, w, c))
    with pytest.raises(RegistryError, match="'mean' cannot be replaced"):
        fedmtl.register_aggregator("mean", replace=True)(my_mean)
    with pytest.raises(RegistryError, match="name must be a non-empty string without spaces"):
        fedmtl.register_aggregator("my mean")(my_mean)
    # a failed replacement keeps what was there
    before = AGGREGATORS["test_twice"]
    with pytest.raises(RegistryError):
        fedmtl.register_aggregator("test_twice", replace=True)(_ignores_weights)
    assert AGGREGATORS["test_twice"] is before


# ------------------------------------------------------------------------------------------------------ attacks


def flip_by_hand(r):
    """What the built-in ``signflip`` sends with strength 1, written by hand: ``payload - (update - payload)``."""
    return T.tmap(lambda x, ref: 2 * ref.unsqueeze(0).to(x.dtype) - x[r.attackers], r.updates, r.reference)


def test_a_registered_attack_runs_from_a_config_and_equals_its_built_in_twin(data):
    assert fedmtl.register_attack("test_flip")(flip_by_hand) is flip_by_hand
    assert "'test_flip'" in field_table(AttackConfig)[0][1]
    builtin = _run(data, attack={"kind": "signflip", "fraction": 0.25})
    mine = _run(data, attack={"kind": "test_flip", "fraction": 0.25})
    honest = _run(data)
    assert mine.summary["attackers"] == builtin.summary["attackers"] and mine.summary["attackers"]
    assert _max_gap(mine.server, builtin.server) < 1e-6
    assert _max_gap(mine.server, honest.server) > 1e-4


def test_a_broken_or_taken_attack_is_refused():
    with pytest.raises(RegistryError, match="register_attack needs a function \\(round: AttackRound\\)"):
        fedmtl.register_attack("test_bad")("not a function")
    with pytest.raises(RegistryError, match="cannot take 1 positional argument"):
        fedmtl.register_attack("test_bad")(lambda updates, reference: updates)
    with pytest.raises(RegistryError, match="one row per attacker \\(here 2\\)"):
        fedmtl.register_attack("test_bad")(lambda r: r.updates)  # every row, not the attackers'
    with pytest.raises(RegistryError, match="raised AttributeError"):
        fedmtl.register_attack("test_bad")(lambda r: r.no_such_field)

    def in_place(r):
        T.leaves(r.updates)[0].zero_()
        return flip_by_hand(r)

    with pytest.raises(RegistryError, match="changed the round's updates"):
        fedmtl.register_attack("test_bad")(in_place)
    assert "test_bad" not in ATTACKS
    with pytest.raises(ValueError, match="attack.kind must be one of none, scale"):
        AttackConfig(kind="test_bad")
    with pytest.raises(RegistryError, match="attack 'signflip' is already registered"):
        fedmtl.register_attack("signflip")(flip_by_hand)
    with pytest.raises(RegistryError, match="'none' cannot be replaced"):
        fedmtl.register_attack("none", replace=True)(flip_by_hand)
    fedmtl.register_attack("signflip", replace=True)(flip_by_hand)
    assert ATTACKS["signflip"] is flip_by_hand


# ---------------------------------------------------------------------------------------------
# checked in the run


def _only_when_distinct(broken):
    """An aggregator that returns the first valid row while the valid rows are equal (so that it passes
    ``register_aggregator``'s check) and ``broken(valid rows)`` per leaf once they differ (in a run)."""

    def aggregate(updates, weights, config):
        def one(x):
            valid = x[weights > 0]
            return valid[0] if bool((valid == valid[0]).all()) else broken(valid)

        return T.tmap(one, updates)

    return aggregate


def _raise(valid):
    raise RuntimeError("boom in plugin")


BROKEN = {
    "nan": (lambda v: v[0] * math.nan, "returned NaN/Inf"),
    "inf": (lambda v: v[0] * math.inf, "returned NaN/Inf"),
    "shape": (lambda v: v[:2], r"has shape \(2, .*\), expected"),
    "bcast": (lambda v: v[0].reshape(-1)[:1], r"has shape \(1,\), expected"),
    "dtype": (lambda v: v[0].double(), "has dtype torch.float64, expected torch.float32"),
    "raise": (_raise, "raised RuntimeError: boom in plugin"),
}


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_a_plugin_aggregator_breaking_the_contract_in_a_run_is_named(data, kind):
    broken, message = BROKEN[kind]
    fedmtl.register_aggregator(f"test_{kind}_runtime")(_only_when_distinct(broken))  # passes the registration check
    with pytest.raises(RegistryError, match=f"robust.aggregator 'test_{kind}_runtime' .*{message}"):
        _run(data, robust={"aggregator": f"test_{kind}_runtime"})


def test_a_plugin_aggregator_returning_none_in_a_run_is_named(data):
    def none_runtime(updates, weights, config):
        first = T.leaves(updates)[0][weights > 0]
        return T.tmap(lambda x: x[weights > 0][0], updates) if bool((first == first[0]).all()) else None

    fedmtl.register_aggregator("test_none_runtime")(none_runtime)
    with pytest.raises(RegistryError, match="robust.aggregator 'test_none_runtime' .*None is not a tree like"):
        _run(data, robust={"aggregator": "test_none_runtime"})


def test_a_plugin_replacing_a_built_in_is_checked_behind_bucketing_and_the_built_ins_are_not_wrapped(data):
    assert RobustConfig(aggregator="krum")._base().__qualname__ == "RobustConfig._base.<locals>.combine"
    fedmtl.register_aggregator("median", replace=True)(_only_when_distinct(lambda v: v[0] * math.nan))
    assert BUILT_IN_AGGREGATORS["median"] is not AGGREGATORS["median"]
    with pytest.raises(RegistryError, match="robust.aggregator 'median' .*returned NaN/Inf"):
        _run(data, robust={"aggregator": "median", "bucketing": 2})


def test_a_plugin_attack_sending_the_wrong_number_of_rows_is_named(data):
    def two_rows(r):
        return T.tmap(lambda x: x[:2].clone(), r.updates)  # two rows, whatever the number of attackers

    fedmtl.register_attack("test_two_rows")(two_rows)  # the check's round has exactly two attackers
    wrong = r"attack.kind 'test_two_rows' .*one row per attacker \(here \d+\).*has shape \(2, "
    with pytest.raises(RegistryError, match=wrong):
        _run(data, attack={"kind": "test_two_rows", "fraction": 0.3})


def test_a_plugin_attack_raising_in_a_run_is_named(data):
    def raises_later(r):
        if r.attackers.numel() != 2:
            raise KeyError("only two")
        return T.tmap(lambda x: x.index_select(0, r.attackers), r.updates)

    fedmtl.register_attack("test_raises_later")(raises_later)
    with pytest.raises(RegistryError, match="attack.kind 'test_raises_later' .*raised KeyError: 'only two'"):
        _run(data, attack={"kind": "test_raises_later", "fraction": 0.3})


#: the CLI's run: a tiny federation written as a config file
CONFIG = {"data": {"name": "fedem_synthetic", "num_clients": 6, "dim": 8, "n_test": 10, "min_samples": 20,
                   "max_samples": 30},
          "model": {"name": "linear"}, "algorithm": {"name": "fedavg"}, "optim": {"lr": 0.1},
          "run": {"rounds": 2, "batch_size": 16, "eval_every": 2, "checkpoint_every": 0}}


def test_the_cli_refuses_a_nan_plugin_aggregator_in_one_line_exit_2(tmp_path, capsys):
    fedmtl.register_aggregator("test_cli_nan")(_only_when_distinct(lambda v: v[0] * math.nan))
    (tmp_path / "c.toml").write_text(dumps(CONFIG))
    out = tmp_path / "out"
    rc = main(["run", str(tmp_path / "c.toml"), "--set", "robust.aggregator=test_cli_nan", "--out", str(out),
               "--no-progress", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("fedmtl: ") and "'test_cli_nan'" in lines[0] and "NaN/Inf" in lines[0]
    assert not (out / "summary.json").exists()


def test_a_plugin_module_refusing_a_registration_at_import_is_named(tmp_path):
    taken = tmp_path / "p_taken.py"
    taken.write_text("import fedmtl\n@fedmtl.register_aggregator('median')\ndef m(u, w, c):\n    return u\n")
    with pytest.raises(RegistryError, match=r"^--import .*p_taken\.py: aggregator 'median' is already registered"):
        import_plugins([str(taken)])


def test_a_plugin_module_calling_sys_exit_at_import_is_an_error_not_a_silent_exit(tmp_path):
    exits = tmp_path / "p_exits.py"
    exits.write_text("import sys\nsys.exit(0)\n")
    with pytest.raises(RegistryError, match=r"^--import .*p_exits\.py: importing it called sys.exit\(0\)"):
        import_plugins([str(exits)])


def test_an_entry_point_plugin_calling_sys_exit_is_skipped_with_a_warning(monkeypatch, caplog):
    class Exits:
        name, value = "exits", "p_exits:main"

        def load(self):
            raise SystemExit(3)

    monkeypatch.setattr(registry, "_loaded_entry_points", False)
    monkeypatch.setattr(registry, "entry_points", lambda group: [Exits()])
    assert load_plugins() == []
    assert "fedmtl plugin exits (p_exits:main) failed to load" in caplog.text

