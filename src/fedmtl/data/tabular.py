"""MOCHA's sensor datasets: one task (client) per subject / sensor / participant, binary labels.

* ``har`` — UCI Human Activity Recognition (Anguita et al. 2013): 30 subjects, 561 features, the
  official zip ("UCI HAR Dataset/{train,test}/{X,y,subject}_*.txt"); task: sitting (label 4) vs the rest
  (``binary=False`` keeps the 6 activities).
* ``vehicle`` — SensIT Vehicle (Duarte & Hu 2004): 23 sensors, 50 acoustic + 50 seismic features, AAV
  vs DW.  Reads MOCHA's processed ``vehicle.mat`` (cell arrays X, Y of 1 x 23, labels +-1) or the raw
  SensIT folder layout (``<aav|dw>/s<k>/`` with acoustic and seismic ``*feat*`` files).  There is no
  stable public URL for either; point ``data_dir`` at a local copy.
* ``gleam`` — Google Glass GLEAM (Rahman et al. 2015): 38 participants; raw sensor streams
  (``*sensorData*.csv``: Unix Time, Sensor, Value1-3; ``*annotate*.csv``: unix time, Activity, Status),
  cut into 60 s windows; for each non-light sensor and axis 10 statistics (mean, variance, skewness,
  kurtosis, crest factor, spectral centroid, onset strength (mean positive spectral flux), spectral
  roll-off (85%), mean first and second differences) = 180 features with 6 sensors; label = majority
  activity in the window, eating vs the rest.  Same dimension as MOCHA's set, not necessarily its exact
  features (which were never published).

Every task's examples are split at random 75 / 25 (MOCHA's protocol), features z-scored per task with
training statistics (``standardize``).
"""

from __future__ import annotations

import io
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from ..files import read_bytes
from ..machine import physical_memory
from ..schema import DataSeed, Fraction
from .download import Remote, locate
from .federated import DataError, FederatedData, tasks_to_federation

HAR_ZIP = Remote("UCI HAR Dataset.zip",
                 ("https://archive.ics.uci.edu/ml/machine-learning-databases/00240/UCI%20HAR%20Dataset.zip",), "")
GLEAM_TAR = Remote("GLEAM.tar.gz", ("http://www.skleinberg.org/data/GLEAM.tar.gz",),
                   "10ad34716546e44c5078d392f25031e1")


# -------------------------------------------------------------------------------------------------- HAR


def read_har_zip(path: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(X (N, 561), activity labels 1..6, subject ids 1..30) from the UCI zip, train and test pooled."""
    xs, ys, ss = [], [], []
    try:
        with zipfile.ZipFile(path) as z:
            for part in ("train", "test"):
                def arr(stem: str, part: str = part) -> np.ndarray:
                    return np.loadtxt(io.BytesIO(z.read(f"UCI HAR Dataset/{part}/{stem}_{part}.txt")), ndmin=2)

                x, y, s = arr("X"), arr("y").ravel(), arr("subject").ravel()
                if x.shape[1] != 561 or not (x.shape[0] == y.shape[0] == s.shape[0]):
                    raise DataError(f"{path}: {part} split has X {x.shape}, y {y.shape}, subject {s.shape}")
                xs.append(x)
                ys.append(y.astype(np.int64))
                ss.append(s.astype(np.int64))
    except (zipfile.BadZipFile, KeyError, ValueError) as e:
        raise DataError(f"{path}: not a valid UCI HAR zip ({e})") from None
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(ss)


def har_tasks(data_dir: str = "", binary: bool = True, download: bool = True
              ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """One task per subject (30): features and labels (MOCHA's task: sitting = 1 vs the rest = 0)."""
    x, y, subj = read_har_zip(locate(HAR_ZIP, "har", data_dir, (), download))
    if y.min() < 1 or y.max() > 6:
        raise DataError(f"har: activity labels must be 1..6, found {y.min()}..{y.max()}")
    labels = (y == 4).astype(np.int64) if binary else y - 1
    ids = np.unique(subj)
    return [x[subj == s] for s in ids], [labels[subj == s] for s in ids]


def har(data_dir: str = "", binary: bool = True, test_frac: Fraction = 0.25, standardize: bool = True,
        seed: DataSeed = 0, unseen_frac: Fraction = 0.0, download: bool = True) -> FederatedData:
    xs, ys = har_tasks(data_dir, binary, download)
    return tasks_to_federation(xs, ys, 2 if binary else 6, "har", test_frac, standardize, seed, unseen_frac)


# ---------------------------------------------------------------------------------------------- Vehicle


def read_vehicle_mat(path: str | Path) -> tuple[list[np.ndarray], list[np.ndarray]]:
    from scipy.io import loadmat

    try:
        m = loadmat(str(path))
        X, Y = m["X"], m["Y"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}: not MOCHA's vehicle.mat (cell arrays X and Y) ({e})") from None
    xs = [np.asarray(X.flat[i], dtype=np.float64) for i in range(X.size)]
    ys = [np.asarray(Y.flat[i]).ravel() for i in range(Y.size)]
    return xs, [(y > 0).astype(np.int64) for y in ys]  # +1 -> 1, -1 -> 0


def read_sensit_folder(root: str | Path) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Raw SensIT layout: ``<...>/<aav|dw>*/s<k>/`` holding an acoustic and a seismic ``*feat*`` file
    (whitespace-separated, 50 features used from each); label 1 for AAV runs."""
    per_sensor: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}
    for d in sorted(Path(root).rglob("s*")):
        if not d.is_dir() or not d.name[1:].isdigit():
            continue
        feats = sorted(f for f in d.iterdir() if "feat" in f.name)
        if len(feats) != 2:
            continue
        blocks = [np.loadtxt(io.BytesIO(read_bytes(f, physical_memory(), "SensIT features", DataError)),
                             ndmin=2)[:, :50] for f in feats]
        if blocks[0].shape[0] != blocks[1].shape[0] or min(b.shape[1] for b in blocks) < 50:
            raise DataError(f"{d}: acoustic and seismic feature files disagree or have < 50 columns")
        aav = "aav" in d.parent.name.lower()
        xs, ys = per_sensor.setdefault(int(d.name[1:]), ([], []))
        xs.append(np.concatenate(blocks, axis=1))
        ys.append(np.full(blocks[0].shape[0], int(aav)))
    if not per_sensor:
        raise DataError(f"{root}: no SensIT sensor folders (s<k>/ with two *feat* files) found")
    keys = sorted(per_sensor)
    return [np.concatenate(per_sensor[k][0]) for k in keys], [np.concatenate(per_sensor[k][1]) for k in keys]


def vehicle_tasks(data_dir: str = "") -> tuple[list[np.ndarray], list[np.ndarray]]:
    """One task per sensor (23): 100 features, AAV = 1 vs DW = 0."""
    root = Path(data_dir) if data_dir else None
    if root is None or not root.exists():
        raise DataError("vehicle: set data_dir to a folder with MOCHA's vehicle.mat or the raw SensIT "
                        "feature folders (no stable public download exists)")
    mat = root / "vehicle.mat" if root.is_dir() else root
    xs, ys = read_vehicle_mat(mat) if mat.is_file() else read_sensit_folder(root)
    if any(x.shape[1] != 100 for x in xs):
        raise DataError(f"vehicle: expected 100 features per example, found {sorted({x.shape[1] for x in xs})}")
    return xs, ys


def vehicle(data_dir: str = "", test_frac: Fraction = 0.25, standardize: bool = True, seed: DataSeed = 0,
            unseen_frac: Fraction = 0.0) -> FederatedData:
    xs, ys = vehicle_tasks(data_dir)
    return tasks_to_federation(xs, ys, 2, "vehicle", test_frac, standardize, seed, unseen_frac)


# ------------------------------------------------------------------------------------------------ GLEAM


def _window_features(v: np.ndarray) -> list[float]:
    """10 statistics of one sensor axis in one window."""
    if v.size < 2:
        return [0.0] * 10
    mu, var = float(v.mean()), float(v.var())
    sd = np.sqrt(var) if var > 0 else 1.0
    z = (v - mu) / sd
    mag = np.abs(np.fft.rfft(v - mu))
    freqs = np.arange(mag.size)
    total = mag.sum()
    centroid = float((freqs * mag).sum() / total) if total > 0 else 0.0
    rolloff = float(np.searchsorted(np.cumsum(mag), 0.85 * total)) if total > 0 else 0.0
    flux = np.diff(np.abs(v - mu))
    d1 = np.diff(v)
    return [mu, var, float((z**3).mean()) if var > 0 else 0.0, float((z**4).mean() - 3) if var > 0 else 0.0,
            float(np.abs(v).max() / np.sqrt((v**2).mean())) if (v**2).mean() > 0 else 0.0,
            centroid, float(np.clip(flux, 0, None).mean()) if flux.size else 0.0, rolloff,
            float(d1.mean()), float(np.diff(d1).mean()) if d1.size > 1 else 0.0]


def gleam_participant(sensor_csv: Any, annotate_csv: Any, window_ms: int = 60_000) -> tuple[np.ndarray, np.ndarray]:
    """Features (W, 10 * 3 * sensors) and eat / not-eat labels (W,) of one participant's streams."""
    import csv

    rows = list(csv.DictReader(io.TextIOWrapper(sensor_csv, encoding="utf-8")))
    ann = list(csv.DictReader(io.TextIOWrapper(annotate_csv, encoding="utf-8")))
    if not rows or not ann:
        raise DataError("gleam: empty sensor or annotation file")
    try:
        t = np.array([float(r["Unix Time"]) for r in rows])
        sensor = np.array([r["Sensor"] for r in rows])
        vals = np.array([[float(r["Value1"]), float(r["Value2"]), float(r["Value3"])] for r in rows])
        at = np.array([float(r["unix time"]) for r in ann])
        act = np.array([r["Activity"].strip().lower() for r in ann])
        status = np.array([r["Status"].strip().lower() for r in ann])
    except (KeyError, ValueError) as e:
        raise DataError(f"gleam: malformed sensor/annotation CSV ({e})") from None
    t0 = t.min()
    sensors = sorted(s for s in set(sensor) if "light" not in s.lower())
    starts, labels_at = at[status == "start"], act[status == "start"]
    n_win = int((t.max() - t0) // window_ms)
    feats, labels = [], []
    for w in range(n_win):
        lo, hi = t0 + w * window_ms, t0 + (w + 1) * window_ms
        in_w = (t >= lo) & (t < hi)
        row = []
        for axis in range(3):
            for s in sensors:
                row += _window_features(vals[in_w & (sensor == s), axis])
        feats.append(row)
        mid = np.arange(lo, hi, 1000.0)
        idx = np.searchsorted(starts, mid, side="right") - 1
        current = np.where(idx >= 0, labels_at[np.clip(idx, 0, None)], "none")
        labels.append(int((current == "eat").mean() > 0.5))
    return np.asarray(feats, dtype=np.float64).reshape(n_win, -1), np.asarray(labels, dtype=np.int64)


def read_gleam_tar(path: str | Path) -> tuple[list[np.ndarray], list[np.ndarray]]:
    try:
        with tarfile.open(path, "r:*") as tar:
            members = [m for m in tar.getmembers() if m.isfile() and not Path(m.name).name.startswith(".")]
            by_dir: dict[str, dict[str, tarfile.TarInfo]] = {}
            for m in members:
                kind = "sensor" if "sensorData" in m.name else "annotate" if "annotate" in m.name else None
                if kind:
                    by_dir.setdefault(str(Path(m.name).parent), {})[kind] = m
            xs, ys = [], []
            for d in sorted(by_dir):
                pair = by_dir[d]
                if len(pair) != 2:
                    continue
                x, y = gleam_participant(tar.extractfile(pair["sensor"]), tar.extractfile(pair["annotate"]))
                xs.append(x)
                ys.append(y)
    except (tarfile.TarError, EOFError, OSError) as e:
        raise DataError(f"{path}: not a valid GLEAM archive ({e})") from None
    if not xs:
        raise DataError(f"{path}: no participant folder with a sensorData and an annotate file")
    return xs, ys


def gleam_tasks(data_dir: str = "", download: bool = True) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """One task per participant (38): 180 window features, eating = 1 vs the rest = 0."""
    return read_gleam_tar(locate(GLEAM_TAR, "gleam", data_dir, (), download))


def gleam(data_dir: str = "", test_frac: Fraction = 0.25, standardize: bool = True, seed: DataSeed = 0,
          unseen_frac: Fraction = 0.0, download: bool = True) -> FederatedData:
    xs, ys = gleam_tasks(data_dir, download)
    return tasks_to_federation(xs, ys, 2, "gleam", test_frac, standardize, seed, unseen_frac)
