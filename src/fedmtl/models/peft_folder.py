"""peft adapter folders: one client's LoRA adapters written as, and read back from, the files peft itself writes and
reads (``adapter_model.safetensors`` with ``base_model.model.<module>.lora_A.weight`` keys, plus
``adapter_config.json``).

``save_peft(params, cfg, out)`` writes a folder that ``peft.PeftModel.from_pretrained(base, out)`` loads.
``load_peft(path, prefix, module)`` reads one back as a fedmtl tree (``<module>.lora_A``, ``<module>.lora_B``, and
the weights of ``modules_to_save``).  A folder may come from anyone, so it is read defensively and refused, with a
``PeftFolderError`` (a ``ValueError``: one line on the command line, exit code 2) naming the file and the key, unless

* ``adapter_config.json`` is a regular file of at most 1 MiB holding a JSON object with ``peft_type = "LORA"``, an
  integer ``r`` in [1, 65536], a number ``lora_alpha`` in (0, 1e6], ``target_modules`` a list of names (or a
  string: peft's regular expression) or null, ``modules_to_save`` a list of names or null, and none of the LoRA
  variants fedmtl's ``LoRALinear`` does not compute (``use_dora``, ``use_rslora``, ``lora_bias``, per-module
  ``rank_pattern`` / ``alpha_pattern``);
* ``adapter_model.safetensors`` is a regular file (checked before it is opened: a FIFO never blocks the reader) no
  larger than the machine's memory, whose every key is ``base_model.model.<module>.lora_A.weight`` or
  ``...lora_B.weight`` (peft's adapter-name segment ``lora_A.default.weight`` accepted) of a module that
  ``target_modules`` names, or a weight of a module in ``modules_to_save``; every lora_A is a 2-d (r, in) and
  every lora_B a 2-d (out, r) floating-point matrix, in pairs, of finite values;
* with ``module`` (the adapted ``nn.Module``, a fedmtl ``Model``'s ``.module``): the keys are exactly the module's
  trainable parameters, each tensor has the parameter's shape (so r and the base layer's in and out features
  agree) and stays finite once converted to the parameter's dtype (``fedmtl.weights.conform``), and
  ``lora_alpha / r`` is the scale of the module's adapters.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ..files import read_text
from ..schema import brief
from ..weights import WeightsError, check_floating, conform, read_safetensors

if TYPE_CHECKING:
    from .lora import AdapterConfig

__all__ = ["CONFIG_FILE", "PEFT_PREFIX", "WEIGHTS_FILE", "PeftFolderError", "load_peft", "save_peft"]

PEFT_PREFIX = "base_model.model."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_LEAVES = ("lora_A", "lora_B")
_UNSUPPORTED = {"use_dora": "DoRA", "use_rslora": "rank-stabilized scaling (alpha / sqrt(r))",
                "lora_bias": "a bias on lora_B"}


class PeftFolderError(WeightsError):
    """A peft adapter folder that cannot be read as LoRA adapters (of a given module)."""


def save_peft(params: dict[str, Tensor], cfg: AdapterConfig, out: str | Path, base_name: str = "",
              strip: str = "") -> Path:
    """Write one client's adapters (``params``: its tree of A and B matrices) as a peft adapter folder:
    ``adapter_model.safetensors`` (keys ``base_model.model.<module>.lora_A.weight``) and ``adapter_config.json``,
    which ``peft.PeftModel.from_pretrained(base, out)`` loads.  ``strip``: a prefix of the tree's names that the peft
    model does not have (the attribute under which a wrapper module holds the Hugging Face model, e.g. ``"model."``)."""
    from safetensors.torch import save_file

    from ..files import atomic

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors, modules = {}, set()
    for k, v in params.items():
        k = k.removeprefix(strip)
        mod, _, leaf = k.rpartition(".")
        if leaf in _LEAVES:
            tensors[f"{PEFT_PREFIX}{mod}.{leaf}.weight"] = v.detach().cpu().contiguous()
            modules.add(mod.rpartition(".")[2])
        else:  # a module trained in full (peft's modules_to_save)
            tensors[f"{PEFT_PREFIX}{k}"] = v.detach().cpu().contiguous()
    save_file(tensors, str(out / WEIGHTS_FILE))
    conf = {"peft_type": "LORA", "task_type": None, "r": cfg.rank, "lora_alpha": cfg.alpha,
            "lora_dropout": cfg.dropout, "target_modules": sorted(cfg.target or modules), "bias": "none",
            "modules_to_save": list(cfg.train) or None, "base_model_name_or_path": base_name or None,
            "inference_mode": True, "fan_in_fan_out": False, "init_lora_weights": True}
    with atomic(out / CONFIG_FILE) as f:
        f.write(json.dumps(conf, indent=2))
    return out


def _names(conf: dict[str, Any], key: str, where: str, regex: bool) -> list[str] | str | None:
    v = conf.get(key)
    if v is None or (regex and isinstance(v, str) and v):
        return v
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise PeftFolderError(f"{where}: {key} must be a list of module names{', a string' if regex else ''} or "
                              f"null, got {brief(v)}")
    return v


def _read_config(path: Path) -> tuple[int, float, list[str] | str | None, list[str]]:
    """``adapter_config.json``'s r, lora_alpha, target_modules and modules_to_save, checked."""
    try:
        text = read_text(path, 1 << 20, "peft adapter config", PeftFolderError)
    except FileNotFoundError:
        raise PeftFolderError(f"{path}: no such file (a peft adapter folder holds {CONFIG_FILE} and "
                              f"{WEIGHTS_FILE})") from None
    except OSError as e:
        raise PeftFolderError(f"{path}: cannot be read ({e.strerror or e})") from None
    try:
        conf = json.loads(text)
    except ValueError as e:
        raise PeftFolderError(f"{path}: not JSON ({brief(str(e))})") from None
    if not isinstance(conf, dict):
        raise PeftFolderError(f"{path}: a peft adapter config must be a JSON object, got {type(conf).__name__}")
    if conf.get("peft_type") != "LORA":
        raise PeftFolderError(f"{path}: peft_type must be \"LORA\", got {brief(conf.get('peft_type'))}")
    r, alpha = conf.get("r"), conf.get("lora_alpha")
    if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= 1 << 16:
        raise PeftFolderError(f"{path}: r must be an integer in [1, 65536], got {brief(r)}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha) \
            or not 0 < alpha <= 1e6:
        raise PeftFolderError(f"{path}: lora_alpha must be a number in (0, 1e6], got {brief(alpha)}")
    for key, what in _UNSUPPORTED.items():
        if conf.get(key) not in (None, False):
            raise PeftFolderError(f"{path}: {key} = {brief(conf.get(key))}: {what} is not supported by fedmtl's "
                                  "LoRA layers")
    for key in ("rank_pattern", "alpha_pattern"):
        v = conf.get(key)
        if v not in (None, {}):
            raise PeftFolderError(f"{path}: {key} = {brief(v)}: per-module ranks and alphas are not supported "
                                  "(one r and one lora_alpha for every adapted layer)")
    target = _names(conf, "target_modules", str(path), regex=True)
    save = _names(conf, "modules_to_save", str(path), regex=False)
    assert not isinstance(save, str)
    return r, float(alpha), target, save or []


def _matches(name: str, targets: list[str]) -> bool:
    return any(name == t or name.endswith("." + t) for t in targets)


def _in_saved(name: str, saved: list[str]) -> bool:
    """Whether parameter ``name`` belongs to a module that ``modules_to_save`` names (peft's suffix rule)."""
    parts = name.split(".")
    return any(_matches(".".join(parts[:i]), saved) for i in range(1, len(parts)))


def _rename(key: str, where: str) -> tuple[str, str | None]:
    """A file key as a tree name (``<module>.lora_A``) and its LoRA leaf (None for a ``modules_to_save`` weight)."""
    if not key.startswith(PEFT_PREFIX):
        raise PeftFolderError(f"{where}: key {brief(key)} is foreign to a peft LoRA adapter (keys start with "
                              f"{PEFT_PREFIX!r})")
    k = key.removeprefix(PEFT_PREFIX)
    for leaf in _LEAVES:
        for suffix in (f".{leaf}.weight", f".{leaf}.default.weight"):
            if k.endswith(suffix) and len(k) > len(suffix):
                return k[: -len(suffix)] + "." + leaf, leaf
    return k, None


def load_peft(path: str | Path, prefix: str = "", module: nn.Module | None = None) -> dict[str, Tensor]:
    """A peft adapter folder (or its ``adapter_model.safetensors``, beside its ``adapter_config.json``) as a fedmtl
    tree: ``<module>.lora_A`` (r, in) and ``<module>.lora_B`` (out, r), plus the weights of ``modules_to_save``, each
    name after ``prefix`` (``save_peft``'s ``strip``).  With ``module`` (the adapted module the adapters are for, e.g.
    a fedmtl ``Model``'s ``.module``) the tree is checked against its trainable parameters and converted to their
    dtypes.  Every check is listed in the module docstring; a failure is a ``PeftFolderError`` naming the file and
    the key.  Without ``module`` the tensors come in torch's default dtype (float32), checked finite in it."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise PeftFolderError(f"{path}: no such peft adapter folder") from None
    except OSError as e:
        raise PeftFolderError(f"{path}: cannot be read ({e.strerror or e})") from None
    folder = path if stat.S_ISDIR(st.st_mode) else path.parent
    weights = path if not stat.S_ISDIR(st.st_mode) else path / WEIGHTS_FILE
    r, alpha, target, saved = _read_config(folder / CONFIG_FILE)
    stored = read_safetensors(weights, "peft adapter weights", PeftFolderError)
    out: dict[str, Tensor] = {}
    leaves: dict[str, dict[str, Tensor]] = {}
    for key, t in stored.items():
        where = f"{weights}: {brief(key, 160)}"  # (a name, cut only if absurdly long)
        name, leaf = _rename(key, str(weights))
        if leaf is None:
            if not _in_saved(name, saved):
                raise PeftFolderError(f"{where}: neither a LoRA matrix (...lora_A.weight, ...lora_B.weight) nor a "
                                      f"weight of a module in modules_to_save {brief(saved)}")
        else:
            mod = name.rpartition(".")[0]
            if isinstance(target, list) and not _matches(mod, target):
                raise PeftFolderError(f"{where}: module {brief(mod)} is not among {CONFIG_FILE}'s target_modules "
                                      f"{brief(target)}")
            if t.dim() != 2:
                raise PeftFolderError(f"{where}: {leaf} must be a 2-d matrix, got shape {brief(tuple(t.shape))}")
            rank = t.shape[0] if leaf == "lora_A" else t.shape[1]
            if rank != r:
                raise PeftFolderError(f"{where}: {leaf} of shape {tuple(t.shape)} has rank {rank}, but "
                                      f"{CONFIG_FILE} says r = {r}")
            leaves.setdefault(mod, {})[leaf] = t
        check_floating(t, where, PeftFolderError)
        if prefix + name in out:
            raise PeftFolderError(f"{where}: a second tensor for {brief(prefix + name)}")
        out[prefix + name] = t
    for mod, pair in leaves.items():
        if len(pair) != 2:
            have, = pair
            raise PeftFolderError(f"{weights}: module {brief(mod)} has {have} but no "
                                  f"{'lora_B' if have == 'lora_A' else 'lora_A'}")
    if not leaves:
        raise PeftFolderError(f"{weights}: no LoRA matrices (keys {PEFT_PREFIX}<module>.lora_A.weight)")
    if module is None:  # fedmtl's parameters are in the default dtype: values that overflow it are refused here
        like = torch.get_default_dtype()
        return {k: conform(v, v.new_empty(v.shape, dtype=like), f"{weights}: {brief(k)}", PeftFolderError)
                for k, v in out.items()}
    return _fit(out, module, weights, r, alpha)


def _fit(tree: dict[str, Tensor], module: nn.Module, weights: Path, r: int, alpha: float) -> dict[str, Tensor]:
    """``tree`` checked against ``module``'s trainable parameters and converted to their dtypes."""
    from .lora import LoRALinear

    own = dict(module.named_parameters())
    extra, missing = sorted(set(tree) - set(own)), sorted(set(own) - set(tree))
    if extra or missing:
        raise PeftFolderError(f"{weights}: does not fit {type(module).__name__}'s adapters: " + "; ".join(
            f"{w} {brief(v[:3])}{' ...' if len(v) > 3 else ''}" for w, v in
            (("unknown keys", extra), ("missing", missing)) if v) + " (is prefix right?)")
    scales = {m.scale for m in module.modules() if isinstance(m, LoRALinear)}
    for s in scales:
        if not math.isclose(s, alpha / r, rel_tol=1e-6):
            raise PeftFolderError(f"{weights.parent / CONFIG_FILE}: lora_alpha / r = {alpha:g} / {r} = "
                                  f"{alpha / r:g}, but {type(module).__name__}'s adapters scale by {s:g}")
    return {k: conform(v, own[k].detach(), f"{weights}: {brief(k)}", PeftFolderError) for k, v in tree.items()}
