"""Local solvers written as pure functions of one client's parameters and padded batches.

``SGD`` mirrors ``torch.optim.SGD`` (momentum with dampening 0, coupled weight decay) plus the
multi-step learning-rate schedule of the FedEM reference experiments (x ``gamma`` at fixed fractions
of the rounds, stepped once per round).  ``local_sgd`` runs a fixed number of steps; a step whose
batch is entirely padding is an exact no-op (parameters and momentum unchanged), which is how
clients with fewer samples run inside one batched computation without branching.  ``masked_steps`` is
that loop, shared by every method with its own local step (APFL, pFedMe).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple, TypeVar

import torch
from torch import Tensor

from .batchnorm import is_statistic
from .models import stacking
from .models.base import Model
from .models.stacked import Step
from .schema import Annotated, Range, check_fields, shown
from .transforms import eager as is_eager
from .transforms import only_vmap
from .tree import Params, Tree, tmap


class Batches(NamedTuple):
    """One client's training batches for a round (padded; shapes for one client).

    The loop runner passes lists of per-step tensors instead, the last batch of each epoch holding
    only the remaining examples (``data.federated.ragged_batches``); everything here iterates steps
    with ``x[s]`` so both forms work.

    x: (S, B, *feat)   y: (S, B)   mask: (S, B) 1.0 for real samples, 0.0 for padding
    pos: (S, B) long   position of each slot in the client's first-epoch order, i.e. an index into
                       ``x[:S0].reshape(S0 * B, ...)`` where S0 = steps of one epoch (used by FedEM to
                       look up per-sample responsibilities computed once on the whole local set)
    n: () float        number of training samples of the client
    limit: () long     optional: the client stops after ``limit`` non-empty steps (a straggler of the
                       systems layer, ``fedmtl.engine.systems``); ``None`` = no limit.  Methods whose local
                       work is not counted in batches (MOCHA's coordinate steps) read it as their budget
    idx: (S, B) long   optional: each slot's index into the client's own examples (0 on padding), for
                       methods that keep per-example state (MOCHA's dual variables)
    all_live: (S,) bools, not a tensor: the steps known to be live for every client of the call these batches
                       belong to, read on the host (``with_all_live``, set by the vmap executor; for one client's
                       ragged batches its own live steps, set by the loop executor; ``None``: unknown).  Under vmap
                       ``local_sgd`` runs those steps without the per-client masking of dead steps.  A method that
                       changes ``mask`` or ``limit`` and passes the result on must drop it
                       (``_replace(all_live=None)``); batches built anew carry none
    """

    x: Tensor
    y: Tensor
    mask: Tensor
    pos: Tensor
    n: Tensor
    limit: Tensor | None = None
    idx: Tensor | None = None
    all_live: tuple[bool, ...] | None = None


class ClientBatches(NamedTuple):
    """K clients' training batches for the ``stacked`` executor, in step-major row blocks: the clients are sorted
    by their number of live steps (non-empty, within the straggler limit), most first, so the clients live at step s
    are a prefix, ``live[s]`` of them, and rows ``[sum(live[:s]), sum(live[:s + 1]))`` are their batches for step s
    (``step(s)``).  Only live batches are held.  Features are already through the model's input transform.

    x: (N, B, *feat)   y: (N, B)   mask: (N, B) float   n: (K,) float   live: the prefix size of every step
    pos: (N, B) long, optional: each slot's example's index in ``first`` (0 on padding)
    first: optional (x0 (N0, *feat), y0 (N0,), owner (N0,) long, mask0 (N0,) float): every client's first epoch
           whole, packed, each example's client (0..K-1) and whether it is one (0.0 on padding), features through the
           input transform (``first_epoch``; for methods that read all local data, as FedEM's E-step)
    """

    x: Tensor
    y: Tensor
    mask: Tensor
    n: Tensor
    live: tuple[int, ...]
    pos: Tensor | None = None
    first: tuple[Tensor, Tensor, Tensor, Tensor] | None = None

    def steps(self) -> Iterator[tuple[int, Tensor, Tensor, Tensor]]:
        """(live clients n, x (n, B, ...), y (n, B), mask (n, B)) of every step, in order."""
        at = 0
        for n in self.live:
            yield n, self.x[at:at + n], self.y[at:at + n], self.mask[at:at + n]
            at += n

    def step_pos(self) -> Iterator[Tensor]:
        """``pos`` (n, B) of every step, in the order of ``steps``."""
        assert self.pos is not None, "these batches were built without their first epochs"
        at = 0
        for n in self.live:
            yield self.pos[at:at + n]
            at += n


class StackedUnsupported(TypeError):
    """An operation that the ``stacked`` executor's clients mode cannot run (the engine then uses vmap)."""


def live_steps(batches: Batches) -> Tensor:
    """(S,) bool: the steps a client actually runs — non-empty, and within its straggler ``limit``."""
    if isinstance(batches.x, list):
        # on the CPU whatever the batches' device: the loop over one client's steps branches on it, and a flag on
        # a GPU would stall the CPU once per step (the loop executor reads them on the host: ``all_live``)
        if batches.all_live is not None:
            return torch.tensor(batches.all_live, dtype=torch.bool)
        live = torch.ones(len(batches.x), dtype=torch.bool)
        if batches.limit is not None:
            live &= torch.arange(len(batches.x)) < batches.limit.cpu()
        return live
    nonempty = batches.mask.sum(-1) > 0
    if batches.limit is None:
        return nonempty
    return nonempty & (torch.cumsum(nonempty.to(torch.long), 0) <= batches.limit)


def with_all_live(batches: Batches) -> Batches:
    """K stacked (K, S, B) ``batches`` with ``all_live`` set: the steps live (non-empty, within the straggler limit)
    for all K clients, which ``local_sgd`` under vmap runs without the per-client masking of dead steps (half the
    update's memory traffic).  One host read of the (K, S) flags per call."""
    nonempty = batches.mask.sum(-1) > 0  # (K, S)
    live = nonempty
    if batches.limit is not None:
        live = nonempty & (torch.cumsum(nonempty.to(torch.long), 1) <= batches.limit.unsqueeze(1))
    return batches._replace(all_live=tuple(bool(f) for f in live.all(0).tolist()))


@dataclass(frozen=True)
class SGD:
    """SGD hyper-parameters.  The learning rate is multiplied by ``lr_gamma`` at each milestone: given as
    fractions of the run's rounds (``lr_milestones``, which move with ``run.rounds``) or as rounds
    (``lr_milestone_rounds = [100, 150]``: the rate decays after round 100 and after round 150, whatever
    ``run.rounds``); ``milestone_rounds`` resolves them (``summary.json`` records ``lr_decay_from_rounds``)."""

    #: learning rate
    lr: Annotated[float, Range(0, 1e3, lo_open=True)] = 0.1
    #: heavy-ball momentum
    momentum: Annotated[float, Range(0, 1, hi_open=True)] = 0.0
    #: L2 weight decay
    weight_decay: Annotated[float, Range(0, 1e3)] = 0.0
    #: fractions of the rounds after which the rate is multiplied by lr_gamma (strictly increasing)
    lr_milestones: tuple[Annotated[float, Range(0, 1, lo_open=True, hi_open=True)], ...] = ()
    #: the decay factor at each milestone
    lr_gamma: Annotated[float, Range(0, 1, lo_open=True)] = 0.1
    #: rounds after which the rate decays (strictly increasing; instead of lr_milestones)
    lr_milestone_rounds: tuple[Annotated[int, Range(1, 10**7)], ...] = ()

    def __post_init__(self) -> None:
        # ranges (fedmtl.schema): rates beyond them diverge in one step on any model (every update non-finite)
        check_fields(self, "optim")
        for key in ("lr_milestones", "lr_milestone_rounds"):
            v = getattr(self, key)
            if any(b <= a for a, b in zip(v, v[1:], strict=False)):
                raise ValueError(f"optim.{key} must be strictly increasing, got {shown(list(v))}")
        if self.lr_milestones and self.lr_milestone_rounds:
            raise ValueError("give optim.lr_milestones (fractions of the rounds) or optim.lr_milestone_rounds "
                             "(rounds), not both")

    def milestone_rounds(self, num_rounds: int) -> list[int]:
        """The rounds after which the rate decays (equivalently: the 0-based index of the first round at the
        decayed rate)."""
        if self.lr_milestone_rounds:
            return sorted(self.lr_milestone_rounds)
        return sorted(int(f * num_rounds) for f in self.lr_milestones)

    def lr_at(self, round_idx: int, num_rounds: int) -> float:
        """Learning rate of round ``round_idx`` (0-based), as ``MultiStepLR`` stepped per round.

        Milestone fraction f decays the rate from round ``int(f * num_rounds)`` on (rounds 100 and 150
        for f = 0.5, 0.75 and 200 rounds, as in the FedEM reference experiments); milestone round m from
        round m on (0-based), so ``lr_milestone_rounds = [100, 150]`` is the same schedule at 200 rounds.
        """
        passed = sum(round_idx >= m for m in self.milestone_rounds(num_rounds))
        return self.lr * self.lr_gamma**passed


GradFn = Callable[[Params, Tensor, Tensor, Tensor, Tensor | None], tuple[Params, Tensor]]
Carry = TypeVar("Carry", bound=Tree)


def masked_steps(
    batches: Batches, step: Callable[..., tuple[Carry, Tensor]], carry: Carry, steps: slice | None = None,
    masks_itself: bool = False,
) -> tuple[Carry, Tensor]:
    """The one local-step loop: ``step(carry, s) -> (carry', loss)`` for every step ``s`` of the client's
    batches, a step that is not live (all padding, or past the straggler ``limit``) leaving ``carry`` and the
    loss average untouched.  Returns (carry, mean loss over the live steps).  ``masks_itself``: ``step`` is called
    as ``step(carry, s, active)`` and returns the carry unchanged itself where ``active`` is False (``local_sgd``
    folds it into its update, saving a pass over the parameters per step).

    vmap-safe: a fixed number of steps, ``torch.where`` instead of branching, nothing updated in place.
    ``loss`` may be a vector (FedEM's M components); the mean is taken per entry.
    """
    live = live_steps(batches)
    loss_sum = torch.zeros((), dtype=torch.float32)
    count = torch.zeros((), dtype=torch.float32)
    rng = range(len(batches.x)) if steps is None else range(*steps.indices(len(batches.x)))
    if isinstance(batches.x, list):  # one client's steps, the flags on the host: branch on them, so that a model on a
        n = 0  # GPU never waits for a flag copied there (fedmtl.hostsync)
        for s in rng:
            active = live[s]
            if masks_itself:
                carry, loss = step(carry, s, active)
            elif bool(active):
                carry, loss = step(carry, s)
            if bool(active):
                loss_sum, n = loss_sum + loss, n + 1
        return carry, loss_sum / max(n, 1)
    for s in rng:
        active = live[s]
        if masks_itself:
            carry, loss = step(carry, s, active)
        else:
            new, loss = step(carry, s)
            carry = tmap(lambda a, b, active=active: torch.where(active, a, b), new, carry)
        loss_sum = loss_sum + torch.where(active, loss, torch.zeros_like(loss))
        count = count + active.to(count.dtype)
    return carry, loss_sum / count.clamp_min(1.0)


def local_sgd(
    grad_fn: GradFn,
    params: Params,
    batches: Batches,
    lr: float | Tensor,
    opt: SGD,
    sample_weight: Tensor | None = None,
    prox_center: Params | None = None,
    prox_mu: float | Tensor = 0.0,
    steps: slice | None = None,
    grad_shift: Params | None = None,
) -> tuple[Params, Tensor]:
    """Run SGD over ``batches`` for one client; returns (new params, mean batch loss).

    ``grad_fn(params, x, y, mask, weight) -> (grads, loss)`` is usually ``Model.value_and_grad``.  K clients at
    once on the stacked executor: ``local_sgd_clients``.

    ``sample_weight`` (..., S0 * B) are per-sample weights indexed by ``batches.pos`` (FedEM's q; a
    leading axis when ``params`` are M stacked models and ``grad_fn`` is ``models.stacking.value_and_grad_stacked``,
    whose loss is then an (M,) vector).
    ``prox_center``/``prox_mu`` add the FedProx term ``mu (w - w_center)`` to every gradient, ``grad_shift`` a
    constant vector (SCAFFOLD's control-variate correction c - c_i, FedDyn's -h_i); ``prox_mu`` may be a 0-d tensor
    (a value per replica under vmap).
    Batch-norm running statistics (``fedmtl.batchnorm``) are not trained: ``grad_fn`` returns their updated values,
    which are assigned (no rate, weight decay, momentum, proximal term or shift).
    After its first step a call updates the parameters and buffers it allocated itself in place (under vmap and
    outside transforms; never under ``grad``), never ``params``, ``grad_fn``'s outputs or any other input.  Under
    the vmap executor, the steps live for every client of the call skip the dead-step masking
    (``known_live_steps``).  With a float ``lr`` all these forms give the same bits (tested); with a tensor ``lr`` they
    agree to rounding.
    """
    mom, wd, mu = opt.momentum, opt.weight_decay, (prox_mu if prox_center is not None else 0.0)
    # a tensor mu is one per replica (``engine.clients.with_fields``: trials over mu trained together): always on
    prox = isinstance(mu, Tensor) or bool(mu)

    owned: set[str] = set()  # parameters (and momentum buffers) this call allocated: updated in place from then on
    in_place = only_vmap()
    # steps live for every client of the enclosing vmap call (``with_all_live``); a list is one client's ragged batches
    known = batches.all_live if in_place and not isinstance(batches.mask, list) else None

    def step(carry: tuple[Params, Params], s: int, active: Tensor) -> tuple[tuple[Params, Params], Tensor]:
        p, buf = carry  # buf: momentum buffers ({} without momentum)
        w = None if sample_weight is None else sample_weight[..., batches.pos[s]]
        g, loss = grad_fn(p, batches.x[s], batches.y[s], batches.mask[s], w)
        rate = -lr * active.to(torch.float32)  # 0 on a step that is not live: parameters unchanged exactly
        new_p, new_buf = {}, {}
        for k, v in p.items():
            if is_statistic(k):
                new_p[k] = torch.where(active, g[k], v)
                if mom > 0:
                    new_buf[k] = buf[k]
                continue
            d = g[k]  # fused updates (torch.add with alpha): one pass over the parameters per term
            if wd:
                d = torch.add(d, v, alpha=wd)
            if prox:
                d = d + mu * (v - prox_center[k])  # type: ignore[index]
            if grad_shift is not None:
                d = d + grad_shift[k]
            if mom > 0:  # d + mom buf, in place on d where d is this step's own tensor (never under grad)
                d = d.add_(buf[k], alpha=mom) if in_place and d is not g[k] else torch.add(d, buf[k], alpha=mom)
            if known is not None and known[s]:
                # live for every client of the vmap call (``Batches.all_live``): no masking, and the direction
                # becomes the new momentum buffer -- 6 reads and writes of parameter-sized tensors where the masked
                # update below makes 13 (with momentum), and 2 fresh tensors instead of 4 on a call's first step;
                # the same bits as the masked update's live branch (buf * 0 + d is d for a finite buf; tested)
                if mom > 0:
                    new_buf[k] = d
                if isinstance(lr, float | int):
                    new_p[k] = v.add_(d, alpha=-lr) if k in owned else torch.add(v, d, alpha=-lr)
                else:
                    new_p[k] = v.sub_(d * lr) if k in owned else v - d * lr
                owned.add(k)  # known only where in_place
                continue
            if k in owned:
                # in place on this call's own tensors (a step over 100 clients' 784 x 200 weights: ~2x faster than
                # four fresh tensors).  d is masked to 0 on a dead step, so v and buf stay exactly as they were; on a
                # live step the results equal the functional branch's bit for bit (tested)
                live = active.to(v.dtype)
                d = d * live if d is g[k] else d.mul_(live)  # g[k] itself is never written
                if mom > 0:
                    new_buf[k] = buf[k].mul_(1.0 - live).add_(d)
                new_p[k] = v.add_(d, alpha=-lr) if isinstance(lr, float | int) else v.sub_(d.mul_(lr))
                continue
            if mom > 0:
                new_buf[k] = torch.where(active, d, buf[k])
            new_p[k] = torch.addcmul(v, d, rate.to(v.dtype))
            if in_place:
                owned.add(k)
        return (new_p, new_buf), loss

    def eager_step(carry: tuple[Params, Params], s: int, active: Tensor) -> tuple[tuple[Params, Params], Tensor]:
        """The same step outside torch.func transforms (the loop runner): a dead step is skipped, and the update
        allocates one tensor per parameter (the direction) instead of four, updating its own tensors in place."""
        if not bool(active):
            return carry, torch.zeros(())
        p, buf = carry
        w = None if sample_weight is None else sample_weight[..., batches.pos[s]]
        g, loss = grad_fn(p, batches.x[s], batches.y[s], batches.mask[s], w)
        first = next(iter(p.values()))
        # once per step, not per parameter; a rate given as a number is filled in on the device, not copied there
        rate = (lr.to(first.device, first.dtype) if isinstance(lr, Tensor)
                else torch.full((), lr, dtype=first.dtype, device=first.device))
        new_p, new_buf = {}, {}
        for k, v in p.items():
            if is_statistic(k):
                new_p[k] = g[k]
                if mom > 0:
                    new_buf[k] = buf[k]
                continue
            d = torch.add(g[k], v, alpha=wd) if wd else g[k]  # g[k] itself is never written
            if prox:
                d = d + mu * (v - prox_center[k])  # type: ignore[index]
            if grad_shift is not None:
                d = d + grad_shift[k]
            if mom > 0:
                d = torch.add(d, buf[k], alpha=mom) if d is g[k] else d.add_(buf[k], alpha=mom)
                new_buf[k] = d
            if k in owned:
                new_p[k] = v.addcmul_(d, rate.to(v.dtype), value=-1.0)
            else:
                new_p[k] = torch.addcmul(v, d, rate.to(v.dtype), value=-1.0)
                owned.add(k)
        return (new_p, new_buf), loss

    buf0 = {k: torch.zeros_like(v) for k, v in params.items()} if mom > 0 else {}
    eager = is_eager()
    (params, _), loss = masked_steps(batches, eager_step if eager else step, (params, buf0), steps,
                                     masks_itself=True)
    return params, loss


def local_sgd_clients(
    model: Model,
    params: Params,
    batches: ClientBatches,
    lr: float | Tensor,
    opt: SGD,
    prox_center: Params | None = None,
    prox_mu: float = 0.0,
    grad_shift: Params | None = None,
    sample_weight: Tensor | None = None,
    components: bool = False,
) -> tuple[Params, Tensor]:
    """``local_sgd`` of ``model`` for K clients at once (the ``stacked`` executor: an algorithm's
    ``client_update_clients``): returns (K stacked params, (K,) mean losses).

    The gradients are ``models.stacking.value_and_grad_clients`` (one model per client, as ``local_sgd`` on
    ``Model.value_and_grad``) or, with ``components``, ``value_and_grad_clients_stacked`` (M components per client,
    FedEM's, as ``local_sgd`` on ``value_and_grad_stacked``; losses (K, M)), on the live prefix of the clients at
    every step: step s updates, in place, the first ``batches.live[s]`` clients' parameters (views of the stacked
    tensors), and the others are neither computed nor touched.  No padding is computed and no step is masked.
    ``params``, ``prox_center`` and ``grad_shift`` are stacked per client or one model's (broadcast to every client);
    ``sample_weight`` (..., N0) are per-sample weights of the clients' packed first epochs, indexed by
    ``batches.pos``.  The same arithmetic as ``local_sgd`` per client (tested against the loop executor to rounding:
    the batched products sum in another order)."""
    if not stacking.supports_clients(model):
        raise StackedUnsupported(f"model {model.name!r} has no clients form (models.stacking.supports_clients): the "
                                 "stacked executor cannot run its local SGD")
    lead = 1 if components else 0
    clients_grad = stacking.value_and_grad_clients_stacked if components else stacking.value_and_grad_clients
    k = batches.n.shape[0]
    template = dict(model.module.named_parameters())

    def per_client(tree: Params) -> Params:  # (K, ...) views: one model's tensors broadcast to K
        return {n: v.unsqueeze(0).expand(k, *v.shape) if v.dim() == template[n].dim() + lead else v
                for n, v in tree.items()}

    def stacked(tree: Params | None) -> Params | None:  # read-only (K, ...) or broadcast views
        if tree is None:
            return None
        return {n: v.unsqueeze(0) if v.dim() == template[n].dim() + lead else v for n, v in tree.items()}

    mom, wd, mu = opt.momentum, opt.weight_decay, (prox_mu if prox_center is not None else 0.0)
    start = per_client(params)
    first = next(iter(start.values()))
    device = first.device
    graphs = stacking.step_graphs(model, device, (
        k, components, mom > 0, isinstance(lr, Tensor), sample_weight is not None,
        tuple((n, v.shape, v.dtype) for n, v in start.items()),
        None if prox_center is None or not mu else tuple((n, v.shape) for n, v in prox_center.items()),
        None if grad_shift is None else tuple((n, v.shape) for n, v in grad_shift.items())))
    if graphs is None:  # owned tensors of this call
        p = {n: v.clone() for n, v in start.items()}
        center, shift = stacked(prox_center), stacked(grad_shift)
        buf = {n: torch.zeros_like(v) for n, v in p.items()} if mom > 0 else {}
        losses = torch.zeros(first.shape[:1 + lead], dtype=torch.float32, device=device)  # (K,) or (K, M)
        steps = torch.zeros(k, dtype=torch.float32, device=device)
        rate = lr
    else:  # the same tensors at every call, which the recorded steps read and write (``models.replay``)
        p = {n: graphs.hold(f"p.{n}", v) for n, v in start.items()}
        center, shift = ({n: graphs.hold(f"{tag}.{n}", v) for n, v in tree.items()} if tree is not None else None
                         for tag, tree in (("center", stacked(prox_center) if mu else None),
                                           ("shift", stacked(grad_shift))))
        buf = {n: graphs.hold(f"buf.{n}", v, zero=True) for n, v in p.items()} if mom > 0 else {}
        losses = graphs.hold("losses", torch.empty(first.shape[:1 + lead], dtype=torch.float32), zero=True)
        steps = graphs.hold("steps", torch.empty(k, dtype=torch.float32), zero=True)
        rate = graphs.hold("lr", lr) if isinstance(lr, Tensor) else lr
    # the model's step with the gradient products fused into the update (``models.stacked.Step``), where it has one
    fused = None if model.compile_clients else model.components_step if components else model.clients_step

    def body(n: int, xs: Tensor, ys: Tensor, ms: Tensor, w: Tensor | None) -> None:  # one step of the live n
        view = {name: v[:n] for name, v in p.items()}
        if fused is not None and not mu and shift is None and (w is None or lead) and isinstance(rate, float | int):
            # SGD (with momentum and weight decay): the model applies the step in place with its gradients fused
            # into the update
            step = Step(float(rate), mom, wd, {name: v[:n] for name, v in buf.items()} if mom > 0 else None)
            loss = fused(view, xs, ys, ms, w, step) if lead else fused(view, xs, ys, ms, step)
        else:
            g, loss = clients_grad(model, view, xs, ys, ms, w)
            _update(view, g, buf, n, k, rate, mom, wd, mu, center, shift)
        losses[:n] += loss.detach().to(torch.float32)
        steps[:n] += 1.0

    positions = batches.step_pos() if sample_weight is not None else None
    for n, xs, ys, ms in batches.steps():
        if n == 0:
            break
        w = None
        if positions is not None:
            assert sample_weight is not None
            w = sample_weight[..., next(positions)].movedim(-2, 0)  # (..., N0) -> (n, ..., B)
        if graphs is None:
            body(n, xs, ys, ms, w)
        else:  # the step's shapes and hyper-parameters (baked into a recorded step) name it
            graphs.step((n, rate if isinstance(rate, float | int) else None, mom, wd, mu), partial(body, n),
                        (xs, ys, ms, w))
    # the caller's own tensors, not the held ones that the next call refills (``body``, kept by a recorded step,
    # reads ``p`` at every replay: it is never rebound)
    out = p if graphs is None else {n: v.clone() for n, v in p.items()}
    return out, losses / steps.clamp_min(1.0).reshape(-1, *([1] * lead))


def _update(view: Params, g: Params, buf: Params, n: int, k: int, lr: float | Tensor, mom: float, wd: float,
            mu: float, center: Params | None, shift: Params | None) -> None:
    """``local_sgd``'s step on the live clients' parameters ``view`` (their first n rows), in place: weight decay,
    the proximal pull toward ``center``, the constant ``shift``, momentum in ``buf``; ``g`` is this step's own."""
    rate = float(lr) if isinstance(lr, float | int) else lr
    for name, v in view.items():
        if is_statistic(name):  # a batch-norm running statistic: its new value, assigned (``local_sgd``)
            v.copy_(g[name])
            continue
        d = g[name]
        if wd:
            d = d.add_(v, alpha=wd)
        if mu:
            assert center is not None
            d = d.add_(v - center[name][:n] if center[name].shape[0] == k else v - center[name], alpha=mu)
        if shift is not None:
            d = d.add_(shift[name][:n] if shift[name].shape[0] == k else shift[name])
        if mom > 0:
            d = d.add_(buf[name][:n], alpha=mom)
            buf[name][:n] = d
        if isinstance(rate, float):
            v.sub_(d, alpha=rate)
        else:
            v.sub_(d * rate)


def first_epoch(batches: Batches, epochs: int) -> tuple[Tensor, Tensor, Tensor]:
    """All examples of the first epoch, flattened: x (S0 * B, ...), y, mask — the index space of ``pos`` (for K
    clients' ``ClientBatches``: ``ClientBatches.first``)."""
    s0 = len(batches.x) // epochs
    if isinstance(batches.x, list):
        return torch.cat(batches.x[:s0]), torch.cat(batches.y[:s0]), torch.cat(batches.mask[:s0])
    x = batches.x[:s0].reshape(-1, *batches.x.shape[2:])
    return x, batches.y[:s0].reshape(-1), batches.mask[:s0].reshape(-1)


def pick_batch(batches: Batches, i: int) -> tuple[Tensor, Tensor, Tensor]:
    """Batch ``i mod (number of live batches)``: vmap-safe cyclic access for fixed-step methods."""
    if isinstance(batches.x, list):
        j = i % max(int(live_steps(batches).sum()), 1)
        return batches.x[j], batches.y[j], batches.mask[j]
    active = live_steps(batches).to(torch.long)  # (S,) live steps (padding sits between epochs)
    k = torch.remainder(torch.tensor(i), active.sum().clamp_min(1))
    j = torch.argmax((torch.cumsum(active, 0) == k + 1).to(torch.long)).reshape(1)  # the k-th non-empty step
    return (batches.x.index_select(0, j).squeeze(0), batches.y.index_select(0, j).squeeze(0),
            batches.mask.index_select(0, j).squeeze(0))
