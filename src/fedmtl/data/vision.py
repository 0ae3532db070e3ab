"""Image datasets: MNIST and Fashion-MNIST (IDX files), EMNIST (IDX), FEMNIST (LEAF JSON), CIFAR-10/100.

Images are stored once as uint8 (N, H, W) or (N, C, H, W); models normalize on the fly
(``meta["mean"]``, ``meta["std"]``).  Partitions (``partition=``): ``label_groups`` (FedEM: label
groups spread over clients by Dirichlet), ``dirichlet`` (per-label Dirichlet), ``shards``
(pathological), ``class_fraction`` (Omni-Fedge: each node keeps a U(0, 0.5) fraction of each class),
``iid``; FEMNIST is naturally partitioned by writer.
"""

from __future__ import annotations

import gzip
import json
import struct
import tarfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..schema import Annotated, DataSeed, Fraction, Range
from . import partition as P
from .download import Remote, locate
from .federated import DataError, FederatedData, federate, tasks_to_federation

IDX_TYPES: dict[int, type[np.generic] | str] = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4",
                                              0x0E: ">f8"}


def read_idx(path: str | Path) -> np.ndarray:
    """Parse an IDX file (optionally gzip-compressed); clear errors on corrupt or truncated files."""
    from ..files import check_file, read_bytes
    from ..machine import physical_memory

    path, limit = Path(path), physical_memory()
    try:  # kind and size first (a FIFO or a device is refused, never waited on); a gzip stream is bounded too
        if path.suffix == ".gz":
            check_file(path, limit, "IDX (gzip)", DataError)
            chunks, total = [], 0
            with gzip.open(path) as g:
                while chunk := g.read(1 << 24):
                    chunks.append(chunk)
                    total += len(chunk)
                    if total > limit:
                        raise DataError(f"{path}: decompresses to more than {limit} bytes")
            raw = b"".join(chunks)
        else:
            raw = read_bytes(path, limit, "IDX", DataError)
    except (OSError, EOFError) as e:
        raise DataError(f"{path}: cannot read ({e})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in IDX_TYPES:
        raise DataError(f"{path}: not an IDX file (bad magic number)")
    ndim = raw[3]
    if len(raw) < 4 + 4 * ndim:
        raise DataError(f"{path}: truncated header")
    shape = struct.unpack(">" + "I" * ndim, raw[4 : 4 + 4 * ndim])
    dtype = np.dtype(IDX_TYPES[raw[2]])
    need = int(np.prod(shape)) * dtype.itemsize
    body = raw[4 + 4 * ndim :]
    if len(body) != need:
        raise DataError(f"{path}: expected {need} bytes of data for shape {shape}, found {len(body)} (truncated?)")
    return np.frombuffer(body, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))


_FMNIST_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
_MNIST_URLS = ("https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/")

IDX_DATASETS: dict[str, dict[str, Any]] = {
    "fashion_mnist": {
        "system": ("/usr/share/datasets/fashion-mnist",),
        "files": {
            "train_x": Remote("train-images-idx3-ubyte.gz", (_FMNIST_URL + "train-images-idx3-ubyte.gz",),
                              "8d4fb7e6c68d591d4c3dfef9ec88bf0d"),
            "train_y": Remote("train-labels-idx1-ubyte.gz", (_FMNIST_URL + "train-labels-idx1-ubyte.gz",),
                              "25c81989df183df01b3e8a0aad5dffbe"),
            "test_x": Remote("t10k-images-idx3-ubyte.gz", (_FMNIST_URL + "t10k-images-idx3-ubyte.gz",),
                             "bef4ecab320f06d8554ea6380940ec79"),
            "test_y": Remote("t10k-labels-idx1-ubyte.gz", (_FMNIST_URL + "t10k-labels-idx1-ubyte.gz",),
                             "bb300cfdad3c16e7a12a480ee83cd310"),
        },
        "mean": 0.2860, "std": 0.3530, "classes": 10,
    },
    "mnist": {
        "system": ("/usr/share/datasets/mnist",),
        "files": {
            key: Remote(fname, tuple(u + fname for u in _MNIST_URLS), md5)
            for key, fname, md5 in (
                ("train_x", "train-images-idx3-ubyte.gz", "f68b3c2dcbeaaa9fbdd348bbdeb94873"),
                ("train_y", "train-labels-idx1-ubyte.gz", "d53e105ee54ea40749a09fcbcd1e9432"),
                ("test_x", "t10k-images-idx3-ubyte.gz", "9fb629c4189551a2d022fa330f9573f3"),
                ("test_y", "t10k-labels-idx1-ubyte.gz", "ec29112dd5afa0611ce80d1b7f02629c"),
            )
        },
        "mean": 0.1307, "std": 0.3081, "classes": 10,
    },
}


def load_idx_dataset(name: str, data_dir: str | Path = "", download: bool = True) -> dict[str, np.ndarray]:
    """The four arrays of an IDX dataset (uint8 images (N, 28, 28), uint8 labels)."""
    spec = IDX_DATASETS[name]
    out = {k: read_idx(locate(r, name, data_dir, spec["system"], download)) for k, r in spec["files"].items()}
    for split in ("train", "test"):
        if out[f"{split}_x"].shape[0] != out[f"{split}_y"].shape[0]:
            raise DataError(f"{name}: {split} images and labels differ in count")
    return out


def partition_labels(labels: np.ndarray, num_clients: int, partition: str, rng: np.random.Generator,
                     alpha: float, num_groups: int, shards_per_client: int, keep_high: float) -> list[np.ndarray]:
    if partition == "label_groups":
        return P.label_groups_dirichlet(labels, num_clients, num_groups, alpha, rng)
    if partition == "dirichlet":
        return P.dirichlet(labels, num_clients, alpha, rng, min_size=2)
    if partition == "shards":
        return P.shards(labels, num_clients, shards_per_client, rng)
    if partition == "class_fraction":
        return P.class_fraction(labels, num_clients, keep_high, rng)
    if partition == "iid":
        return P.iid(labels.size, num_clients, rng)
    raise ValueError(f"unknown partition {partition!r}; use label_groups, dirichlet, shards, class_fraction or iid")


def _image_federation(
    name: str, x: np.ndarray, y: np.ndarray, num_classes: int, mean: Any, std: Any, num_clients: int,
    partition: str, alpha: float, num_groups: int, shards_per_client: int, keep_high: float, fraction: float,
    test_frac: float, val_frac: float, unseen_frac: float, seed: int,
) -> FederatedData:
    rng = np.random.default_rng(seed)
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if fraction < 1:
        keep = np.sort(rng.choice(y.size, size=int(fraction * y.size), replace=False))
        x, y = x[keep], y[keep]
    parts = partition_labels(y, num_clients, partition, rng, alpha, num_groups, shards_per_client, keep_high)
    meta = {"mean": mean, "std": std, "input": "image", "partition": partition}
    return federate(torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y.astype(np.int64)), parts,
                    num_classes, rng, test_frac, val_frac, unseen_frac, name=name, meta=meta)


def idx_federation(
    name: str = "fashion_mnist",
    num_clients: Annotated[int, Range(1, 10**6)] = 100,
    partition: str = "label_groups",
    alpha: Annotated[float, Range(0, 1e3, lo_open=True)] = 0.4,
    num_groups: Annotated[int, Range(1, 10**4)] = 3,
    shards_per_client: Annotated[int, Range(1, 10**4)] = 2,
    keep_high: Annotated[float, Range(0, 1)] = 0.5,
    fraction: Annotated[float, Range(0, 1, lo_open=True)] = 1.0,
    test_frac: Fraction = 0.2,
    val_frac: Fraction = 0.0,
    unseen_frac: Fraction = 0.0,
    seed: DataSeed = 12345,
    data_dir: str = "",
    download: bool = True,
) -> FederatedData:
    """MNIST / Fashion-MNIST federation: train and test pooled (70,000 images, as FedEM does), a
    ``fraction`` kept, partitioned over ``num_clients``, then split per client."""
    if name not in IDX_DATASETS:
        raise ValueError(f"unknown IDX dataset {name!r}; use {sorted(IDX_DATASETS)}")
    a = load_idx_dataset(name, data_dir, download)
    x = np.concatenate([a["train_x"], a["test_x"]])
    y = np.concatenate([a["train_y"], a["test_y"]]).astype(np.int64)
    spec = IDX_DATASETS[name]
    return _image_federation(name, x, y, spec["classes"], spec["mean"], spec["std"], num_clients, partition, alpha,
                             num_groups, shards_per_client, keep_high, fraction, test_frac, val_frac, unseen_frac, seed)


def digits(
    num_clients: Annotated[int, Range(1, 1797)] = 20,
    partition: str = "shards",
    alpha: Annotated[float, Range(0, 1e3, lo_open=True)] = 0.4,
    num_groups: Annotated[int, Range(1, 10**4)] = 3,
    shards_per_client: Annotated[int, Range(1, 10**4)] = 2,
    keep_high: Annotated[float, Range(0, 1)] = 0.5,
    test_frac: Fraction = 0.2,
    val_frac: Fraction = 0.0,
    unseen_frac: Fraction = 0.0,
    seed: DataSeed = 12345,
) -> FederatedData:
    """scikit-learn's handwritten digits (1,797 images of 8x8 pixels, 10 classes, shipped with scikit-learn: no
    download), an offline analogue of MNIST; pixel values 0-16 stored as uint8 0-255 and partitioned like MNIST
    (default ``shards``: each client a couple of classes)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = np.round(d.images * (255.0 / 16.0)).astype(np.uint8)  # (1797, 8, 8)
    y = d.target.astype(np.int64)
    scaled = x.astype(np.float64) / 255.0
    return _image_federation("digits", x, y, 10, float(scaled.mean()), float(scaled.std()), num_clients, partition,
                             alpha, num_groups, shards_per_client, keep_high, 1.0, test_frac, val_frac, unseen_frac,
                             seed)


def fashion_mnist(**kwargs: Any) -> FederatedData:
    """Fashion-MNIST federation (see ``idx_federation`` for the arguments)."""
    return idx_federation(name="fashion_mnist", **kwargs)


def mnist(**kwargs: Any) -> FederatedData:
    """MNIST federation (same code path as Fashion-MNIST; downloaded with its checksum)."""
    return idx_federation(name="mnist", **kwargs)


# ----------------------------------------------------------------------------------------------- EMNIST

EMNIST_ZIP = Remote("gzip.zip", ("https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip",),
                    "58c8d27c78d21e728a6bc7b3cc06412e")


def emnist(
    split: str = "byclass",
    num_clients: Annotated[int, Range(1, 10**6)] = 100,
    partition: str = "label_groups",
    alpha: Annotated[float, Range(0, 1e3, lo_open=True)] = 0.4,
    num_groups: Annotated[int, Range(-1, 10**4)] = -1,
    fraction: Annotated[float, Range(0, 1, lo_open=True)] = 0.1,
    test_frac: Fraction = 0.2,
    val_frac: Fraction = 0.0,
    unseen_frac: Fraction = 0.0,
    seed: DataSeed = 12345,
    data_dir: str = "",
    download: bool = True,
) -> FederatedData:
    """EMNIST (``byclass``: 62 classes) from NIST's ``gzip.zip`` (IDX files inside ``gzip/``); the FedEM
    setting keeps 10% of train+test and makes every class its own label group (``num_groups=-1``)."""
    zpath = locate(EMNIST_ZIP, "emnist", data_dir, (), download)
    arrays = {}
    try:
        with zipfile.ZipFile(zpath) as z:
            for part in ("train", "test"):
                for kind in ("images-idx3", "labels-idx1"):
                    member = f"gzip/emnist-{split}-{part}-{kind}-ubyte.gz"
                    tmp = Path(zpath).parent / Path(member).name
                    tmp.write_bytes(z.read(member))
                    try:
                        arrays[(part, kind)] = read_idx(tmp)
                    finally:
                        tmp.unlink()
    except (zipfile.BadZipFile, KeyError) as e:
        raise DataError(f"{zpath}: not a valid EMNIST gzip.zip ({e})") from None
    x = np.concatenate([arrays[("train", "images-idx3")], arrays[("test", "images-idx3")]])
    x = np.ascontiguousarray(x.transpose(0, 2, 1))  # EMNIST images are stored transposed
    y = np.concatenate([arrays[("train", "labels-idx1")], arrays[("test", "labels-idx1")]]).astype(np.int64)
    classes = int(y.max()) + 1 if split != "byclass" else 62
    return _image_federation(f"emnist_{split}", x, y, classes, 0.1736, 0.3317, num_clients, partition, alpha,
                             num_groups, 2, 0.5, fraction, test_frac, val_frac, unseen_frac, seed)


# ---------------------------------------------------------------------------------------------- FEMNIST


def read_leaf_json(paths: list[Path]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """LEAF JSON files ({"users": [...], "user_data": {u: {"x": [...], "y": [...]}}}) -> per-user arrays."""
    from ..files import read_text
    from ..machine import physical_memory

    users: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for p in paths:
        try:
            doc = json.loads(read_text(p, physical_memory(), "LEAF JSON", DataError))
            for u in doc["users"]:
                d = doc["user_data"][u]
                x, y = np.asarray(d["x"], dtype=np.float32), np.asarray(d["y"], dtype=np.int64)
                if x.shape[0] != y.shape[0]:
                    raise DataError(f"{p}: user {u} has {x.shape[0]} examples but {y.shape[0]} labels")
                users[u] = (x, y)
        except DataError:
            raise
        except (json.JSONDecodeError, KeyError, ValueError) as e:
            raise DataError(f"{p}: not a valid LEAF JSON file ({e})") from None
    return users


def femnist(
    data_dir: str = "",
    writers_frac: Annotated[float, Range(0, 1, lo_open=True)] = 0.15,
    test_frac: Fraction = 0.2,
    val_frac: Fraction = 0.0,
    unseen_frac: Fraction = 0.0,
    seed: DataSeed = 12345,
) -> FederatedData:
    """FEMNIST: LEAF's per-writer JSON files (``data_dir/*.json``, produced by LEAF's preprocessing of
    NIST SD19; there is no single download), one client per writer, ``writers_frac`` of writers kept
    (FedEM: 15%), each writer's images split at random into train / test.  Pixels in LEAF are floats in
    [0, 1] (1 = white background); stored here as uint8 of the inverted image."""
    files = sorted(Path(data_dir).glob("*.json")) if data_dir else []
    if not files:
        raise DataError(f"femnist: no LEAF JSON files in data_dir={data_dir!r}; run LEAF's femnist preprocessing "
                        "(data/femnist/preprocess.sh -s niid --sf 1.0 -k 0 -t sample) and point data_dir at all_data/")
    users = read_leaf_json(files)
    rng = np.random.default_rng(seed)
    names = sorted(users)
    names = [names[i] for i in np.sort(rng.choice(len(names), max(1, int(round(writers_frac * len(names)))),
                                                  replace=False))]
    xs, ys, parts, start = [], [], [], 0
    for u in names:
        x, y = users[u]
        if x.shape[1] != 784:
            raise DataError(f"femnist: user {u} images have {x.shape[1]} pixels, expected 784")
        xs.append(np.clip(np.round((1.0 - x) * 255), 0, 255).astype(np.uint8).reshape(-1, 28, 28))
        ys.append(y)
        parts.append(np.arange(start, start + len(y)))
        start += len(y)
    y_all = np.concatenate(ys)
    if y_all.min() < 0 or y_all.max() >= 62:
        raise DataError(f"femnist: labels must lie in [0, 61], found [{y_all.min()}, {y_all.max()}]")
    return federate(torch.from_numpy(np.concatenate(xs)), torch.from_numpy(y_all), parts, 62, rng, test_frac,
                    val_frac, unseen_frac, name="femnist", meta={"mean": 0.0368, "std": 0.1441, "input": "image"})


# ---------------------------------------------------------------------------------------------- CIFAR

# The binary versions of the archives (raw records, no pickle: the python versions are pickled dicts, which
# fedmtl never loads from a file).  Record = label byte(s) + 3072 pixel bytes (R, G, B planes of 32 x 32).
CIFAR = {
    "cifar10": (Remote("cifar-10-binary.tar.gz", ("https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz",),
                       "c32a1d4ab5d03f1284b67883e8d87530"), "cifar-10-batches-bin",
                [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"], 1, 0,
                10, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    # CIFAR-100 records carry the coarse label then the fine label; the fine one (100 classes) is used
    "cifar100": (Remote("cifar-100-binary.tar.gz", ("https://www.cs.toronto.edu/~kriz/cifar-100-binary.tar.gz",),
                        "03b5dce01913d631647c71ecec9e9cb8"), "cifar-100-binary", ["train.bin", "test.bin"], 2, 1,
                 100, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}


def read_cifar_records(raw: bytes, label_bytes: int, label_at: int, classes: int, what: str
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, 3, 32, 32) uint8 and labels of a CIFAR binary batch file's bytes."""
    size = label_bytes + 3072
    if len(raw) == 0 or len(raw) % size:
        raise DataError(f"{what}: {len(raw)} bytes is not a whole number of {size}-byte CIFAR records (truncated?)")
    rec = np.frombuffer(raw, dtype=np.uint8).reshape(-1, size)
    y = rec[:, label_at].astype(np.int64)
    if int(y.max()) >= classes:
        raise DataError(f"{what}: label {int(y.max())} out of range for {classes} classes")
    return rec[:, label_bytes:].reshape(-1, 3, 32, 32).copy(), y


def load_cifar(name: str, data_dir: str = "", download: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """All 60,000 images (uint8 (N, 3, 32, 32)) and labels of CIFAR-10/100 from the binary tarball."""
    remote, folder, members, label_bytes, label_at, classes, _, _ = CIFAR[name]
    path = locate(remote, name, data_dir, (), download)
    xs, ys = [], []
    try:
        with tarfile.open(path, "r:gz") as tar:
            for m in members:
                f = tar.extractfile(f"{folder}/{m}")
                if f is None:
                    raise DataError(f"{path}: member {folder}/{m} missing")
                x, y = read_cifar_records(f.read(), label_bytes, label_at, classes, f"{path}: {m}")
                xs.append(x)
                ys.append(y)
    except (tarfile.TarError, EOFError, OSError, KeyError) as e:
        raise DataError(f"{path}: not a valid {name} archive ({e})") from None
    return np.concatenate(xs), np.concatenate(ys)


def cifar(
    name: str = "cifar10",
    num_clients: Annotated[int, Range(1, 10**6)] = 80,
    partition: str = "label_groups",
    alpha: Annotated[float, Range(0, 1e3, lo_open=True)] = 0.4,
    num_groups: Annotated[int, Range(1, 10**4)] = 3,
    shards_per_client: Annotated[int, Range(1, 10**4)] = 2,
    fraction: Annotated[float, Range(0, 1, lo_open=True)] = 1.0,
    test_frac: Fraction = 0.2,
    val_frac: Fraction = 0.0,
    unseen_frac: Fraction = 0.0,
    seed: DataSeed = 12345,
    data_dir: str = "",
    download: bool = True,
) -> FederatedData:
    """CIFAR-10/100 federation (FedEM's CIFAR-10 setting: 80 clients, 3 label groups, alpha 0.4)."""
    if name not in CIFAR:
        raise ValueError(f"unknown CIFAR dataset {name!r}; use cifar10 or cifar100")
    x, y = load_cifar(name, data_dir, download)
    *_, classes, mean, std = CIFAR[name]
    return _image_federation(name, x, y, classes, mean, std, num_clients, partition, alpha, num_groups,
                             shards_per_client, 0.5, fraction, test_frac, val_frac, unseen_frac, seed)


def fmnist_peer_workload(seed: int = 0, examples: int = 12_000, clients: int = 20, alpha: float = 0.1
                         ) -> FederatedData:
    """The most used personalized-FL library's default Fashion-MNIST workload, offline: the 70,000 images pooled,
    a seeded uniform subset of ``examples``, ``clients`` clients by a Dirichlet(``alpha``) label split (at least 40
    examples each), 75/25 train/test per client, images scaled to [-1, 1] (its ``Normalize([0.5], [0.5])``).
    ``fedmtl bench peers`` times it; ``fedmtl reproduce peer-fedper`` compares accuracies on it."""
    raw = load_idx_dataset("fashion_mnist", download=False)
    x = np.concatenate([raw["train_x"], raw["test_x"]])
    y = np.concatenate([raw["train_y"], raw["test_y"]]).astype(np.int64)
    rng = np.random.default_rng(seed)
    keep = np.sort(rng.choice(len(y), examples, replace=False))
    x = (x[keep].astype(np.float32) / 255.0 - 0.5) / 0.5
    x, y = x.reshape(-1, 1, 28, 28), y[keep]
    parts = P.dirichlet(y, clients, alpha, rng, min_size=40)
    train, test = P.split_arrays(x, y, parts, 0.25, rng)
    return FederatedData.from_arrays(train, test, num_classes=10, name="fmnist_peers")


FMNIST_PAIRS = ((0, 6), (2, 4), (7, 9))  # T-shirt/shirt, pullover/coat, sneaker/ankle boot


def fmnist_pair_arrays(m: int = 30, seed: int = 0, data_dir: str = "", sizes: Sequence[int] | None = None
                       ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """One binary task per client: client t separates the classes of pair ``t mod 3``, with 40-120 images
    (``sizes``: task t gets ``sizes[t]``; 2x2-average-pooled to 14x14, scaled to [0, 1], plus a constant feature);
    labels +-1 (MOCHA's Table 1 Fashion-MNIST federation)."""
    if sizes is not None and len(sizes) != m:
        raise ValueError(f"sizes: {len(sizes)} values for {m} tasks")
    raw = load_idx_dataset("fashion_mnist", data_dir, download=False)
    x = raw["train_x"].astype(np.float64).reshape(-1, 14, 2, 14, 2).mean((2, 4)).reshape(-1, 196) / 255.0
    x = np.hstack([x, np.ones((len(x), 1))])
    y = raw["train_y"]
    rng = np.random.default_rng(seed)
    pools = {p: [rng.permutation(np.flatnonzero(y == c)) for c in p] for p in FMNIST_PAIRS}
    used = {p: [0, 0] for p in FMNIST_PAIRS}
    xs, ys = [], []
    for t in range(m):
        p = FMNIST_PAIRS[t % len(FMNIST_PAIRS)]
        n = int(rng.integers(40, 121))
        n = n if sizes is None else int(sizes[t])
        k = int(rng.binomial(n, 0.5))
        take = []
        for j, cnt in enumerate((k, n - k)):
            take.append(pools[p][j][used[p][j]: used[p][j] + cnt])
            used[p][j] += cnt
            if used[p][j] > len(pools[p][j]):
                raise ValueError(f"sizes: the tasks of classes {p} need more than the {len(pools[p][j])} images "
                                 f"of class {p[j]}")
        idx = np.concatenate(take)
        xs.append(x[idx])
        ys.append(np.where(y[idx] == p[0], 1.0, -1.0))
    return xs, ys


def fmnist_pairs(
    m: Annotated[int, Range(1, 10**4)] = 30,
    seed: DataSeed = 0,
    data_dir: str = "",
    test_frac: Fraction = 0.25,
    split_seed: DataSeed = 0,
) -> FederatedData:
    """``fmnist_pair_arrays`` as a federation (class 1 = the pair's first class), split 75/25 per task."""
    xs, ys = fmnist_pair_arrays(m, seed, data_dir)
    return tasks_to_federation(xs, [(y > 0).astype(np.int64) for y in ys], 2, "fmnist_pairs", test_frac,
                               standardize=False, seed=split_seed)
