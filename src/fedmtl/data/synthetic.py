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

from collections.abc import Sequence

import numpy as np
import torch

from ..schema import Annotated, DataSeed, Fraction, Range
from .federated import ClientGroup, FederatedData, Split, from_clients, tasks_to_federation


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
    num_clients: Annotated[int, Range(1, 10**7)] = 300,
    dim: Annotated[int, Range(1, 10**6)] = 150,
    num_components: Annotated[int, Range(1, 1000)] = 3,
    alpha: Annotated[float, Range(0, 1e3, lo_open=True)] = 0.4,
    noise: Annotated[float, Range(0, 1e3)] = 0.1,
    n_test: Annotated[int, Range(1, 10**7)] = 5000,
    min_samples: Annotated[int, Range(1, 10**7)] = 50,
    max_samples: Annotated[int, Range(1, 10**7)] = 1000,
    seed: DataSeed = 12345,
    legacy: bool = False,
    unseen_frac: Fraction = 0.0,
    val_frac: Fraction = 0.0,
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
    num_clients: Annotated[int, Range(1, 10**7)] = 40,
    num_groups: Annotated[int, Range(1, 10**4)] = 2,
    dim: Annotated[int, Range(1, 10**6)] = 20,
    num_classes: Annotated[int, Range(2, 10**4)] = 4,
    n_train: Annotated[int, Range(1, 10**7)] = 100,
    n_test: Annotated[int, Range(1, 10**7)] = 200,
    seed: DataSeed = 0,
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
    xs_tr: list[torch.Tensor] = []
    ys_tr: list[torch.Tensor] = []
    xs_te: list[torch.Tensor] = []
    ys_te: list[torch.Tensor] = []
    for k in range(num_clients):
        for n, xs, ys in ((n_train, xs_tr, ys_tr), (n_test, xs_te, ys_te)):
            x = rng.normal(size=(n, dim)).astype(np.float32)
            ys.append(torch.from_numpy(perms[groups[k]][np.argmax(x @ w, axis=1)]))
            xs.append(torch.from_numpy(x))
    return from_clients(list(zip(xs_tr, ys_tr, strict=True)), list(zip(xs_te, ys_te, strict=True)), num_classes,
                        name="permuted_groups", meta={"group": groups})


def related_task_arrays(m: int = 30, d: int = 20, clusters: int = 3, seed: int = 0, noise: float = 0.05,
                        sizes: Sequence[int] | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Related tasks: ``clusters`` groups whose separators are a shared centre plus a small task offset;
    a few dozen examples per task (log-normal sizes; ``sizes``: task t gets ``sizes[t]``), 5% label noise;
    labels +-1 (MOCHA's Table 1 synthetic federation, ``fedmtl reproduce mocha``)."""
    rng = np.random.default_rng(seed)
    if sizes is not None and len(sizes) != m:
        raise ValueError(f"sizes: {len(sizes)} values for {m} tasks")
    centres = rng.normal(size=(clusters, d))
    xs, ys = [], []
    for t in range(m):
        w = centres[t % clusters] + 0.25 * rng.normal(size=d)
        n = int(np.clip(rng.lognormal(3.6, 0.4), 20, 120))
        n = n if sizes is None else int(sizes[t])
        x = rng.normal(size=(n, d))
        y = np.sign(x @ w)
        flip = rng.random(n) < noise
        y[flip] = -y[flip]
        xs.append(x)
        ys.append(y)
    return xs, ys


def related_tasks(
    m: Annotated[int, Range(1, 10**6)] = 30,
    d: Annotated[int, Range(1, 10**6)] = 20,
    clusters: Annotated[int, Range(1, 10**4)] = 3,
    seed: DataSeed = 0,
    noise: Annotated[float, Range(0, 1e3)] = 0.05,
    test_frac: Fraction = 0.25,
    split_seed: DataSeed = 0,
) -> FederatedData:
    """``related_task_arrays`` as a federation (one binary task per client, class 1 = label +1), each task split
    at random ``1 - test_frac`` / ``test_frac`` (MOCHA's 75/25); the MOCHA configs' data."""
    xs, ys = related_task_arrays(m, d, clusters, seed, noise)
    return tasks_to_federation(xs, [(y > 0).astype(np.int64) for y in ys], 2, "related_tasks", test_frac,
                               standardize=False, seed=split_seed)


def linear_mixture(
    num_clients: Annotated[int, Range(1, 10**8)] = 1000,
    dim: Annotated[int, Range(1, 10**6)] = 60,
    num_classes: Annotated[int, Range(2, 10**4)] = 10,
    num_components: Annotated[int, Range(1, 1000)] = 3,
    alpha: Annotated[float, Range(0, 1e3, lo_open=True)] = 0.4,
    min_train: Annotated[int, Range(1, 10**7)] = 10,
    max_train: Annotated[int, Range(1, 10**7)] = 20,
    n_test: Annotated[int, Range(0, 10**7)] = 5,
    label_noise: Annotated[float, Range(0, 1)] = 0.1,
    seed: DataSeed = 0,
    feature_dtype: str = "float32",
    chunk: Annotated[int, Range(1, 10**8)] = 25_000,
) -> FederatedData:
    """A vectorized mixture federation for populations of up to millions of clients (``fedmtl bench scale``).

    M linear labelling rules W_m (d x C, N(0, 1/d)); client k mixes them with pi_k ~ Dirichlet(alpha); each
    example draws its rule z ~ pi_k, x ~ N(0, I_d) and y = argmax(x W_z), replaced by a uniformly random class
    with probability ``label_noise``.  Clients have U{min_train..max_train} training and ``n_test`` test
    examples.  Everything is generated ``chunk`` clients at a time straight into the flat arrays (a million
    clients in seconds); ``feature_dtype = "float16"`` halves the features' memory (models cast them to
    float32 on the fly).  ``meta["pi"]`` holds the mixture weights.
    """
    if num_clients < 1 or dim < 1 or num_classes < 2 or num_components < 1 or n_test < 0:
        raise ValueError("need num_clients, dim, num_components >= 1, num_classes >= 2, n_test >= 0")
    if not 1 <= min_train <= max_train:
        raise ValueError(f"need 1 <= min_train <= max_train, got {min_train}, {max_train}")
    if not 0 <= label_noise <= 1:
        raise ValueError(f"label_noise must be in [0, 1], got {label_noise}")
    if feature_dtype not in ("float32", "float16"):
        raise ValueError(f"feature_dtype must be 'float32' or 'float16', got {feature_dtype!r}")
    tdtype = torch.float16 if feature_dtype == "float16" else torch.float32
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(int(rng.integers(2**62)))
    rules = rng.normal(size=(num_components, dim, num_classes)).astype(np.float32) / np.sqrt(dim)
    pi = rng.dirichlet(np.full(num_components, alpha), size=num_clients).astype(np.float32)  # (N, M)
    sizes = {"train": rng.integers(min_train, max_train + 1, size=num_clients), "test": np.full(num_clients, n_test)}
    splits = {}
    for name, counts in sizes.items():
        offsets = np.zeros(num_clients + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        x = torch.empty((int(offsets[-1]), dim), dtype=tdtype)
        y = np.empty(int(offsets[-1]), dtype=np.int64)
        cum = np.cumsum(pi, axis=1)
        for c0 in range(0, num_clients, chunk):
            c1 = min(num_clients, c0 + chunk)
            a, b = int(offsets[c0]), int(offsets[c1])
            owner = np.repeat(np.arange(c0, c1), counts[c0:c1])
            z = (rng.random((b - a, 1), dtype=np.float32) > cum[owner]).sum(1).clip(max=num_components - 1)
            xc = torch.randn(b - a, dim, generator=gen).numpy()  # torch's sampler: 3x numpy's here
            every = (xc @ rules.transpose(1, 0, 2).reshape(dim, -1)).reshape(b - a, num_components, num_classes)
            yc = np.argmax(every[np.arange(b - a), z], axis=1)  # each example's own rule
            flip = rng.random(b - a, dtype=np.float32) < label_noise
            yc[flip] = rng.integers(0, num_classes, int(flip.sum()))
            y[a:b] = yc
            x[a:b] = torch.from_numpy(xc)  # torch's vectorized float16 conversion (numpy's is ~20x slower)
        splits[name] = Split(x, torch.from_numpy(y), torch.from_numpy(offsets))
    meta = {"pi": pi, "input": "float16"} if feature_dtype == "float16" else {"pi": pi}
    return FederatedData(ClientGroup(splits["train"], splits["test"]), num_classes, name="linear_mixture", meta=meta)
