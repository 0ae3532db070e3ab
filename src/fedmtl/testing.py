"""``check_algorithm``: the contract every fedmtl algorithm keeps, as a function anyone can call on their own.

    from fedmtl.testing import check_algorithm
    check_algorithm(MyAlg, {"mu": 0.1})          # raises ContractError naming the broken promise

or, in a pytest suite, one test item per algorithm and check (as scikit-learn's ``parametrize_with_checks``)::

    @parametrize_with_checks([MyAlg])
    def test_contract(algorithm, check):
        check_algorithm(algorithm, checks=(check,))

Each algorithm runs with the toy settings it declares (``Algorithm.toy``: hyper-parameters, model, optimizer,
rounds), unless the call gives others.

Checks, on a small synthetic federation (20 clients, 16 seen and 4 unseen, binary, 10 features, linear
model, momentum SGD), each with tolerances that a wrong algorithm fails:

* ``capabilities``: the class attributes agree with what the algorithm does (``keeps_client_state`` iff its
  client state has tensors);
* ``loop_equals_vmap``: the ``loop`` and ``vmap`` executors give the same server, client states, losses and
  evaluation (half the clients sampled, two local epochs), and grouping clients differently into vmap calls
  (no bucketing; chunks of 3) changes nothing; for an algorithm with a clients form (``client_update_clients``) on a
  model with one, the ``stacked`` executor gives the same too (with stragglers, drops and chunks of 3 as well);
* ``no_input_mutation``: the payload, the states and the data are not modified in place;
* ``deterministic``: the same seed gives identical rounds and evaluation, another seed different ones;
* ``learns``: the training loss over all clients falls on the toy task;
* ``checkpoint_round_trip``: a run checkpointed after two rounds (written and read back, without pickle) and resumed
  in a fresh engine for one more round equals the same run continued uninterrupted to its third round, and writing
  the checkpoint leaves the live run's state unchanged;
* ``nan_excluded``: a client whose update is NaN is excluded and counted, and nothing non-finite reaches the
  server or any client's state;
* ``private_release``: under ``[privacy]`` every server state that reaches a client or the released model comes from
  the noised sum: trained with no noise and with a huge noise, every leaf of the server state differs between the
  two runs, except those the algorithm declares public (``Algorithm.public_server_state``, with the reason); and a
  round in which no client was sampled still releases (the broadcast model changes).  An algorithm that refuses
  ``[privacy]`` (``Algorithm.check_privacy``) must be refused by the engine before any work;
* ``everything_on``: with momentum and weight decay (the suite's optimizer), Poisson-sampled DP (a generous clip,
  little noise; left off where the algorithm refuses privacy), stragglers and drops all on, half the clients a
  round: either refused before any work (``ValueError``), or every logged loss finite and the last rounds' training
  loss below the first round's.  No combination diverges silently.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import tree as T
from .algorithms.base import Algorithm
from .data.federated import FederatedData
from .engine.evaluation import SEEN_TEST_LOSS, SEEN_TRAIN_LOSS, summarize
from .engine.round import Engine
from .engine.spec import RunConfig, RunSpec
from .models.base import Model
from .models.stacking import supports_clients
from .optim import SGD
from .privacy import PrivacyConfig
from .runs import checkpoint
from .runs.driver import make_engine


class ContractError(AssertionError):
    """An algorithm breaks the contract; the message names the check and what differed."""


#: the contract's checks, in the order ``check_algorithm`` runs them
CHECKS: tuple[str, ...] = ("capabilities", "no_input_mutation", "deterministic", "loop_equals_vmap", "learns",
                           "checkpoint_round_trip", "nan_excluded", "private_release", "everything_on")


def toy_model(cls: type[Algorithm], data: FederatedData | None = None) -> Model | None:
    """The model ``cls.toy`` names for the toy federation (None: the suite's linear model); a fresh one each call (an
    engine moves its model's module to the run's device)."""
    from torch import nn

    from .batchnorm import BatchNorm
    from .models import build_model

    kind = cls.toy.model
    d = 10 if data is None else int(np.prod(data.feature_shape))
    if kind == "linear":
        return None
    if kind == "linear_nobias":
        return build_model("linear", d, 2, bias=False)
    if kind == "mlp":  # a body and a head
        return build_model("mlp", d, 2, hidden=(16,))
    if kind == "batchnorm":
        return Model.from_module(nn.Sequential(nn.Linear(d, 16), BatchNorm(16), nn.ReLU(), nn.Linear(16, 1)), 2)
    if kind == "lora":  # a frozen base MLP (seeded) with rank-2 adapters on every layer
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            base = nn.Sequential(nn.Linear(d, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
        return Model.from_module(base, 2, output="multiclass", adapters={"rank": 2, "alpha": 4.0})
    raise ValueError(f"{cls.__name__}.toy.model = {kind!r}: one of linear, linear_nobias, mlp, batchnorm, lora")


def toy_opt(cls: type[Algorithm]) -> SGD | None:
    """Plain SGD where ``cls.toy`` asks for it (None: the suite's momentum SGD)."""
    return SGD(cls.toy.sgd_lr) if cls.toy.sgd_lr is not None else None


def parametrize_with_checks(algorithms: Any) -> Any:
    """A ``pytest.mark.parametrize`` over ``(algorithm, check)``: one test item per algorithm class (a list, or a
    name -> class mapping such as ``fedmtl.algorithms.ALGORITHMS``) and contract check, with ids ``name-check``."""
    import pytest

    classes = list(algorithms.values()) if isinstance(algorithms, dict) else list(algorithms)
    cases = [(cls, check) for cls in classes for check in CHECKS]
    return pytest.mark.parametrize("algorithm, check", cases, ids=[f"{c.name}-{k}" for c, k in cases])


def toy_data() -> FederatedData:
    """20 clients (16 seen, 4 unseen), d = 10, binary, with validation splits (FedEM's synthetic generator)."""
    from .data.synthetic import fedem_synthetic

    return fedem_synthetic(num_clients=20, dim=10, n_test=40, max_samples=300, seed=3, unseen_frac=0.2, val_frac=0.2)


def simulator(alg: Algorithm, data: FederatedData, model: Model | None = None, opt: SGD | None = None,
              **run: Any) -> Engine:
    """An in-process engine for tests: linear model, momentum SGD, 6 rounds of batch 32 unless given."""
    from .models import build_model

    model = model or build_model("linear", data.feature_shape, data.num_classes, data.meta)
    opt = opt or SGD(lr=0.1, momentum=0.9, weight_decay=5e-4, lr_milestones=(0.5, 0.75))
    cfg = {"rounds": 6, "batch_size": 32, "seed": 7, **run}
    names = [f.name for f in dataclasses.fields(RunSpec) if f.name not in ("run", "optim")]  # the server-side tables
    tables = {k: cfg.pop(k) for k in names if cfg.get(k) is not None}
    for k in names:
        cfg.pop(k, None)
    return make_engine(alg, model, data, RunSpec(RunConfig(**cfg), opt, **tables))


def run_rounds(engine: Engine, n: int) -> tuple[Any, list[dict[str, Any]]]:
    st = engine.init_state()
    return st, [engine.round(st) for _ in range(n)]


def all_client_states(engine: Engine) -> Any:
    return engine.clients.read(torch.arange(engine.fed.num_clients))  # type: ignore[attr-defined]


def _close(a: Any, b: Any, atol: float, what: str) -> None:
    la, lb = T.leaves(a), T.leaves(b)
    if len(la) != len(lb):
        raise ContractError(f"{what}: {len(la)} vs {len(lb)} tensors")
    for x, y in zip(la, lb, strict=True):
        if x.shape != y.shape or not torch.allclose(x.double(), y.double(), atol=atol, rtol=atol, equal_nan=True):
            diff = (x.double() - y.double()).abs().max() if x.shape == y.shape else f"shapes {x.shape} {y.shape}"
            raise ContractError(f"{what}: differ by {diff} (tolerance {atol})")


def _summaries_close(a: dict[str, float], b: dict[str, float], atol: float, what: str) -> None:
    if a.keys() != b.keys():
        raise ContractError(f"{what}: different metrics {sorted(a.keys() ^ b.keys())}")
    for k in a:
        if not (abs(a[k] - b[k]) <= atol or (np.isnan(a[k]) and np.isnan(b[k]))):
            raise ContractError(f"{what}: {k} = {a[k]} vs {b[k]}")


def check_algorithm(
    cls: type[Algorithm],
    kwargs: dict[str, Any] | None = None,
    *,
    data: FederatedData | None = None,
    model: Model | None = None,
    opt: SGD | None = None,
    toy_rounds: int | None = None,
    atol: float = 1e-5,
    checks: tuple[str, ...] | None = None,
) -> dict[str, str]:
    """Run the contract suite (module docstring) on ``cls(**kwargs)``; returns ``{check: "ok"}`` or raises
    ``ContractError``.  ``kwargs`` / ``model`` / ``opt`` / ``toy_rounds`` default to what the class declares in
    ``Algorithm.toy`` (hyper-parameters, model, optimizer, rounds of the ``learns`` check); ``data`` replaces the
    toy federation; ``checks``: a subset of ``CHECKS`` to run."""
    unknown = sorted(set(checks or ()) - set(CHECKS))
    if unknown:
        raise ValueError(f"unknown checks {unknown}; the checks are {list(CHECKS)}")
    kwargs = dict(cls.toy.kwargs) if kwargs is None else kwargs
    toy_rounds = cls.toy.rounds if toy_rounds is None else toy_rounds
    opt = opt if opt is not None else toy_opt(cls)
    try:
        alg = cls(**kwargs)
    except Exception as e:
        raise ContractError(f"constructing {cls.__name__}(**{kwargs}): {type(e).__name__}: {e}") from e
    data = data if data is not None else toy_data()
    model = model if model is not None else toy_model(cls, data)

    def sim(a: Algorithm = alg, **run: Any) -> Engine:
        return simulator(a, data, model, opt, **run)

    suite: dict[str, Callable[[], None]] = {
        "capabilities": lambda: _capabilities(alg, sim),
        "no_input_mutation": lambda: _no_mutation(sim, data),
        "deterministic": lambda: _deterministic(sim),
        "loop_equals_vmap": lambda: _loop_equals_vmap(sim, atol),
        "learns": lambda: _learns(sim, toy_rounds),
        "checkpoint_round_trip": lambda: _checkpoint_round_trip(sim),
        "nan_excluded": lambda: _nan_excluded(cls, kwargs, data, sim),
        "private_release": lambda: _private_release(alg, sim),
        "everything_on": lambda: _everything_on(alg, sim, toy_rounds),
    }
    done = {}
    for name, fn in suite.items():
        if checks is not None and name not in checks:
            continue
        try:
            fn()
        except ContractError as e:
            raise ContractError(f"{cls.__name__} fails '{name}': {e}") from None
        except Exception as e:  # an algorithm that crashes under a check fails that check
            raise ContractError(f"{cls.__name__} fails '{name}': {type(e).__name__}: {e}") from e
        done[name] = "ok"
    return done


def _capabilities(alg: Algorithm, sim: Callable[..., Engine]) -> None:
    eng = sim()
    st = eng.init_state()
    has_state = bool(T.leaves(alg.init_clients(eng.ctx, st.server, torch.arange(2))))
    if alg.keeps_client_state != has_state and not (has_state and _only_ids(alg, eng, st)):
        raise ContractError(f"keeps_client_state = {alg.keeps_client_state} but the client state "
                            f"{'has' if has_state else 'has no'} tensors")


def _only_ids(alg: Algorithm, eng: Engine, st: Any) -> bool:
    """A client state that only records the client's id (Clustered FL, Omni-Fedge) is not personal state."""
    init = alg.init_clients(eng.ctx, st.server, torch.arange(2))
    return tuple(getattr(init, "_fields", ())) == ("id",)


def _loop_equals_vmap(sim: Callable[..., Engine], atol: float) -> None:
    res = {}
    for runner in ("vmap", "loop"):
        eng = sim(runner=runner, sampling_rate=0.5, local_epochs=2)
        if eng.clients.executor.name != runner:  # type: ignore[attr-defined]  # a fallback would compare loop to loop
            raise ContractError(f"asked for the {runner} executor, got {eng.clients.executor.name}")  # type: ignore[attr-defined]
        st, rows = run_rounds(eng, 3)
        res[runner] = (st.server, all_client_states(eng), rows, summarize(eng.evaluate(st)))
    (sa, ca, ra, ea), (sb, cb, rb, eb) = res["vmap"], res["loop"]
    _close(sa, sb, atol, "server state, vmap vs loop")
    _close(ca, cb, atol, "client states, vmap vs loop")
    for a, b in zip(ra, rb, strict=True):
        la, lb = a["train_loss"], b["train_loss"]
        if not (abs(la - lb) <= atol or (np.isnan(la) and np.isnan(lb))):
            raise ContractError(f"round {a['round']} training loss, vmap {a['train_loss']} vs loop {b['train_loss']}")
    _summaries_close(ea, eb, atol, "evaluation, vmap vs loop")
    outs = []
    for extra in ({"bucketing": "none"}, {"bucketing": "steps", "chunk_size": 3}):
        eng = sim(**extra)
        st, _ = run_rounds(eng, 2)
        outs.append((st.server, all_client_states(eng)))
    _close(outs[0], outs[1], 1e-6, "grouping clients into vmap calls changed the result")
    if not (eng.alg.clients_form() and supports_clients(eng.model)):  # the algorithm and model of every sim()
        return
    from .engine.systems import SystemsConfig

    eng = sim(runner="stacked", sampling_rate=0.5, local_epochs=2)  # the settings of the loop run above
    if eng.clients.executor.name != "stacked":  # type: ignore[attr-defined]
        raise ContractError(f"asked for the stacked executor, got {eng.clients.executor.name}")  # type: ignore[attr-defined]
    st, rows = run_rounds(eng, 3)
    sa, ca, la, ea = st.server, all_client_states(eng), [r["train_loss"] for r in rows], summarize(eng.evaluate(st))
    sb, cb, rb, eb = res["loop"]  # that loop run's result: the same settings, so not run a second time
    lb = [r["train_loss"] for r in rb]
    _close(sa, sb, atol, "server state, stacked vs loop")
    _close(ca, cb, atol, "client states, stacked vs loop")
    if not np.allclose(la, lb, atol=atol, rtol=atol):
        raise ContractError(f"training losses, stacked {la} vs loop {lb}")
    _summaries_close(ea, eb, atol, "evaluation, stacked vs loop")
    systems = SystemsConfig(variability="high", drop_prob=0.2)  # stragglers' limits cut steps; some clients drop
    outs = [run_rounds(sim(runner=r, systems=systems, chunk_size=c), 2)[0].server
            for r, c in (("stacked", 3), ("loop", 0))]
    _close(outs[0], outs[1], atol, "stacked (chunks of 3) vs loop with stragglers and drops")


def _no_mutation(sim: Callable[..., Engine], data: FederatedData) -> None:
    eng = sim(runner="loop")  # one client at a time: vmap-specific failures belong to loop_equals_vmap
    st = eng.init_state()
    server0, clients0 = T.clone(st.server), T.clone(all_client_states(eng))
    payload = eng.alg.payload(st.server)
    p0 = T.clone(payload)
    x0, y0 = data.seen.train.x.clone(), data.seen.train.y.clone()
    eng.round(st)
    eng.evaluate(st)
    _close(payload, p0, 0.0, "the payload was modified in place")
    if not (torch.equal(data.seen.train.x, x0) and torch.equal(data.seen.train.y, y0)):
        raise ContractError("the training data was modified")
    fresh = sim(runner="loop")
    st2 = fresh.init_state()
    _close((st2.server, all_client_states(fresh)), (server0, clients0), 0.0, "initial states were modified")


def _deterministic(sim: Callable[..., Engine]) -> None:
    res = []
    for _ in range(2):
        eng = sim(sampling_rate=0.5, runner="loop")
        st, rows = run_rounds(eng, 2)
        res.append((rows, summarize(eng.evaluate(st))))
    if res[0] != res[1]:
        raise ContractError("two runs with the same seed differ (global random state? unseeded randomness?)")
    # another seed: its first logged round differs already (initialization, sampling, batch order) for every
    # registered algorithm but MOCHA (zero dual variables: a training loss of exactly 1 whatever the clients), so a
    # second round runs only where the first is identical; the verdict is that of comparing both rounds
    eng = sim(sampling_rate=0.5, seed=99, runner="loop")
    st = eng.init_state()
    rows = [eng.round(st)]
    if rows == res[0][0][:1]:
        rows.append(eng.round(st))
        if rows == res[0][0]:
            raise ContractError("another seed gave identical rounds (is the run's seed used?)")


def _learns(sim: Callable[..., Engine], rounds: int) -> None:
    eng = sim(rounds=rounds)
    st = eng.init_state()
    before = summarize(eng.evaluate(st))[SEEN_TRAIN_LOSS]
    for _ in range(rounds):
        eng.round(st)
    after = summarize(eng.evaluate(st))[SEEN_TRAIN_LOSS]
    if not after < before - 0.05:
        raise ContractError(f"training loss did not fall on the toy task: {before:.4f} -> {after:.4f} "
                            f"in {rounds} rounds")


def _everything_on(alg: Algorithm, sim: Callable[..., Engine], rounds: int) -> None:
    """With momentum and weight decay (the suite's optimizer), Poisson-sampled DP-FedAvg (a generous clip, little
    noise), stragglers and drops all on, the algorithm either refuses the combination before any work
    (``ValueError`` naming it) or trains: every logged loss finite, nothing silently excluded every round, and the
    training loss below its start.  Never a silent divergence."""
    from .engine.systems import SystemsConfig

    options: dict[str, Any] = {"systems": SystemsConfig(variability="high", drop_prob=0.1), "sampling_rate": 0.5}
    try:
        alg.check_privacy()
        options["privacy"] = PrivacyConfig(clip_norm=10.0, noise_multiplier=0.01, sampling="poisson",
                                           reproducible_noise=True)
    except ValueError:
        pass  # refused by the algorithm (``_private_release`` checks the refusal): the rest stays on
    try:
        eng = sim(rounds=rounds, **options)
    except ValueError:
        return  # refused before any work
    st = eng.init_state()
    rows = [eng.round(st) for _ in range(rounds)]
    after = summarize(eng.evaluate(st))[SEEN_TRAIN_LOSS]
    losses = [r["train_loss"] for r in rows if r["clients"] - r["excluded"] > 0]  # rounds somebody trained in
    if len(losses) < 2 or not all(np.isfinite(losses)) or not np.isfinite(after):
        raise ContractError(f"no finite training with every option on: logged losses {losses[-3:]}, evaluated "
                            f"training loss {after}")
    # the logged local training loss (what the clients' steps minimize), its last rounds against its first
    if not float(np.mean(losses[-3:])) < losses[0]:
        raise ContractError(f"training loss did not fall with every option on: {losses[0]:.4f} in the first round, "
                            f"{float(np.mean(losses[-3:])):.4f} in the last three of {rounds} (momentum, weight "
                            "decay, Poisson DP, stragglers and drops)")


def _checkpoint_round_trip(sim: Callable[..., Engine]) -> None:
    """The run itself is checkpointed after two rounds: written, read back (``weights_only``) and resumed in a fresh
    engine for a third round, which must equal the run's own third round.  Writing the checkpoint must leave the live
    run as it was (compared exactly), so a save that disturbs the run is caught even where the file holds the
    disturbance too."""
    ref = sim(sampling_rate=0.5)
    st_ref = ref.init_state()
    for _ in range(2):
        ref.round(st_ref)
    before = T.clone((st_ref.server, st_ref.server_opt, all_client_states(ref)))
    history, counters = copy.deepcopy(st_ref.history), copy.deepcopy(st_ref.counters)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "checkpoint.pt"
        checkpoint.save(path, st_ref, {"check": True}, ref.clients.state_dict())
        saved = checkpoint.load(path)
    _close((st_ref.server, st_ref.server_opt, all_client_states(ref)), before, 0.0,
           "writing a checkpoint changed the run's state")
    if st_ref.history != history or st_ref.counters != counters:
        raise ContractError("writing a checkpoint changed the run's history or counters")
    ref.round(st_ref)  # the uninterrupted run's third round
    resumed = sim(sampling_rate=0.5)
    st2 = resumed.init_state(saved)
    resumed.round(st2)
    _close(st2.server, st_ref.server, 0.0, "server after resuming from a checkpoint")
    _close(st2.server_opt, st_ref.server_opt, 0.0, "server optimizer state after resuming")
    _close(all_client_states(resumed), all_client_states(ref), 0.0, "client states after resuming")
    if st2.history != st_ref.history[: len(st2.history)] or st2.counters.keys() != st_ref.counters.keys():
        raise ContractError("history or counters changed by the checkpoint round trip")


def _nan_excluded(cls: type[Algorithm], kwargs: dict[str, Any], data: FederatedData,
                  sim: Callable[..., Engine]) -> None:
    n0 = float(data.seen.train.counts[0])

    class Poisoned(cls):  # type: ignore[misc, valid-type]
        def client_update(self, ctx, payload, state, batches, lr):
            upd, new_state, loss = super().client_update(ctx, payload, state, batches, lr)
            bad = batches.n == n0

            def poison(t: torch.Tensor) -> torch.Tensor:
                return torch.where(bad, torch.full_like(t, float("nan")), t) if t.is_floating_point() else t

            return T.tmap(poison, upd), T.tmap(poison, new_state), torch.where(bad, loss * float("nan"), loss)

    eng = sim(Poisoned(**kwargs))
    st = eng.init_state()
    log = logging.getLogger("fedmtl")
    level = log.level
    log.setLevel(logging.ERROR)  # the exclusions this check provokes are expected: no warnings on the console
    try:
        rows = [eng.round(st) for _ in range(2)]
    finally:
        log.setLevel(level)
    if not all(r["excluded"] >= 1 for r in rows) or st.counters["excluded_updates"] < 2:
        raise ContractError(f"a NaN update was not excluded and counted: {[r['excluded'] for r in rows]}")
    for x in T.leaves(st.server) + T.leaves(all_client_states(eng)):
        if x.is_floating_point() and not bool(torch.isfinite(x).all()):
            raise ContractError("a NaN update reached the server or a client's state")
    if not np.isfinite(summarize(eng.evaluate(st))[SEEN_TEST_LOSS]):
        raise ContractError("evaluation after a NaN update is not finite")


def _private_release(alg: Algorithm, sim: Callable[..., Engine]) -> None:
    try:
        alg.check_privacy()
    except ValueError:
        try:
            sim(privacy=PrivacyConfig(clip_norm=1.0, noise_multiplier=1.0))
        except ValueError:
            return  # refused before any work, as declared
        raise ContractError("check_privacy refuses [privacy] but the engine accepted it") from None
    public = dict(alg.public_server_state)

    def field(path: str) -> str:  # ".fixed['2.weight']" -> "fixed": public state is declared per server-state field
        m = re.match(r"\.(\w+)", path)
        return m.group(1) if m else path

    named = []
    for sigma in (0.0, 1e3):
        eng = sim(privacy=PrivacyConfig(clip_norm=1.0, noise_multiplier=sigma, sampling="fixed"), sampling_rate=0.5)
        st, _ = run_rounds(eng, 1)  # one round: both runs' clients train from the same model, so anything computed
        named.append(T.to_named(st.server))  # from their raw updates is equal in both
    unknown = sorted(set(public) - {field(k) for k in named[0]})
    if unknown:
        raise ContractError(f"public_server_state names {unknown}, which are not fields of the server state "
                            f"({sorted({field(k) for k in named[0]})})")
    same = [k for k in named[0] if field(k) not in public and torch.equal(named[0][k], named[1][k])]
    if same:
        raise ContractError(f"under [privacy] the server state {same} is the same with no noise and with a huge "
                            "noise: it is released without noise (derive it from the noised mean, declare it in "
                            "public_server_state with the reason, or refuse [privacy] in check_privacy)")
    # Poisson sampling with q = 1/16 of 16 clients: rounds without any client; each must still release
    eng = sim(privacy=PrivacyConfig(clip_norm=1.0, noise_multiplier=1.0), sampling_rate=1 / 16, rounds=8)
    st = eng.init_state()
    empty = 0
    for _ in range(8):
        before = {k: v.clone() for k, v in T.to_named(st.server).items()}
        row = eng.round(st)
        empty += row["clients"] == 0
        kept = [k for k, v in T.to_named(st.server).items() if field(k) not in public and torch.equal(before[k], v)]
        if kept:
            raise ContractError(f"round {row['round']} ({row['clients']} clients) under [privacy] left the server "
                                f"state {kept} unchanged: a private round must release its noise")
    if not empty:
        raise ContractError("the toy Poisson run had no empty round to check (change its seed)")
