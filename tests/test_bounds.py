"""Bad input gets a short, clear refusal and costs nothing: ranges, lists and sizes are checked before anything is
allocated from them; devices are checked as written; error lines echo values cut short and name types in words;
the advice after a refused resume or a refused write names a command that works and the user's real files."""

import re
import shlex
import shutil
import tracemalloc
from pathlib import Path

import pytest
import torch

from fedmtl import machine
from fedmtl.cli import main, parse_seeds
from fedmtl.config import ConfigError, load
from fedmtl.engine.spec import RunConfig

TINY = """
[data]
name = "fedem_synthetic"
num_clients = 6
dim = 8
n_test = 20
max_samples = 60
seed = 2

[model]
name = "linear"

[algorithm]
name = "fedavg"

[optim]
lr = 0.1

[run]
rounds = 2
batch_size = 16
eval_every = 2
checkpoint_every = 2
seed = 5
"""


@pytest.fixture
def cfg(tmp_path: Path) -> Path:
    p = tmp_path / "c.toml"
    p.write_text(TINY)
    return p


def one_line(err: str, limit: int = 1000) -> str:
    """The refusal: one line on stderr, no traceback, at most ``limit`` characters."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err[:2000]
    assert len(lines[0]) <= limit, lines[0][:2000]
    return lines[0]


def peak_bytes(fn) -> int:
    """The peak of Python allocations while ``fn()`` runs (its exception swallowed)."""
    tracemalloc.start()
    try:
        fn()
    except Exception:  # noqa: BLE001 (the refusal itself is checked by the caller)
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


# ---------------------------------------------------------------------------------------------- ranges


def test_seeds_ranges_are_bounded_before_any_list_is_built(cfg, tmp_path, capsys):
    assert parse_seeds("1-3, 7") == "1, 2, 3, 7"
    assert main(["run", str(cfg), "--seeds", "0-99999999999", "--out", str(tmp_path / "o")]) == 2
    line = one_line(capsys.readouterr().err)
    assert "--seeds" in line and "1000" in line and not (tmp_path / "o").exists()
    # three million seeds: refused without building them (that list alone is ~100 MB of Python objects)
    assert peak_bytes(lambda: parse_seeds("0-3000000")) < 10 * 2**20
    for bad in ("1-x", "-3", "5-2", "1e3", "", "9" * 30):
        with pytest.raises(ConfigError, match="--seeds"):
            parse_seeds(bad)


def test_a_node_partition_typo_is_refused_without_building_the_ids(cfg):
    from flwr.app import Context, RecordDict

    from fedmtl.flower.apps import NodeCache, node_of

    text = cfg.read_text()

    def query(node_config: dict) -> None:  # what every message to a node does first (a query, a train message)
        ctx = Context(run_id=1, node_id=1, node_config=node_config, state=RecordDict(), run_config={})
        node_of(NodeCache(), ctx, text, full=False)

    query({"partition-ids": "0-2"})  # the federation is built once here (its caches warm), then each typo:
    assert peak_bytes(lambda: query({"partition-ids": "0-3000000"})) < 20 * 2**20
    for nc, key in (({"partition-ids": "9-999999999"}, "partition-ids"), ({"partition-ids": "0-2,x"}, "partition-ids"),
                    ({"partition-id": "1e3"}, "partition-id"), ({"partition-id": 7}, "partition-id"),
                    ({"partition-id": 0, "num-partitions": 0}, "num-partitions"),
                    ({"partition-ids": "0-" + "9" * 5000}, "partition-ids")):
        with pytest.raises(ValueError, match=f"node config {key}") as e:
            query(nc)
        one_line(str(e.value), 300)


@pytest.mark.slow
def test_export_clients_range_checked_against_the_federation():
    from fedmtl.data.federated import DataError
    from fedmtl.data.npz import parse_range

    assert parse_range("3-4,0-1,1", 6) == [0, 1, 3, 4]
    assert peak_bytes(lambda: parse_range("0-5,0-5," * 20000, 6)) < 20 * 2**20
    with pytest.raises(DataError, match=r"--clients .*0-999999999999 is not a range within 0-5"):
        parse_range("0-999999999999", 6)


def test_a_sweep_counts_its_settings_before_building_them(cfg, tmp_path):
    from fedmtl.runs.sweep import run_sweep

    lrs = ",".join(f"0.{i:03d}" for i in range(1, 41))
    seeds = ",".join(str(i) for i in range(39)) + ",-1"  # the 40th value is invalid: found only by loading them all
    with pytest.raises(ConfigError, match=r"40 x 40 = 1600 settings to sweep; a sweep runs at most 1000"):
        run_sweep(cfg, [f"optim.lr={lrs}", f"run.seed={seeds}"], tmp_path / "s")
    assert not (tmp_path / "s").exists()


@pytest.mark.slow
def test_config_lists_are_bounded_before_their_items_are_read(cfg):
    with pytest.raises(ConfigError, match=r"\[optim\]\.lr_milestones: 100000 items; a config list holds at most") as e:
        load(cfg, ["optim.lr_milestones=[" + ",".join(["0.5"] * 100000) + "]"])
    one_line(str(e.value), 300)


# ---------------------------------------------------------------------------------------------- devices


@pytest.mark.parametrize("device", ["cuda:-1", "cuda:1e3", "cuda:" + "9" * 20, "cuda:0x1", "cpu:0", "CUDA", "cuda:",
                                    "cuda:01"])
def test_device_strings_are_checked_whole(device, cfg, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"run\.device must be 'cpu', 'cuda' or 'cuda:N'"):
        RunConfig(device=device)
    assert main(["run", str(cfg), "--device", device, "--out", str(tmp_path / "o")]) == 2
    line = one_line(capsys.readouterr().err)
    assert "run.device" in line and str(cfg) in line


def test_a_sweep_and_a_study_check_their_devices_before_any_output(cfg, tmp_path, monkeypatch, capsys):
    """A device the machine lacks, in any setting of a sweep or in a study's config: one line, exit 2, and no folder
    (a sweep left its first setting's empty folder behind; a study its database and a failed first trial)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["sweep", str(cfg), "--set", "run.device=cpu,cuda", "--out", str(tmp_path / "s"), "-q"]) == 2
    assert "no CUDA device" in one_line(capsys.readouterr().err)
    pytest.importorskip("optuna")
    space = tmp_path / "space.toml"
    space.write_text("[optim]\nlr = { low = 0.01, high = 1.0, log = true }\n")
    assert main(["tune", str(cfg), "--space", str(space), "--device", "cuda:0", "--out", str(tmp_path / "t")]) == 2
    assert "no CUDA device" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "s").exists() and not (tmp_path / "t").exists()


def test_a_flower_simulation_checks_its_device_before_starting(cfg, tmp_path, monkeypatch, capsys):
    """The simulated nodes compute on this machine: a CUDA device it lacks is one line and exit 2 (it was minutes of
    Ray workers failing, then a traceback); an app project may still name it (its nodes have the GPU)."""
    pytest.importorskip("flwr")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["flower", "simulate", str(cfg), "--device", "cuda", "--out", str(tmp_path / "f")]) == 2
    assert "no CUDA device" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "f").exists()
    assert main(["flower", "app", str(cfg), "--device", "cuda", "--out", str(tmp_path / "app")]) == 0
    text = "".join(f.read_text() for f in (tmp_path / "app").rglob("*.toml"))
    assert 'device = \\"cuda\\"' in text  # the app's config, a TOML string in its pyproject.toml


def test_a_gpu_index_is_checked_against_the_gpus_present(monkeypatch):
    for ok in ("cpu", "cuda", "cuda:0", "cuda:999"):
        assert RunConfig(device=ok).device == ok  # as written: valid on any machine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA device"):
        machine.torch_device("cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert machine.torch_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"run\.device = 'cuda:2' but this machine has 2 GPU\(s\): cuda:0 to cuda:1"):
        machine.torch_device("cuda:2")


# ---------------------------------------------------------------------------------------------- error lines


@pytest.mark.slow
def test_error_lines_echo_values_cut_short(cfg, capsys):
    huge = "x" * 900_000
    assert main(["run", str(cfg), "--set", f"algorithm.name={huge}"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "[algorithm].name" in line and "(900000 characters)" in line
    for override, key in ((f"run.{huge}=1", "unknown key"), (f"run.device={huge}", "run.device"),
                          ("data.num_clients=" + "9" * 4000, "num_clients"), (f"run.rounds='{huge}'", "rounds")):
        assert main(["run", str(cfg), "--set", override]) == 2
        assert key in one_line(capsys.readouterr().err)
    from fedmtl.schema import shown

    assert shown(list(range(10**5))).endswith("(100000 items)") and len(shown(list(range(10**5)))) < 120


def test_type_expectations_are_written_in_words(cfg):
    for override, want in (("model.hidden=[100001]", r"\[model\]\.hidden\[0\] must be in \[1, 10\^5\], got 100001"),
                           ("model.hidden=5", r"\[model\]\.hidden: expected a list of integers in \[1, 10\^5\], got "
                                              "int 5"),
                           ("model.hidden=['a']", r"\[model\]\.hidden\[0\]: expected an integer, got string 'a'"),
                           ("run.seeds=1", r"\[run\]\.seeds: expected a list of integers in \[0, 2\^63 - 1\]"),
                           ("optim.lr='big'", r"\[optim\]\.lr: expected a number, got string 'big'")):
        with pytest.raises(ConfigError, match=want) as e:
            load(cfg, ["model.name=mlp", override])
        assert not re.search(r"typing|Annotated|Range\(|list\[|tuple\[", str(e.value)), str(e.value)


def test_an_absurd_model_is_refused_before_it_is_allocated(cfg, tmp_path, monkeypatch, capsys):
    from fedmtl.models import build_model

    monkeypatch.setattr(machine, "physical_memory", lambda: 64 * 2**20)  # a 64 MiB machine
    with pytest.raises(ValueError, match=r"mlp with hidden = \[10000, 1000\] on 784 features: 1.79e\+07 parameters"):
        build_model("mlp", (784,), 10, hidden=[10000, 1000])  # 72 MB of weights: more than this machine allows
    assert peak_bytes(lambda: build_model("lstm", (80,), 80, hidden=100_000, layers=64)) < 2**20
    with pytest.raises(ValueError, match="lstm with embed = 8, hidden = 100000, layers = 64"):
        build_model("lstm", (80,), 80, hidden=100_000, layers=64)
    with pytest.raises(ValueError, match="char_transformer with d_model = 4096"):
        build_model("char_transformer", (80,), 80, d_model=4096, layers=64, mlp_ratio=16)
    assert main(["-q", "run", str(cfg), "--set", "model.name=mlp", "--set", "model.hidden=[10000,1000]", "--out",
                 str(tmp_path / "o")]) == 2
    assert "[model] mlp with hidden = [10000, 1000] on 8 features" in one_line(capsys.readouterr().err)


# ---------------------------------------------------------------------------------------------- advice


def advised(err: str) -> list[list[str]]:
    """The fedmtl commands an error line advises, as argument lists."""
    return [shlex.split(c)[1:] for c in re.findall(r"(fedmtl run [^()]*?)(?: \(|\)|$)", err.strip())]


@pytest.mark.slow
def test_a_swapped_checkpoint_gets_advice_that_works(cfg, tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["-q", "run", str(cfg), "--out", str(a)]) == 0
    assert main(["-q", "run", str(cfg), "--out", str(b), "--set", "run.seed=7"]) == 0
    shutil.copy(b / "checkpoint.pt", a / "checkpoint.pt")
    capsys.readouterr()
    assert main(["-q", "run", "--resume", "--out", str(a)]) == 2
    line = one_line(capsys.readouterr().err)
    commands = advised(line)
    assert commands and ["run", "--resume", "--out", str(a)] not in commands, line  # never the command that failed
    assert f"{a}/config.toml does not match {a}/checkpoint.pt" in line
    for args in commands:  # each advised command succeeds
        assert main(["-q", *args]) == 0, capsys.readouterr().err
    # a command whose config differs while the directory's own config fits its checkpoint: resume as it was
    assert main(["-q", "run", str(cfg), "--resume", "--out", str(b), "--set", "optim.lr=0.3"]) == 2
    commands = advised(one_line(capsys.readouterr().err))
    assert commands == [["run", "--resume", "--out", str(b)]] and main(["-q", *commands[0]]) == 0


@pytest.mark.slow
def test_an_edited_seed_folder_config_gets_advice_that_works(cfg, tmp_path, capsys):
    out = tmp_path / "s"
    assert main(["-q", "run", str(cfg), "--seeds", "1,2", "--out", str(out)]) == 0
    f = out / "seed-2" / "config.toml"
    f.write_text(f.read_text().replace("lr = 0.1", "lr = 0.2"))
    capsys.readouterr()
    assert main(["-q", "run", "--resume", "--out", str(out)]) == 2
    line = one_line(capsys.readouterr().err)
    commands = advised(line)
    assert commands and ["run", "--resume", "--out", str(out)] not in commands, line
    assert main(["-q", *commands[0]]) == 0


@pytest.mark.slow
def test_a_directory_in_place_of_a_result_file_is_named_not_its_temporary(cfg, tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["-q", "run", str(cfg), "--out", str(out)]) == 0
    (out / "metrics.csv").unlink()
    (out / "metrics.csv").mkdir()
    capsys.readouterr()
    assert main(["-q", "run", "--resume", "--out", str(out)]) == 2  # found before the run starts
    line = one_line(capsys.readouterr().err)
    assert f"{out}/metrics.csv is a directory" in line and "move it out of the way" in line and "--resume" not in line
    (out / "metrics.csv").rmdir()  # as advised: then the run resumes
    assert main(["-q", "run", "--resume", "--out", str(out)]) == 0
    # one that appears while the run runs: the write's error names the file, never the temporary written beside it
    from fedmtl.cli import written_file
    from fedmtl.files import atomic

    (out / "summary.json").unlink()
    (out / "summary.json").mkdir()
    with pytest.raises(OSError) as e, atomic(out / "summary.json") as f:
        f.write("{}")
    assert written_file(e.value) == out / "summary.json"
    assert written_file(OSError(28, "No space left", str(out / ".metrics.csv.ab12_xyz.tmp"))) == out / "metrics.csv"
    assert written_file(OSError(28, "No space left", str(out / ".checkpoint.pt.k2j4l5m6.tmp"))) == out / "checkpoint.pt"
    # a fresh directory holding such a directory: neither --resume nor --overwrite is advised (both would fail)
    fresh = tmp_path / "f"
    (fresh / "metrics.csv").mkdir(parents=True)
    assert main(["-q", "run", str(cfg), "--out", str(fresh)]) == 2
    line = one_line(capsys.readouterr().err)
    assert f"{fresh}/metrics.csv is a directory" in line and "--resume" not in line and "--overwrite" not in line


def test_results_without_a_checkpoint_are_not_advised_to_resume(cfg, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    assert main(["-q", "run", str(cfg), "--out", str(out)]) == 2
    line = one_line(capsys.readouterr().err)
    assert "--resume" not in line and "--overwrite" in line
    assert main(["-q", "run", str(cfg), "--out", str(out), "--overwrite"]) == 0


# ---------------------------------------------------------------------------------------------- Flower inputs


def test_simulation_resources_are_bounded():
    from fedmtl.flower.simulation import backend_config

    for cpus, per_node, gpus in ((10**9, 1.0, 0.0), (4, float("nan"), 0.0), (4, 1.0, float("nan")), (4, 1e12, 0.0)):
        with pytest.raises(ValueError, match="--cpus|--gpus"):
            backend_config(cpus, per_node, gpus)


def test_the_server_run_config_node_count_is_bounded():
    from fedmtl.flower.apps import server_options

    assert server_options({"fedmtl-num-nodes": "3"}).num_nodes == 3
    assert server_options({"fedmtl-num-nodes": 0}).num_nodes == 0
    for bad in ("9" * 30, "-1", 10**7, True, "x"):
        with pytest.raises(ValueError, match="fedmtl-num-nodes"):
            server_options({"fedmtl-num-nodes": bad})


def test_a_node_s_metadata_is_bounded_before_it_is_parsed():
    from fedmtl.flower.apps import NodeError, _sha, federation_of

    info = {"config_sha": _sha("c"), "feature_shape": [2], "feature_dtype": "float32", "num_classes": 2,
            "meta": "[" + "1," * (1 << 20) + "1]", "client_ids": [0], "train_counts": [3]}
    with pytest.raises(NodeError, match="unreadable dataset metadata: not a JSON text of at most") as e:
        federation_of({1: info}, "c")
    one_line(str(e.value), 300)


def test_a_node_state_file_larger_than_a_state_is_refused_unread(cfg, tmp_path, caplog):
    from flwr.app import Context, RecordDict

    from fedmtl.flower.apps import NodeCache, _local_clients, _restore, _sha, node_of

    text = cfg.read_text().replace('name = "fedavg"', 'name = "fedem"\nnum_components = 2')
    ctx = Context(run_id=1, node_id=1, node_config={"partition-ids": "0-1", "state-dir": str(tmp_path / "st")},
                  state=RecordDict(), run_config={})
    node = node_of(NodeCache(), ctx, text, full=False)
    lc, _ = _local_clients(node, {"num_clients": 6, "total_train": 300.0, "local_epochs": 1, "rounds": 2,
                                  "max_train": 60})
    sub = tmp_path / "st" / _sha(text)[:16]
    sub.mkdir(parents=True)
    with open(sub / "client0.r0.pt", "wb") as f:
        f.truncate(1 << 30)  # a sparse GiB where a state of a few hundred bytes belongs
    with caplog.at_level("WARNING", logger="fedmtl"):
        _restore(node, lc, ctx, text, 1)
    assert "client 0: ignoring unusable state file" in caplog.text and "1073741824 bytes; a client state file is " \
        "at most" in caplog.text
