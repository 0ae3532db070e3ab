"""File fuzzing: every file fedmtl reads that a user, a node or a crash could have written -- checkpoints, memory-mapped
client stores, safetensors weights, peft adapter folders, the run files ``fedmtl watch`` and ``fedmtl compare`` read
(progress.json, summary.json, metrics.csv, clients.csv, config.toml), node-local ``.npz`` data directories -- made
corrupt, truncated, empty, of the wrong dtype (float64 1e299, int64, bool), NaN, of the wrong shape, with foreign
keys, a FIFO, a directory, /dev/zero or a 1 TB sparse file in its place.  Each case reads it through the command
line (``fedmtl run --resume``, ``--set model.weights=``, ``watch``, ``compare``) or the loader itself, bounded in
time and memory with FIFOs unblocked (``fuzz_harness``): a one-line refusal naming the file, or a sane result;
never a traceback, a hang or nonsense accepted."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from fedmtl.cli import main

from .fuzz_harness import TINY as HARNESS_TINY
from .fuzz_harness import bounded, check_line, expect_error, expect_refused, make_fifo, make_huge, run_cli

TINY = HARNESS_TINY.replace("rounds = 1", "rounds = 2").replace("checkpoint_every = 0", "checkpoint_every = 1")



@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    """Every case runs in its own folder: a relative path a case gives (--out 0, --results nan) lands there."""
    monkeypatch.chdir(tmp_path)

def _kinds(f: Path) -> dict[str, Callable[[], None]]:
    """Ways to replace the file ``f`` with something that is not it."""
    def fifo() -> None:
        f.unlink(missing_ok=True)
        make_fifo(f)

    def directory() -> None:
        f.unlink(missing_ok=True)
        f.mkdir()

    def huge() -> None:
        f.unlink(missing_ok=True)
        make_huge(f)

    def devzero() -> None:
        f.unlink(missing_ok=True)
        f.symlink_to("/dev/zero")

    def truncated() -> None:
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2])

    def garbage() -> None:
        f.write_bytes(bytes(range(256)) * 8)

    return {"fifo": fifo, "directory": directory, "huge": huge, "devzero": devzero, "truncated": truncated,
            "empty": lambda: f.write_bytes(b""), "garbage": garbage}


KINDS = ["fifo", "directory", "huge", "devzero", "truncated", "empty", "garbage"]


def _replaced(name: str, kind: str) -> Callable[[Path], None]:
    """An edit of a folder: its file ``name`` replaced by ``kind`` (``_kinds``)."""
    return lambda d: _kinds(d / name)[kind]()


# ------------------------------------------------------------------------------------------------ checkpoints
@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory) -> dict[str, Path]:
    """Finished tiny runs with checkpoints: a memory client store and a memory-mapped one."""
    d = tmp_path_factory.mktemp("runs")
    (d / "tiny.toml").write_text(TINY)
    assert main(["run", str(d / "tiny.toml"), "--out", str(d / "mem"), "-q"]) == 0
    assert main(["run", str(d / "tiny.toml"), "--set", "run.client_store=mmap", "--out", str(d / "mmap"), "-q"]) == 0
    return {"cfg": d / "tiny.toml", "mem": d / "mem", "mmap": d / "mmap"}


def _copy(run_dirs: dict[str, Path], kind: str, tmp: Path) -> Path:
    out = tmp / kind
    shutil.copytree(run_dirs[kind], out, symlinks=True)
    (out / ".lock").unlink(missing_ok=True)
    return out


def _resume(run_dirs: dict[str, Path], out: Path, capsys, *names: str, store: str = "mem") -> str:
    argv = ["run", str(run_dirs["cfg"]), "--resume", "--out", str(out), "-q"]
    if store == "mmap":
        argv[2:2] = ["--set", "run.client_store=mmap"]
    return expect_refused(argv, capsys, *names, fifo_roots=[out], seconds=20)


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_file_of_every_kind(run_dirs, tmp_path, capsys, kind):
    out = _copy(run_dirs, "mem", tmp_path)
    _kinds(out / "checkpoint.pt")[kind]()
    _resume(run_dirs, out, capsys, "checkpoint.pt")


def _edit_checkpoint(path: Path, edit: Callable[[dict], None]) -> None:
    payload = torch.load(path, weights_only=True)
    edit(payload)
    torch.save(payload, path)


def _server(p: dict, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    k = sorted(p["server"])[0]
    p["server"][k] = fn(p["server"][k])


def _client_leaf(p: dict, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    p["clients"]["leaf0"] = fn(p["clients"]["leaf0"])


CHECKPOINT_EDITS: dict[str, Callable[[dict], None]] = {
    "format": lambda p: p.update(format="fedmtl-checkpoint/999"),
    "round -1": lambda p: p.update(round=-1),
    "round bool": lambda p: p.update(round=True),
    "round 1e299": lambda p: p.update(round=1e299),
    "round 2^70": lambda p: p.update(round=2**70),
    "round str": lambda p: p.update(round="2"),
    "history not a list": lambda p: p.update(history={"a": 1}),
    "history too short": lambda p: p.update(history=p["history"][:1]),
    "counters not a dict": lambda p: p.update(counters=[1]),
    "config other": lambda p: p["config"]["optim"].update(lr=0.5),
    "config not a dict": lambda p: p.update(config=[1]),
    "server NaN": lambda p: _server(p, lambda t: torch.full_like(t, float("nan"))),
    "server inf": lambda p: _server(p, lambda t: torch.full_like(t, float("inf"))),
    "server float64 1e299": lambda p: _server(p, lambda t: torch.full(t.shape, 1e299, dtype=torch.float64)),
    "server int64": lambda p: _server(p, lambda t: torch.ones(t.shape, dtype=torch.int64)),
    "server bool": lambda p: _server(p, lambda t: torch.ones(t.shape, dtype=torch.bool)),
    "server wrong shape": lambda p: _server(p, lambda t: torch.zeros(7, 7)),
    "server foreign key": lambda p: p["server"].update({"evil.weight": torch.zeros(2)}),
    "server missing key": lambda p: p["server"].pop(sorted(p["server"])[0]),
    "server not tensors": lambda p: p.update(server={"x": [1, 2]}),
    "clients kind": lambda p: p["clients"].update(kind="bogus"),
    "clients other kind": lambda p: p["clients"].update(kind="mmap"),
    "clients ids out of range": lambda p: p["clients"].update(ids=p["clients"]["ids"] + 1000),
    "clients ids negative": lambda p: p["clients"].update(ids=p["clients"]["ids"] - 1000),
    "clients ids repeat": lambda p: p["clients"].update(ids=torch.zeros_like(p["clients"]["ids"])),
    "clients ids float": lambda p: p["clients"].update(ids=p["clients"]["ids"].double()),
    "clients leaf NaN": lambda p: _client_leaf(p, lambda t: torch.full_like(t, float("nan"))),
    "clients leaf float64": lambda p: _client_leaf(p, lambda t: t.double()),
    "clients leaf wrong shape": lambda p: _client_leaf(p, lambda t: t[:, :1]),
    "clients leaf missing": lambda p: p["clients"].pop("leaf0"),
    "evaluation malformed": lambda p: p.update(evaluation={"a": torch.zeros(2)}),
    "evaluation 2-d": lambda p: p.update(evaluation={"seen/test/acc": torch.zeros(2, 2)}),
    "base digest not str": lambda p: p.update(base_sha256=5),
    "not a dict": lambda p: (p.clear(), p.update(format=1)),
}


@pytest.mark.parametrize("edit", sorted(CHECKPOINT_EDITS))
def test_checkpoint_contents_tampered(run_dirs, tmp_path, capsys, edit):
    """A checkpoint whose contents are wrong: refused in one line naming it when the run is resumed."""
    out = _copy(run_dirs, "mem", tmp_path)
    _edit_checkpoint(out / "checkpoint.pt", CHECKPOINT_EDITS[edit])
    _resume(run_dirs, out, capsys, "checkpoint.pt")


def test_a_pickled_object_in_a_checkpoint_is_never_unpickled(run_dirs, tmp_path, capsys):
    out = _copy(run_dirs, "mem", tmp_path)
    payload = torch.load(out / "checkpoint.pt", weights_only=True)
    payload["history"] = [_Evil()]
    torch.save(payload, out / "checkpoint.pt")
    _resume(run_dirs, out, capsys, "checkpoint.pt", "never unpickled")
    assert not (tmp_path / "pwned").exists()


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


# ------------------------------------------------------------------------------------------------ client stores
def _npy_edit(f: Path, what: str) -> None:
    arr = np.load(f)
    if what == "nan":
        arr = arr.astype(arr.dtype)
        if arr.dtype.kind == "f":
            arr[...] = np.nan
        np.save(f, arr)
    elif what == "float64":
        np.save(f, arr.astype(np.float64))
    elif what == "int64":
        np.save(f, arr.astype(np.int64))
    elif what == "fortran":
        np.save(f, np.asfortranarray(arr.reshape(arr.shape[0], -1)).reshape(arr.shape, order="F")
                if arr.ndim > 1 else arr)
        if arr.ndim > 1:  # a true Fortran-ordered header
            with open(f, "wb") as fh:
                np.lib.format.write_array(fh, np.asfortranarray(arr))
    elif what == "shape":
        np.save(f, arr[:1])
    elif what == "padded":
        with open(f, "ab") as fh:
            fh.write(b"\x00" * 64)


STORE_FILES = ["layout.json", "leaf0.npy", "written.npy", "undo.log"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", STORE_FILES)
def test_client_store_file_of_every_kind(run_dirs, tmp_path, capsys, name, kind):
    """A memory-mapped client store file that is a FIFO, a directory, 1 TB, /dev/zero, truncated, empty or garbage:
    the resume is refused in one line naming the file (or ends sanely, for a journal with nothing to undo)."""
    out = _copy(run_dirs, "mmap", tmp_path)
    f = out / "client_store" / name
    if not f.exists():
        f.write_bytes(b"")
    _kinds(f)[kind]()
    argv = ["run", str(run_dirs["cfg"]), "--set", "run.client_store=mmap", "--resume", "--out", str(out), "-q"]
    code, _, err = run_cli(argv, capsys, 20, fifo_roots=[out])
    if name == "undo.log" and kind in ("truncated", "empty", "garbage") and code == 0:
        return  # a journal cut short or foreign undoes nothing: the files are the checkpoint's
    assert code == 2, (name, kind, code, err[:300])
    check_line(err, (name if name != "leaf0.npy" else "leaf0",), f"{name} {kind}")


@pytest.mark.parametrize("what", ["nan", "float64", "int64", "fortran", "shape", "padded"])
@pytest.mark.parametrize("name", ["leaf0.npy", "written.npy"])
def test_client_store_array_tampered(run_dirs, tmp_path, capsys, name, what):
    out = _copy(run_dirs, "mmap", tmp_path)
    f = out / "client_store" / name
    if what == "nan" and name == "written.npy":
        pytest.skip("written flags hold no floats")
    if what == "fortran" and name == "written.npy":
        pytest.skip("a 1-d array has no order")
    _npy_edit(f, what)
    _resume(run_dirs, out, capsys, "client_store", store="mmap")


@pytest.mark.parametrize("layout", ['{"num_clients": 1e400}', "[1]", '{"num_clients": 4}', "9" * 5000,
                                    '{"a": ' * 10000 + "1" + "}" * 10000])
def test_client_store_layout_tampered(run_dirs, tmp_path, capsys, layout):
    out = _copy(run_dirs, "mmap", tmp_path)
    (out / "client_store" / "layout.json").write_text(layout)
    _resume(run_dirs, out, capsys, "layout.json", store="mmap")


@pytest.mark.parametrize("record", ["k huge", "k negative", "ids out of range", "round huge"])
def test_undo_journal_records_tampered(run_dirs, tmp_path, capsys, record):
    """A journal record whose count, ids or round are forged: refused or ignored, never a crash or an allocation of
    its claimed size."""
    out = _copy(run_dirs, "mmap", tmp_path)
    k = {"k huge": 2**60, "k negative": -5}.get(record, 1)
    rnd = 2**62 if record == "round huge" else 1
    ids = np.array([10**6 if record == "ids out of range" else 0], "<i8").tobytes()
    leaf = np.load(out / "client_store" / "leaf0.npy")
    body = struct.pack("<qq", rnd, k) + ids + b"\x01" + np.zeros(leaf.shape[1:], leaf.dtype).tobytes()
    (out / "client_store" / "undo.log").write_bytes(b"FMUL" + body + b"END!")
    argv = ["run", str(run_dirs["cfg"]), "--set", "run.client_store=mmap", "--resume", "--out", str(out), "-q"]
    code, _, err = run_cli(argv, capsys, 20)
    assert code in (0, 2), (record, code, err[:300])
    if code == 2:
        check_line(err, ("undo.log",), record)


# ------------------------------------------------------------------------------------------------ safetensors
def _module_state(tmp: Path) -> dict[str, torch.Tensor]:
    from fedmtl.config import load

    (tmp / "tiny.toml").write_text(TINY)
    model = load(tmp / "tiny.toml").build_model((3,), 2, {})
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def _safetensors_header(f: Path, header: bytes, body: bytes = b"") -> None:
    f.write_bytes(struct.pack("<Q", len(header)) + header + body)


def _weights_kinds(f: Path, state: dict[str, torch.Tensor]) -> dict[str, Callable[[], None]]:
    from safetensors.torch import save_file

    def tensors(fn: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> Callable[[], None]:
        return lambda: save_file(fn({k: v.clone() for k, v in state.items()}), str(f))

    k0 = sorted(state)[0]
    return {
        **{k: v for k, v in _kinds(f).items()},
        "float64 1e299": tensors(lambda s: {k: torch.full(v.shape, 1e299, dtype=torch.float64) for k, v in s.items()}),
        "float64": tensors(lambda s: {k: v.double() for k, v in s.items()}),
        "int64": tensors(lambda s: {k: torch.ones(v.shape, dtype=torch.int64) for k, v in s.items()}),
        "bool": tensors(lambda s: {k: torch.ones(v.shape, dtype=torch.bool) for k, v in s.items()}),
        "float16 inf": tensors(lambda s: {k: torch.full(v.shape, 7e4).half() for k, v in s.items()}),
        "NaN": tensors(lambda s: {k: torch.full_like(v, float("nan")) for k, v in s.items()}),
        "wrong shape": tensors(lambda s: {**s, k0: torch.zeros(9, 9)}),
        "foreign key": tensors(lambda s: {**s, "evil.weight": torch.zeros(2)}),
        "missing key": tensors(lambda s: {k: v for k, v in s.items() if k != k0}),
        "header 2^60": lambda: f.write_bytes(struct.pack("<Q", 2**60) + b"{}"),
        "header not json": lambda: _safetensors_header(f, b"{not json"),
        "header offsets beyond": lambda: _safetensors_header(
            f, json.dumps({k0: {"dtype": "F32", "shape": [10**6, 10**6], "data_offsets": [0, 4 * 10**12]}}).encode()),
    }


WEIGHT_KINDS = KINDS + ["float64 1e299", "int64", "bool", "float16 inf", "NaN", "wrong shape",
                        "foreign key", "missing key", "header 2^60", "header not json", "header offsets beyond"]


@pytest.fixture(scope="module")
def state(tmp_path_factory) -> dict[str, torch.Tensor]:
    return _module_state(tmp_path_factory.mktemp("state"))


@pytest.mark.parametrize("kind", WEIGHT_KINDS)
@pytest.mark.parametrize("key", ["weights", "adapters.base"])
def test_safetensors_weights_of_every_kind(tmp_path, capsys, state, key, kind):
    """[model] weights / [model.adapters] base given a file that is not this model's weights (corrupt, of another
    dtype, NaN, another shape, foreign keys, a FIFO...): one line naming the key and the file (exit 2)."""
    from safetensors.torch import save_file

    f = tmp_path / "w.safetensors"
    save_file(state, str(f))
    _weights_kinds(f, state)[kind]()
    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY.replace("checkpoint_every = 1", "checkpoint_every = 0").replace("rounds = 2", "rounds = 1"))
    argv = ["run", str(cfg), "--set", f"model.{key}={f}", "--out", str(tmp_path / "o"), "-q"]
    expect_refused(argv, capsys, str(f), key.rpartition(".")[2], fifo_roots=[tmp_path], seconds=20)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_good_safetensors_weights_are_where_a_run_starts(tmp_path, capsys, state, dtype):
    """Weights the model's dtype holds exactly or by rounding (float64 values within float32's range) are where the
    run starts: a float cast is refused only where it would overflow (``float64 1e299`` above)."""
    from safetensors.torch import save_file

    f = tmp_path / "w.safetensors"
    save_file({k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}, str(f))
    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY.replace("rounds = 2", "rounds = 1"))
    code, _, err = run_cli(["run", str(cfg), "--set", f"model.weights={f}", "--out", str(tmp_path / "o"), "-q"],
                           capsys)
    assert code == 0, err


# ------------------------------------------------------------------------------------------------ peft folders
@pytest.fixture()
def peft_dir(tmp_path) -> Path:
    from fedmtl.models.lora import AdapterConfig
    from fedmtl.models.peft_folder import save_peft

    params = {"fc.lora_A": torch.randn(2, 3), "fc.lora_B": torch.zeros(4, 2)}
    return save_peft(params, AdapterConfig(rank=2, alpha=4.0), tmp_path / "peft")


PEFT_EDITS: dict[str, Callable[[Path], None]] = {
    **{f"config {k}": _replaced("adapter_config.json", k) for k in KINDS},
    **{f"weights {k}": _replaced("adapter_model.safetensors", k) for k in KINDS},
    "config missing": lambda d: (d / "adapter_config.json").unlink(),
    "config r 0": lambda d: _json_edit(d / "adapter_config.json", r=0),
    "config r mismatch": lambda d: _json_edit(d / "adapter_config.json", r=5),
    "config r 1e400": lambda d: (d / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 1e400}'),
    "config not LORA": lambda d: _json_edit(d / "adapter_config.json", peft_type="PROMPT"),
    "config a list": lambda d: (d / "adapter_config.json").write_text("[1]"),
    "weights NaN": lambda d: _peft_tensors(d, lambda k, v: torch.full_like(v, float("nan"))),
    "weights float64 1e299": lambda d: _peft_tensors(d, lambda k, v: torch.full(v.shape, 1e299, dtype=torch.float64)),
    "weights int64": lambda d: _peft_tensors(d, lambda k, v: torch.ones(v.shape, dtype=torch.int64)),
    "weights bool": lambda d: _peft_tensors(d, lambda k, v: torch.ones(v.shape, dtype=torch.bool)),
    "weights A wrong rank": lambda d: _peft_tensors(d, lambda k, v: torch.zeros(7, v.shape[1]) if "lora_A" in k
                                                    else v),
    "weights B wrong rank": lambda d: _peft_tensors(d, lambda k, v: torch.zeros(v.shape[0], 7) if "lora_B" in k
                                                    else v),
    "weights foreign key": lambda d: _peft_tensors(d, None, extra={"evil.bias": torch.zeros(2)}),
    "weights B missing": lambda d: _peft_tensors(d, None, drop="lora_B"),
}


def _json_edit(f: Path, **kv: object) -> None:
    conf = json.loads(f.read_text())
    conf.update(kv)
    f.write_text(json.dumps(conf))


def _peft_tensors(d: Path, fn, extra: dict | None = None, drop: str = "") -> None:
    from safetensors.torch import load_file, save_file

    f = d / "adapter_model.safetensors"
    t = load_file(str(f))
    t = {k: (fn(k, v) if fn else v) for k, v in t.items() if not (drop and drop in k)}
    save_file({**t, **(extra or {})}, str(f))


@pytest.mark.parametrize("edit", sorted(PEFT_EDITS))
def test_peft_folder_tampered(peft_dir, tmp_path, edit):
    """A peft adapter folder whose config or weights are wrong: ``load_peft`` refuses it in one line naming the file,
    never a hang on a FIFO, never NaN, float64 or mis-shaped adapters handed on."""
    from fedmtl.models.peft_folder import load_peft

    PEFT_EDITS[edit](peft_dir)
    msg = expect_error(lambda: load_peft(peft_dir), what=f"peft folder, {edit}", fifo_roots=[tmp_path], seconds=10)
    assert str(peft_dir) in msg, msg


def test_a_good_peft_folder_loads(peft_dir):
    from fedmtl.models.peft_folder import load_peft

    got = load_peft(peft_dir)
    assert sorted(got) == ["fc.lora_A", "fc.lora_B"] and got["fc.lora_A"].shape == (2, 3)


# ------------------------------------------------------------------------------------------------ watch and compare
WATCH_VALUES = ["1e400", "-1e400", "NaN", "Infinity", "[1]", '{"a": 1}', "9" * 400, "-5", '"x"', "null", "true",
                "1e299"]


def _watch_line_is_sane(out: str, what: str) -> None:
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1, (what, out[:500])
    line = lines[0]
    assert not re.search(r"\b(nan|inf|infinity)\b", line.lower()), (what, line)
    assert len(line) <= 300, (what, line[:300])
    for n in re.findall(r"(?:round|dropped|excluded) (-?\d+)", line):
        assert 0 <= int(n) <= 10**7, (what, line)
    for pct in re.findall(r"(-?[\d.]+)%", line):
        assert 0 <= float(pct) <= 100, (what, line)


def _watch(run: Path, capsys, what: str, roots: list[Path]) -> None:
    code, out, err = run_cli(["watch", str(run), "--once"], capsys, 10, fifo_roots=roots)
    if code == 2:
        check_line(err, (), what)
        return
    assert code in (0, 1), (what, code, err[:300])
    _watch_line_is_sane(out, what)


@pytest.mark.parametrize("value", WATCH_VALUES)
@pytest.mark.parametrize("field", ["progress.json round", "progress.json seconds_per_round",
                                   "summary.json rounds", "summary.json final acc", "metrics.csv round",
                                   "metrics.csv acc", "metrics.csv dropped", "config.toml rounds"])
def test_watch_reads_tampered_values(run_dirs, tmp_path, capsys, field, value):
    """Values fedmtl watch reads (progress.json, summary.json, metrics.csv, config.toml) set to 1e400, NaN, Infinity,
    [1], a 400-digit number...: a sane status line (no nan or inf, a round within bounds) or one refusal line."""
    out = _copy(run_dirs, "mem", tmp_path)
    name, key = field.split(maxsplit=1)
    f = out / name
    if name == "progress.json":
        f.write_text(json.dumps({"round": 1, "rounds": 2, "seconds_per_round": 0.1}).replace(
            f'"{key}": ' + ("1" if key == "round" else "0.1"), f'"{key}": {value}'))
    elif name == "summary.json":
        s = json.loads(f.read_text())
        text = json.dumps(s)
        if key == "rounds":
            text = re.sub(r'"rounds": \d+', f'"rounds": {value}', text)
        else:
            text = re.sub(r'"seen_test_acc_mean": [^,}]+', f'"seen_test_acc_mean": {value}', text, count=1)
        f.write_text(text)
    elif name == "metrics.csv":
        rows = f.read_text().splitlines()
        header = rows[0].split(",")
        col = {"round": "round", "acc": "seen_test_acc_mean", "dropped": "dropped"}[key]
        i = header.index(col)
        cells = rows[-1].split(",")
        cells[i] = value.replace(",", ";")
        rows[-1] = ",".join(cells)
        f.write_text("\n".join(rows) + "\n")
        (out / "summary.json").unlink()  # watch reads the rows of a running run
    else:
        f.write_text(re.sub(r"rounds = \d+", f"rounds = {value}", f.read_text()))
        (out / "summary.json").unlink()
    _watch(out, capsys, f"{field} = {value[:20]}", [out])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["progress.json", "summary.json", "metrics.csv", "config.toml", ".lock"])
def test_watch_reads_files_of_every_kind(run_dirs, tmp_path, capsys, name, kind):
    out = _copy(run_dirs, "mem", tmp_path)
    f = out / name
    if not f.exists():
        f.write_text(f"{os.uname().nodename} 1\n")
    _kinds(f)[kind]()
    _watch(out, capsys, f"{name} {kind}", [out])


@pytest.mark.parametrize("lock", KINDS + ["pid of 20 digits", "one word", "pid -1"])
def test_resume_reads_a_lock_of_every_kind(run_dirs, tmp_path, capsys, lock):
    """A run directory's .lock that is a FIFO, a directory, 1 TB, /dev/zero, garbage or names a pid beyond any
    process id: the resume ends (refused in one line naming the directory, or run), never a hang or a traceback."""
    out = _copy(run_dirs, "mem", tmp_path)
    f = out / ".lock"
    f.write_text(f"{os.uname().nodename} 1\n")
    text = {"pid of 20 digits": f"{os.uname().nodename} {'9' * 20}", "one word": "x", "pid -1": "host -1"}.get(lock)
    if text is not None:
        f.write_text(text)
    else:
        _kinds(f)[lock]()
    argv = ["run", str(run_dirs["cfg"]), "--resume", "--out", str(out), "-q"]
    code, _, err = run_cli(argv, capsys, 20, fifo_roots=[out])
    assert code in (0, 2), (lock, code, err[:300])
    if code == 2:
        check_line(err, (str(out),), f".lock {lock}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["summary.json", "metrics.csv", "clients.csv"])
def test_compare_reads_files_of_every_kind(run_dirs, tmp_path, capsys, name, kind):
    """fedmtl compare over a run whose summary.json, metrics.csv or clients.csv is a FIFO, a directory, 1 TB,
    /dev/zero, truncated, empty or garbage: one line naming the file (exit 2), never a hang or a traceback."""
    out = _copy(run_dirs, "mem", tmp_path)
    _kinds(out / name)[kind]()
    argv = ["compare", str(out), "--out", str(tmp_path / "cmp")]
    code, _, err = run_cli(argv, capsys, 20, fifo_roots=[out])
    if code == 0 and name != "summary.json" and kind in ("truncated", "empty"):
        return  # a table from what is there
    assert code == 2, (name, kind, code, err[:300])
    check_line(err, (name,), f"compare, {name} {kind}")


@pytest.mark.parametrize("summary", ['{"final": {}, "seeds": [1], "runs": ["../../../etc"]}',
                                     '{"final": {}, "seeds": [1], "runs": [5]}',
                                     '{"final": {}, "seeds": [1], "runs": ["/dev/zero"]}',
                                     '{"final": {"seen_test_acc_mean": 1e400}}', '{"final": [1]}', "[1]"])
def test_compare_reads_tampered_summaries(run_dirs, tmp_path, capsys, summary):
    out = _copy(run_dirs, "mem", tmp_path)
    (out / "summary.json").write_text(summary)
    code, out_text, err = run_cli(["compare", str(out), "--out", str(tmp_path / "cmp")], capsys, 20)
    assert code in (0, 2), (summary, code, err[:300])
    if code == 2:
        check_line(err, ("summary.json",), summary)
    else:
        assert not re.search(r"\b(nan|inf)\b", (tmp_path / "cmp" / "compare.md").read_text().lower()), summary


# ------------------------------------------------------------------------------------------------ npz data directories
def _data_dir(tmp: Path) -> Path:
    d = tmp / "data"
    d.mkdir()
    (d / "dataset.json").write_text(json.dumps({"format": "fedmtl-npz/1", "num_classes": 3}))
    for k in (0, 1):
        np.savez(d / f"client_{k}.npz", x_train=np.ones((4, 2), np.float32), y_train=np.array([0, 1, 2, 0]),
                 x_test=np.ones((2, 2), np.float32), y_test=np.array([1, 2]))
    return d


def _npz(f: Path, **change: object) -> None:
    with np.load(f) as z:
        arrays = {k: z[k] for k in z.files}
    for k, v in change.items():
        if v is None:
            arrays.pop(k)
        else:
            arrays[k] = v
    np.savez(f, **arrays)


def _huge_header(d: Path) -> None:
    """Client 0's ``x_train`` header claims 10^12 rows over its few bytes of data (numpy would allocate 8 TB)."""
    import io
    import zipfile

    f = d / "client_0.npz"
    with np.load(f) as z:
        arrays = {k: z[k] for k in z.files}
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": "<f4", "fortran_order": False, "shape": (10**12, 2)})
    with zipfile.ZipFile(f, "w") as zf:
        for k, v in arrays.items():
            if k == "x_train":
                zf.writestr("x_train.npy", head.getvalue() + v.tobytes())
            else:
                buf = io.BytesIO()
                np.save(buf, v)
                zf.writestr(f"{k}.npy", buf.getvalue())


NPZ_EDITS: dict[str, Callable[[Path], None]] = {
    "header claims 10^12 rows": _huge_header,
    **{f"dataset.json {k}": _replaced("dataset.json", k) for k in KINDS},
    **{f"client npz {k}": _replaced("client_0.npz", k) for k in KINDS},
    "num_classes 10^12": lambda d: _json_edit(d / "dataset.json", num_classes=10**12),
    "num_classes bool": lambda d: _json_edit(d / "dataset.json", num_classes=True),
    "num_classes 1e400": lambda d: (d / "dataset.json").write_text('{"format": "fedmtl-npz/1", "num_classes": 1e400}'),
    "meta a list": lambda d: _json_edit(d / "dataset.json", meta=[1]),
    "object array": lambda d: np.savez(d / "client_0.npz", x_train=np.array([{"a": 1}] * 4, dtype=object),
                                       y_train=np.zeros(4, np.int64), x_test=np.zeros((0, 2)), y_test=np.zeros(0)),
    "labels float": lambda d: _npz(d / "client_0.npz", y_train=np.zeros(4)),
    "labels bool": lambda d: _npz(d / "client_0.npz", y_train=np.ones(4, bool)),
    "labels -1": lambda d: _npz(d / "client_0.npz", y_train=np.full(4, -1)),
    "labels = num_classes": lambda d: _npz(d / "client_0.npz", y_train=np.full(4, 3)),
    "labels 2-d": lambda d: _npz(d / "client_0.npz", y_train=np.zeros((4, 1), np.int64)),
    "features NaN": lambda d: _npz(d / "client_0.npz", x_train=np.full((4, 2), np.nan, np.float32)),
    "features float64 1e299": lambda d: _npz(d / "client_0.npz", x_train=np.full((4, 2), 1e299)),
    "features bool": lambda d: _npz(d / "client_0.npz", x_train=np.ones((4, 2), bool)),
    "features shape differs": lambda d: _npz(d / "client_0.npz", x_train=np.ones((4, 5), np.float32),
                                             x_test=np.ones((2, 5), np.float32)),
    "test shape differs": lambda d: _npz(d / "client_0.npz", x_test=np.ones((2, 7), np.float32)),
    "x and y lengths differ": lambda d: _npz(d / "client_0.npz", y_train=np.zeros(3, np.int64)),
    "no training examples": lambda d: _npz(d / "client_0.npz", x_train=np.zeros((0, 2), np.float32),
                                           y_train=np.zeros(0, np.int64)),
    "x_val without y_val": lambda d: _npz(d / "client_0.npz", x_val=np.ones((1, 2), np.float32)),
    "extra array": lambda d: _npz(d / "client_0.npz", evil=np.zeros(1)),
    "missing y_test": lambda d: _npz(d / "client_0.npz", y_test=None),
    "misnamed npz": lambda d: (d / "client_0.npz").rename(d / "client_x.npz"),
}


@pytest.mark.parametrize("edit", sorted(NPZ_EDITS))
def test_npz_data_dir_tampered(tmp_path, edit):
    """A node-local data directory whose description or client files are wrong: one line naming the file (a
    ``DataError``), never a hang, a pickle or nonsense data accepted."""
    from fedmtl.data.npz import load_dir

    d = _data_dir(tmp_path)
    NPZ_EDITS[edit](d)
    msg = expect_error(lambda: load_dir(d), what=f"data-dir, {edit}", fifo_roots=[tmp_path], seconds=10)
    assert str(d) in msg, msg


def test_a_good_npz_data_dir_loads(tmp_path):
    from fedmtl.data.npz import load_dir

    with bounded(10, what="good data-dir"):
        ids, data = load_dir(_data_dir(tmp_path))
    assert ids.tolist() == [0, 1] and data.seen.num_clients == 2
