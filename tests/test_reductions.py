"""Exact reductions between algorithms and against plain torch training."""

import pytest
import torch
from torch import nn

from fedmtl import tree as T
from fedmtl.algorithms import FedAvg, FedEM, FedProx, Local
from fedmtl.data.federated import epoch_orders
from fedmtl.engine.clients import eval_elems
from fedmtl.engine.evaluation import summarize
from fedmtl.engine.sampling import round_generator, sample_clients
from fedmtl.optim import SGD

from .conftest import all_client_states, make_sim, run_rounds
from .conftest import same_trees as _same


@pytest.mark.correctness(
    ("fedprox",), "mu = 0 is FedAvg",
    guards="a proximal term that stays on when disabled",
)
def test_fedprox_mu0_is_fedavg(small_data):
    sa, _ = run_rounds(make_sim(FedAvg(), small_data, sampling_rate=0.5), 3)
    sb, _ = run_rounds(make_sim(FedProx(mu=0.0), small_data, sampling_rate=0.5), 3)
    _same(sa.server, sb.server, atol=0)


@pytest.mark.correctness(
    ("fedprox",), "mu > 0 pulls the local models towards the global one",
    guards="a proximal term with the wrong sign or centre (the current local model instead of the round's global "
           "model)",
)
def test_fedprox_mu_pulls_towards_global(small_data):
    far = []
    for mu in (0.0, 10.0):
        sim = make_sim(FedProx(mu=mu), small_data)
        st = sim.init_state()
        g0 = T.clone(st.server.params)
        sim.round(st)
        far.append(float(T.sq_dist(st.server.params, g0)))
    assert far[1] < 0.5 * far[0]


@pytest.mark.correctness(
    ("fedem",), "M = 1 is FedAvg",
    guards="responsibilities that do not sum to one; component averaging weighted wrongly",
)
def test_fedem_single_component_is_fedavg(small_data):
    sa, ra = run_rounds(make_sim(FedAvg(), small_data, sampling_rate=0.5), 3)
    sb, rb = run_rounds(make_sim(FedEM(num_components=1), small_data, sampling_rate=0.5), 3)
    _same(sa.server.params, T.take(sb.server.components, 0), atol=1e-6)
    # the logged training loss is the same quantity: the mean over local steps of the (responsibility-weighted)
    # batch loss, which with one component is FedAvg's
    for a, b in zip(ra, rb, strict=True):
        assert abs(a["train_loss"] - b["train_loss"]) < 1e-6, (a["train_loss"], b["train_loss"])


def _torch_sgd_client(data, k, params0, opt, orders_fn, rounds, batch_size):
    """Plain torch training of client k with the simulator's batch order: nn.Linear + torch.optim.SGD."""
    lin = nn.Linear(params0["weight"].shape[1], 1)
    with torch.no_grad():
        lin.weight.copy_(params0["weight"])
        lin.bias.copy_(params0["bias"])
    x, y = data.seen.train.client(k)
    for r in range(rounds):
        sgd = torch.optim.SGD(lin.parameters(), lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay)
        order = orders_fn(r, k)
        for s in range(0, len(order), batch_size):
            idx = order[s : s + batch_size]
            sgd.zero_grad()
            nn.functional.binary_cross_entropy_with_logits(lin(x[idx]).squeeze(-1), y[idx].float()).backward()
            sgd.step()
    return {"weight": lin.weight.detach(), "bias": lin.bias.detach()}


@pytest.mark.correctness(
    ("local",), "each client's model equals an independent torch training loop on its data",
    guards="clients leaking into each other's models through shared optimizer state",
)
def test_local_equals_independent_torch_training_per_client(small_data):
    opt = SGD(lr=0.05, momentum=0.9, weight_decay=1e-3)
    sim = make_sim(Local(), small_data, opt=opt, batch_size=16)
    st, _ = run_rounds(sim, 2)
    counts = small_data.seen.train.counts

    def orders_fn(r, k):
        o = epoch_orders(counts, 1, round_generator(sim.cfg.seed, r, 2))
        return o.local[0, int(o.starts[k]) : int(o.starts[k + 1])]

    p0 = sim.model.init(sim.cfg.seed)
    clients = all_client_states(sim)
    for k in (0, 5, 11):
        ref = _torch_sgd_client(small_data, k, p0, opt, orders_fn, 2, 16)
        _same(T.take(clients, k).params, ref, atol=1e-5)


@pytest.mark.correctness(
    ("fedavg",), "one client, one step: FedAvg is one SGD step",
    guards="aggregation weights or learning rates applied twice; momentum carried across rounds",
)
def test_fedavg_one_client_one_step_is_plain_sgd(small_data):
    opt = SGD(lr=0.2, momentum=0.9, weight_decay=5e-4)
    n0 = int(small_data.seen.train.counts[0])
    sim = make_sim(FedAvg(), small_data, opt=opt, clients_per_round=1, batch_size=n0 + 500)
    st = sim.init_state()
    sim.round(st)
    (k,) = sample_clients(sim.cfg, small_data.num_clients, 0).tolist()
    x, y = small_data.seen.train.client(k)
    p = sim.model.init(sim.cfg.seed)
    lin = nn.Linear(x.shape[1], 1)
    with torch.no_grad():
        lin.weight.copy_(p["weight"])
        lin.bias.copy_(p["bias"])
    sgd = torch.optim.SGD(lin.parameters(), lr=0.2, momentum=0.9, weight_decay=5e-4)
    nn.functional.binary_cross_entropy_with_logits(lin(x).squeeze(-1), y.float()).backward()
    sgd.step()
    _same(st.server.params, {"weight": lin.weight.detach(), "bias": lin.bias.detach()}, atol=1e-6)


def test_local_client_unaffected_by_other_clients_data(small_data):
    from fedmtl.data.federated import ClientGroup, FederatedData, Split

    tr = small_data.seen.train
    x2 = tr.x.clone()
    a, b = int(tr.offsets[3]), int(tr.offsets[4])
    x2[a:b] = torch.randn(b - a, x2.shape[1])
    other = FederatedData(ClientGroup(Split(x2, tr.y, tr.offsets), small_data.seen.test), num_classes=2)
    e1, e2 = make_sim(Local(), small_data), make_sim(Local(), other)
    run_rounds(e1, 2)
    run_rounds(e2, 2)
    c1, c2 = all_client_states(e1), all_client_states(e2)
    for k in range(small_data.num_clients):
        same = torch.allclose(c1.params["weight"][k], c2.params["weight"][k])
        assert same == (k != 3)


def test_evaluation_summaries(small_data):
    sim = make_sim(FedAvg(), small_data)
    st, _ = run_rounds(sim, 2)
    ev = sim.evaluate(st)
    s = summarize(ev)
    acc = ev["seen"]["test"]["acc"]
    assert s["seen_test_acc_mean"] == pytest.approx(acc.mean())
    assert s["seen_test_acc_p10"] <= s["seen_test_acc_mean"]
    assert {"seen_val_acc", "unseen_test_acc", "participation_gap"} <= s.keys()


@pytest.mark.parametrize("alg", [FedAvg(), Local(), FedEM(num_components=2)])
def test_evaluation_in_small_chunks_equals_one_pass(small_data, alg):
    """Evaluation gathers clients in chunks (ordered by size, padded to the chunk's largest): a budget that takes a
    few clients a chunk scores every client as one chunk of all does, for a global model, personal models and a
    mixture."""
    out = {}
    per_ex, per_client = eval_elems(make_sim(alg, small_data).model, small_data)
    few = 3 * (int(small_data.seen.test.counts.max()) * per_ex + per_client)  # about three clients a chunk
    for budget in (10**9, few, 1):  # all clients in one chunk; a few; one client a chunk (below any client)
        sim = make_sim(alg, small_data, eval_chunk_elems=budget)
        st, _ = run_rounds(sim, 2)
        out[budget] = sim.evaluate(st)
    for group, splits in (*out[1].items(), *out[few].items()):
        for split, r in splits.items():
            ref = out[10**9][group][split]
            assert (r["client"] == ref["client"]).all()
            assert r["acc"] == pytest.approx(ref["acc"], abs=1e-9), (group, split)
            assert r["loss"] == pytest.approx(ref["loss"], rel=1e-5), (group, split)
