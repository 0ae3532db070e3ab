"""Robust aggregation (the ``[robust]`` table): how a round's client updates are combined, for any algorithm
whose server averages updates (FedAvg and its variants, FedEM's M components, Clustered FL's clusters, ...).

* ``mean`` — the algorithm's own weighted mean (weights n_k): the default, bit-for-bit the plain run.
* ``median`` — coordinate-wise median of the valid updates (Yin, Chen, Ramchandran, Bartlett, "Byzantine-
  robust distributed learning: towards optimal statistical rates", ICML 2018); for an even count the mean of
  the two middle values.
* ``trimmed_mean`` — coordinate-wise beta-trimmed mean (same paper): per coordinate, the ``floor(trim * K)``
  largest and smallest values are dropped and the rest averaged (unweighted).
* ``krum`` / ``multi_krum`` — Krum (Blanchard, El Mhamdi, Guerraoui, Stainer, "Machine learning with
  adversaries: Byzantine tolerant gradient descent", NeurIPS 2017): each update's score is the sum of squared
  distances to its ``K - f - 2`` nearest other updates (f = ``num_byzantine``); Krum returns the update of least
  score, multi-Krum (same paper, section 4) averages the ``multi_krum_m`` updates of least score (default
  ``K - f``), weighted by n_k as FedAvg would.  Distances are over a client's whole update (all of FedEM's
  components together).  With fewer than ``2f + 3`` valid updates the neighbour count is clamped to 1 (logged).
* ``clip_norm`` (> 0) — each update's deviation from the round's payload (from zero where the update is not
  model-shaped, e.g. MOCHA's dual steps) is scaled down to L2 norm at most ``clip_norm`` before combining.
* ``bulyan`` — Bulyan (El Mhamdi, Guerraoui, Rouault, "The Hidden Vulnerability of Distributed Learning in
  Byzantium", ICML 2018) over K valid updates with f = ``num_byzantine``: ``theta = K - 2f`` updates are selected
  by repeated Krum (Krum with f on the updates not yet selected, its choice moved to the selection), then per
  coordinate the ``beta = theta - 2f`` selected values closest to the selection's coordinate-wise median are
  averaged (unweighted).  It needs ``K >= 4f + 3``: the engine refuses a run whose rounds have fewer updates than
  that (after bucketing); a round that falls below it (failed or excluded clients) uses the largest f it can,
  ``floor((K - 3) / 4)`` (logged).
* ``centered_clip`` — centered clipping (Karimireddy, He, Jaggi, "Learning from History for Byzantine Robust
  Optimization", ICML 2021): from a centre v, ``cc_iterations`` times ``v <- v + sum_i w_i clip_tau(x_i - v) /
  sum_i w_i`` with ``clip_tau(d) = d * min(1, tau / ||d||)`` (distances over a client's whole update).  The
  paper starts from the previous round's aggregate (momentum) and weights the workers equally; here v starts at
  the coordinate-wise median of the round's valid updates (no state across rounds, so a resumed run repeats an
  uninterrupted one and the rule is a function of the round's updates) and the weights are FedAvg's n_k (with
  ``tau`` infinite it is the ``mean``, equal up to rounding).  ``cc_tau`` > 0 fixes tau; 0 (default) sets
  it automatically per call to the median distance of the valid updates from the starting centre, a scale the
  honest majority sets (the paper's tau is a constant tuned to the honest spread).
* ``bucketing = s`` (> 1; Karimireddy, He, Jaggi, "Byzantine-Robust Learning on Heterogeneous Datasets via
  Bucketing", ICLR 2022) in front of any aggregator: the K valid updates are randomly permuted, cut into
  ``ceil(K / s)`` buckets of s consecutive ones (the last may be smaller), each bucket averaged, and the aggregator
  applied to the bucket means.  The permutation comes from a generator of the run's seed and the round
  (``round_generator(seed, round, 15)``), so runs are reproducible and resumes exact.  Deviation from the paper
  (plain averages): a bucket's mean is weighted by n_k and carries the bucket's total weight, so that bucketing in
  front of ``mean`` is FedAvg's weighted mean and the weighted rules (``mean``, ``multi_krum``,
  ``centered_clip``) keep FedAvg's weights; the unweighted rules ignore them as without bucketing.

Only rows with positive weight take part: excluded (non-finite) and failed updates never reach a combiner.

Each aggregator registers itself with ``fedmtl.register_aggregator`` (one line at the end of this module), as a
plugin's does: ``(updates, weights, config) -> update``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from .. import tree as T
from ..registry import AGGREGATORS, RegistryError, register_checked
from ..schema import Annotated, OneOf, Range, brief, check_fields, shown
from ..tree import Tree, TreeT

log = logging.getLogger("fedmtl")

Combine = T.Combine
#: a registered aggregator: ``(updates (K, ...), weights (K,), config) -> one update``
Aggregator = Callable[[Tree, Tensor, "RobustConfig"], Tree]
#: the stream of ``round_generator(seed, round, stream)`` that bucketing's permutations come from
BUCKETING_STREAM = 15


@dataclass(frozen=True)
class RobustConfig:
    """The ``[robust]`` table."""

    #: a registered aggregator (fedmtl.register_aggregator adds one)
    aggregator: Annotated[str, OneOf(AGGREGATORS, "fedmtl.register_aggregator")] = "mean"
    trim: Annotated[float, Range(0, 0.5, hi_open=True)] = 0.1  # trimmed_mean: fraction cut at each end
    num_byzantine: Annotated[int, Range(0, 10**6)] = 0  # krum / multi_krum / bulyan: f, the attackers tolerated
    multi_krum_m: Annotated[int, Range(0, 10**6)] = 0  # multi_krum: updates averaged (0 = K - f)
    clip_norm: Annotated[float, Range(0)] = 0.0  # 0 = off
    bucketing: Annotated[int, Range(0, 1000)] = 0  # s > 1: average random buckets of s first; 0 or 1 = off
    cc_tau: Annotated[float, Range(0)] = 0.0  # centered_clip: clipping radius (0 = automatic, per round)
    cc_iterations: Annotated[int, Range(1, 100)] = 3  # centered_clip: clipping iterations

    def __post_init__(self) -> None:
        check_fields(self, "robust")

    @property
    def is_plain(self) -> bool:
        return self.aggregator == "mean" and self.clip_norm == 0 and self.bucketing <= 1

    def inputs_per_round(self, updates: int) -> int:
        """How many rows the aggregator sees when a round has ``updates`` valid updates (buckets, if any)."""
        return -(-updates // self.bucketing) if self.bucketing > 1 else updates

    def combiner(self, generator: torch.Generator | None = None) -> Combine:
        """``combine(stacked updates (K, ...), weights (K,)) -> one update``.  ``generator``: where bucketing's
        permutations come from (one per round: ``round_generator(seed, round, BUCKETING_STREAM)``); None draws
        every call's permutation from a fresh generator seeded 0."""
        base = self._base()
        if self.bucketing <= 1:
            return base
        s = self.bucketing

        def bucketed_combine(u: TreeT, w: Tensor) -> TreeT:
            gen = generator if generator is not None else torch.Generator().manual_seed(0)
            return bucketed(u, w, s, base, gen)

        return bucketed_combine

    def _base(self) -> Combine:
        aggregate: Aggregator = AGGREGATORS[self.aggregator]
        if BUILT_IN_AGGREGATORS.get(self.aggregator) is not aggregate:  # a plugin's: its every result is checked
            return checked_combine(self.aggregator, aggregate, self)

        def combine(u: TreeT, w: Tensor) -> TreeT:
            return cast(TreeT, aggregate(u, w, self))

        return combine


def plugin_name(table_key: str, name: str, fn: Callable[..., Any]) -> str:
    """A registered plugin in words for an error message: its config key and value and where its function lives."""
    where = f"{getattr(fn, '__module__', None) or '?'}.{getattr(fn, '__qualname__', type(fn).__name__)}"
    return f"{table_key} {brief(name, 80)!r} (the plugin {brief(where, 120)})"


def misshapen(out: object, like: Tree, rows: int | None = None, dtype: bool = True) -> str | None:
    """What in ``out`` is not shaped like one row of the stacked tree ``like`` (``rows``: like ``rows`` of its rows),
    in words: its structure, then each tensor leaf's shape (and, with ``dtype``, its dtype); None where nothing is.
    Metadata only: it never waits for a GPU."""
    problems: list[str] = []

    def leaf(path: pytree.KeyPath, x: object, o: object) -> object:
        if isinstance(x, Tensor) and not problems:
            at = pytree.keystr(path) or "the update"
            want = tuple(x.shape[1:]) if rows is None else (rows, *x.shape[1:])
            if not isinstance(o, Tensor):
                problems.append(f"{at} is {brief(type(o).__name__, 60)}, not a tensor")
            elif tuple(o.shape) != want:
                problems.append(f"{at} has shape {tuple(o.shape)}, expected {want}")
            elif dtype and o.dtype != x.dtype:
                problems.append(f"{at} has dtype {o.dtype}, expected {x.dtype}")
        return o

    try:
        pytree.tree_map_with_path(leaf, like, out)
    except Exception as e:  # noqa: BLE001 (pytree's refusal: another structure)
        return f"{shown(out, 120)} is not a tree like the updates' ({brief(str(e), 120)})"
    return problems[0] if problems else None


def checked_combine(name: str, aggregate: Aggregator, config: RobustConfig) -> Combine:
    """``aggregate`` (a plugin's, registered as ``name``) as a ``Combine`` whose every call is checked: what it raises,
    and a result not shaped like one update (its structure, shapes and dtypes) or holding NaN/Inf, become a
    ``RegistryError`` naming the aggregator.  ``register_aggregator`` checked it on one small case only; the built-ins
    are known to keep the contract and are not wrapped."""
    what = plugin_name("robust.aggregator", name, aggregate)

    def combine(u: TreeT, w: Tensor) -> TreeT:
        try:
            out = aggregate(u, w, config)
        except Exception as e:
            raise RegistryError(f"{what} raised {type(e).__name__}: {brief(str(e), 200)}") from e
        wrong = misshapen(out, u)
        if wrong is not None:
            raise RegistryError(f"{what} must return one update shaped like a row of the updates: {wrong}")
        leaves = T.leaves(out)
        # one host synchronisation per call (once a round for most algorithms; on a GPU the host waits for the
        # plugin's work): accepted for a plugin, whose NaN must not pass as a result; the built-ins skip it
        if leaves and not bool(torch.stack([x.isfinite().all().to(leaves[0].device) for x in leaves]).all()):
            at = next(pytree.keystr(p) or "the update" for p, x in pytree.tree_flatten_with_path(out)[0]
                      if isinstance(x, Tensor) and not bool(x.isfinite().all()))
            raise RegistryError(f"{what} returned NaN/Inf (in {at}) from {int((w > 0).sum())} finite updates "
                                "(the rows of positive weight); it must return a finite update")
        return cast(TreeT, out)

    return combine


def _valid(stacked: TreeT, weights: Tensor) -> tuple[TreeT, Tensor]:
    ok = torch.nonzero(weights > 0).flatten()
    return T.tmap(lambda x: x.index_select(0, ok.to(x.device)), stacked), weights.index_select(0, ok)


def median(stacked: TreeT, weights: Tensor) -> TreeT:
    """Coordinate-wise median of the rows with positive weight."""
    valid, _ = _valid(stacked, weights)

    def med(x: Tensor) -> Tensor:
        k = x.shape[0]
        s = x.sort(0).values
        if k % 2:
            return s[k // 2]
        return (s[k // 2 - 1] + s[k // 2]) / 2

    return T.tmap(med, valid)


def trimmed_mean(stacked: TreeT, weights: Tensor, trim: float) -> TreeT:
    """Coordinate-wise mean of the rows with positive weight after dropping ``floor(trim * K)`` at each end."""
    valid, _ = _valid(stacked, weights)

    def tm(x: Tensor) -> Tensor:
        k = x.shape[0]
        b = int(math.floor(trim * k))
        s = x.sort(0).values
        return s[b : k - b].mean(0)

    return T.tmap(tm, valid)


def flat_rows(stacked: Tree) -> Tensor:
    """(K, D) float64: each row one client's whole update."""
    leaves = T.leaves(stacked)
    return torch.cat([x.reshape(x.shape[0], math.prod(x.shape[1:])).double() for x in leaves], 1)  # K = 0 too


def krum_scores(flat: Tensor, f: int) -> Tensor:
    """Krum's score of each row: the sum of squared distances to its ``K - f - 2`` nearest other rows."""
    k = flat.shape[0]
    d = torch.cdist(flat, flat).pow(2)
    d.fill_diagonal_(float("inf"))
    near = k - f - 2
    if near < 1:
        log.warning("krum: %d updates cannot tolerate %d attackers (needs >= %d); scoring by the nearest one",
                    k, f, 2 * f + 3)
        near = 1
    near = min(near, k - 1)
    return d.topk(near, dim=1, largest=False).values.sum(1)


def krum(stacked: TreeT, weights: Tensor, f: int, m: int | None) -> TreeT:
    """Krum (``m = 1``) or multi-Krum (the ``m`` rows of least score, default ``K - f``, averaged with their
    weights) over the rows with positive weight."""
    valid, w = _valid(stacked, weights)
    k = int(w.numel())
    if k == 1:
        return T.take(valid, 0)
    scores = krum_scores(flat_rows(valid), f)
    m = max(1, min(k, m if m is not None else k - f))
    pick = torch.argsort(scores, stable=True)[:m]
    if m == 1:
        return T.take(valid, int(pick[0]))
    return T.weighted_mean(T.tmap(lambda x: x.index_select(0, pick.to(x.device)), valid), w.index_select(0, pick))


def _krum_pick(d2: Tensor, f: int) -> int:
    """The row Krum chooses among the rows of the squared-distance matrix ``d2`` (diagonal inf): least sum of
    squared distances to its ``R - f - 2`` nearest others (at least 1), ties to the lowest index."""
    r = d2.shape[0]
    if r == 1:
        return 0
    near = max(1, min(r - f - 2, r - 1))
    scores = d2.topk(near, dim=1, largest=False).values.sum(1)
    return int(torch.argsort(scores, stable=True)[0])


def bulyan(stacked: TreeT, weights: Tensor, f: int) -> TreeT:
    """Bulyan over the rows with positive weight: ``theta = K - 2f`` rows selected by repeated Krum, then per
    coordinate the mean of the ``theta - 2f`` selected values closest to their median (unweighted)."""
    valid, w = _valid(stacked, weights)
    k = int(w.numel())
    if k < 4 * f + 3:
        f_used = max(0, (k - 3) // 4)
        log.warning("bulyan: %d updates cannot tolerate %d attackers (needs >= %d); using f = %d", k, f, 4 * f + 3,
                    f_used)
        f = f_used
    theta = k - 2 * f
    d2 = torch.cdist(flat_rows(valid), flat_rows(valid)).pow(2) if k > 1 else torch.zeros(1, 1, dtype=torch.float64)
    d2.fill_diagonal_(float("inf"))
    remaining = list(range(k))
    selected: list[int] = []
    for _ in range(theta):
        idx = torch.tensor(remaining)
        pick = _krum_pick(d2.index_select(0, idx).index_select(1, idx), f)
        selected.append(remaining.pop(pick))
    sel = torch.tensor(selected)
    beta = theta - 2 * f

    def around_median(x: Tensor) -> Tensor:
        s = x.index_select(0, sel.to(x.device))
        srt = s.sort(0).values
        med = (srt[(theta - 1) // 2] + srt[theta // 2]) / 2  # the mean of the two middle values for an even count
        order = torch.argsort((s - med.unsqueeze(0)).abs(), dim=0, stable=True)[:beta]
        return torch.gather(s, 0, order).mean(0)

    return T.tmap(around_median, valid)


def _coordinate_median(flat: Tensor) -> Tensor:
    k = flat.shape[0]
    s = flat.sort(0).values
    return (s[(k - 1) // 2] + s[k // 2]) / 2


def centered_clip(stacked: TreeT, weights: Tensor, tau: float | None, iterations: int) -> TreeT:
    """Centered clipping over the rows with positive weight: from the coordinate-wise median v,
    ``iterations`` times ``v <- v + sum_i w_i clip_tau(x_i - v) / sum_i w_i``.  ``tau`` None: the median distance of
    the rows from the starting v (``math.inf``: no clipping, the weighted mean)."""
    valid, w = _valid(stacked, weights)
    leaves = T.leaves(valid)
    flat = flat_rows(valid)  # (K, D) float64
    wn = (w.double() / w.double().sum()).to(flat.device)
    v = _coordinate_median(flat)
    if tau is None:
        tau = float((flat - v).norm(dim=1).median())
    for _ in range(iterations):
        diff = flat - v
        norms = diff.norm(dim=1)
        factor = torch.clamp(tau / norms.clamp_min(1e-300), max=1.0) if math.isfinite(tau) else torch.ones_like(norms)
        v = v + (wn * factor) @ diff
    out, at = [], 0
    for x in leaves:
        n = int(x[0].numel())
        out.append(v[at : at + n].reshape(x.shape[1:]).to(x.dtype))
        at += n
    return _rebuild(valid, out)


def _rebuild(stacked: TreeT, new_leaves: list[Tensor]) -> TreeT:
    """A tree shaped like one row of ``stacked`` holding ``new_leaves`` (in ``T.leaves`` order)."""
    it = iter(new_leaves)
    return T.tmap(lambda x: next(it) if isinstance(x, Tensor) else x, T.take(stacked, 0))


def bucketed(stacked: TreeT, weights: Tensor, s: int, inner: Combine, generator: torch.Generator) -> TreeT:
    """Bucketing: the rows with positive weight randomly permuted (``generator``), cut into buckets of ``s``
    consecutive rows, each bucket's weighted mean carrying the bucket's total weight, then ``inner`` on the
    bucket means."""
    valid, w = _valid(stacked, weights)
    k = int(w.numel())
    if k <= 1 or s <= 1:
        return inner(stacked, weights)
    perm = torch.randperm(k, generator=generator)
    nb = -(-k // s)
    bucket_of = torch.empty(k, dtype=torch.long)
    bucket_of[perm] = torch.arange(k) // s  # row perm[j] goes to bucket j // s
    wd = w.double()
    assign = torch.zeros(nb, k, dtype=torch.float64)
    assign[bucket_of, torch.arange(k)] = wd
    totals = assign.sum(1)
    assign = assign / totals.unsqueeze(1)
    means = T.tmap(lambda x: torch.tensordot(assign.to(x.device, x.dtype), x, dims=1), valid)
    return inner(means, totals)


def clip_updates(updates: TreeT, reference: Tree | None, weights: Tensor, clip_norm: float) -> TreeT:
    """Scale each row's deviation from ``reference`` (None: from zero) to L2 norm at most ``clip_norm``."""
    dev = updates if reference is None else T.tmap(lambda u, r: u - r.unsqueeze(0), updates, reference)
    norms = flat_rows(dev).norm(dim=1)
    factor = torch.clamp(clip_norm / norms.clamp_min(1e-30), max=1.0)
    factor = torch.where(weights.to(factor.device) > 0, factor, torch.ones_like(factor))

    def scale(d: Tensor) -> Tensor:
        return d * factor.to(d.device, d.dtype).reshape(-1, *([1] * (d.dim() - 1)))

    if reference is None:
        return T.tmap(scale, dev)
    return T.tmap(lambda d, r: r.unsqueeze(0) + scale(d), dev, reference)


def reference_of(updates: Tree, payload: Tree) -> Tree | None:
    """The payload (the part of it the updates cover, e.g. FedBABU's body) when the updates are model-shaped like it
    (one row per client), else None."""
    try:
        one = T.tmap(lambda x: x.new_empty(x.shape[1:]), updates)  # one row's structure (K may be 0)
        ups, pay = T.to_named(one), T.to_named(payload)
    except Exception:
        return None
    if not ups.keys() <= pay.keys() or any(ups[n].shape != pay[n].shape for n in ups):
        return None
    return T.from_named({n: pay[n] for n in ups}, one)


def check_aggregator(name: str, aggregate: Aggregator) -> None:
    """``register_aggregator``'s contract check (``RegistryError`` naming what broke): on five identical updates of
    unequal weights, plus a sixth of weight 0 holding NaN (an excluded update), ``aggregate`` returns that update
    (within 1e-6, in its structure, shapes and dtypes) and leaves its input as it was."""
    row = {"w": torch.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": torch.tensor([0.5, -0.25])}
    stacked = {k: torch.cat([v.unsqueeze(0).repeat(5, *([1] * v.dim())), torch.full((1, *v.shape), math.nan)])
               for k, v in row.items()}
    weights = torch.tensor([1.0, 2.0, 3.0, 1.0, 2.0, 0.0], dtype=torch.float64)
    given = T.tmap(lambda x: x.clone(), stacked), weights.clone()
    what = f"register_aggregator({name!r}): {getattr(aggregate, '__name__', aggregate)!r}"
    try:
        out = aggregate(stacked, weights, RobustConfig(aggregator=name))
    except Exception as e:
        raise RegistryError(f"{what} raised {type(e).__name__}: {brief(str(e), 200)} on five identical updates and "
                            "one excluded (weight 0, NaN); it is called as (updates, weights, config)") from e
    same = (a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())
            for a, b in zip([*T.leaves(stacked), weights], [*T.leaves(given[0]), given[1]], strict=True))
    if not all(same):
        raise RegistryError(f"{what} changed its input (the stacked updates or the weights); it must not")
    ok = misshapen(out, stacked) is None and all(  # one update's structure, shapes and dtypes, then its values
        torch.allclose(x, r, rtol=1e-6, atol=1e-6) for x, r in zip(T.leaves(out), T.leaves(row), strict=True))
    if not ok:
        raise RegistryError(f"{what} must return the update itself when every update is the same (and ignore rows of "
                            f"weight 0, which may hold NaN); on five identical updates it returned {shown(out, 200)}")


def register_aggregator(name: str | Callable[..., Any] | None = None, *, replace: bool = False) -> Any:
    """Decorator for a robust aggregator ``(updates, weights, config) -> update``, then usable as ``[robust]
    aggregator = "NAME"``: ``updates`` a tree of stacked rows (K, ...), one per client of the round, ``weights``
    (K,) float64 (the clients' example counts; 0 for an excluded update, whose row may hold NaN and must not
    count), ``config`` the run's ``RobustConfig``; it returns one row's tree.  ``@register_aggregator`` uses the
    function's name.

    Checked when registered (``check_aggregator``; a refusal raises ``fedmtl.registry.RegistryError``): the
    signature, the name (taken names need ``replace=True``; ``mean``, the algorithm's own weighted mean, is never
    replaced), and on five identical updates of unequal weights, plus one of weight 0 holding NaN, it must return
    that update (within 1e-6) without changing its input.  In a run every result is checked too
    (``checked_combine``): an exception it raises, a result not shaped like one update, or one holding NaN/Inf stops
    the run with a ``RegistryError`` naming it."""
    return register_checked(AGGREGATORS, "aggregator", name, replace, 3, "(updates, weights, config) -> update",
                            check_aggregator)


#: the built-in aggregators, in the order they are listed; a new one is a function above and one line here
register_aggregator("mean")(lambda u, w, c: T.weighted_mean(u, w))
register_aggregator("median")(lambda u, w, c: median(u, w))
register_aggregator("trimmed_mean")(lambda u, w, c: trimmed_mean(u, w, c.trim))
register_aggregator("krum")(lambda u, w, c: krum(u, w, c.num_byzantine, 1))
register_aggregator("multi_krum")(lambda u, w, c: krum(u, w, c.num_byzantine, c.multi_krum_m or None))
register_aggregator("bulyan")(lambda u, w, c: bulyan(u, w, c.num_byzantine))
register_aggregator("centered_clip")(lambda u, w, c: centered_clip(u, w, c.cc_tau or None, c.cc_iterations))
#: the built-ins as registered here: trusted to keep the contract (a name a plugin replaced is the plugin's, checked)
BUILT_IN_AGGREGATORS: dict[str, Aggregator] = dict(AGGREGATORS)


__all__ = ["BUCKETING_STREAM", "BUILT_IN_AGGREGATORS", "Aggregator", "RobustConfig", "bucketed", "bulyan",
           "centered_clip", "check_aggregator", "checked_combine", "clip_updates", "krum", "krum_scores", "median",
           "misshapen", "plugin_name", "reference_of", "register_aggregator", "trimmed_mean"]
