"""MR-MTL, FENDA-FL, FedDBE and FedCAC: each against its defining property (reductions to existing methods, closed
forms and hand computations on tiny federations)."""

from pathlib import Path

import pytest
import torch

from fedmtl import tree as T
from fedmtl.algorithms import MRMTL, Local
from fedmtl.optim import SGD

from .conftest import all_client_states, make_sim, run_rounds


def _same(a, b, atol=1e-6):
    for x, y in zip(T.leaves(a), T.leaves(b), strict=True):
        assert torch.allclose(x, y, atol=atol), (x - y).abs().max()


def _spread(models):
    """The largest distance of a personal model (stacked (N, ...)) to the mean of all of them."""
    flat = torch.cat([v.reshape(v.shape[0], -1) for v in models.values()], 1)
    return float((flat - flat.mean(0)).norm(dim=1).max())


# ------------------------------------------------------------------------------------------------------------ MR-MTL
@pytest.mark.correctness(
    ("mrmtl",), "lambda = 0 is Local training (personal models equal bit for bit); with full participation the "
    "server's model is the uniform mean of the personal models",
    guards="personal models reset to the broadcast mean each round (FedAvg-like), or a Ditto-style separate global "
    "model instead of the mean of the personal ones",
)
def test_mrmtl_without_penalty_is_local_and_its_server_keeps_the_mean(small_data):
    mr = make_sim(MRMTL(lam=0.0), small_data, rounds=3)
    run_rounds(mr, 3)
    loc = make_sim(Local(), small_data, rounds=3)
    run_rounds(loc, 3)
    _same(all_client_states(mr).w, all_client_states(loc).params, atol=0)
    mr = make_sim(MRMTL(lam=0.5), small_data, rounds=3)
    st, _ = run_rounds(mr, 3)
    seen = torch.arange(mr.fed.num_clients)
    personal = mr.clients.read(seen).w  # every seen client trained every round (full participation)
    _same(st.server.params, T.tmap(lambda v: v.mean(0), personal), atol=1e-6)


@pytest.mark.correctness(
    ("mrmtl",), "the personal models' spread around their mean shrinks as lambda grows (lambda = 30 under a quarter "
    "of Local's spread)", guards="the proximal pull applied with the wrong sign or towards the client's own start",
)
def test_mrmtl_large_penalty_pins_personal_models_to_their_mean(small_data):
    opt = SGD(lr=0.05)  # plain SGD: lr x lambda < 2 keeps the explicit proximal step stable
    spread = {}
    for lam in (0.0, 3.0, 30.0):
        sim = make_sim(MRMTL(lam=lam), small_data, opt=opt, rounds=5)
        run_rounds(sim, 5)
        spread[lam] = _spread(sim.clients.read(torch.arange(sim.fed.num_clients)).w)
    assert spread[0.0] > spread[3.0] > spread[30.0], spread
    assert spread[30.0] < 0.25 * spread[0.0], spread


# ------------------------------------------------------------------------------------------------- bundled configs
@pytest.mark.parametrize("name", ["mrmtl"])
def test_bundled_configs_build_their_method_on_local_s_settings(name):
    from fedmtl import config

    path = Path(__file__).resolve().parents[1] / f"src/fedmtl/configs/fmnist/{name}.toml"
    alg = config.load(path).build_algorithm()
    assert alg.name == name
    raw, local = config.read_toml(path), config.read_toml(path.parent / "local.toml")
    for table in ("data", "model", "optim", "run"):  # compares directly with Local
        assert raw[table] == local[table], table
