"""FedGen: data-free knowledge distillation for heterogeneous federated learning.

Zhu, Hong, Zhou, "Data-Free Knowledge Distillation for Heterogeneous Federated Learning", ICML 2021 (PMLR 139,
arXiv 2105.10056).  Sources read: the paper's text (Sec. 2-3, Algorithm 1, Sec. 6.1 and 6.3), cited below by
equation and by line of Algorithm 1, and the authors' code (zhuangdizhu/FedGen: ``serverpFedGen.py``,
``userpFedGen.py``, ``generator.py``, ``model_config.py``) for what the paper leaves open, for the numbers below
and for the ``reference_code`` form.

The model is split at the head's input (``Model.features`` -> z in R^d -> ``Model.head``, the paper's feature
extractor f and predictor h, Sec. 2; a model without the split is refused).  The server learns a lightweight
generator G_w(z | y) (Sec. 3.1) that maps a label y and noise eps ~ N(0, I_r) to a representation z, so that the
ensemble of the round's clients' heads h_k predicts y from it (the server's objective, Eq. (4), Alg. 1 line 14):

    min_w  alpha_e E_{y ~ p^(y), eps} [ CE(sigma((1/K) sum_k h_k(G_w(y, eps))), y) ] + eta L_div(eps, G_w(y, eps)),

p^(y) the label distribution of the round's clients' label counts (Alg. 1 lines 3 and 13), the K heads' logits
averaged before the softmax, and L_div = exp(-mean_ij ||eps_i - eps_j||^2_mean * |g_i - g_j|_mean) the diversity
loss (the paper names it, Sec. 6.1, after Mao et al. 2019, without its formula or weight: the authors' code's, with
their weight eta = 1; alpha_e = 1 likewise); ``generator_steps`` Adam steps a round (rate ``generator_lr`` x
0.98^round, L2 weight ``generator_weight_decay``: the authors' optimizer, the paper leaves it open), after the models
are averaged uniformly (Alg. 1 line 13).  The generator is an MLP (Sec. 6.1): [eps, onehot(y)] ->
Linear(``generator_hidden``) -> BatchNorm -> ReLU -> Linear(d).

Clients distil the generator's knowledge into their models (the clients' objective, Eq. (5), Alg. 1 lines 6-9):
from the second round on, each local step on a real batch (x, y) adds the generated samples' cross-entropy

    E_{y^ ~ p^(y), eps ~ N(0, I)} [ CE(h(G_w(y^, eps)), y^) ]       (mean over B_g = ``gen_batch_size`` samples)

to the batch's cross-entropy; the generator runs in evaluation mode (its batch-norm running statistics).  Every
client predicts with the global model (FedGen trains one global model).

``reference_code = true`` runs the authors' code's form instead (zhuangdizhu/FedGen: ``serverpFedGen.py``,
``userpFedGen.py``, ``generator.py``, ``model_config.py``), where it departs from the paper:

* the server's objective weights each head's cross-entropy by the clients' label counts instead of averaging the
  heads' logits (Eq. (4)):  alpha_e sum_k E [ a_{k,y} CE(h_k(G_w(y, eps)), y) ] + eta L_div,
  a_{k,y} = (n_{k,y} + 1) / sum_l (n_{l,y} + 1);
* the clients' objective (Eq. (5)) weights the generated samples' term by (B_g / B) alpha_t and adds a latent
  distillation term beta_t KL( softmax(h(G_w(y, eps'))) || p_theta(. | x) ) on the batch's own labels (teacher
  probabilities constant), alpha_t = max(1e-4, alpha 0.98^t) and likewise beta_t (t the 0-based round; alpha =
  ``generative_alpha``, beta = ``generative_beta``); with alpha = beta = 0 the clients train as FedAvg's (tested);
* the noise is eps ~ U[0, 1)^r (Sec. 3.1: N(0, I)), the labels uniform over the labels some client of the round
  holds (server) or over all labels (clients) (Eq. (4), (5): y ~ p^(y));
* the models are averaged weighted by sample counts (Alg. 1 line 13: uniformly).

Defaults: the authors' MNIST settings: alpha = beta = 10 (``reference_code`` only), generator rate 3e-4, weight
decay 1e-2, alpha_e = 1, eta = 1, hidden 256, noise 32, generated batch 32, 50 generator steps a round (their 10
epochs of 5 iterations) of batches of 32 (their user batch size; the paper sets B_g = B by default, Sec. 6.3).

Choices for both forms where the paper is silent, each stated where it is implemented:
* the generated terms start in the second round, as in the authors' code (the first round's generator is untrained);
* the label counts n_{k,y} are each client's label counts over its data (the authors count the labels of the
  batches drawn during local training, from 1: the same up to the number of epochs); p^(y) is uniform until the
  first counts arrive;
* the client's noise and sampled labels come from a counter-based generator keyed by (run seed, round, client,
  live step), so that an update is a pure function of its inputs; the server's from a generator seeded by (run seed,
  round);
* the authors stop the generated-sample terms after 20 local epochs (``early_stop``); not done (runs here train a
  few local epochs a round);
* the generator's Adam is torch.optim.Adam's update written out (coupled L2 weight decay, bias correction), its state
  kept in the server state (checkpointed); the batch-norm running statistics use momentum 0.1 as nn.BatchNorm1d;
* the server uses each client's head: robust aggregators and ``[privacy]`` are refused (``averages_updates``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor

from .. import tree as T
from ..models.base import Model
from ..optim import Batches, first_epoch
from ..schema import Annotated, Range
from ..tree import Params
from .base import Algorithm, ClientId, Context, Toy, nobody
from .fedproto import one_hot, representation_dim
from .floco import _MOD, counter_uniforms, sgd_by_step

#: the per-round decay of the clients' alpha, beta and of the generator's rate (the authors')
DECAY = 0.98
BN_EPS = 1e-5
BN_MOMENTUM = 0.1


class GenServer(NamedTuple):
    """Server state (also the payload): the global model, the generator's parameters (with its batch-norm running
    statistics), its Adam moments, Adam's step count, the aggregations done t (()), the run's seed (()) and the label
    distribution p^(y) (C,) of the last round's label counts (uniform before any)."""

    params: Params
    gen: Params
    adam_m: Params
    adam_v: Params
    adam_t: Tensor
    t: Tensor
    seed: Tensor
    label_dist: Tensor


class GenUpdate(NamedTuple):
    """A client's update: its trained model and its label counts n_{k,y} (C,)."""

    params: Params
    counts: Tensor


def init_generator(noise: int, classes: int, hidden: int, d: int, generator: torch.Generator) -> Params:
    """The generator's parameters as nn.Linear and nn.BatchNorm1d initialize them (uniform +-1/sqrt(fan_in))."""
    def linear(fan_in: int, fan_out: int) -> tuple[Tensor, Tensor]:
        bound = 1.0 / fan_in**0.5
        return ((torch.rand(fan_out, fan_in, generator=generator) * 2 - 1) * bound,
                (torch.rand(fan_out, generator=generator) * 2 - 1) * bound)

    w1, b1 = linear(noise + classes, hidden)
    w2, b2 = linear(hidden, d)
    return {"fc.weight": w1, "fc.bias": b1, "bn.weight": torch.ones(hidden), "bn.bias": torch.zeros(hidden),
            "bn.running_mean": torch.zeros(hidden), "bn.running_var": torch.ones(hidden),
            "out.weight": w2, "out.bias": b2}


STATS = ("bn.running_mean", "bn.running_var")


def generate(gen: Params, y_onehot: Tensor, eps: Tensor, train: bool) -> tuple[Tensor, Params]:
    """G_w(y, eps) (Sec. 3.1): [eps, onehot(y)] -> Linear -> BatchNorm -> ReLU -> Linear.  ``train``: normalize by the
    batch's statistics and return the updated running statistics (nn.BatchNorm1d, momentum 0.1, unbiased running
    variance); otherwise by the running statistics (returned unchanged)."""
    h = torch.cat([eps, y_onehot], -1) @ gen["fc.weight"].T + gen["fc.bias"]
    if train:
        mean, var = h.mean(0), h.var(0, unbiased=False)
        n = h.shape[0]
        stats = {"bn.running_mean": (1 - BN_MOMENTUM) * gen["bn.running_mean"] + BN_MOMENTUM * mean.detach(),
                 "bn.running_var": (1 - BN_MOMENTUM) * gen["bn.running_var"]
                 + BN_MOMENTUM * var.detach() * n / max(n - 1, 1)}
    else:
        mean, var = gen["bn.running_mean"], gen["bn.running_var"]
        stats = {k: gen[k] for k in STATS}
    h = (h - mean) / torch.sqrt(var + BN_EPS) * gen["bn.weight"] + gen["bn.bias"]
    return torch.relu(h) @ gen["out.weight"].T + gen["out.bias"], stats


def diversity_loss(eps: Tensor, z: Tensor) -> Tensor:
    """L_div = exp(-mean_ij (mean_r (eps_i - eps_j)^2) (mean_d |z_i - z_j|)) (the authors' DiversityLoss, 'l1'; the
    paper names a diversity loss, Sec. 6.1, without its formula)."""
    noise = ((eps.unsqueeze(0) - eps.unsqueeze(1)) ** 2).mean(-1)
    layer = (z.unsqueeze(0) - z.unsqueeze(1)).abs().mean(-1)
    return torch.exp(-(noise * layer).mean())


def label_distribution(counts: Tensor) -> Tensor:
    """p^(y) (C,): the label counts (K, C) of the round's clients summed and normalized (Alg. 1 line 13)."""
    total = counts.sum(0)
    return total / total.sum()


def sample_labels(dist: Tensor, u: Tensor) -> Tensor:
    """Labels y ~ dist (C,) by inversion of uniforms u (...,): y = #{c : F(c) <= u}, F the cumulative distribution; a
    label of probability 0 is never drawn (the classes from the last one of positive probability on get F = inf).
    Pure and vmap-safe (no searchsorted)."""
    p = dist.to(torch.float64)
    idx = torch.arange(p.shape[-1], device=p.device)
    last = (idx * (p > 0)).max()
    cdf = torch.where(idx >= last, torch.full_like(p, float("inf")), torch.cumsum(p, -1) / p.sum())
    return (cdf <= u.to(torch.float64).unsqueeze(-1)).sum(-1)


def counter_normals(key: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Standard normal draws (float64) of ``shape`` from the counter-based uniforms (floco.counter_uniforms, in (0, 1))
    by the Box-Muller transform; pure and vmap-safe."""
    u = counter_uniforms(key, (2, *shape))
    return torch.sqrt(-2.0 * torch.log(u[0])) * torch.cos(2.0 * torch.pi * u[1])


def ensemble_loss(model: Model, heads: list[Params], z: Tensor, y: Tensor) -> Tensor:
    """mean_j CE(sigma((1/K) sum_k h_k(z_j)), y_j): Eq. (4)'s ensemble term, one cross-entropy of the K heads'
    averaged logits."""
    logits = torch.stack([model.apply_head(head, z) for head in heads]).mean(0)
    return model.nll(logits, y).mean()


def ensemble_weights(counts: Tensor) -> Tensor:
    """a_{k,y} (K, C): each label's (n_{k,y} + 1) normalized over the K clients (``reference_code``)."""
    c = counts + 1.0
    return c / c.sum(0, keepdim=True)


def teacher_loss(model: Model, heads: list[Params], weights: Tensor, z: Tensor, y: Tensor) -> Tensor:
    """sum_k mean_j a_{k,y_j} CE(h_k(z_j), y_j) over the K heads (weights (K, C)): the ensemble term of Eq. (4) in the
    authors' code's form (``reference_code``; Eq. (4) takes one cross-entropy of the heads' averaged logits,
    ``ensemble_loss``)."""
    total = torch.zeros((), dtype=z.dtype)
    for k, head in enumerate(heads):
        nll = model.nll(model.apply_head(head, z), y)
        total = total + (nll * weights[k].index_select(0, y)).mean()
    return total


@dataclass(frozen=True)
class FedGen(Algorithm[GenServer, ClientId]):
    """FedGen: a server-side generator of representations, trained so that the ensemble of the round's heads
    recognizes its samples, distils their knowledge into every client's local training."""

    name: ClassVar[str] = "fedgen"
    toy: ClassVar[Toy] = Toy({"generator_hidden": 16, "noise_dim": 4, "generator_steps": 5}, model="mlp")
    # the server trains on each client's head and label counts: robust aggregators and [privacy] do not apply
    averages_updates: ClassVar[bool] = False
    #: run the authors' code's form instead of the paper's (the default): heads' cross-entropies weighted by label
    #: counts, uniform labels and U[0, 1) noise, the clients' decaying alpha / beta terms and latent distillation,
    #: sample-count means
    reference_code: bool = False
    #: reference_code: alpha, the weight of the generated samples' cross-entropy in local training (decays 0.98 a
    #: round; the paper's Eq. (5) has no weight)
    generative_alpha: Annotated[float, Range(0, 1e4)] = 10.0
    #: reference_code: beta, the weight of the latent distillation term in local training (decays 0.98 a round; not
    #: in the paper's Eq. (5))
    generative_beta: Annotated[float, Range(0, 1e4)] = 10.0
    #: B_g: generated samples per local step (32, the authors' user batch size, in both forms; a deviation in the
    #: paper's form, which sets B_g = B, Sec. 6.3: give run.batch_size here to follow it)
    gen_batch_size: Annotated[int, Range(1, 10**5)] = 32
    #: the generator's Adam rate (decays 0.98 a round; the authors' choice, the paper leaves it open)
    generator_lr: Annotated[float, Range(0, 1e3, lo_open=True)] = 3e-4
    #: the generator's L2 weight decay (Adam's coupled weight decay)
    generator_weight_decay: Annotated[float, Range(0, 1e3)] = 1e-2
    #: generator steps on the server each round
    generator_steps: Annotated[int, Range(0, 10**5)] = 50
    #: the server's generated batch size
    generator_batch_size: Annotated[int, Range(2, 10**5)] = 32
    #: alpha_e, the weight of the ensemble (teacher) loss in the generator's objective (the authors'; the paper gives
    #: none)
    ensemble_alpha: Annotated[float, Range(0, 1e4)] = 1.0
    #: eta, the weight of the diversity loss in the generator's objective (the authors'; the paper gives none)
    ensemble_eta: Annotated[float, Range(0, 1e4)] = 1.0
    #: the generator's hidden width
    generator_hidden: Annotated[int, Range(1, 10**5)] = 256
    #: r, the dimension of the generator's noise
    noise_dim: Annotated[int, Range(1, 10**5)] = 32

    def check_model(self, model: Model) -> None:
        model.head_names(self.name)
        representation_dim(model, self.name)

    def weights_at(self, base: float, t: Tensor) -> Tensor:
        """max(1e-4, base 0.98^t) (the authors' exp_lr_scheduler), a tensor of the round t; 0 where base is 0 (the
        authors' floor would keep 1e-4 of a term switched off)."""
        if base == 0:
            return torch.zeros((), dtype=torch.float64, device=t.device)
        return torch.clamp(base * DECAY ** t.to(torch.float64), min=1e-4)

    # -- server ---------------------------------------------------------------------------------
    def init_server(self, ctx: Context, params: Params, seed: int) -> GenServer:
        ref = next(iter(params.values()))
        g = torch.Generator().manual_seed(int(seed) + 5151)
        c, d = ctx.model.num_classes, representation_dim(ctx.model, self.name)
        gen = {k: v.to(ref.device, ref.dtype) for k, v in
               init_generator(self.noise_dim, c, self.generator_hidden, d, g).items()}
        zeros = {k: torch.zeros_like(v) for k, v in gen.items() if k not in STATS}
        def count(v: int) -> Tensor:
            return torch.tensor(v, dtype=torch.long, device=ref.device)

        # p^(y) uniform until the first counts arrive (no client samples from it before: the generated terms start in
        # the second round)
        uniform = torch.full((c,), 1.0 / c, dtype=torch.float32, device=ref.device)
        return GenServer({k: v.clone() for k, v in params.items()}, gen, zeros, T.clone(zeros), count(0), count(0),
                         count(int(seed) % _MOD), uniform)

    def payload(self, server: GenServer) -> GenServer:
        return server

    def update_like(self, ctx: Context, payload: GenServer) -> GenUpdate:
        ref = next(iter(payload.params.values()))
        return GenUpdate(payload.params, torch.zeros(ctx.model.num_classes, device=ref.device))

    def train_generator(self, ctx: Context, server: GenServer, heads: list[Params],
                        counts: Tensor) -> tuple[Params, Params, Params, Tensor]:
        """``generator_steps`` Adam steps on the generator's objective (Eq. (4), Alg. 1 line 14) with the round's heads
        and label counts (K, C); returns (generator, m, v, Adam's step count)."""
        model = ctx.model
        gen, m, v, step = dict(server.gen), dict(server.adam_m), dict(server.adam_v), int(server.adam_t)
        weights = ensemble_weights(counts.to(torch.float64)).to(next(iter(gen.values())).dtype)
        # the labels some client of the round holds (the authors': a count above 1 in counts that start at 1)
        qualified = torch.nonzero(counts.max(0).values > 0).flatten()
        if qualified.numel() == 0 or self.generator_steps == 0:
            return gen, m, v, server.adam_t
        rate = self.generator_lr * DECAY ** int(server.t)  # ExponentialLR(0.98), stepped once a round
        g = torch.Generator().manual_seed((int(server.seed) * 1_000_003 + int(server.t) * 7_919 + 17) % (2**62))
        classes = model.num_classes
        dev = next(iter(gen.values())).device
        heads = [{k: x.detach() for k, x in h.items()} for h in heads]
        dist = label_distribution(counts.to(torch.float64)).cpu()  # p^(y), Alg. 1 line 13
        dtype = next(iter(gen.values())).dtype
        for _ in range(self.generator_steps):
            if self.reference_code:
                # reference_code: y uniform over the held labels, eps ~ U[0, 1) (the authors' code)
                y = qualified[torch.randint(len(qualified), (self.generator_batch_size,), generator=g)].to(dev)
                eps = torch.rand(self.generator_batch_size, self.noise_dim, generator=g).to(dev)
            else:
                # paper: y ~ p^(y) (Eq. (4)), eps ~ N(0, I) (Sec. 3.1)
                y = torch.multinomial(dist, self.generator_batch_size, replacement=True, generator=g).to(dev)
                eps = torch.randn(self.generator_batch_size, self.noise_dim, generator=g).to(dev, dtype)
            onehot = (y.unsqueeze(-1) == torch.arange(classes, device=dev)).to(eps.dtype)
            trainable = {k: x.detach().requires_grad_() for k, x in gen.items() if k not in STATS}
            with torch.enable_grad():
                z, stats = generate({**gen, **trainable}, onehot, eps, train=True)
                if self.reference_code:
                    # reference_code: each head's cross-entropy weighted by the label counts a_{k,y} (the authors')
                    teacher = teacher_loss(model, heads, weights, z, y)
                else:
                    teacher = ensemble_loss(model, heads, z, y)  # paper: Eq. (4), the heads' averaged logits
                # the diversity term and both weights for both forms (the paper names the loss, Sec. 6.1, gives no
                # weight: the authors' eta and alpha_e)
                loss = self.ensemble_alpha * teacher + self.ensemble_eta * diversity_loss(eps, z)
                grads = torch.autograd.grad(loss, list(trainable.values()))
            step += 1
            for (k, x), gk in zip(trainable.items(), grads, strict=True):  # torch.optim.Adam, coupled weight decay
                gk = gk + self.generator_weight_decay * x.detach()
                m[k] = 0.9 * m[k] + 0.1 * gk
                v[k] = 0.999 * v[k] + 0.001 * gk * gk
                m_hat, v_hat = m[k] / (1 - 0.9**step), v[k] / (1 - 0.999**step)
                gen[k] = x.detach() - rate * m_hat / (torch.sqrt(v_hat) + 1e-8)
            gen.update(stats)
        return gen, m, v, torch.tensor(step, dtype=torch.long, device=server.adam_t.device)

    def aggregate(self, ctx: Context, server: GenServer, updates: GenUpdate, weights: Tensor,
                  clients: Tensor) -> GenServer:
        if nobody(ctx, weights):
            return server
        ok = torch.nonzero(weights > 0).flatten()
        _, head_names = ctx.model.split(server.params, self.name)
        heads = [{k: updates.params[k][int(i)] for k in head_names} for i in ok]
        counts = updates.counts.index_select(0, ok.to(updates.counts.device))
        gen, m, v, adam_t = self.train_generator(ctx, server, heads, counts)  # Alg. 1 line 14, on the clients' heads
        # Alg. 1 line 13: paper: the uniform mean of the round's models; reference_code: weighted by sample counts (the
        # authors' code)
        params = ctx.combine(updates.params, weights if self.reference_code else (weights > 0).to(weights.dtype))
        # p^(y) from the round's label counts (Alg. 1 line 13); kept where the round brought none
        dist = label_distribution(counts.to(torch.float64)).to(server.label_dist) if float(counts.sum()) > 0 \
            else server.label_dist
        return GenServer(params, gen, m, v, adam_t, server.t + 1, server.seed, dist)

    # -- client ---------------------------------------------------------------------------------
    def init_clients(self, ctx: Context, server: GenServer, ids: Tensor) -> ClientId:
        return ClientId(ids.clone())

    def init_client(self, ctx: Context, server: GenServer) -> ClientId:
        return ClientId(torch.zeros((), dtype=torch.long))

    def paper_loss(self, model: Model, gen: Params, p: Params, x: Tensor, y: Tensor, mask: Tensor, y_hat: Tensor,
                   eps_hat: Tensor, on: Tensor) -> tuple[Tensor, Tensor]:
        """The client's objective, Eq. (5) (Alg. 1 line 9), on one real batch (x, y, mask): the batch's cross-entropy
        plus ``on`` (0 in the first round, else 1) x the mean cross-entropy of the head on the generated
        representations G_w(y_hat, eps_hat) of the labels y_hat, unweighted; returns (objective, the batch's
        cross-entropy detached)."""
        m = mask.to(torch.float32)
        ce = (model.nll(model.apply(p, x), y) * m).sum() / m.sum().clamp_min(1.0)
        head = {k: p[k] for k in model.head_names(self.name)}
        z_hat, _ = generate(gen, one_hot(model, y_hat, eps_hat.dtype), eps_hat, False)
        gen_ce = model.nll(model.apply_head(head, z_hat.detach()), y_hat).mean()
        return ce + on.to(ce.dtype) * gen_ce, ce.detach()

    def local_loss(self, model: Model, gen: Params, p: Params, x: Tensor, y: Tensor, mask: Tensor, y_hat: Tensor,
                   eps_hat: Tensor, eps: Tensor, alpha: Tensor, beta: Tensor) -> Tensor:
        """The client's objective in the authors' code's form (``reference_code``: Eq. (5), Alg. 1 line 9, with their
        weights and latent distillation term) on one real batch (x, y, mask) with generated labels y_hat, noises eps_hat
        (for the generated samples) and eps (for the latent distillation of the batch's own labels)."""
        classes = model.num_classes
        m = mask.to(torch.float32)
        n = m.sum().clamp_min(1.0)
        out = model.apply(p, x)
        ce = (model.nll(out, y) * m).sum() / n
        head = {k: p[k] for k in model.head_names(self.name)}
        z_hat, _ = generate(gen, (y_hat.unsqueeze(-1) == torch.arange(classes, device=y_hat.device)).to(eps_hat.dtype),
                            eps_hat, False)
        gen_ce = model.nll(model.apply_head(head, z_hat.detach()), y_hat).mean()
        z, _ = generate(gen, one_hot(model, y, eps.dtype), eps, False)
        teacher = model.log_proba(model.apply_head(head, z.detach())).detach()  # target probabilities, constant
        kl = ((teacher.exp() * (teacher - model.log_proba(out))).sum(-1) * m).sum() / n  # KLDivLoss(batchmean)
        # B_g / B: the authors divide by the configured batch size, here by the step's real examples (the same but
        # on an epoch's last, partial batch)
        ratio = self.gen_batch_size / n
        return ce + ratio * alpha.to(ce.dtype) * gen_ce + beta.to(ce.dtype) * kl

    def client_update(
        self, ctx: Context, payload: GenServer, state: ClientId, batches: Batches, lr: float
    ) -> tuple[GenUpdate, ClientId, Tensor]:
        model = ctx.model
        classes = model.num_classes
        # the generated terms from the second round on, for both forms (the authors' code; the first round's generator
        # is untrained and p^(y) not yet estimated)
        on = (payload.t > 0).to(torch.float64)
        alpha = self.weights_at(self.generative_alpha, payload.t) * on
        beta = self.weights_at(self.generative_beta, payload.t) * on
        gen = {k: x.detach() for k, x in payload.gen.items()}
        key0 = payload.seed * 7919 + payload.t * 104729 + state.id.to(torch.long) * 15485863
        bg, r = self.gen_batch_size, self.noise_dim

        def step_grad(p: Params, s: int, nth: Tensor) -> tuple[Params, Tensor]:
            x, y, mask = batches.x[s], batches.y[s], batches.mask[s]
            key = torch.remainder(key0 + nth.squeeze(0) * 982451653, _MOD)
            if not self.reference_code:
                # paper: Alg. 1 line 7's generated samples y_hat ~ p^(y) (Eq. (5)), eps_hat ~ N(0, I) (Sec. 3.1)
                y_hat_p = sample_labels(payload.label_dist, counter_uniforms(key, (bg,)))
                eps_hat_p = counter_normals(torch.remainder(key + 1, _MOD), (bg, r)).to(torch.float32)

                def paper_value(q: Params) -> tuple[Tensor, Tensor]:
                    return self.paper_loss(model, gen, q, x, y, mask, y_hat_p, eps_hat_p, on)

                g_p, ce_p = torch.func.grad(paper_value, has_aux=True)(p)
                return g_p, ce_p
            # reference_code: y_hat uniform over all labels, eps_hat ~ U[0, 1) (the authors' code)
            y_hat = torch.clamp((counter_uniforms(key, (bg,)) * classes).to(torch.long), max=classes - 1)
            eps_hat = counter_uniforms(torch.remainder(key + 1, _MOD), (bg, r)).to(torch.float32)
            # the batch's own noise row by row (a ragged batch draws the first rows of a padded one's)
            eps = counter_uniforms(torch.remainder(key + 2, _MOD), (x.shape[0], r)).to(torch.float32)

            def value(q: Params) -> tuple[Tensor, Tensor]:
                total = self.local_loss(model, gen, q, x, y, mask, y_hat, eps_hat, eps, alpha, beta)
                ce = (model.nll(model.apply(q, x), y) * mask).sum() / mask.sum().clamp_min(1.0)
                return total, ce.detach()

            g, ce = torch.func.grad(value, has_aux=True)(p)
            return g, ce

        trained, loss = sgd_by_step(step_grad, payload.params, batches, lr, ctx.opt)
        x0, y0, m0 = first_epoch(batches, ctx.local_epochs)
        # n_{k,y}: the label counter c_k the client sends back (Alg. 1 lines 8 and 11)
        counts = (one_hot(model, y0, torch.float32) * m0.to(torch.float32).unsqueeze(-1)).sum(0)
        return GenUpdate(trained, counts), state, loss

    # -- evaluation -----------------------------------------------------------------------------
    def personalize(
        self, ctx: Context, payload: GenServer, state: ClientId, batches: Batches | None, lr: float, seen: bool
    ) -> Params:
        return payload.params  # the global model
