"""peft adapter folders read defensively (``fedmtl.models.peft_folder``): what ``save_peft`` writes reads back exactly
and real peft loads it; a broken or foreign folder (config, kind of file, keys, shapes, rank, dtype, values) is
refused with one ``ValueError`` naming the file and the key, never returned or left to hang."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from fedmtl.models.base import Model
from fedmtl.models.lora import AdapterConfig
from fedmtl.models.peft_folder import load_peft, save_peft

CFG = AdapterConfig(rank=2, alpha=4.0, target=("2", "4"))
W = "adapter_model.safetensors"
C = "adapter_config.json"


def _base() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


def _folder(tmp_path: Path, cfg: AdapterConfig = CFG) -> tuple[Path, Model, dict[str, torch.Tensor]]:
    model = Model.from_module(_base(), 3, adapters=cfg)
    params = {k: torch.randn_like(v) for k, v in model.init(0).items()}  # B non-zero: a trained adapter
    return save_peft(params, cfg, tmp_path / "adapter"), model, params


def _edit_config(folder: Path, **changes: object) -> None:
    conf = json.loads((folder / C).read_text())
    conf.update(changes)
    (folder / C).write_text(json.dumps(conf))


def _edit_weights(folder: Path, fn) -> None:
    state = load_file(str(folder / W))
    save_file(fn(state), str(folder / W))


def test_save_peft_round_trips_through_load_peft_with_and_without_the_module(tmp_path):
    folder, model, params = _folder(tmp_path)
    for module in (None, model.module):
        back = load_peft(folder, module=module)
        assert set(back) == set(params) and all(torch.equal(back[k], params[k]) for k in params)
    # the safetensors file itself, beside its config, reads the same
    assert set(load_peft(folder / W, module=model.module)) == set(params)
    # float64 adapters within float32's range are converted to the module's dtype
    _edit_weights(folder, lambda s: {k: v.double() for k, v in s.items()})
    back = load_peft(folder, module=model.module)
    assert all(back[k].dtype == torch.float32 and torch.allclose(back[k], params[k]) for k in params)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [CFG, AdapterConfig(rank=3, alpha=1.5, target=("2",), train=("4",))],
                         ids=["adapters", "modules_to_save"])
def test_what_save_peft_writes_real_peft_loads_and_predicts_alike(tmp_path, cfg):
    peft = pytest.importorskip("peft")
    folder, model, params = _folder(tmp_path, cfg)
    back = load_peft(folder, module=model.module)
    assert set(back) == set(params) and all(torch.equal(back[k], params[k]) for k in params)
    loaded = peft.PeftModel.from_pretrained(_base(), folder).eval()
    x = torch.randn(5, 6)
    with torch.no_grad():
        assert torch.allclose(model.apply(params, x), loaded(x), atol=1e-5)
        assert not torch.allclose(model.apply(params, x), model.apply(model.init(0), x), atol=1e-3)


def _bad_config(folder: Path, kind: str) -> str:
    """Damage ``folder``'s config as ``kind`` says; the words the refusal must contain."""
    conf = folder / C
    if kind == "garbage":
        conf.write_bytes(os.urandom(64) + b"{")
        return C
    if kind == "list":
        conf.write_text("[1, 2]")
        return "JSON object"
    if kind == "directory":
        conf.unlink()
        conf.mkdir()
        return "a directory"
    if kind == "missing":
        conf.unlink()
        return "no such file"
    if kind == "huge":
        conf.write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4.0, "pad": "x" * (2 << 20)}))
        return "at most"
    changes: dict[str, object] = {
        "rank": {"r": 3}, "r_bool": {"r": True}, "r_zero": {"r": 0}, "r_string": {"r": "2"},
        "alpha_negative": {"lora_alpha": -1.0}, "alpha_string": {"lora_alpha": "4"},
        "alpha_huge": {"lora_alpha": 1e300}, "targets": {"target_modules": [1, 2]},
        "targets_other": {"target_modules": ["q", "v"]}, "type": {"peft_type": "IA3"},
        "dora": {"use_dora": True}, "pattern": {"rank_pattern": {"2": 4}}, "save": {"modules_to_save": "0"},
    }[kind]
    _edit_config(folder, **changes)
    key = next(iter(changes))
    return {"rank": "r = 3", "targets_other": "target_modules ['q', 'v']", "type": "peft_type"}.get(kind, key)


@pytest.mark.parametrize("kind", ["garbage", "list", "directory", "missing", "huge", "rank", "r_bool", "r_zero",
                                  "r_string", "alpha_negative", "alpha_string", "alpha_huge", "targets",
                                  "targets_other", "type", "dora", "pattern", "save"])
def test_a_bad_adapter_config_is_refused_naming_file_and_key(tmp_path, kind):
    folder, model, _ = _folder(tmp_path)
    words = _bad_config(folder, kind)
    for module in (None, model.module):
        with pytest.raises(ValueError) as e:
            load_peft(folder, module=module)
        msg = str(e.value)
        assert C in msg and words in msg and "\n" not in msg, msg
        assert len(msg) < 400, msg  # values quoted are cut short


def _nan(s):
    return {k: v.fill_(float("nan")) if k.endswith("4.lora_B.weight") else v for k, v in s.items()}


WEIGHTS = {  # damage to adapter_model.safetensors: (edit, words in the refusal, checked with the module only)
    "nan": (_nan, "NaN or Inf", False),
    "3d": (lambda s: {k: v[None] if "2.lora_A" in k else v for k, v in s.items()}, "2-d", False),
    "foreign": (lambda s: {**s, "base_model.model.0.weight": torch.zeros(8, 6)}, "modules_to_save", False),
    "unprefixed": (lambda s: {**s, "evil": torch.zeros(1)}, "foreign", False),
    "long_key": (lambda s: {**s, "evil" * 5000: torch.zeros(1)}, "... is foreign", False),
    "unpaired": (lambda s: {k: v for k, v in s.items() if "4.lora_B" not in k}, "no lora_B", False),
    "int": (lambda s: {k: v.to(torch.int64) if "2.lora_B" in k else v for k, v in s.items()}, "int64", False),
    "bool": (lambda s: {k: v > 0 if "2.lora_B" in k else v for k, v in s.items()}, "torch.bool", False),
    "overflow": (lambda s: {k: v.double() * 1e299 for k, v in s.items()}, "beyond the range of torch.float32", False),
    "in_features": (lambda s: {k: torch.ones(2, 5) if "2.lora_A" in k else v for k, v in s.items()}, "shape", True),
    "missing_layer": (lambda s: {k: v for k, v in s.items() if ".4." not in k}, "missing", True),
}


@pytest.mark.parametrize("kind", list(WEIGHTS))
def test_bad_adapter_weights_are_refused_naming_file_and_key(tmp_path, kind):
    folder, model, _ = _folder(tmp_path)
    edit, words, module_only = WEIGHTS[kind]
    _edit_weights(folder, edit)
    if module_only:
        load_peft(folder)  # nothing to compare with: what can be checked holds
    with pytest.raises(ValueError) as e:
        load_peft(folder, module=model.module)
    msg = str(e.value)
    assert W in msg and words in msg and "\n" not in msg and len(msg) < 600, msg
    if kind not in ("unpaired", "missing_layer"):
        assert "lora" in msg or "evil" in msg or "0.weight" in msg, msg  # the key is named


def test_alpha_that_does_not_match_the_modules_scale_is_refused(tmp_path):
    folder, model, _ = _folder(tmp_path)
    _edit_config(folder, lora_alpha=8.0)
    load_peft(folder)  # a consistent folder on its own
    with pytest.raises(ValueError, match="lora_alpha / r = 8 / 2 = 4, but Sequential's adapters scale by 2"):
        load_peft(folder, module=model.module)


@pytest.mark.parametrize("kind", ["fifo", "directory", "missing", "truncated", "garbage"])
def test_a_weights_file_that_is_not_a_regular_safetensors_file_is_refused_without_hanging(tmp_path, kind):
    folder, model, _ = _folder(tmp_path)
    w = folder / W
    if kind == "truncated":
        w.write_bytes(w.read_bytes()[:100])
    elif kind == "garbage":
        w.write_bytes(os.urandom(200))
    else:
        w.unlink()
        if kind == "fifo":
            os.mkfifo(w)
        elif kind == "directory":
            w.mkdir()
    got: list[BaseException | None] = []

    def read() -> None:
        try:
            load_peft(folder, module=model.module)
            got.append(None)
        except BaseException as e:  # noqa: BLE001 (reported below)
            got.append(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(20)
    if t.is_alive():  # unblock the reader (a writer opening the FIFO), then fail
        with open(w, "wb"):
            pass
        pytest.fail("load_peft blocked on a FIFO")
    assert isinstance(got[0], ValueError), got
    msg = str(got[0])
    assert W in msg and "\n" not in msg
    assert {"fifo": "FIFO", "directory": "directory", "missing": "no such file"}.get(kind, "not a readable") in msg
