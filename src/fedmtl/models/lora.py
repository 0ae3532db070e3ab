"""Low-rank adapters (LoRA; Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", ICLR 2022) as a model
transform: the base model is frozen and shared, the adapters are what each client trains and sends.

``apply_adapters(module, AdapterConfig(rank=8, alpha=16, target=("q", "v")))`` returns a copy of ``module`` in which

* every targeted ``nn.Linear`` (all of them when ``target`` is empty; else those whose qualified name equals a
  target or ends with ``"." + target``, peft's rule) becomes a ``LoRALinear``: ``y = x W^T + b + (alpha / r)
  x A^T B^T`` with the base ``W``, ``b`` frozen and ``A`` (r, in), ``B`` (out, r) trainable; ``B`` starts at zero
  (the adapted model starts as the base model), ``A`` Kaiming-uniform (peft's default initialisation);
* every other parameter becomes a *buffer* (frozen), except those of the modules named in ``train`` (e.g. a new
  classifier head), which stay trainable.

fedmtl trains, stacks across clients, aggregates, checkpoints and sends exactly a model's parameters, so after the
transform all of that holds the adapters (and ``train`` modules) only: the base is one set of buffers shared by every
client -- under ``vmap`` a closed-over constant, one product for all clients' rows -- never copied per client and
never communicated.  ``Model.from_module(module, num_classes, adapters=...)`` and the ``[model.adapters]`` table
apply it; a ``peft.LoraConfig`` is accepted as the spec (``AdapterConfig.of``).

The adapters of one client export to, and import from, the ``safetensors`` files peft reads and writes
(``adapter_model.safetensors`` with ``base_model.model.<module>.lora_A.weight`` keys, plus ``adapter_config.json``):
``save_peft`` / ``load_peft`` in ``fedmtl.models.peft_folder``, which checks a folder before anything of it is used.

Dropout on the adapters' input (``lora_dropout``) is not supported: it draws per-example randomness inside the
clients' vectorized step, which ``torch.func.vmap`` refuses; a spec with dropout > 0 is refused by name.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..schema import Annotated, Range, check_fields, shown


@dataclass(frozen=True)
class AdapterConfig:
    """The ``[model.adapters]`` table."""

    #: the adapters' rank r
    rank: Annotated[int, Range(1, 1 << 16)] = 8
    #: the scale numerator: the adapters' output is multiplied by alpha / r
    alpha: Annotated[float, Range(0, 1e6, lo_open=True)] = 16.0
    #: dropout on the adapters' input (only 0: see fedmtl.models.lora)
    dropout: Annotated[float, Range(0, 1, hi_open=True)] = 0.0
    #: the Linear layers to adapt: qualified names or name suffixes (peft's target_modules); empty = every Linear
    target: tuple[str, ...] = ()
    #: modules trained in full beside the adapters (peft's modules_to_save, e.g. a new classifier head)
    train: tuple[str, ...] = ()
    #: a safetensors file of the base model's weights (its state_dict), loaded before the adapters are added
    base: str = ""
    #: without a base file, a config's base model is drawn from its initializer with this seed (every node and every
    #: run draws the same base)
    base_seed: Annotated[int, Range(0, 2**63 - 1)] = 0

    def __post_init__(self) -> None:
        check_fields(self, "model.adapters")
        if self.dropout:
            raise ValueError(f"model.adapters.dropout = {self.dropout}: dropout on the adapters is not supported (it "
                             "draws randomness inside the clients' vectorized step, which vmap refuses); use 0")
        object.__setattr__(self, "target", tuple(self.target))
        object.__setattr__(self, "train", tuple(self.train))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def of(cls, spec: Any) -> AdapterConfig:
        """An ``AdapterConfig``, a dict of its fields, or a ``peft.LoraConfig`` (its ``r``, ``lora_alpha``,
        ``lora_dropout``, ``target_modules`` and ``modules_to_save``)."""
        if isinstance(spec, cls):
            return spec
        if isinstance(spec, dict):
            unknown = sorted(set(spec) - {f for f in cls.__dataclass_fields__})
            if unknown:
                raise ValueError(f"model.adapters: unknown key(s) {unknown}; keys: {list(cls.__dataclass_fields__)}")
            return cls(**spec)
        if type(spec).__name__ == "LoraConfig" and hasattr(spec, "r"):
            targets = spec.target_modules
            if isinstance(targets, str):
                raise ValueError("model.adapters: a LoraConfig whose target_modules is a regular expression is not "
                                 "supported; give the module names as a list")
            return cls(rank=int(spec.r), alpha=float(spec.lora_alpha), dropout=float(spec.lora_dropout),
                       target=tuple(sorted(targets or ())), train=tuple(spec.modules_to_save or ()))
        raise TypeError(f"adapters must be an AdapterConfig, a dict or a peft.LoraConfig, got {type(spec).__name__}")


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` (its weight and bias as buffers) plus a trainable low-rank update ``B A``."""

    weight: Tensor
    bias: Tensor | None

    def __init__(self, base: nn.Linear, rank: int, scale: float):
        super().__init__()
        self.in_features, self.out_features, self.scale = base.in_features, base.out_features, float(scale)
        self.register_buffer("weight", base.weight.detach().clone())
        self.register_buffer("bias", None if base.bias is None else base.bias.detach().clone())
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, dtype=base.weight.dtype))
        self.lora_B = nn.Parameter(torch.empty(base.out_features, rank, dtype=base.weight.dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """peft's default: A Kaiming-uniform (a = sqrt(5), as nn.Linear's weight), B zero."""
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias) + self.scale * F.linear(F.linear(x, self.lora_A), self.lora_B)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.lora_A.shape[0]}, scale={self.scale:g}"


def _matches(name: str, targets: tuple[str, ...]) -> bool:
    return not targets or any(name == t or name.endswith("." + t) for t in targets)


def _freeze(module: nn.Module) -> None:
    """Every parameter of ``module`` (its own, not its children's) becomes a buffer of the same name."""
    for pname, p in list(module._parameters.items()):
        del module._parameters[pname]
        module.register_buffer(pname, None if p is None else p.detach())


def apply_adapters(module: nn.Module, cfg: AdapterConfig) -> nn.Module:
    """A copy of ``module`` with ``cfg``'s adapters (see the module docstring); ``cfg.base`` loaded first."""
    out = copy.deepcopy(module)
    if cfg.base:
        load_base(out, cfg.base)
    linears = {n: m for n, m in out.named_modules() if isinstance(m, nn.Linear) and _matches(n, cfg.target)}
    if not linears:
        have = [n for n, m in out.named_modules() if isinstance(m, nn.Linear)]
        raise ValueError(f"model.adapters: target {shown(list(cfg.target))} names no Linear layer of "
                         f"{type(module).__name__} (its Linear layers: {shown(have)})")
    trained = [n for n, _ in out.named_modules() if n and any(n == t or n.endswith("." + t) for t in cfg.train)]
    missing = [t for t in cfg.train if not any(n == t or n.endswith("." + t) for n in trained)]
    if missing:
        raise ValueError(f"model.adapters: train names {shown(missing)}, no module of {type(module).__name__}")
    for name, lin in linears.items():
        if any(name == t or name.startswith(t + ".") for t in trained):
            continue  # trained in full: not adapted
        parent_name, _, child = name.rpartition(".")
        parent = out.get_submodule(parent_name) if parent_name else out
        setattr(parent, child, LoRALinear(lin, cfg.rank, cfg.scale))
    keep = {id(m) for t in trained for m in out.get_submodule(t).modules()}
    for m in out.modules():
        if not isinstance(m, LoRALinear) and id(m) not in keep:
            _freeze(m)
    return out


def adapter_names(module: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The parameter names of the adapters' A and B matrices in ``module``, in module order."""
    a = tuple(f"{n}.lora_A" for n, m in module.named_modules() if isinstance(m, LoRALinear))
    return a, tuple(x[:-1] + "B" for x in a)


def seeded_base(module: nn.Module, seed: int) -> None:
    """Draw ``module``'s weights afresh from its own initializers under ``seed`` (the global generator untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for m in module.modules():
            reset = getattr(m, "reset_parameters", None)
            if reset is not None:
                reset()


def base_digest(module: nn.Module) -> str:
    """SHA-256 of an adapted module's frozen base (every buffer: name, dtype, shape and bytes).  A checkpoint keeps
    it, so a run is never resumed over other base weights (the base is not in the checkpoint: only the adapters
    are trained)."""
    import hashlib

    h = hashlib.sha256()
    for name, b in sorted(module.named_buffers(), key=lambda kv: kv[0]):
        t = b.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def load_base(module: nn.Module, path: str | Path, key: str = "model.adapters.base") -> None:
    """Load a safetensors file of ``module``'s state_dict (the base weights: no pickle, tensors only); every key
    must be one of the module's and every parameter and buffer must be given (``key``: the config key named in
    errors).  The file's kind and size are checked before it is opened, and every tensor's dtype kind, shape and
    values after conversion to the module's dtype (``fedmtl.weights.conform``): a ``WeightsError`` names the file
    and the tensor."""
    from ..schema import brief
    from ..weights import WeightsError, conform, read_safetensors

    path = Path(path)
    state = read_safetensors(path, key)
    own = module.state_dict()
    extra, missing = sorted(set(state) - set(own)), sorted(set(own) - set(state))
    if extra or missing:
        raise WeightsError(f"{key}: {path} does not fit {type(module).__name__}: "
                           + "; ".join(f"{w} {brief(v[:4])}{' ...' if len(v) > 4 else ''}"
                                       for w, v in (("unknown keys", extra), ("missing", missing)) if v))
    module.load_state_dict({k: conform(v, own[k], f"{key}: {path}: tensor {k!r}") for k, v in state.items()})


__all__ = ["AdapterConfig", "LoRALinear", "adapter_names", "apply_adapters", "base_digest", "load_base", "seeded_base"]
