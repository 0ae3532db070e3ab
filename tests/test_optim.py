import pytest
import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from fedmtl.models import build_model
from fedmtl.models.stacking import apply_stacked, value_and_grad_stacked
from fedmtl.optim import SGD, Batches, local_sgd
from fedmtl.tree import batch_dims


@pytest.mark.parametrize("classes", [2, 5])
def test_linear_closed_form_gradient_equals_autograd(classes):
    m = build_model("linear", 7, classes)
    p = m.init(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 7, generator=g)
    y = torch.randint(0, classes, (20,), generator=g)
    mask = (torch.rand(20, generator=g) > 0.3).float()
    w = torch.rand(20, generator=g)
    ga, la = m.value_and_grad(p, x, y, mask, w)
    gb, lb = grad_and_value(m.loss)(p, x, y, mask, w)
    assert torch.allclose(la, lb, atol=1e-6)
    for k in p:
        assert torch.allclose(ga[k], gb[k], atol=1e-6)


def test_local_sgd_equals_torch_sgd_with_momentum_and_weight_decay():
    torch.manual_seed(0)
    lin = nn.Linear(4, 1)
    m = build_model("linear", 4, 2)
    params = {k: v.detach().clone() for k, v in lin.named_parameters()}
    opt = torch.optim.SGD(lin.parameters(), lr=0.3, momentum=0.9, weight_decay=0.01)
    x = torch.randn(3, 5, 4)
    y = (torch.rand(3, 5) > 0.5).long()
    mask = torch.ones(3, 5)
    mask[2, 3:] = 0  # a short last batch
    for s in range(3):
        opt.zero_grad()
        n = int(mask[s].sum())
        out = lin(x[s, :n]).squeeze(-1)
        nn.functional.binary_cross_entropy_with_logits(out, y[s, :n].float()).backward()
        opt.step()
    b = Batches(x, y, mask, torch.zeros(3, 5, dtype=torch.long), torch.tensor(13.0))
    new, _ = local_sgd(m.value_and_grad, params, b, 0.3, SGD(0.3, 0.9, 0.01))
    for k, v in lin.named_parameters():
        assert torch.allclose(new[k], v.detach(), atol=1e-6)


def test_padded_steps_are_exact_no_ops():
    m = build_model("linear", 4, 2)
    p = m.init(1)
    x = torch.randn(2, 6, 4)
    y = (torch.rand(2, 6) > 0.5).long()
    mask = torch.ones(2, 6)
    b1 = Batches(x[:1], y[:1], mask[:1], torch.zeros(1, 6, dtype=torch.long), torch.tensor(6.0))
    padded_mask = torch.stack([mask[0], torch.zeros(6)])
    b2 = Batches(x, y, padded_mask, torch.zeros(2, 6, dtype=torch.long), torch.tensor(6.0))
    opt = SGD(0.1, 0.9, 1e-3)
    a, la = local_sgd(m.value_and_grad, p, b1, 0.1, opt, prox_center=p, prox_mu=0.5)
    c, lc = local_sgd(m.value_and_grad, p, b2, 0.1, opt, prox_center=p, prox_mu=0.5)
    for k in p:
        assert torch.equal(a[k], c[k])
    assert torch.equal(la, lc)


def test_multistep_schedule():
    opt = SGD(lr=0.1, lr_milestones=(0.5, 0.75))
    lrs = [opt.lr_at(r, 200) for r in (0, 99, 100, 149, 150, 199)]
    assert lrs == pytest.approx([0.1, 0.1, 0.01, 0.01, 0.001, 0.001])


def test_bad_optimizer_values():
    with pytest.raises(ValueError, match="momentum"):
        SGD(lr=0.1, momentum=1.5)
    with pytest.raises(ValueError, match="lr_milestones"):
        SGD(lr=0.1, lr_milestones=(50.0,))


@pytest.mark.parametrize("classes", [2, 4])
@pytest.mark.parametrize("name", ["linear", "mlp"])
def test_stacked_dense_gradient_equals_autograd_of_the_module(classes, name):
    # the hand-written backpropagation (models.stacked), for one model and M = 3 stacked ones, against autograd
    # through the nn.Module itself, with padding and sample weights
    m = build_model(name, 5, classes, **({"hidden": (7, 6)} if name == "mlp" else {}))
    assert m.stacks and m.analytic_grad is not None
    comps = {k: torch.stack([m.init(s)[k] for s in range(3)]) for k in m.init(0)}
    g = torch.Generator().manual_seed(1)
    x = torch.randn(11, 5, generator=g)
    y = torch.randint(0, classes, (11,), generator=g)
    mask = torch.ones(11)
    mask[-2:] = 0
    q = torch.rand(3, 11, generator=g)

    def module_loss(p, w):
        out = functional_call(m.module, p, (x,))
        out = out.squeeze(-1) if classes == 2 else out
        return (m.nll(out, y) * mask * w).sum() / mask.sum()

    gs, ls = value_and_grad_stacked(m, comps, x, y, mask, q)
    out = apply_stacked(m, comps, x)
    for j in range(3):
        pj = {k: v[j] for k, v in comps.items()}
        gj, lj = grad_and_value(module_loss)(pj, q[j])
        assert torch.allclose(ls[j], lj, atol=1e-6)
        ref_out = functional_call(m.module, pj, (x,))
        assert torch.allclose(out[j], ref_out.squeeze(-1) if classes == 2 else ref_out, atol=1e-5)
        for k in pj:
            assert torch.allclose(gs[k][j], gj[k], atol=1e-5), k
        g1, l1 = m.value_and_grad(pj, x, y, mask, q[j])  # one model
        assert torch.allclose(l1, lj, atol=1e-6)
        assert all(torch.allclose(g1[k], gj[k], atol=1e-5) for k in pj)
    # under vmap over clients (each client's own weights), as the engine runs it
    gv, lv = torch.func.vmap(m.value_and_grad, in_dims=(0, None, None, None, 0))(comps, x, y, mask, q)
    assert torch.allclose(lv, ls, atol=1e-6) and all(torch.allclose(gv[k], gs[k], atol=1e-5) for k in gs)


@pytest.mark.parametrize("opt,prox,rate", [(SGD(0.1, 0.9, 1e-3), False, 0.1), (SGD(0.1, 0.0, 0.0), False, 0.1),
                                           (SGD(0.05, 0.5, 0.0), True, 0.1),
                                           (SGD(0.1, 0.9, 1e-3), False, torch.tensor(0.1))])  # a tensor rate
def test_vmapped_in_place_steps_equal_the_functional_steps_bit_for_bit(monkeypatch, opt, prox, rate):
    """Under vmap, local_sgd updates the tensors it allocated in place after its first step; the results equal the
    functional steps exactly, dead steps (padding, a limit) included, and the inputs are never written."""
    import fedmtl.optim as optim

    m = build_model("mlp", 6, 3, hidden=(5,))
    p = m.init(0)
    p0 = {k: v.clone() for k, v in p.items()}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 5, 6, generator=g)
    y = torch.randint(0, 3, (3, 4, 5), generator=g)
    mask = torch.ones(3, 4, 5)
    mask[1, 3:] = 0  # client 1: a dead step at the end
    mask[2, 1] = 0  # client 2: a dead step in the middle
    mask[2, 3, 2:] = 0  # and a short last batch
    pos = torch.zeros(3, 4, 5, dtype=torch.long)
    parts = (x, y, mask, pos, mask.sum((1, 2)), torch.tensor([4, 4, 2]))
    kw = {"prox_center": p, "prox_mu": 0.3} if prox else {}

    def run(hint: tuple[bool, ...] | None = None) -> dict[str, torch.Tensor]:
        stacked = Batches(*parts, all_live=hint)
        return vmap(lambda b: local_sgd(m.value_and_grad, p, b, rate, opt, **kw)[0], in_dims=(batch_dims(stacked),))(
            stacked)

    probe, in_place = optim.only_vmap, []  # its answers: True picks the in-place branch (False: the functional one)
    monkeypatch.setattr(optim, "only_vmap", lambda: in_place.append(probe()) or in_place[-1])
    fast = run()
    hint = optim.with_all_live(Batches(*parts)).all_live
    assert hint == (True, False, True, False)  # steps 0 and 2 are live for all three clients: run without masking
    hinted = run(hint)
    if opt.momentum:  # the hint is what local_sgd reads: a wrong one runs client 1's dead last step with momentum
        assert not torch.equal(run((True,) * 4)["0.weight"][1], hinted["0.weight"][1])
    # the in-place branch ran (a torch without the probe falls back to the functional steps: ref against itself)
    assert in_place and all(in_place), in_place
    monkeypatch.setattr(optim, "only_vmap", lambda: False)
    ref = run()
    # a tensor rate cannot be a fused scalar factor in place: there the branches agree to rounding
    same = torch.equal if isinstance(rate, float) else (lambda a, b: torch.allclose(a, b, rtol=0, atol=1e-6))
    for k in p:
        assert same(fast[k], ref[k]), k
        assert same(hinted[k], ref[k]), k
        assert torch.equal(p[k], p0[k])  # the shared input untouched
    for c in range(3):  # and each client equals its own eager run
        one = local_sgd(m.value_and_grad, p, Batches(*(t[c] for t in parts)), rate, opt, **kw)[0]
        for k in p:
            assert torch.allclose(fast[k][c], one[k], atol=1e-6), (c, k)
