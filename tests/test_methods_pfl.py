"""FedAS, pFedFDA, Floco, FedGen: each method's defining property by hand or as a reduction to another method."""

import dataclasses

import pytest
import torch

from fedmtl import tree as T
from fedmtl.algorithms import FedAS, FedAvg, FedGen, FedPer, Floco, PFedFDA
from fedmtl.algorithms.base import Context
from fedmtl.algorithms.bodyhead import SplitModel
from fedmtl.algorithms.fedas import ASUpdate, alignment_step, fisher_trace
from fedmtl.algorithms.fedgen import (
    GenServer,
    GenUpdate,
    counter_normals,
    diversity_loss,
    ensemble_loss,
    ensemble_weights,
    generate,
    init_generator,
    sample_labels,
    teacher_loss,
)
from fedmtl.algorithms.floco import counter_uniforms, project_clients, project_to_simplex, riesz_log_energy
from fedmtl.algorithms.pfedfda import FDAServer, FDAUpdate, discriminants, gaussian_estimate, shrink
from fedmtl.models import build_model
from fedmtl.models.base import ModelError
from fedmtl.optim import SGD, Batches

from .conftest import all_client_states, make_sim, run_rounds
from .conftest import same_trees as _same


@pytest.fixture(scope="module")
def mlp():
    return build_model("mlp", 10, 2, hidden=(16,))


def _batches(s: int, b: int, d: int, classes: int, seed: int) -> Batches:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s, b, d, generator=g)
    y = torch.randint(0, classes, (s, b), generator=g)
    mask = torch.ones(s, b)
    mask[-1, b // 2:] = 0.0  # a padded last batch
    return Batches(x, y, mask, torch.arange(s * b).reshape(s, b), mask.sum())


@pytest.mark.parametrize("cls", [FedAS, PFedFDA, Floco, FedGen])
def test_refuses_a_model_without_a_head(cls, small_model):
    with pytest.raises(ModelError, match=cls.name):
        cls().check_model(small_model)


# ------------------------------------------------------------------------------------------------ FedAS
@pytest.mark.correctness(
    ("fedas",), "without parameter alignment and with sample-count weights, FedAS trains and aggregates as FedPer; "
    "its clients keep their whole trained model",
    guards="a local model trained from something other than the received body and the client's own head",
)
def test_fedas_without_alignment_and_fisher_is_fedper(small_data, mlp):
    sim = make_sim(FedAS(align_epochs=0, weighting="samples"), small_data, model=mlp, sampling_rate=0.5)
    sa, _ = run_rounds(sim, 2)
    sb, _ = run_rounds(make_sim(FedPer(), small_data, model=mlp, sampling_rate=0.5), 2)
    _same(sa.server.params, sb.server.params, atol=1e-6)
    own = all_client_states(sim).params
    assert float((own["2.weight"] - own["2.weight"][0]).abs().max()) > 1e-3  # every client has its own head


@pytest.mark.correctness(
    ("fedas",), "the server's body is the Fisher-trace-weighted mean sum_i F_i phi_i / sum_i F_i of the valid "
    "updates; F_i is the empirical Fisher's trace (1/n) sum_l ||grad log p(y_l|x_l)||^2 over single examples (a "
    "per-example autograd loop) or, as in the authors' code, the summed squared mini-batch gradients",
    guards="weights by sample counts, a NaN update's trace read, a trace of the mean gradient instead of the mean of "
           "per-example squared gradients",
)
def test_fedas_fisher_trace_and_weighted_aggregation(mlp):
    params = mlp.init(3)
    b = _batches(3, 8, 10, 2, seed=0)
    per, n = 0.0, 0.0
    for s in range(3):
        for i in range(8):
            if b.mask[s, i] == 0:
                continue
            p = {k: v.detach().requires_grad_() for k, v in params.items()}
            g = torch.autograd.grad(mlp.nll(mlp.apply(p, b.x[s, i:i + 1]), b.y[s, i:i + 1]).sum(), list(p.values()))
            per += sum(float((v ** 2).sum()) for v in g)
            n += 1
    assert float(fisher_trace(mlp, params, b, 3, per_sample=True)) == pytest.approx(per / n, rel=1e-4)
    batch = 0.0
    for s in range(3):
        p = {k: v.detach().requires_grad_() for k, v in params.items()}
        g = torch.autograd.grad(mlp.loss(p, b.x[s], b.y[s], b.mask[s]), list(p.values()))
        batch += sum(float((v ** 2).sum()) for v in g)
    assert float(fisher_trace(mlp, params, b, 3, per_sample=False)) == pytest.approx(batch, rel=1e-4)
    assert batch < per  # a mean gradient is shorter than the mean of the per-example ones here

    body, head = mlp.split(params)
    bodies = T.stack([T.scale(body, 1.0), T.scale(body, 2.0), T.scale(body, float("nan"))])
    fisher = torch.tensor([1.0, 3.0, float("nan")])
    ctx = Context(mlp, SGD(0.1), 3, 30.0)
    new = FedAS().aggregate(ctx, SplitModel(body, head), ASUpdate(bodies, fisher), torch.tensor([10.0, 10.0, 0.0]),
                            torch.arange(3))
    _same(new.params, T.scale(body, (1.0 * 1.0 + 3.0 * 2.0) / 4.0), atol=1e-6)
    by_counts = FedAS(weighting="samples").aggregate(ctx, SplitModel(body, head), ASUpdate(bodies, fisher),
                                                     torch.tensor([10.0, 30.0, 0.0]), torch.arange(3))
    _same(by_counts.params, T.scale(body, (10.0 + 60.0) / 40.0), atol=1e-6)


@pytest.mark.correctness(
    ("fedas",), "parameter alignment: the gradient of the sum over the batch's classes of the mean-squared distance "
    "of the received body's features to the client's own prototypes, by autograd on the hand-written loss",
    guards="prototypes of the received body instead of the client's own, a distance averaged over all examples "
           "instead of per class",
)
def test_fedas_alignment_gradient_by_hand(mlp):
    received, own = mlp.init(1), mlp.init(2)
    b = _batches(1, 12, 10, 2, seed=4)
    x, y, m = b.x[0], b.y[0], b.mask[0]
    z_own = mlp.features(own, x)
    protos = torch.stack([z_own[(y == c) & (m > 0)].mean(0) for c in range(2)])
    body, head = mlp.split(received)
    grads, _ = alignment_step(mlp, head, protos, torch.ones(2))(body, x, y, m, None)
    p = {k: v.detach().requires_grad_() for k, v in body.items()}
    z = mlp.features({**p, **head}, x)
    loss = sum(((z[(y == c) & (m > 0)] - protos[c]) ** 2).mean() for c in range(2))
    want = torch.autograd.grad(loss, list(p.values()))
    for k, g in zip(p, want, strict=True):
        assert torch.allclose(grads[k], g, atol=1e-6), k
    assert float(sum((g ** 2).sum() for g in want)) > 1e-6  # a real pull: the two bodies differ


# ------------------------------------------------------------------------------------------------ pFedFDA
@pytest.mark.correctness(
    ("pfedfda",), "the generative head: its softmax is the posterior of the Gaussians N(mu_c, Sigma') with priors pi_c "
    "(multivariate normal densities), Sigma' = (1 - eps) Sigma + eps tr(Sigma)/d I the shrunk covariance",
    guards="a head without the quadratic term or the log prior, a covariance used unshrunk or shrunk towards the "
           "wrong target",
)
def test_pfedfda_generative_head_is_the_gaussian_posterior():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 3, generator=g, dtype=torch.float64)
    cov = a @ a.T + 0.1 * torch.eye(3, dtype=torch.float64)
    means = torch.randn(4, 3, generator=g, dtype=torch.float64)
    priors = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    shrunk = (1 - 1e-4) * cov + 1e-4 * torch.trace(cov) / 3 * torch.eye(3, dtype=torch.float64)
    assert torch.allclose(shrink(cov), shrunk, atol=1e-12)
    z = torch.randn(6, 3, generator=g, dtype=torch.float64)
    w, b = discriminants(means, cov, priors)
    dens = torch.stack([torch.distributions.MultivariateNormal(m, shrunk).log_prob(z) for m in means], -1)
    want = torch.softmax(dens + priors.log(), -1)
    assert torch.allclose(torch.softmax(z @ w.T + b, -1), want, atol=1e-9)


@pytest.mark.correctness(
    ("pfedfda",), "the local Gaussian estimate: class means (the global mean for a class with min_samples examples or "
    "fewer), the pooled within-class covariance S / (n - 1) + ridge I, padding left out, by hand; the server's "
    "means and covariance are the n_i-weighted means of the clients' interpolated estimates",
    guards="a covariance around the overall mean, padding counted, a rare class's mean estimated from 1-2 examples",
)
def test_pfedfda_local_estimate_and_server_means_by_hand():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(9, 2, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2])
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 1, 1, 0], dtype=torch.float64)  # the last example is padding
    onehot = torch.nn.functional.one_hot(y, 3).to(torch.float64) * mask[:, None]
    glob = torch.full((3, 2), 7.0, dtype=torch.float64)
    means, cov = gaussian_estimate(z, onehot, glob, min_samples=2, ridge=0.5)
    want_means = torch.stack([z[:4].mean(0), z[4:7].mean(0), glob[2]])  # class 2: one real example, the global mean
    assert torch.allclose(means, want_means, atol=1e-12)
    centered = torch.cat([z[:4] - want_means[0], z[4:7] - want_means[1], z[7:8] - want_means[2]])
    assert torch.allclose(cov, centered.T @ centered / 7 + 0.5 * torch.eye(2, dtype=torch.float64), atol=1e-12)

    mlp = build_model("mlp", 10, 3, hidden=(2,))
    body, _ = mlp.split(mlp.init(0))
    ups = FDAUpdate(T.stack([body, body, body]), torch.stack([means, 2 * means, means * float("nan")]).float(),
                    torch.stack([cov, 3 * cov, cov]).float())
    ctx = Context(mlp, SGD(0.1), 3, 40.0)
    new = PFedFDA().aggregate(ctx, FDAServer(body, means.float(), cov.float()), ups, torch.tensor([10.0, 30.0, 0.0]),
                              torch.arange(3))
    assert torch.allclose(new.means, (0.25 + 0.75 * 2) * means.float(), atol=1e-5)
    assert torch.allclose(new.cov, (0.25 + 0.75 * 3) * cov.float(), atol=1e-5)


@pytest.mark.correctness(
    ("pfedfda",), "the local-global interpolation: beta = 0 gives the global generative head (with the client's "
    "priors), beta = 1 the local one; the cross-validated beta is 1 where the global means are wrong and the local "
    "data plentiful",
    guards="beta applied the wrong way round, a cross-validation that cannot prefer the local estimate",
)
def test_pfedfda_interpolation_and_cross_validated_beta():
    mlp = build_model("mlp", 3, 2, hidden=(3,))
    g = torch.Generator().manual_seed(2)
    y = torch.arange(80) % 2
    true = torch.tensor([[2.0, 0.0, 0.0], [-2.0, 0.0, 0.0]])
    z = true[y] + 0.5 * torch.randn(80, 3, generator=g)
    mask = torch.ones(80)
    wrong, cov_g = true.flip(0), torch.eye(3)  # the global means swap the classes
    local_means, local_cov = gaussian_estimate(z, torch.nn.functional.one_hot(y, 2).float(), wrong, 2, 1.0)
    m0, c0, b0 = PFedFDA(interpolation="fixed", beta=0.0).adapt(mlp, z, y, mask, wrong, cov_g)
    assert float(b0) == 0.0 and torch.allclose(m0, wrong) and torch.allclose(c0, cov_g)
    m1, c1, _ = PFedFDA(interpolation="fixed", beta=1.0).adapt(mlp, z, y, mask, wrong, cov_g)
    assert torch.allclose(m1, local_means, atol=1e-6) and torch.allclose(c1, local_cov, atol=1e-6)
    _, _, beta = PFedFDA().adapt(mlp, z, y, mask, wrong, cov_g)
    assert float(beta) == 1.0
    _, _, beta = PFedFDA().adapt(mlp, z, y, mask, true, 0.25 * torch.eye(3))  # a global estimate that is right
    assert float(beta) < 1.0


# ------------------------------------------------------------------------------------------------ Floco
@pytest.mark.correctness(
    ("floco",), "one endpoint (M = 1) is FedAvg: the simplex layer W(alpha) = sum_m alpha_m W_m is the plain layer",
    guards="a simplex layer that changes the model, an update rule other than the run's SGD",
)
def test_floco_with_one_endpoint_is_fedavg(small_data, mlp):
    sim = make_sim(Floco(endpoints=1, tau=2), small_data, model=mlp, sampling_rate=0.5)
    st = sim.init_state()
    wn = "2.weight"
    start = {**mlp.init(7), wn: st.server.simplex[0].clone()}  # FedAvg from the same start (seed 7: the simulator's)
    ref = make_sim(FedAvg(), small_data, model=dataclasses.replace(mlp, initial_params=start), sampling_rate=0.5)
    sa, _ = run_rounds(sim, 3)
    sb, _ = run_rounds(ref, 3)
    got = {**sa.server.params, wn: sa.server.simplex[0]}
    for k, v in sb.server.params.items():
        assert torch.allclose(got[k], v, atol=1e-5), k


@pytest.mark.correctness(
    ("floco",), "the Euclidean projection onto the simplex of sum z (Duchi et al. 2008) by hand; the projection of "
    "clients places two groups of gradient signatures at two distant centers, each group together, at the z of least "
    "Riesz s-energy",
    guards="a projection that is not onto the simplex, centers that do not follow the signatures, the wrong z",
)
def test_floco_projection_by_hand():
    beta = project_to_simplex(torch.tensor([[0.5, 0.2, -0.1], [0.2, 0.3, 0.5]], dtype=torch.float64))
    want = torch.tensor([[0.5 + 0.4 / 3, 0.2 + 0.4 / 3, -0.1 + 0.4 / 3], [0.2, 0.3, 0.5]], dtype=torch.float64)
    assert torch.allclose(beta, want, atol=1e-12)
    assert torch.allclose(project_to_simplex(torch.tensor([[3.0, 0.0, 1.0]]), 0.5), torch.tensor([[0.5, 0.0, 0.0]]))

    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(40, generator=g), torch.randn(40, generator=g)
    sigs = torch.stack([a + 0.01 * torch.randn(40, generator=g) for _ in range(4)]
                       + [b + 0.01 * torch.randn(40, generator=g) for _ in range(4)])
    c = project_clients(sigs, 3)
    assert torch.allclose(c.sum(-1), torch.ones(8, dtype=torch.float64)) and bool((c >= 0).all())
    assert float((c[:4] @ c[4:].T).abs().max()) < 1e-12  # the two groups share no endpoint
    energies = []  # the chosen centers have the least energy over the grid
    from fedmtl.algorithms.floco import pca_scores
    kappa = pca_scores(sigs.double(), 3)
    for z in torch.linspace(1e-4, 1.0, 1000, dtype=torch.float64):
        p = project_to_simplex(kappa, z)
        energies.append(float(riesz_log_energy(p / p.sum(-1, keepdim=True))))
    assert float(riesz_log_energy(c)) == pytest.approx(min(energies), abs=1e-9)


@pytest.mark.correctness(
    ("floco",), "before round tau every step's alpha is on the simplex; from tau on it lies in the client's subregion "
    "(within L1 distance rho of its center; on the simplex, or the authors' L1-ball draw), the centers placed in the "
    "round before tau from the clients' signatures, and a client predicts at its center",
    guards="a subregion ignored after the projection, draws outside the L1 ball, a projection at the wrong round",
)
@pytest.mark.parametrize("subregion", ["simplex", "ball"])
def test_floco_subregions_after_the_projection(small_data, mlp, subregion):
    alg = Floco(endpoints=3, tau=3, rho=0.2, subregion=subregion)
    sim = make_sim(alg, small_data, model=mlp)
    st = sim.init_state()
    sim.round(st)
    assert torch.allclose(st.server.centers, torch.full_like(st.server.centers, 1 / 3))  # round 1: no projection
    before = alg.alphas(sim.ctx, st.server, torch.tensor(0), 50)
    assert torch.allclose(before.sum(-1), torch.ones(50)) and bool((before >= 0).all())
    assert float(before.std(0).min()) > 0.1  # spread over the whole simplex
    sim.round(st)  # round 2 = tau - 1: the projection
    centers = st.server.centers
    assert float((centers - 1 / 3).abs().max()) > 0.05 and torch.allclose(centers.sum(-1), torch.ones(len(centers)))
    after = alg.alphas(sim.ctx, st.server, torch.tensor(5), 200)  # round 3 = tau
    dist = (after - centers[5]).abs().sum(-1)
    assert float(dist.max()) <= 0.2 + 1e-6 and float(dist.max()) > 0.05
    if subregion == "simplex":  # the authors' L1-ball draw may leave the simplex (its sum is not kept)
        assert bool((after >= -1e-7).all()) and torch.allclose(after.sum(-1), torch.ones(200), atol=1e-6)
    from fedmtl.algorithms.base import ClientId
    model = alg.personalize(sim.ctx, st.server, ClientId(torch.tensor(5)), None, 0.1, True)
    assert torch.allclose(model["2.weight"], torch.tensordot(centers[5], st.server.simplex, dims=1))


# ------------------------------------------------------------------------------------------------ FedGen
@pytest.mark.correctness(
    ("fedgen",), "reference_code: without the generated terms (alpha = beta = 0) the clients train as FedAvg's and the "
    "global model is FedAvg's, whatever the generator",
    guards="a local update rule or an aggregation other than FedAvg's under FedGen's regularizers",
)
def test_fedgen_without_distillation_is_fedavg(small_data, mlp):
    alg = FedGen(reference_code=True, generative_alpha=0.0, generative_beta=0.0, generator_hidden=8, noise_dim=3,
                 generator_steps=1)
    sa, _ = run_rounds(make_sim(alg, small_data, model=mlp, sampling_rate=0.5), 2)  # round 2 has the terms, at 0
    sb, _ = run_rounds(make_sim(FedAvg(), small_data, model=mlp, sampling_rate=0.5), 2)
    for k, v in sb.server.params.items():
        assert torch.allclose(sa.server.params[k], v, atol=1e-5), k


@pytest.mark.correctness(
    ("fedgen",), "reference_code: the server's generator objective by hand: ensemble weights (n_ky + 1) / "
    "sum_l (n_ly + 1), the weighted cross-entropy of every head on the generated representations, the diversity loss; "
    "the server's steps are torch.optim.Adam's on that objective (same draws), and they lower the ensemble loss",
    guards="heads weighted uniformly instead of by label counts, a generator trained on one head, a wrong Adam step",
)
def test_fedgen_generator_is_trained_on_the_heads_and_label_counts():
    import torch.nn.functional as F

    mlp = build_model("mlp", 10, 3, hidden=(16,))
    g = torch.Generator().manual_seed(5)
    counts = torch.tensor([[5.0, 0.0, 0.0], [1.0, 3.0, 0.0]])  # class 2: no client of the round holds it
    w = ensemble_weights(counts)
    assert torch.allclose(w, torch.tensor([[6 / 8, 1 / 5, 1 / 2], [2 / 8, 4 / 5, 1 / 2]]))
    heads = [{"2.weight": torch.randn(3, 16, generator=g), "2.bias": torch.randn(3, generator=g)} for _ in range(2)]
    z, y = torch.randn(6, 16, generator=g), torch.tensor([0, 1, 2, 0, 1, 0])
    want = sum((F.cross_entropy(z @ h["2.weight"].T + h["2.bias"], y, reduction="none") * w[k][y]).mean()
               for k, h in enumerate(heads))
    assert float(teacher_loss(mlp, heads, w, z, y)) == pytest.approx(float(want), rel=1e-6)
    eps = torch.rand(6, 3, generator=g)
    pairs = [((eps[i] - eps[j]) ** 2).mean() * (z[i] - z[j]).abs().mean() for i in range(6) for j in range(6)]
    assert float(diversity_loss(eps, z)) == pytest.approx(float(torch.exp(-torch.stack(pairs).mean())), rel=1e-6)

    alg = FedGen(reference_code=True, generator_hidden=8, noise_dim=3, generator_steps=4, generator_batch_size=10)
    ctx = Context(mlp, SGD(0.1), 2, 10.0)
    gen0 = init_generator(3, 3, 8, 16, torch.Generator().manual_seed(0))
    zeros = {k: torch.zeros_like(v) for k, v in gen0.items() if "running" not in k}
    server = GenServer(mlp.init(0), gen0, zeros, dict(zeros), torch.tensor(0), torch.tensor(3), torch.tensor(11),
                       torch.full((3,), 1 / 3))
    gen, _, _, steps = alg.train_generator(ctx, server, heads, counts)
    assert int(steps) == 4
    # the same steps with torch.optim.Adam on leaf tensors and the same draws
    leaves = {k: v.clone().requires_grad_() for k, v in gen0.items() if "running" not in k}
    stats = {k: v.clone() for k, v in gen0.items() if "running" in k}
    adam = torch.optim.Adam(leaves.values(), lr=3e-4 * 0.98**3, weight_decay=1e-2)
    draws = torch.Generator().manual_seed((11 * 1_000_003 + 3 * 7_919 + 17) % (2**62))
    qualified = torch.tensor([0, 1])  # the labels some client holds
    for _ in range(4):
        yy = qualified[torch.randint(2, (10,), generator=draws)]
        ee = torch.rand(10, 3, generator=draws)
        zz, stats = generate({**leaves, **stats}, F.one_hot(yy, 3).float(), ee, train=True)
        loss = teacher_loss(mlp, heads, w, zz, yy) + diversity_loss(ee, zz)
        adam.zero_grad()
        loss.backward()
        adam.step()
        stats = {k: v.detach() for k, v in stats.items()}
    for k, v in leaves.items():
        assert torch.allclose(gen[k], v.detach(), atol=1e-6), k
    for k, v in stats.items():
        assert torch.allclose(gen[k], v, atol=1e-6), k
    # many steps lower the ensemble (teacher) loss of fresh samples
    trained, _, _, _ = FedGen(reference_code=True, generator_hidden=8, noise_dim=3, generator_steps=300,
                              generator_lr=0.01, ensemble_eta=0.0).train_generator(ctx, server, heads, counts)
    yy, ee = torch.tensor([0, 1] * 50), torch.rand(100, 3, generator=g)
    before = teacher_loss(mlp, heads, w, generate(gen0, F.one_hot(yy, 3).float(), ee, False)[0], yy)
    after = teacher_loss(mlp, heads, w, generate(trained, F.one_hot(yy, 3).float(), ee, False)[0], yy)
    assert float(after) < 0.5 * float(before)


@pytest.mark.correctness(
    ("fedgen",), "reference_code: the client's objective by hand: cross-entropy + (B_g / B) alpha_t x the "
    "cross-entropy of its head on generated representations of sampled labels + beta_t x KL(softmax(head(G(y))) || "
    "p(. | x)) (batch mean), alpha_t = alpha 0.98^t, no generated terms in the first round",
    guards="the distillation's KL reversed or taken on logits, a generator trained by the clients, terms on from "
           "round one",
)
def test_fedgen_client_objective_by_hand():
    import torch.nn.functional as F

    mlp = build_model("mlp", 10, 3, hidden=(16,))
    alg = FedGen(reference_code=True, generator_hidden=8, noise_dim=3, gen_batch_size=4)
    g = torch.Generator().manual_seed(6)
    gen = init_generator(3, 3, 8, 16, g)
    gen["bn.running_mean"], gen["bn.running_var"] = torch.randn(8, generator=g), torch.rand(8, generator=g) + 0.5
    p = mlp.init(1)
    x, y, mask = torch.randn(5, 10, generator=g), torch.tensor([0, 1, 2, 0, 1]), torch.tensor([1.0, 1, 1, 1, 0])
    y_hat, eps_hat, eps = torch.tensor([1, 0, 2, 1]), torch.rand(4, 3, generator=g), torch.rand(5, 3, generator=g)
    alpha, beta = torch.tensor(2.0), torch.tensor(3.0)
    got = alg.local_loss(mlp, gen, p, x, y, mask, y_hat, eps_hat, eps, alpha, beta)

    def g_eval(yy, ee):  # the generator in evaluation mode, by hand
        h = torch.cat([ee, F.one_hot(yy, 3).float()], -1) @ gen["fc.weight"].T + gen["fc.bias"]
        h = (h - gen["bn.running_mean"]) / torch.sqrt(gen["bn.running_var"] + 1e-5) * gen["bn.weight"] + gen["bn.bias"]
        return torch.relu(h) @ gen["out.weight"].T + gen["out.bias"]

    def head(zz):
        return zz @ p["2.weight"].T + p["2.bias"]

    real = mlp.apply(p, x)[:4]
    ce = F.cross_entropy(real, y[:4])
    gen_ce = F.cross_entropy(head(g_eval(y_hat, eps_hat)), y_hat)
    teacher = F.softmax(head(g_eval(y, eps))[:4], -1)
    kl = F.kl_div(F.log_softmax(real, -1), teacher, reduction="batchmean")
    assert float(got) == pytest.approx(float(ce + (4 / 4) * 2.0 * gen_ce + 3.0 * kl), rel=1e-5)
    assert float(alg.weights_at(10.0, torch.tensor(5))) == pytest.approx(10.0 * 0.98**5)


@pytest.mark.correctness(
    ("fedgen",), "the paper's generator objective (Eq. (4)) by hand: one cross-entropy of the heads' averaged logits "
    "(below the mean of the heads' own); the server's steps are torch.optim.Adam's on alpha_e x that + eta x the "
    "diversity loss, labels drawn from the round's label distribution p^(y) and noise from N(0, I)",
    guards="per-head or label-count-weighted cross-entropies in the paper's form, labels drawn uniformly, U[0, 1) "
           "noise",
)
def test_fedgen_paper_generator_objective():
    import torch.nn.functional as F

    mlp = build_model("mlp", 10, 3, hidden=(16,))
    g = torch.Generator().manual_seed(5)
    heads = [{"2.weight": torch.randn(3, 16, generator=g), "2.bias": torch.randn(3, generator=g)} for _ in range(2)]
    z, y = torch.randn(6, 16, generator=g), torch.tensor([0, 1, 2, 0, 1, 0])
    logits = [z @ h["2.weight"].T + h["2.bias"] for h in heads]
    got = float(ensemble_loss(mlp, heads, z, y))
    assert got == pytest.approx(float(F.cross_entropy((logits[0] + logits[1]) / 2, y)), rel=1e-6)
    assert got < float(sum(F.cross_entropy(out, y) for out in logits)) / 2 - 1e-3  # not the heads' own mean

    counts = torch.tensor([[5.0, 0.0, 0.0], [1.0, 3.0, 0.0]])  # p^(y) = (6, 3, 0) / 9
    alg = FedGen(generator_hidden=8, noise_dim=3, generator_steps=3, generator_batch_size=10, ensemble_alpha=0.5)
    gen0 = init_generator(3, 3, 8, 16, torch.Generator().manual_seed(0))
    zeros = {k: torch.zeros_like(v) for k, v in gen0.items() if "running" not in k}
    server = GenServer(mlp.init(0), gen0, zeros, dict(zeros), torch.tensor(0), torch.tensor(3), torch.tensor(11),
                       torch.full((3,), 1 / 3))
    gen, _, _, _ = alg.train_generator(Context(mlp, SGD(0.1), 2, 10.0), server, heads, counts)
    leaves = {k: v.clone().requires_grad_() for k, v in gen0.items() if "running" not in k}
    stats = {k: v.clone() for k, v in gen0.items() if "running" in k}
    adam = torch.optim.Adam(leaves.values(), lr=3e-4 * 0.98**3, weight_decay=1e-2)
    draws = torch.Generator().manual_seed((11 * 1_000_003 + 3 * 7_919 + 17) % (2**62))
    for _ in range(3):
        yy = torch.multinomial(torch.tensor([6.0, 3.0, 0.0], dtype=torch.float64) / 9, 10, True, generator=draws)
        ee = torch.randn(10, 3, generator=draws)
        zz, stats = generate({**leaves, **stats}, F.one_hot(yy, 3).float(), ee, train=True)
        avg = sum(zz @ h["2.weight"].T + h["2.bias"] for h in heads) / 2
        loss = 0.5 * F.cross_entropy(avg, yy) + diversity_loss(ee, zz)
        adam.zero_grad()
        loss.backward()
        adam.step()
        stats = {k: v.detach() for k, v in stats.items()}
    _same({k: gen[k] for k in leaves}, {k: v.detach() for k, v in leaves.items()})
    _same({k: gen[k] for k in stats}, stats)


@pytest.mark.correctness(
    ("fedgen",), "the paper's client objective (Eq. (5)) by hand: cross-entropy + the unweighted mean cross-entropy of "
    "the head on generated representations, none in the first round; a local step samples the generated labels from "
    "the broadcast p^(y) (one SGD step by hand)",
    guards="the authors' alpha_t / B_g weights or latent distillation term in the paper's form, generated labels not "
           "drawn from p^(y)",
)
def test_fedgen_paper_client_objective_by_hand():
    import torch.nn.functional as F

    mlp = build_model("mlp", 10, 3, hidden=(16,))
    alg = FedGen(generator_hidden=8, noise_dim=3, gen_batch_size=4)
    g = torch.Generator().manual_seed(6)
    gen = init_generator(3, 3, 8, 16, g)
    gen["bn.running_mean"], gen["bn.running_var"] = torch.randn(8, generator=g), torch.rand(8, generator=g) + 0.5
    p = mlp.init(1)
    x, y, mask = torch.randn(5, 10, generator=g), torch.tensor([0, 1, 2, 0, 1]), torch.tensor([1.0, 1, 1, 1, 0])
    y_hat, eps_hat = torch.tensor([1, 0, 2, 1]), torch.randn(4, 3, generator=g)

    def g_eval(yy, ee):  # the generator in evaluation mode, by hand
        h = torch.cat([ee, F.one_hot(yy, 3).float()], -1) @ gen["fc.weight"].T + gen["fc.bias"]
        h = (h - gen["bn.running_mean"]) / torch.sqrt(gen["bn.running_var"] + 1e-5) * gen["bn.weight"] + gen["bn.bias"]
        return torch.relu(h) @ gen["out.weight"].T + gen["out.bias"]

    def by_hand(q, yy, ee, on):
        gen_ce = F.cross_entropy(g_eval(yy, ee) @ q["2.weight"].T + q["2.bias"], yy)
        return F.cross_entropy(mlp.apply(q, x)[:4], y[:4]) + on * gen_ce

    for on in (0.0, 1.0):
        got, _ = alg.paper_loss(mlp, gen, p, x, y, mask, y_hat, eps_hat, torch.tensor(on))
        assert float(got) == pytest.approx(float(by_hand(p, y_hat, eps_hat, on)), rel=1e-5)
    # one local step in the second round with p^(y) all on label 2 and a generator blind to its noise: every
    # generated sample is G(2), whatever the draws
    gen["fc.weight"][:, :3] = 0.0
    zeros = {k: torch.zeros_like(v) for k, v in gen.items() if "running" not in k}
    payload = GenServer(p, gen, zeros, dict(zeros), torch.tensor(0), torch.tensor(1), torch.tensor(3),
                        torch.tensor([0.0, 0.0, 1.0]))
    batches = Batches(x.unsqueeze(0), y.unsqueeze(0), mask.unsqueeze(0), torch.arange(5).reshape(1, 5), mask.sum())
    ctx = Context(mlp, SGD(0.1), 2, 10.0)
    update, _, _ = alg.client_update(ctx, payload, alg.init_client(ctx, payload), batches, 0.1)
    q = {k: v.clone().requires_grad_() for k, v in p.items()}
    grads = torch.autograd.grad(by_hand(q, torch.full((4,), 2), torch.zeros(4, 3), 1.0), list(q.values()))
    _same(update.params, {k: p[k] - 0.1 * gk for k, gk in zip(q, grads, strict=True)}, atol=1e-6)
    assert torch.equal(update.counts, torch.tensor([2.0, 1.0, 1.0]))  # the live labels 0, 1, 2, 0


@pytest.mark.correctness(
    ("fedgen",), "the paper's labels y ~ p^(y) by inversion of counter-based uniforms: frequencies of 20,000 draws "
    "within 1.5 points of p^(y), a label of probability 0 never drawn; the counter-based noise is standard normal",
    guards="uniform labels, a zero-probability label drawn, noise that is not N(0, 1)",
)
def test_fedgen_paper_draws_follow_the_label_distribution():
    dist = torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0])
    labels = sample_labels(dist, counter_uniforms(torch.tensor(123), (20000,)))
    freq = torch.bincount(labels, minlength=5).double() / 20000
    assert freq[1] == 0 and freq[4] == 0  # a label of probability 0 is never drawn
    assert torch.allclose(freq, dist.double(), atol=0.015), freq
    eps = counter_normals(torch.tensor(7), (20000,))
    assert abs(float(eps.mean())) < 0.03 and abs(float(eps.std()) - 1) < 0.03
    assert float((eps.abs() < 1.96).double().mean()) == pytest.approx(0.95, abs=0.01)


@pytest.mark.correctness(
    ("fedgen",), "the server averages the round's models uniformly (Alg. 1 line 13; reference_code: weighted by their "
    "sample counts) and keeps the round's label distribution p^(y) for the next round's clients",
    guards="a sample-count-weighted mean in the paper's form, p^(y) from other than the round's label counts",
)
def test_fedgen_server_mean_is_uniform(mlp):
    ctx = Context(mlp, SGD(0.1), 2, 40.0)
    a, b = mlp.init(1), mlp.init(2)
    updates = GenUpdate({k: torch.stack([a[k], b[k]]) for k in a}, torch.tensor([[3.0, 1.0], [0.0, 4.0]]))
    for reference, wa in ((False, 0.5), (True, 0.75)):
        alg = FedGen(reference_code=reference, generator_hidden=4, noise_dim=2, generator_steps=0)
        new = alg.aggregate(ctx, alg.init_server(ctx, mlp.init(0), 0), updates, torch.tensor([30.0, 10.0]),
                            torch.arange(2))
        _same(new.params, {k: wa * a[k] + (1 - wa) * b[k] for k in a})
        assert torch.allclose(new.label_dist, torch.tensor([3.0, 5.0]) / 8)


@pytest.mark.correctness(
    ("fedgen",), "reference_code = true reproduces the server state that the code recorded before the option existed "
    "(2 rounds: models, generator, Adam's step count)",
    guards="the authors' code's form changed by the paper's form",
)
def test_fedgen_reference_code_reproduces_the_recorded_run(small_data, mlp):
    import json
    from pathlib import Path

    rec = json.loads((Path(__file__).parent / "data" / "fedgen_reference_code.json").read_text())
    sim = make_sim(FedGen(reference_code=True, **rec["algorithm"]), small_data, model=mlp, **rec["run"])
    st, _ = run_rounds(sim, rec["rounds"])
    for part in ("params", "gen"):
        for k, want in rec[part].items():  # float32 values stored exactly; the tolerance is for other machines' BLAS
            got = getattr(st.server, part)[k].flatten().double()
            assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-6), (part, k)
    assert (int(st.server.adam_t), int(st.server.t)) == (rec["adam_t"], rec["t"])


# ------------------------------------------------------------------------------------------------ bundled configs
@pytest.mark.parametrize("name", ["fedas", "pfedfda", "floco", "fedgen"])
def test_bundled_configs_load_and_compare_with_local(name):
    from pathlib import Path

    from fedmtl import config

    path = Path(__file__).resolve().parents[1] / f"src/fedmtl/configs/fmnist/{name}.toml"
    cfg = config.load(path)
    assert cfg.build_algorithm().name == name
    local, raw = config.read_toml(path.parent / "local.toml"), config.read_toml(path)
    for table in ("data", "model", "optim", "run"):
        assert raw[table] == local[table], table
