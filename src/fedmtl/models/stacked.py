"""The stacked-layer fast path of dense networks: forward and backward of a ReLU MLP written as batched matrix
products, with no autograd.

One function serves one model (weights (out, in)), M stacked models on the same inputs (weights (M, out, in),
FedEM's components: the M axis is the batch axis of every product), and K clients' models on their own batches
side by side (weights (K, out, in), inputs (K, n, in), masks (K, n): the ``stacked`` executor's form, each client's
loss divided by its own count).  Under ``torch.func.vmap`` over the sampled
clients each product becomes one batched GEMM over clients (and components) -- the forward ``baddbmm`` per layer,
the backward two -- instead of the per-operation graph that ``torch.func.grad`` records and replays.  The first
layer's input gradient is never formed (nothing needs it), which saves a third of that layer's backward.

Equal to autograd's gradient of ``Model.loss`` (tested to 1e-5 for one and for stacked models, binary and
multiclass, with padding and sample weights).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..transforms import eager
from ..tree import Params

Layers = Sequence[tuple[str, str | None]]  # (weight name, bias name or None) of each dense layer, input first


# At most this many output rows (M x out), a layer's product is formed transposed, w @ a^T: a GEMM with a few long
# rows runs faster than a @ w^T with a few short columns under vmap on CPU (from about 10 rows the usual layout is
# faster).  Same sums.
NARROW = 4


def _affine(a: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """a @ w^T + b for a (..., n, in) and w (..., out, in); broadcasts a shared (n, in) input over stacked weights.
    Narrow layers (binary heads, FedEM's linear components) return a transposed view of w @ a^T + b."""
    if a.dim() == 2 and w.dim() == 3:  # a shared input, M stacked layers: one GEMM against all M x out rows
        m, o, i = w.shape
        if m * o <= NARROW and not eager():  # under vmap only: one eager product over many rows is faster as a @ w^T
            flat = w.reshape(m * o, i)
            zt = flat @ a.T if b is None else torch.addmm(b.reshape(m * o, 1), flat, a.T)
            return zt.reshape(m, o, a.shape[0]).transpose(1, 2)  # (M, n, out), a view
        flat = w.reshape(m * o, i).T
        z = a @ flat if b is None else torch.addmm(b.reshape(m * o), a, flat)
        return z.reshape(a.shape[0], m, o).transpose(0, 1)  # (M, n, out), a view
    if w.shape[-2] <= NARROW:
        at = a.transpose(-1, -2)
        if b is None:
            return (w @ at).transpose(-1, -2)
        if a.dim() == 3:
            return torch.baddbmm(b.unsqueeze(-1), w, at).transpose(-1, -2)
        return torch.addmm(b.unsqueeze(-1), w, at).transpose(-1, -2)
    wt = w.transpose(-1, -2)
    if b is None:
        return a @ wt
    if a.dim() == 3:  # stacked activations and weights: one fused batched GEMM
        return torch.baddbmm(b.unsqueeze(-2), a, wt)
    return torch.addmm(b, a, wt)


def mlp_forward(params: Params, x: Tensor, layers: Layers, binary: bool) -> tuple[Tensor, list[Tensor]]:
    """(logits, pre-activations of the hidden layers): logits (n, out) or (M, n, out) for stacked weights; binary
    models drop the trailing axis of size 1."""
    a, pre = x, []
    for i, (wn, bn) in enumerate(layers):
        z = _affine(a, params[wn], params[bn] if bn else None)
        if i < len(layers) - 1:
            pre.append(z)
            a = F.relu(z)
        else:
            a = z
    return (a.squeeze(-1) if binary else a), pre


def head_residual(z: Tensor, y: Tensor, mask: Tensor, weight: Tensor | None, binary: bool,
                  num_out: int) -> tuple[Tensor, Tensor]:
    """(loss, d loss / d logits) of the mean (sample-weighted) logistic or softmax loss over the real samples:
    ``loss = sum(w * nll) / count``, the residual (p - onehot(y)) w / count shaped (..., n, out).  A mask (n,) is
    one batch (of one model, or of M stacked models); a mask (K, n) is K clients' batches side by side (the
    ``stacked`` executor), each divided by its own count."""
    wt = mask.to(z.dtype) if weight is None else mask.to(z.dtype) * weight  # (n,), (M, n) or (K, n)
    if mask.dim() > 1:  # K clients' batches: one count per client
        count = mask.to(z.dtype).sum(-1).clamp_min(1.0)  # (K,)
        rc = count.unsqueeze(-1)
    else:
        count = rc = mask.to(z.dtype).sum().clamp_min(1.0)
    if binary:
        yf = y.to(z.dtype)
        loss = ((F.softplus(z) - yf * z) * wt).sum(-1) / count
        return loss, ((torch.sigmoid(z) - yf) * wt / rc).unsqueeze(-1)
    logp = F.log_softmax(z, dim=-1)
    nll = -torch.gather(logp, -1, y.long().expand(z.shape[:-1]).unsqueeze(-1)).squeeze(-1)
    loss = (nll * wt).sum(-1) / count
    return loss, (logp.exp() - F.one_hot(y.long(), num_out).to(z.dtype)) * (wt / rc).unsqueeze(-1)


def mlp_value_and_grad(params: Params, x: Tensor, y: Tensor, mask: Tensor, weight: Tensor | None, layers: Layers,
                       binary: bool) -> tuple[Params, Tensor]:
    """(gradients, loss) of the MLP's loss by hand-written backpropagation; loss (M,) for stacked weights."""
    z, pre = mlp_forward(params, x, layers, binary)
    num_out = params[layers[-1][0]].shape[-2]
    loss, r = head_residual(z, y, mask, weight, binary, num_out)
    grads: Params = {}
    for i in range(len(layers) - 1, -1, -1):
        wn, bn = layers[i]
        a = x if i == 0 else F.relu(pre[i - 1])
        rt = r.transpose(-1, -2)  # (..., out, n)
        if rt.dim() == 3 and a.dim() == 2:  # a shared input (n, in): the M stacked residuals as one GEMM's rows
            m, o, n = rt.shape
            grads[wn] = (rt.reshape(m * o, n) @ a).reshape(m, o, a.shape[-1])
        else:
            grads[wn] = rt @ a
        if bn:
            grads[bn] = r.sum(-2)
        if i > 0:  # the input gradient of the first layer is never needed
            r = (r @ params[wn]) * (pre[i - 1] > 0).to(r.dtype)
    return {k: grads[k] for k in params}, loss


class Step(NamedTuple):
    """An SGD step that a backward pass applies in place, with each gradient product accumulated straight into the
    update, instead of returning the gradients (``torch.optim.SGD``'s update: ``buf = momentum * buf + (g +
    weight_decay * w)``, ``w -= lr * buf``).  ``buffers``: the momentum buffers, views like the parameters, zero
    before the first step; ``None`` without momentum."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    buffers: Params | None = None


def _apply(step: Step, w: Tensor, buf: Tensor | None, rt: Tensor | None = None, a: Tensor | None = None,
           g: Tensor | None = None) -> None:
    """``step`` on ``w`` (and its momentum buffer ``buf``) in place, the gradient given as the batched product
    ``rt @ a`` (accumulated into the weight or the buffer: never stored) or as ``g``.  Without momentum one pass over
    ``w`` (after ``w *= 1 - lr * weight_decay``); with momentum three (``buf.baddbmm_(rt, a, beta=momentum)``,
    ``buf += weight_decay * w``, ``w -= lr * buf``) instead of the six of forming, scaling and applying g."""
    lr, mom, wd = step.lr, step.momentum, step.weight_decay
    if buf is None:
        if wd:
            w.mul_(1.0 - lr * wd)
        if g is None:
            w.baddbmm_(rt, a, alpha=-lr)  # type: ignore[arg-type]
        else:
            w.sub_(g, alpha=lr)
        return
    if g is None:
        buf.baddbmm_(rt, a, beta=mom)  # type: ignore[arg-type]
    else:
        buf.mul_(mom).add_(g)
    if wd:
        buf.add_(w, alpha=wd)
    w.sub_(buf, alpha=lr)


def mlp_components_forward(params: Params, x: Tensor, layers: Layers, binary: bool) -> tuple[Tensor, list[Tensor]]:
    """(logits (K x M, n[, out]), pre-activations) of M components of each of K clients on the client's own examples:
    params (K, M, ...), x (K, n, in).  The first layer reads each client's examples once for its M components (one
    product against its M x out rows); the layers above run the K x M models as one batch of products."""
    k, m = next(iter(params.values())).shape[:2]
    km = k * m
    w0n, b0n = layers[0]
    w0 = params[w0n]  # (K, M, o, in)
    o = w0.shape[2]
    rows = w0.reshape(k, m * o, w0.shape[3]).transpose(1, 2)  # (K, in, M x o)
    z = torch.bmm(x, rows) if b0n is None else torch.baddbmm(params[b0n].reshape(k, 1, m * o), x, rows)
    z = z.reshape(k, x.shape[1], m, o).transpose(1, 2).reshape(km, x.shape[1], o)  # (K x M, n, o)
    pre, a = [], z
    for wn, bn in layers[1:]:
        pre.append(a)
        a = _affine(F.relu(a), params[wn].reshape(km, *params[wn].shape[2:]),
                    params[bn].reshape(km, *params[bn].shape[2:]) if bn else None)
    return (a.squeeze(-1) if binary else a), pre


def mlp_components(params: Params, x: Tensor, y: Tensor, mask: Tensor, weight: Tensor | None, layers: Layers,
                   binary: bool, step: Step | None = None) -> tuple[Params, Tensor]:
    """(gradients, loss) of M components of each of K clients on the client's own batch: params (K, M, ...), x (K, n,
    in), y and mask (K, n), weight (K, M, n) (FedEM's responsibilities); gradients (K, M, ...), losses (K, M), each
    component's loss the weighted sum over the client's real samples divided by their number (``Model.loss``).
    With ``step``, the step is applied to ``params`` (views of the stacked parameters) in place instead (``Step``) and
    no gradient is returned.  The first layer reads each client's batch once for its M components (one product
    against its M x out rows, as ``_affine`` does for one client); the layers above run the K x M models as one
    batch of products."""
    k, m = next(iter(params.values())).shape[:2]
    km = k * m
    flat = {name: v.reshape(km, *v.shape[2:]) for name, v in params.items()}  # (K x M, ...) views
    bufs = None if step is None or step.buffers is None else {
        name: v.reshape(km, *v.shape[2:]) for name, v in step.buffers.items()}
    w0n, b0n = layers[0]
    o = params[w0n].shape[2]
    logits, pre = mlp_components_forward(params, x, layers, binary)
    rep = (lambda t: t.unsqueeze(1).expand(k, m, *t.shape[1:]).reshape(km, *t.shape[1:]))  # noqa: E731
    loss, r = head_residual(logits, rep(y), rep(mask), None if weight is None else weight.reshape(km, -1), binary,
                            params[layers[-1][0]].shape[-2])
    grads: Params = {}
    for i in range(len(layers) - 1, 0, -1):
        wn, bn = layers[i]
        act = F.relu(pre[i - 1])
        r_next = (r @ flat[wn]) * (pre[i - 1] > 0).to(r.dtype)  # with the weight before its step
        if step is None:
            grads[wn] = r.transpose(-1, -2) @ act
            if bn:
                grads[bn] = r.sum(-2)
        else:
            _apply(step, flat[wn], None if bufs is None else bufs[wn], r.transpose(-1, -2), act)
            if bn:
                _apply(step, flat[bn], None if bufs is None else bufs[bn], g=r.sum(-2))
        r = r_next
    n = x.shape[1]
    rk = r.reshape(k, m, n, o).transpose(1, 2).reshape(k, n, m * o)  # (K, n, M x o): the first layer's residuals
    if step is None:
        grads[w0n] = torch.bmm(rk.transpose(1, 2), x)  # (K, M x o, in)
        if b0n:
            grads[b0n] = rk.sum(1)
        return {name: grads[name].reshape(params[name].shape) for name in params}, loss.reshape(k, m)
    for name, g in ((w0n, None), (b0n, rk.sum(1) if b0n else None)):
        if name:
            target = params[name].reshape(k, m * o, *params[name].shape[3:])  # (K, M x o[, in]) views
            buf = None if step.buffers is None else step.buffers[name].reshape(target.shape)
            _apply(step, target, buf, rk.transpose(1, 2) if g is None else None, x if g is None else None, g)
    return {}, loss.reshape(k, m)


def mlp_sgd_step_clients(params: Params, x: Tensor, y: Tensor, mask: Tensor, layers: Layers, binary: bool,
                         step: Step) -> Tensor:
    """One SGD step (``Step``) of K clients' MLPs on their own batches, applied in place with each weight's gradient
    product accumulated straight into its update, so the gradient is never stored.  params (K, ...) (views of the
    stacked parameters), x (K, n, in), y and mask (K, n); returns the (K,) losses (before the step).  The same
    arithmetic as ``mlp_value_and_grad`` then the update up to the rounding of the fused multiply-adds (tested)."""
    z, pre = mlp_forward(params, x, layers, binary)
    num_out = params[layers[-1][0]].shape[-2]
    loss, r = head_residual(z, y, mask, None, binary, num_out)
    bufs = step.buffers
    for i in range(len(layers) - 1, -1, -1):
        wn, bn = layers[i]
        a = x if i == 0 else F.relu(pre[i - 1])
        r_next = (r @ params[wn]) * (pre[i - 1] > 0).to(r.dtype) if i > 0 else None  # with the weight before its step
        _apply(step, params[wn], None if bufs is None else bufs[wn], r.transpose(-1, -2), a)
        if bn:
            _apply(step, params[bn], None if bufs is None else bufs[bn], g=r.sum(-2))
        if r_next is not None:
            r = r_next
    return loss


class MLPFunctions(NamedTuple):
    """An MLP's closed forms (``mlp_functions``), the ``Model`` fields of the same names."""

    forward: Callable[[Params, Tensor], Tensor]
    analytic_grad: Callable[..., tuple[Params, Tensor]]
    clients_step: Callable[..., Tensor]
    components_grad: Callable[..., tuple[Params, Tensor]]
    components_step: Callable[..., Tensor]


def mlp_functions(layers: Layers, binary: bool) -> MLPFunctions:
    """The closed forms of an MLP with these dense layers, for ``Model(**mlp_functions(...)._asdict())``: the forward
    (one model, or M stacked on one input), the gradient (one model, M stacked, or K clients' on their own batches),
    the fused SGD step of K clients, and the gradient and fused step of K clients' M components each."""
    layers = tuple(layers)

    def forward(params: Params, x: Tensor) -> Tensor:
        return mlp_forward(params, x, layers, binary)[0]

    def value_and_grad(params: Params, x: Tensor, y: Tensor, mask: Tensor, weight: Tensor | None = None
                       ) -> tuple[Params, Tensor]:
        return mlp_value_and_grad(params, x, y, mask, weight, layers, binary)

    def clients_step(params: Params, x: Tensor, y: Tensor, mask: Tensor, step: Step) -> Tensor:
        return mlp_sgd_step_clients(params, x, y, mask, layers, binary, step)

    def components_grad(params: Params, x: Tensor, y: Tensor, mask: Tensor, weight: Tensor | None = None
                        ) -> tuple[Params, Tensor]:
        return mlp_components(params, x, y, mask, weight, layers, binary)

    def components_step(params: Params, x: Tensor, y: Tensor, mask: Tensor, weight: Tensor | None, step: Step
                        ) -> Tensor:
        return mlp_components(params, x, y, mask, weight, layers, binary, step)[1]

    return MLPFunctions(forward, value_and_grad, clients_step, components_grad, components_step)
