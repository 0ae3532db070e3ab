"""An attack harness for experiments and tests (the ``[attack]`` table): a fixed set of malicious clients,
drawn once per run from the run's seed, that corrupt what they send.

Every attack below acts on *deviations* ``d = update - payload`` (where an update is not model-shaped, e.g. MOCHA's
dual steps, "payload" reads zero) and sends ``payload + (malicious deviation)``; ``strength`` is each attack's own
parameter, ``None`` (the default) its default:

* ``scale`` — ``payload + strength * d`` (model replacement / boosting; ``strength = -100`` is "minus a hundred
  times its update").  Default 1 (honest).
* ``signflip`` — ``payload - strength * d``.  Default 1.
* ``gaussian`` — ``payload + strength * N(0, I)``, ignoring its data (noise drawn from ``(seed, round)``).
  Default 1.
* ``labelflip`` — the client trains honestly on its training labels flipped ``y -> C - 1 - y`` (data poisoning;
  its update is then sent as is).  ``strength`` is unused.
* ``ipm`` — inner product manipulation (Xie, Koyejo, Gupta, "Fall of Empires: Breaking Byzantine-tolerant SGD by
  Inner Product Manipulation", UAI 2019): every attacker sends ``payload - strength * mean(d_h)``, ``d_h`` the
  round's honest deviations; ``strength`` is the paper's epsilon.  Default 0.1 (the paper's small epsilon, which
  Krum-type rules cannot tell from an honest update); epsilon 0.5 is the usual "large" setting.
* ``alie`` — "a little is enough" (Baruch, Baruch, Goldberg, "A Little Is Enough: Circumventing Defenses for
  Distributed Learning", NeurIPS 2019): every attacker sends, per coordinate, ``mean(d_h) - z * std(d_h)``.
  ``strength`` is z; by default z is the paper's ``z_max`` for the round's n valid updates and f attackers among
  them: ``s = floor(n / 2 + 1) - f`` honest "supporters" are needed, and z is the largest value with
  ``Phi(z) < (n - s) / n`` (Phi the standard normal CDF), i.e. ``z = Phi^-1((n - s) / n)``.
* ``minmax`` — AGR-agnostic min-max (Shejwalkar, Houmansadr, "Manipulating the Byzantine: Optimizing Model
  Poisoning Attacks and Defenses for Federated Learning", NDSS 2021): every attacker sends
  ``mean(d_h) + gamma * p`` with the paper's inverse-standard-deviation direction ``p = -std(d_h)``, gamma the
  largest value with ``max_i ||malicious - d_i|| <= strength * max_{i,j} ||d_i - d_j||`` over the honest
  deviations (distances over a client's whole update).  Default strength 1: the paper's constraint (the
  malicious update is no farther from any honest one than the two farthest honest ones are from each other).

Threat model of ``ipm``, ``alie`` and ``minmax``: the attackers are *omniscient* and collude — they see every
honest update of the round (the rows that are valid and not attackers') before sending, and all send the same
vector.  This is the standard setting of these papers' strongest variants (ALIE's paper also studies attackers
that estimate the statistics from their own updates; this harness gives them the exact honest ones).  Means and
standard deviations are unweighted (the papers' workers are equal) and the standard deviation is the population
one (divides by the number of honest rows).  A round with no honest valid row: these three attacks compute their
statistics from the attackers' own honest updates instead.

Attacks act on the update a client sends, never on its own state.  ``fraction`` of the seen clients (rounded) are
attackers; ``summary.json`` lists them under ``"attackers"``.

Each attack registers itself with ``fedmtl.register_attack`` (``labelflip`` too: its update is sent as trained, the
poisoning is ``flip_labels``), as a plugin's does: ``(AttackRound) -> what the attackers send``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from .. import tree as T
from ..data.federated import FederatedData
from ..registry import ATTACKS, RegistryError, register_checked
from ..schema import Annotated, OneOf, Range, brief, check_fields, shown
from ..tree import Tree
from .aggregators import misshapen, plugin_name


@dataclass(frozen=True)
class AttackConfig:
    """The ``[attack]`` table."""

    #: a registered attack (fedmtl.register_attack adds one)
    kind: Annotated[str, OneOf(ATTACKS, "fedmtl.register_attack")] = "none"
    fraction: Annotated[float, Range(0, 1)] = 0.0
    # each attack's own parameter (see the module's docstring); None = the attack's default
    strength: Annotated[float | None, Range(-1e6, 1e6)] = None

    def __post_init__(self) -> None:
        check_fields(self, "attack")
        if self.kind == "minmax" and self.strength is not None and self.strength <= 0:
            raise ValueError(f"attack.strength (minmax: the allowed distance, a multiple of the honest updates' "
                             f"largest pairwise distance) must be > 0, got {self.strength}")

    @property
    def active(self) -> bool:
        return self.kind != "none" and self.fraction > 0

    def attackers(self, num_clients: int, seed: int) -> Tensor:
        """The malicious clients (sorted ids), the same for the whole run."""
        if not self.active:
            return torch.zeros(0, dtype=torch.long)
        k = int(round(self.fraction * num_clients))
        rng = np.random.default_rng(np.random.SeedSequence([seed, 13]))
        return torch.from_numpy(np.sort(rng.choice(num_clients, size=k, replace=False))).long()


class AttackRound(NamedTuple):
    """What an attack sees of a round (a registered attack's one argument)."""

    updates: Tree  # (K, ...) every update of the round, as trained
    reference: Tree  # what they deviate from: the broadcast model (zeros where the updates are not model-shaped)
    attackers: Tensor  # (A,) long: the rows of the attackers' valid updates
    honest: Tensor  # (H,) long: the rows of the honest valid updates (what omniscient attackers see)
    strength: float | None  # attack.strength; None: the attack's own default
    generator: torch.Generator  # of the run's seed and the round: the attack's randomness

    def strength_or(self, default: float) -> float:
        return default if self.strength is None else self.strength


#: a registered attack: ``(AttackRound) -> what the attackers send`` (the updates' structure, A rows)
Attack = Callable[[AttackRound], Tree]


def alie_z(n: int, f: int) -> float:
    """ALIE's ``z_max`` for ``n`` updates of which ``f`` are the attackers': ``Phi^-1((n - s) / n)`` with
    ``s = floor(n / 2 + 1) - f`` (Baruch et al. 2019, section 3)."""
    s = math.floor(n / 2 + 1) - f
    p = (n - s) / n
    # deviation: the paper assumes f < n / 2 + 1 (s >= 1); with an attacker majority p >= 1 and z would be
    # infinite, so p is capped at 0.999 (z = 3.09)
    p = min(max(p, 0.5), 0.999)
    return NormalDist().inv_cdf(p)


def _deviations(updates: Tree, ref: Tree) -> list[Tensor]:
    """Per leaf, the rows' deviations from ``ref`` in float64."""
    return [x.double() - r.unsqueeze(0).double().to(x.device) for x, r in zip(T.leaves(updates), T.leaves(ref),
                                                                               strict=True)]


def _like(updates: Tree, new_leaves: list[Tensor]) -> Tree:
    """A tree shaped like ``updates`` holding ``new_leaves`` (in ``T.leaves`` order)."""
    it = iter(new_leaves)
    return T.tmap(lambda x: next(it) if isinstance(x, Tensor) else x, updates)


def _each_attacker(r: AttackRound, send: Callable[[Tensor, Tensor], Tensor]) -> Tree:
    """Per leaf, ``send(the attackers' rows, the reference as one row in their dtype)``."""
    new = [send(x.index_select(0, r.attackers.to(x.device)), ref.unsqueeze(0).to(x.dtype))
           for x, ref in zip(T.leaves(r.updates), T.leaves(r.reference), strict=True)]
    return _like(r.updates, new)


def _honest_deviations(r: AttackRound) -> list[Tensor]:
    """Per leaf (float64), the deviations of the rows omniscient attackers see: the honest valid ones, or with none,
    the attackers' own."""
    seen = r.honest if r.honest.numel() else r.attackers
    return [d.index_select(0, seen.to(d.device)) for d in _deviations(r.updates, r.reference)]


def _all_send(r: AttackRound, deviation: list[Tensor]) -> Tree:
    """Every attacker sends the reference plus the one malicious ``deviation`` (per leaf, float64)."""
    n = r.attackers.numel()
    new = [(ref.double().to(m.device) + m).unsqueeze(0).expand(n, *m.shape)
           for ref, m in zip(T.leaves(r.reference), deviation, strict=True)]
    return _like(r.updates, new)


def as_trained(r: AttackRound) -> Tree:
    """The attackers send their updates as trained (``none``; ``labelflip``, whose poison is in the data)."""
    return T.tmap(lambda x: x.index_select(0, r.attackers.to(x.device)), r.updates)


def scale(r: AttackRound) -> Tree:
    """``payload + strength * d`` (default strength 1)."""
    s = r.strength_or(1.0)
    return _each_attacker(r, lambda sel, base: base + s * (sel - base))


def signflip(r: AttackRound) -> Tree:
    """``payload - strength * d`` (default strength 1)."""
    s = r.strength_or(1.0)
    return _each_attacker(r, lambda sel, base: base - s * (sel - base))


def gaussian(r: AttackRound) -> Tree:
    """``payload + strength * N(0, I)`` (default strength 1), drawn leaf by leaf from the round's generator."""
    s = r.strength_or(1.0)

    def send(sel: Tensor, base: Tensor) -> Tensor:
        noise = torch.randn(sel.shape, generator=r.generator, dtype=torch.float64).to(sel.device, sel.dtype)
        return base + s * noise

    return _each_attacker(r, send)


def ipm(r: AttackRound) -> Tree:
    """Inner product manipulation: ``payload - epsilon * mean(d_h)`` (epsilon = strength, default 0.1)."""
    eps = r.strength_or(0.1)
    return _all_send(r, [-eps * h.mean(0) for h in _honest_deviations(r)])


def alie(r: AttackRound) -> Tree:
    """A little is enough: ``payload + mean(d_h) - z * std(d_h)`` (z = strength, default ``alie_z(n, f)``)."""
    hon = _honest_deviations(r)
    z = r.strength if r.strength is not None else alie_z(int(r.honest.numel() + r.attackers.numel()),
                                                         int(r.attackers.numel()))
    return _all_send(r, [h.mean(0) - z * h.std(0, correction=0) for h in hon])


def minmax(r: AttackRound) -> Tree:
    """AGR-agnostic min-max: ``payload + mean(d_h) - gamma * std(d_h)``, gamma the largest keeping the distance bound
    (strength, default 1; ``minmax_gamma``)."""
    hon = _honest_deviations(r)
    mean = [h.mean(0) for h in hon]
    std = [h.std(0, correction=0) for h in hon]
    flat = torch.cat([h.reshape(h.shape[0], -1) for h in hon], 1)
    mu = torch.cat([m.reshape(-1) for m in mean])
    p = -torch.cat([s.reshape(-1) for s in std])
    gamma = minmax_gamma(flat, mu, p, r.strength_or(1.0))
    return _all_send(r, [m + gamma * (-s) for m, s in zip(mean, std, strict=True)])


def minmax_gamma(honest: Tensor, mean: Tensor, direction: Tensor, bound: float = 1.0) -> float:
    """The largest ``gamma >= 0`` with ``max_i ||mean + gamma * direction - honest_i|| <= bound * D``, D the largest
    pairwise distance of the rows of ``honest`` (K, D).

    Deviation from the paper: it finds gamma by a binary search (from gamma_init, to a tolerance); here it is the
    exact solution.  ``||mean - h_i + gamma p||^2 = (bound D)^2`` is a quadratic in gamma whose positive root is the
    largest gamma allowed by row i, and the bound holds for every row up to the smallest of these roots (each row's
    distance is convex in gamma and within the bound at gamma = 0 when bound >= 1, ``mean`` being a convex
    combination of the rows).  0 when the direction is zero or no gamma > 0 is allowed."""
    h = honest.double()
    limit = bound * float(torch.cdist(h, h).max()) if h.shape[0] > 1 else 0.0
    p = direction.double()
    a = float(p.pow(2).sum())
    if a == 0.0:
        return 0.0
    c0 = mean.double().unsqueeze(0) - h  # (K, D): mean - h_i
    b = c0 @ p  # (K,)
    c = c0.pow(2).sum(1) - limit**2
    disc = (b * b - a * c).clamp_min(0.0)
    roots = (-b + disc.sqrt()) / a
    return max(0.0, float(roots.min()))


def corrupt(cfg: AttackConfig, updates: Tree, reference: Tree | None, rows: Tensor, seed: int,
            round_idx: int, honest: Tensor | None = None) -> Tree:
    """The updates with rows ``rows`` (positions of the round's attackers) replaced by what they send (the attack
    ``cfg.kind`` registered in ``fedmtl.registry.ATTACKS``).

    ``honest``: positions of the round's honest *valid* rows (what omniscient attackers see; default: every row
    not in ``rows``, which is right only when every row is valid)."""
    if rows.numel() == 0:
        return updates
    ref = reference if reference is not None else T.tmap(lambda x: torch.zeros_like(x[0]), updates)
    if honest is None:
        n_rows = T.leaves(updates)[0].shape[0]
        honest = torch.tensor([i for i in range(n_rows) if i not in set(rows.tolist())], dtype=torch.long)
    gen = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, round_idx, 14]).generate_state(1)[0]))
    attack: Attack = ATTACKS[cfg.kind]
    rnd = AttackRound(updates, ref, rows, honest, cfg.strength, gen)
    sent = attack(rnd) if BUILT_IN_ATTACKS.get(cfg.kind) is attack else checked_attack(cfg.kind, attack, rnd)
    out = T.tmap(lambda x: x.clone(), updates)
    for dst, new in zip(T.leaves(out), T.leaves(sent), strict=True):
        dst.index_copy_(0, rows.to(dst.device), new.to(dst.device, dst.dtype))
    return out


def checked_attack(name: str, attack: Attack, r: AttackRound) -> Tree:
    """What ``attack`` (a plugin's, registered as ``name``) sends in the round ``r``, checked: an exception it raises,
    or a result not shaped like the updates with one row per attacker, becomes a ``RegistryError`` naming the attack.
    ``register_attack`` checked it on one small round only; the built-ins are known to keep the contract.  Shapes
    only (no wait for a GPU): what it sends may be non-finite, screened as any update is."""
    what = plugin_name("attack.kind", name, attack)
    try:
        sent = attack(r)
    except Exception as e:
        raise RegistryError(f"{what} raised {type(e).__name__}: {brief(str(e), 200)}") from e
    wrong = misshapen(sent, r.updates, rows=int(r.attackers.numel()), dtype=False)
    if wrong is not None:
        raise RegistryError(f"{what} must return a tree like the updates with one row per attacker (here "
                            f"{r.attackers.numel()}): {wrong}")
    return sent


def check_attack(name: str, attack: Attack) -> None:
    """``register_attack``'s contract check (``RegistryError`` naming what broke): on a round of five distinct
    updates, two of them the attackers', ``attack`` returns two rows in the updates' structure and shapes and leaves
    its input as it was."""
    updates = {"w": torch.arange(30.0).reshape(5, 2, 3).sin(), "b": torch.arange(10.0).reshape(5, 2).cos()}
    reference = {"w": torch.zeros(2, 3), "b": torch.full((2,), 0.1)}
    given = T.tmap(lambda x: x.clone(), updates)
    what = f"register_attack({name!r}): {getattr(attack, '__name__', attack)!r}"
    rnd = AttackRound(updates, reference, torch.tensor([1, 3]), torch.tensor([0, 2, 4]), None,
                      torch.Generator().manual_seed(0))
    try:
        out = attack(rnd)
    except Exception as e:
        raise RegistryError(f"{what} raised {type(e).__name__}: {brief(str(e), 200)} on a round of five updates, two "
                            "of them the attackers'; it is called with one AttackRound") from e
    if not all(torch.equal(a, b) for a, b in zip(T.leaves(updates), T.leaves(given), strict=True)):
        raise RegistryError(f"{what} changed the round's updates; it must return what the attackers send instead")
    if misshapen(out, updates, rows=2, dtype=False) is not None:  # the updates' structure, one row per attacker
        raise RegistryError(f"{what} must return a tree like the updates with one row per attacker (here 2); it "
                            f"returned {shown(out, 200)}")


def flip_labels(data: FederatedData, attackers: Tensor) -> FederatedData:
    """``data`` with the training labels of the seen clients ``attackers`` flipped ``y -> C - 1 - y``."""
    tr = data.seen.train
    y = tr.y.clone()
    for k in attackers.tolist():
        a, b = int(tr.offsets[k]), int(tr.offsets[k + 1])
        y[a:b] = data.num_classes - 1 - y[a:b]
    seen = dataclasses.replace(data.seen, train=dataclasses.replace(tr, y=y))
    return dataclasses.replace(data, seen=seen)


def register_attack(name: str | Callable[..., Any] | None = None, *, replace: bool = False) -> Any:
    """Decorator for an attack ``(round: AttackRound) -> what the attackers send``, then usable as ``[attack] kind =
    "NAME"``: the ``AttackRound`` holds the round's updates (K, ...), the reference they deviate from (the broadcast
    model), the attackers' rows, the honest valid rows, ``[attack] strength`` (None: the attack's own default) and
    a generator of the run's seed and the round; the function returns a tree shaped like the updates with one row
    per attacker, which replaces the attackers' rows.  ``@register_attack`` uses the function's name.

    Checked when registered (``check_attack``; a refusal raises ``fedmtl.registry.RegistryError``): the signature,
    the name (taken names need ``replace=True``; ``none`` is never replaced), and on a small round it must return
    one row per attacker in the updates' structure without changing its input.  In a run what it sends is checked
    too (``checked_attack``): an exception it raises or a result of another structure or row count stops the run
    with a ``RegistryError`` naming it."""
    return register_checked(ATTACKS, "attack", name, replace, 1, "(round: AttackRound) -> sent updates", check_attack)


#: the built-in attacks, in the order they are listed; a new one is a function above and one line here
register_attack("none")(as_trained)
register_attack("scale")(scale)
register_attack("signflip")(signflip)
register_attack("gaussian")(gaussian)
register_attack("labelflip")(as_trained)
register_attack("ipm")(ipm)
register_attack("alie")(alie)
register_attack("minmax")(minmax)
#: the built-ins as registered here: trusted to keep the contract (a name a plugin replaced is the plugin's, checked)
BUILT_IN_ATTACKS: dict[str, Attack] = dict(ATTACKS)


__all__ = ["BUILT_IN_ATTACKS", "Attack", "AttackConfig", "AttackRound", "alie", "alie_z", "as_trained", "check_attack",
           "checked_attack", "corrupt", "flip_labels", "gaussian", "ipm", "minmax", "minmax_gamma", "register_attack",
           "scale", "signflip"]
