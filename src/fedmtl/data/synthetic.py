"""The synthetic mixture data of FedEM (Marfoq et al., NeurIPS 2021, Sec. 5 / App. I).

Binary classification with M linear components.  Process (seed 12345 by default):

* client sizes n_t = min(int(LogNormal(4, 2)) + 50, 1000); mixture weights pi_t ~ Dirichlet(0.4 * 1_M);
  components theta_m ~ U[-1, 1]^d (d = 150, no bias);
* per client and per split: latent counts c ~ Multinomial(n, pi_t); x ~ U[-1, 1]^d;
  the c_m examples of component m get y = round(sigmoid(x . theta_m + eps)), eps ~ N(0, 0.1^2);
  then the examples are shuffled.  Every client has 5,000 test examples.

The random draws are made in the same order as the reference generator (numpy's legacy
``RandomState``), so ``legacy=True`` reproduces its data exactly, including its bug: the reference
never advances the write index, so every component labels rows ``0 .. c_m - 1`` and rows past
``max_m c_m`` keep y = 0 (about 27% of labels forced to 0; positive rate ~37% instead of ~50%).
The published FedEM numbers were measured on that data.  ``legacy=False`` (default) labels each
example by its own component, as the paper describes.
"""

from __future__ import annotations

import numpy as np
import torch

from .federated import FederatedData, from_clients


def _labels(x: np.ndarray, counts: np.ndarray, theta: np.ndarray, noise: float,
            rng: np.random.RandomState, legacy: bool) -> np.ndarray:
    y = np.zeros(x.shape[0])
    start = 0
    for m, c in enumerate(counts):
        rows = slice(0, c) if legacy else slice(start, start + c)
        eps = rng.normal(size=c, scale=noise)
        y[rows] = np.round(1.0 / (1.0 + np.exp(-(x[rows] @ theta[m] + eps))))
        if not legacy:
            start += c
    return y


def _client_split(n: int, pi: np.ndarray, theta: np.ndarray, noise: float, rng: np.random.RandomState,
                  legacy: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    counts = rng.multinomial(n, pi)
    x = rng.uniform(-1.0, 1.0, size=(n, theta.shape[1]))
    y = _labels(x, counts, theta, noise, rng, legacy)  # labels from the float64 features, as the reference
    z = np.repeat(np.arange(len(counts)), counts)  # latent component of each row (before shuffling)
    perm = np.arange(n)
    rng.shuffle(perm)  # the draw sklearn.utils.shuffle makes with the global RandomState
    return x[perm].astype(np.float32), y[perm].astype(np.int64), z[perm]


def fedem_synthetic(
    num_clients: int = 300,
    dim: int = 150,
    num_components: int = 3,
    alpha: float = 0.4,
    noise: float = 0.1,
    n_test: int = 5000,
    min_samples: int = 50,
    max_samples: int = 1000,
    seed: int = 12345,
    legacy: bool = False,
    unseen_frac: float = 0.0,
    val_frac: float = 0.0,
) -> FederatedData:
    """Generate FedEM's synthetic federation; see the module docstring.

    ``unseen_frac``: the last ``num_clients - int((1 - unseen_frac) * num_clients)`` clients by index are
    held out of training (as the reference's ``train_tasks_frac``).  ``val_frac``: fraction of each
    client's training examples moved to a validation split (taken from the end of the shuffled set).
    ``meta`` holds the true ``theta`` (M, d), ``pi`` (T, M) and per-example latent components.
    """
    if not 0 <= unseen_frac < 1 or not 0 <= val_frac < 1:
        raise ValueError("unseen_frac and val_frac must lie in [0, 1)")
    rng = np.random.RandomState(seed)
    sizes = np.minimum(rng.lognormal(4, 2, num_clients).astype(int) + min_samples, max_samples)
    pis = np.stack([rng.dirichlet(alpha * np.ones(num_components)) for _ in range(num_clients)])
    theta = rng.uniform(-1.0, 1.0, size=(num_components, dim))
    tr_x, tr_y, va_x, va_y, te_x, te_y, tr_z = [], [], [], [], [], [], []
    for t in range(num_clients):
        x, y, z = _client_split(int(sizes[t]), pis[t], theta, noise, rng, legacy)
        n_val = int(round(val_frac * len(y)))
        cut = len(y) - n_val
        tr_x.append(x[:cut])
        tr_y.append(y[:cut])
        tr_z.append(z[:cut])
        va_x.append(x[cut:])
        va_y.append(y[cut:])
        xt, yt, _ = _client_split(n_test, pis[t], theta, noise, rng, legacy)
        te_x.append(xt)
        te_y.append(yt)

    def pairs(xs: list[np.ndarray], ys: list[np.ndarray]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.from_numpy(a), torch.from_numpy(b)) for a, b in zip(xs, ys, strict=True)]

    n_seen = num_clients - int(round(unseen_frac * num_clients)) if unseen_frac else num_clients
    return from_clients(
        pairs(tr_x, tr_y), pairs(te_x, te_y), 2, num_clients - n_seen, pairs(va_x, va_y) if val_frac else None,
        "fedem_synthetic" + ("_legacy" if legacy else ""),
        {"theta": theta, "pi": pis, "sizes": sizes, "latent": tr_z, "seen_clients": n_seen},
    )


def permuted_groups(
    num_clients: int = 40,
    num_groups: int = 2,
    dim: int = 20,
    num_classes: int = 4,
    n_train: int = 100,
    n_test: int = 200,
    seed: int = 0,
) -> FederatedData:
    """Data built to need personalization: one linear labelling rule y = argmax(x W), x ~ N(0, I),
    and clients in ``num_groups`` groups whose labels are permuted by a group-specific permutation
    (group 0 keeps the identity).  One global model cannot fit two groups; clustering or
    personalization can.  ``meta["group"]`` gives each client's group."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(dim, num_classes))
    perms = [np.arange(num_classes)] + [rng.permutation(num_classes) for _ in range(num_groups - 1)]
    for g in range(1, num_groups):  # make sure every group's permutation differs from the identity
        while np.array_equal(perms[g], np.arange(num_classes)):
            perms[g] = rng.permutation(num_classes)
    groups = np.arange(num_clients) % num_groups
    xs_tr, ys_tr, xs_te, ys_te = [], [], [], []
    for k in range(num_clients):
        for n, xs, ys in ((n_train, xs_tr, ys_tr), (n_test, xs_te, ys_te)):
            x = rng.normal(size=(n, dim)).astype(np.float32)
            ys.append(torch.from_numpy(perms[groups[k]][np.argmax(x @ w, axis=1)]))
            xs.append(torch.from_numpy(x))
    return from_clients(list(zip(xs_tr, ys_tr, strict=True)), list(zip(xs_te, ys_te, strict=True)), num_classes,
                        name="permuted_groups", meta={"group": groups})
