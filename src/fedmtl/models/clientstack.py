"""Any user ``nn.Module`` on K clients' stacked parameters at once: the clients form of a module.

``ClientsForm.of(module)`` makes a twin of the module in which every standard layer is replaced by its client-stacked
form, keeping the user's own ``forward`` code.  Activations flow with the K clients' batches side by side on the batch
axis (K x B rows, client-major), so every operation that treats examples independently (activations, pooling,
dropout with p = 0, flatten, views such as ``x.view(x.size(0), -1)``, residual sums) runs unchanged on all clients at
once, and only layers with parameters need to know the clients apart.  Each reads the number of clients K from the
leading axis of its (stacked) parameters:

=====================================  ===========================================================================
layer                                  client-stacked form
=====================================  ===========================================================================
``Linear``                             one batched matrix product over clients (``baddbmm``)
``Conv1d``, ``Conv2d``                 one grouped convolution, the clients as groups; on CUDA a ``Conv2d`` with
                                       one input channel as im2col + one batched product (``StackedConv``)
``Embedding``                          one lookup in the clients' tables laid end to end
``LayerNorm``, ``GroupNorm``           the normalization unchanged, the affine step per client
``fedmtl.BatchNorm``                   each client normalized with the statistics of its own real samples (padding
                                       left out) in training, with its own running statistics elsewhere; each
                                       client's updated running statistics recorded for the step to assign
``LSTM``, ``GRU``, ``RNN``             the recurrence with stacked gates: the input products of every step as one
                                       batched product, one per step for the hidden state (the manual recurrence of
                                       ``nn.LSTM``'s equations; PyTorch's gate order)
``MultiheadAttention``                 stacked projections; the attention itself is per example
=====================================  ===========================================================================

Any other module that owns parameters (and a standard layer in a configuration outside the table: a padding index
with ``max_norm``, recurrent dropout, separate key/value sizes ...) is a *fallback unit*: its forward runs under
``torch.func.vmap`` over the clients, or, where vmap cannot run it, once per client.  ``ClientsForm.layers`` says
which form each parameterised module took (``"stacked"``, ``"vmap"`` or ``"loop"``); ``summary.json`` records it.

A twin computes what the module computes only if the module's own code treats examples independently along axis 0.
``ClientsForm.verify`` checks that on real examples before a run uses the form (three clients with different weights
against the module applied client by client, to 1e-4): a module that mixes examples (a batch statistic of its own,
a reshape that fixes the batch size, a batch axis other than 0 around a stacked layer) is refused there and the run
takes the vmap or loop path instead, with the reason logged and recorded.  Gradients come from autograd through the
twin (``models.stacking.value_and_grad_clients``): each client's parameters receive exactly its own loss's gradient.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, vmap

from .. import batchnorm
from .lora import LoRALinear
from .parts import ModelError, value_and_grad_of

log = logging.getLogger("fedmtl")

#: the form each parameterised module of a twin takes
STACKED, VMAP, LOOP = "stacked", "vmap", "loop"


def _clients(x: Tensor, k: int) -> Tensor:
    """(K x B, ...) -> (K, B, ...): the clients' rows of a merged batch (client-major)."""
    if x.shape[0] % k:
        raise ValueError(f"a batch of {x.shape[0]} rows cannot hold {k} clients' examples side by side")
    return x.reshape(k, x.shape[0] // k, *x.shape[1:])


def _per_client(t: Tensor, k: int, nd: int) -> Tensor:
    """A per-client vector (K, C) shaped to broadcast over (K, B, C, *spatial with nd - 3 axes)."""
    return t.reshape(k, 1, t.shape[1], *([1] * (nd - 3)))


# ---------------------------------------------------------------------------------------------- stacked layers
class StackedLinear(nn.Module):
    """``nn.Linear`` on K clients: weight (K, out, in), bias (K, out); inputs (K x B, ..., in)."""

    def __init__(self, layer: nn.Linear):
        super().__init__()
        self.weight = layer.weight
        self.bias = layer.bias

    def forward(self, x: Tensor) -> Tensor:
        w, b = self.weight, self.bias
        k = w.shape[0]
        xs = x.reshape(k, -1, x.shape[-1])  # (K, B x ..., in): client-major rows
        out = torch.bmm(xs, w.transpose(1, 2)) if b is None else torch.baddbmm(b.unsqueeze(1), xs, w.transpose(1, 2))
        return out.reshape(*x.shape[:-1], w.shape[1])


class StackedLoRALinear(nn.Module):
    """``fedmtl.models.lora.LoRALinear`` on K clients: the frozen base (buffers, shared) on all K x B rows in one
    product, the adapters A (K, r, in) and B (K, out, r) as batched products; inputs (K x B, ..., in)."""

    weight: Tensor
    bias: Tensor | None

    def __init__(self, layer: LoRALinear):
        super().__init__()
        self.register_buffer("weight", layer.weight)
        self.register_buffer("bias", layer.bias)
        self.lora_A, self.lora_B, self.scale = layer.lora_A, layer.lora_B, float(layer.scale)

    def forward(self, x: Tensor) -> Tensor:
        a, b = self.lora_A, self.lora_B
        xs = x.reshape(a.shape[0], -1, x.shape[-1])  # (K, B x ..., in): client-major rows
        low = torch.bmm(torch.bmm(xs, a.transpose(1, 2)), b.transpose(1, 2))
        return F.linear(x, self.weight, self.bias) + self.scale * low.reshape(*x.shape[:-1], b.shape[1])


#: the largest unfolded input (elements: K x B x output positions x kernel size) the im2col path of a single-input-
#: channel ``StackedConv`` builds (1 GiB in float32); a larger one takes the grouped convolution
IM2COL_MAX_ELEMENTS = 2 ** 28


def use_im2col(x: Tensor) -> bool:
    """Whether a ``StackedConv`` with one input channel per client (``Conv2d(1, out, ...)``, the first layer on
    grayscale images) runs on the input ``x`` as im2col + batched product: on CUDA, where the grouped convolution with
    K groups of one channel takes the slow depthwise kernel (measured on ``cnn_femnist``'s first layer, 100 clients x
    128 images: forward and backward 2.5x faster as im2col); on the CPU the grouped convolution stays (no
    measurement says im2col pays there).  Module-level so that tests can force either path."""
    return x.is_cuda


def _same_padding(kernel: tuple[int, ...], dilation: tuple[int, ...]) -> tuple[int, ...] | None:
    """``padding="same"`` as symmetric padding, or None where PyTorch pads one side more (an even span)."""
    spans = [d * (k - 1) for k, d in zip(kernel, dilation, strict=True)]
    return None if any(s % 2 for s in spans) else tuple(s // 2 for s in spans)


class StackedConv(nn.Module):
    """``nn.Conv1d``/``nn.Conv2d`` on K clients as one grouped convolution: the clients' channels side by side
    (B, K x C, *spatial), weight (K x out, C / groups, *kernel), K x groups groups.

    A ``Conv2d`` with one input channel (``in_channels == groups == 1``) runs instead as im2col + one batched product
    over clients where ``use_im2col(x)`` says so (on CUDA): the (K x B, 1, H, W) input's windows as (K, B x L, kh x kw)
    (L output positions), times the clients' weights (K, kh x kw, out), plus the bias; autograd's backward is batched
    products too.  The unfolded input is bounded: where K x B x L x kh x kw exceeds ``IM2COL_MAX_ELEMENTS`` (2 ** 28,
    1 GiB in float32), or where ``padding="same"`` pads one side more, the grouped convolution runs."""

    def __init__(self, layer: nn.Conv1d | nn.Conv2d):
        super().__init__()
        self.weight = layer.weight
        self.bias = layer.bias
        self.conv = F.conv1d if isinstance(layer, nn.Conv1d) else F.conv2d
        self.stride, self.padding, self.dilation = layer.stride, layer.padding, layer.dilation
        self.groups = layer.groups
        # the im2col path's padding (None: no im2col path): a Conv2d with one input channel, padding it can express
        pad: tuple[int, ...] | None = None
        if isinstance(layer, nn.Conv2d) and layer.in_channels == 1 and layer.groups == 1:
            pad = ((0, 0) if layer.padding == "valid" else
                   _same_padding(layer.kernel_size, layer.dilation) if layer.padding == "same" else
                   tuple(layer.padding))  # type: ignore[arg-type]
        self.im2col_padding = pad

    def forward(self, x: Tensor) -> Tensor:
        w, b = self.weight, self.bias
        k = w.shape[0]
        if self.im2col_padding is not None and x.dim() == 4 and use_im2col(x):
            out = self._im2col(x, w, b, self.im2col_padding)
            if out is not None:
                return out
        xs = _clients(x, k)  # (K, B, C, *sp)
        n = xs.shape[1]
        merged = xs.transpose(0, 1).reshape(n, k * xs.shape[2], *xs.shape[3:])  # (B, K x C, *sp)
        out = self.conv(merged, w.reshape(k * w.shape[1], *w.shape[2:]), None if b is None else b.reshape(-1),
                        self.stride, self.padding, self.dilation, self.groups * k)  # (B, K x out, *sp')
        out = out.reshape(n, k, w.shape[1], *out.shape[2:]).transpose(0, 1)  # (K, B, out, *sp')
        return out.reshape(k * n, *out.shape[2:])

    def _im2col(self, x: Tensor, w: Tensor, b: Tensor | None, padding: tuple[int, ...]) -> Tensor | None:
        """The single-input-channel convolution as im2col + ``bmm`` (class docstring), or None where the unfolded
        input would exceed ``IM2COL_MAX_ELEMENTS``.  x (K x B, 1, H, W), w (K, out, 1, kh, kw) -> (K x B, out, H', W')
        (channels-last strides: the product's (K, B x L, out) rows as they are)."""
        k, cout, kh, kw = w.shape[0], w.shape[1], w.shape[3], w.shape[4]
        n = _clients(x, k).shape[1]
        oh, ow = ((size + 2 * p - d * (ks - 1) - 1) // s + 1 for size, p, d, ks, s in
                  zip(x.shape[2:], padding, self.dilation, (kh, kw), self.stride, strict=True))
        if k * n * oh * ow * kh * kw > IM2COL_MAX_ELEMENTS:
            return None
        # the windows as a strided view of the padded input, then one copy into the product's rows (not F.unfold:
        # on CUDA its im2col launches one kernel per image, 18x slower than the grouped convolution, measured)
        (ph, pw), (dh, dw), (sh, sw) = padding, self.dilation, self.stride
        xp = F.pad(x[:, 0], (pw, pw, ph, ph)) if ph or pw else x[:, 0]  # (K x B, H + 2 ph, W + 2 pw)
        # (K x B, H', W', kh, kw): window (i, j) of each image
        win = xp.unfold(1, dh * (kh - 1) + 1, sh).unfold(2, dw * (kw - 1) + 1, sw)[..., ::dh, ::dw]
        cols = win.reshape(k, n * oh * ow, kh * kw)  # (K, B x L, kh x kw)
        ws = w.reshape(k, cout, kh * kw).transpose(1, 2)  # (K, kh kw, out)
        out = torch.bmm(cols, ws) if b is None else torch.baddbmm(b.unsqueeze(1), cols, ws)  # (K, B L, out)
        return out.reshape(k * n, oh, ow, cout).permute(0, 3, 1, 2)


class StackedEmbedding(nn.Module):
    """``nn.Embedding`` on K clients: one lookup in the K tables laid end to end (weight (K, V, D)); the padding
    row receives no gradient, as in ``nn.Embedding``."""

    def __init__(self, layer: nn.Embedding):
        super().__init__()
        self.weight = layer.weight
        self.padding_idx = layer.padding_idx

    def forward(self, idx: Tensor) -> Tensor:
        w = self.weight
        k, v = w.shape[0], w.shape[1]
        ids = _clients(idx, k)
        offset = (torch.arange(k, device=idx.device) * v).reshape(k, *([1] * (ids.dim() - 1)))
        out = F.embedding(ids + offset, w.reshape(k * v, w.shape[2])).reshape(*idx.shape, w.shape[2])
        if self.padding_idx is not None:
            out = torch.where((idx == self.padding_idx).unsqueeze(-1), out.detach(), out)
        return out


class StackedLayerNorm(nn.Module):
    """``nn.LayerNorm`` on K clients: the normalization per example, the affine step with each client's weights."""

    def __init__(self, layer: nn.LayerNorm):
        super().__init__()
        self.weight = layer.weight
        self.bias = layer.bias
        self.normalized_shape, self.eps = tuple(layer.normalized_shape), layer.eps

    def forward(self, x: Tensor) -> Tensor:
        y = F.layer_norm(x, self.normalized_shape, None, None, self.eps)
        w, b = self.weight, self.bias
        if w is None and b is None:
            return y
        k = (w if w is not None else b).shape[0]
        ys = y.reshape(k, -1, *self.normalized_shape)
        if w is not None:
            ys = ys * w.unsqueeze(1)
        if b is not None:
            ys = ys + b.unsqueeze(1)
        return ys.reshape(x.shape)


class StackedGroupNorm(nn.Module):
    """``nn.GroupNorm`` on K clients: the normalization per example, the per-channel affine step per client."""

    def __init__(self, layer: nn.GroupNorm):
        super().__init__()
        self.weight = layer.weight
        self.bias = layer.bias
        self.num_groups, self.eps = layer.num_groups, layer.eps

    def forward(self, x: Tensor) -> Tensor:
        y = F.group_norm(x, self.num_groups, None, None, self.eps)
        w, b = self.weight, self.bias
        if w is None:
            return y
        k = w.shape[0]
        ys = _clients(y, k)
        ys = ys * _per_client(w, k, ys.dim()) + (0 if b is None else _per_client(b, k, ys.dim()))
        return ys.reshape(x.shape)


class StackedBatchNorm(nn.Module):
    """``fedmtl.BatchNorm`` on K clients: weights, biases and running statistics (K, C); inputs (K x B, C, *spatial).
    In training (``fedmtl.batchnorm.training`` with the clients' (K, B) mask) client k's channels are normalized
    with the mean and variance of k's own real samples, and k's running statistics move with them (recorded under
    the layer's parameter names, (K, C) each), exactly what ``BatchNorm`` does for k alone
    (``fedmtl.batchnorm.normalize``); elsewhere with k's running statistics."""

    def __init__(self, layer: batchnorm.BatchNorm):
        super().__init__()
        self.weight, self.bias = layer.weight, layer.bias
        self.running_mean, self.running_var = layer.running_mean, layer.running_var
        self.momentum, self.eps, self.num_features = layer.momentum, layer.eps, layer.num_features
        self.prefix = ""  # the layer's name in the module ("features.1."): set where the form is made

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() < 2 or x.shape[1] != self.num_features:
            raise ValueError(f"BatchNorm({self.num_features}) needs inputs (n, {self.num_features}, ...), "
                             f"got {tuple(x.shape)}")
        xs = _clients(x, self.weight.shape[0])  # (K, B, C, *sp)
        return batchnorm.normalize(xs, self.weight, self.bias, self.running_mean, self.running_var, self.momentum,
                                   self.eps, self.prefix).reshape(x.shape)


_GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}


class StackedRNN(nn.Module):
    """``nn.LSTM``, ``nn.GRU`` or ``nn.RNN`` on K clients (any number of layers, bidirectional or not, with or without
    biases, batch-first or not): per layer and direction, the input products of all time steps as one batched product
    over clients, then one batched product per step for the hidden state.  PyTorch's equations and gate order
    (LSTM i, f, g, o; GRU r, z, n with n = tanh(W_in x + b_in + r (W_hn h + b_hn)))."""

    def __init__(self, layer: nn.RNNBase):
        super().__init__()
        for name in layer._flat_weights_names:
            setattr(self, name, getattr(layer, name))
        self.mode: str = layer.mode
        self.hidden: int = layer.hidden_size
        self.layers: int = layer.num_layers
        self.directions = 2 if layer.bidirectional else 1
        self.batch_first: bool = layer.batch_first
        self.weight_names = list(layer._flat_weights_names)

    def _w(self, kind: str, layer: int, reverse: bool) -> Tensor | None:
        name = f"{kind}_l{layer}{'_reverse' if reverse else ''}"
        return getattr(self, name) if name in self.weight_names else None

    def _cell(self, gx: Tensor, h: Tensor, c: Tensor | None, w_hh: Tensor, b_hh: Tensor | None
              ) -> tuple[Tensor, Tensor | None]:
        """One step of K clients: gx (K, B, G x H) the input's gate pre-activations, h (K, B, H)."""
        gh = torch.bmm(h, w_hh.transpose(1, 2)) if b_hh is None else torch.baddbmm(b_hh.unsqueeze(1), h,
                                                                                    w_hh.transpose(1, 2))
        if self.mode == "LSTM":
            i, f, g, o = (gx + gh).chunk(4, dim=-1)
            assert c is not None
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            return torch.sigmoid(o) * torch.tanh(c), c
        if self.mode == "GRU":
            xr, xz, xn = gx.chunk(3, dim=-1)
            hr, hz, hn = gh.chunk(3, dim=-1)
            r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
            n = torch.tanh(xn + r * hn)
            return (1 - z) * n + z * h, None
        act = torch.tanh if self.mode == "RNN_TANH" else torch.relu
        return act(gx + gh), None

    def forward(self, x: Tensor, hx: Any = None) -> tuple[Tensor, Any]:
        if not isinstance(x, Tensor) or x.dim() != 3:
            raise ValueError("the stacked recurrent layer takes batched 3-d inputs (no PackedSequence)")
        first = self._w("weight_ih", 0, False)
        assert first is not None
        k = int(first.shape[0])
        seq = x if self.batch_first else x.transpose(0, 1)  # (K x B, T, I)
        inp = _clients(seq, k)  # (K, B, T, I)
        n, steps = inp.shape[1], inp.shape[2]
        h0 = c0 = None
        if hx is not None:
            h0, c0 = hx if self.mode == "LSTM" else (hx, None)
        finals_h, finals_c = [], []
        for layer in range(self.layers):
            outs = []
            for d in range(self.directions):
                rev = d == 1
                w_ih, w_hh = self._w("weight_ih", layer, rev), self._w("weight_hh", layer, rev)
                b_ih, b_hh = self._w("bias_ih", layer, rev), self._w("bias_hh", layer, rev)
                assert w_ih is not None and w_hh is not None
                flat = inp.reshape(k, n * steps, inp.shape[-1])
                gx = torch.bmm(flat, w_ih.transpose(1, 2)) if b_ih is None else torch.baddbmm(
                    b_ih.unsqueeze(1), flat, w_ih.transpose(1, 2))
                gx = gx.reshape(k, n, steps, -1)
                j = layer * self.directions + d
                h = x.new_zeros(k, n, self.hidden) if h0 is None else _clients(h0[j], k)
                c = None
                if self.mode == "LSTM":
                    c = x.new_zeros(k, n, self.hidden) if c0 is None else _clients(c0[j], k)
                hs: list[Tensor] = [x] * steps
                for t in (range(steps - 1, -1, -1) if rev else range(steps)):
                    h, c = self._cell(gx[:, :, t], h, c, w_hh, b_hh)
                    hs[t] = h
                outs.append(torch.stack(hs, dim=2))  # (K, B, T, H)
                finals_h.append(h.reshape(k * n, self.hidden))
                if c is not None:
                    finals_c.append(c.reshape(k * n, self.hidden))
            inp = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        out = inp.reshape(k * n, steps, inp.shape[-1])
        out = out if self.batch_first else out.transpose(0, 1)
        h_n = torch.stack(finals_h)
        return out, ((h_n, torch.stack(finals_c)) if self.mode == "LSTM" else h_n)


class StackedAttention(nn.Module):
    """``nn.MultiheadAttention`` (one embedding size for queries, keys and values) on K clients: the input and output
    projections as batched products over clients; the scaled dot-product attention per example and head."""

    def __init__(self, layer: nn.MultiheadAttention):
        super().__init__()
        self.in_proj_weight = layer.in_proj_weight
        self.in_proj_bias = layer.in_proj_bias
        self.out_proj = StackedLinear(layer.out_proj)
        self.heads, self.batch_first, self.embed = layer.num_heads, layer.batch_first, layer.embed_dim

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None = None,
                need_weights: bool = True, attn_mask: Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
        if query.dim() != 3:
            raise ValueError("the stacked attention takes batched 3-d inputs")
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))  # (K x B, T, E)
        w, b = self.in_proj_weight, self.in_proj_bias
        k, e, h = w.shape[0], self.embed, self.heads
        n, tq, ts = query.shape[0], query.shape[1], key.shape[1]

        def project(t: Tensor, i: int) -> Tensor:  # (K x B, T, E) -> (K x B, heads, T, E / heads)
            ws = w[:, i * e:(i + 1) * e].transpose(1, 2)
            flat = t.reshape(k, -1, e)
            p = torch.bmm(flat, ws) if b is None else torch.baddbmm(b[:, None, i * e:(i + 1) * e], flat, ws)
            return p.reshape(n, -1, h, e // h).transpose(1, 2)

        q, kk, v = project(query, 0), project(key, 1), project(value, 2)
        mask = _attention_mask(attn_mask, key_padding_mask, n, h, tq, ts, q.dtype, is_causal)
        if need_weights:
            scores = q @ kk.transpose(-1, -2) / math.sqrt(e // h)
            if mask is not None:
                scores = scores + mask
            weights: Tensor | None = torch.softmax(scores, dim=-1)  # (K x B, heads, Tq, Ts)
            out = weights @ v  # type: ignore[operator]
        else:
            out = F.scaled_dot_product_attention(q, kk, v, attn_mask=mask)
            weights = None
        out = self.out_proj(out.transpose(1, 2).reshape(n, tq, e))
        if not self.batch_first:
            out = out.transpose(0, 1)
        if weights is not None and average_attn_weights:
            weights = weights.mean(1)
        return out, weights


def _attention_mask(attn_mask: Tensor | None, key_padding_mask: Tensor | None, n: int, heads: int, tq: int, ts: int,
                    dtype: torch.dtype, is_causal: bool) -> Tensor | None:
    """``nn.MultiheadAttention``'s masks as one additive float mask broadcast to (N, heads, Tq, Ts) (True: masked)."""

    def additive(m: Tensor) -> Tensor:
        return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(m, float("-inf")) \
            if m.dtype == torch.bool else m.to(dtype)

    out: Tensor | None = None
    if attn_mask is not None:  # given, it is the mask (``is_causal`` is only a hint about it, as in PyTorch)
        a = additive(attn_mask)
        out = a.reshape(n, heads, tq, ts) if a.dim() == 3 else a
    elif is_causal:
        device = key_padding_mask.device if key_padding_mask is not None else None
        out = additive(torch.ones(tq, ts, dtype=torch.bool, device=device).triu(1))
    if key_padding_mask is not None:
        kp = additive(key_padding_mask).reshape(n, 1, 1, ts)
        out = kp if out is None else out + kp
    return out


def _stacked_form(m: nn.Module) -> nn.Module | None:
    """The client-stacked form of a standard layer in a configuration the form reproduces exactly, else None."""
    if type(m) is nn.Linear:
        return StackedLinear(m)
    if type(m) is LoRALinear:
        return StackedLoRALinear(m)
    if type(m) in (nn.Conv1d, nn.Conv2d) and m.padding_mode == "zeros":
        return StackedConv(m)  # type: ignore[arg-type]
    if type(m) is nn.Embedding and m.max_norm is None and not m.sparse and not m.scale_grad_by_freq:
        return StackedEmbedding(m)
    if type(m) is nn.LayerNorm:
        return StackedLayerNorm(m)
    if type(m) is nn.GroupNorm:
        return StackedGroupNorm(m)
    if type(m) is batchnorm.BatchNorm:
        return StackedBatchNorm(m)
    if type(m) in (nn.LSTM, nn.GRU, nn.RNN) and m.dropout == 0 and getattr(m, "proj_size", 0) == 0:
        return StackedRNN(m)  # type: ignore[arg-type]
    if (type(m) is nn.MultiheadAttention and m._qkv_same_embed_dim and m.bias_k is None and not m.add_zero_attn
            and m.dropout == 0):
        return StackedAttention(m)
    return None


# ---------------------------------------------------------------------------------------------- fallback units
def _unit_forward(path: str, unit: nn.Module, template: nn.Module, names: list[str], mode: str
                  ) -> Callable[..., Any]:
    """The forward of a fallback unit: ``template`` (a copy of the unit) applied to each client's rows with its
    parameters, under vmap (``mode == "vmap"``) or client by client; tensors whose first axis holds the K clients'
    rows are split, anything else is shared."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        params = {n: _get(unit, n) for n in names}  # (K, ...) while the twin runs under functional_call
        k = next(iter(params.values())).shape[0]

        def split(a: Any) -> Any:
            return _clients(a, k) if isinstance(a, Tensor) and a.dim() > 0 and a.shape[0] % k == 0 else a

        parts = [split(a) for a in args]
        dims = tuple(0 if isinstance(a, Tensor) and p is not a else None for a, p in zip(args, parts, strict=True))
        if mode == VMAP:
            try:
                out = vmap(lambda p, *a: functional_call(template, p, a, kwargs), in_dims=(0, *dims),
                           randomness="error")(params, *parts)
            except Exception as e:  # named, so that ``ClientsForm.verify`` loops this unit
                e.fedmtl_unit = path  # type: ignore[attr-defined]
                raise
        else:
            rows = [functional_call(template, {n: v[i] for n, v in params.items()},
                                    tuple(p[i] if d == 0 else p for p, d in zip(parts, dims, strict=True)), kwargs)
                    for i in range(k)]
            out = torch.utils._pytree.tree_map(lambda *xs: torch.stack(xs), *rows)
        return torch.utils._pytree.tree_map(lambda t: t.reshape(-1, *t.shape[2:]) if isinstance(t, Tensor) else t,
                                            out)

    return forward


def _get(root: nn.Module, dotted: str) -> Tensor:
    mod, _, leaf = dotted.rpartition(".")
    return getattr(root.get_submodule(mod) if mod else root, leaf)


# ---------------------------------------------------------------------------------------------- the form
class ClientsForm:
    """A module's twin for K clients' stacked parameters (module docstring): ``form(params, x)`` with params
    (K, ...) keyed like the module's ``named_parameters`` and x (K, B, ...) returns (K, B, ...) outputs."""

    def __init__(self, module: nn.Module):
        drop = [n for n, m in module.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]
        if drop and module.training:
            raise NoClientsForm(f"dropout {drop[0]!r} draws random masks from torch's global generator, which no two "
                               "paths draw alike")
        self.layers: dict[str, str] = {}
        self.usable: bool | None = None  # None: not verified yet; False: ``reason`` says why not
        self.reason = ""
        self._units: list[tuple[str, nn.Module, nn.Module, list[str]]] = []
        root = _stacked_form(module)
        if root is not None:  # the module is one standard layer
            self.twin, self.layers[""] = root, STACKED
        else:
            if any(True for _ in module.parameters(recurse=False)):
                raise NoClientsForm(f"{type(module).__name__} owns parameters of its own, outside any sub-module")
            # the module's buffers are shared with the twin, not copied (a frozen base model is held once)
            self.twin = copy.deepcopy(module, {id(b): b for b in module.buffers()})
            self._convert(self.twin, "")
        for m in (*self.twin.modules(), *(t for _, _, t, _ in self._units)):  # only buffers are ever read
            for m2 in m.modules():
                for name, p in list(m2._parameters.items()):
                    if p is not None and p.device.type != "meta":
                        m2._parameters[name] = nn.Parameter(torch.empty_like(p, device="meta"),
                                                            requires_grad=p.requires_grad)
        # which of the twin's buffer slots hold one of the module's buffers: where the module moves to another
        # device, ``to`` points them at its moved tensors again (the base stays held once, on the run's device)
        owners = {id(b): (mod, name) for mod in module.modules() for name, b in mod._buffers.items() if b is not None}
        self._links: list[tuple[nn.Module, str, nn.Module, str]] = [
            (m2, name, *owners[id(b)]) for m2 in self._buffer_holders() for name, b in m2._buffers.items()
            if b is not None and id(b) in owners]
        self._device: torch.device | None = None

    def _buffer_holders(self) -> list[nn.Module]:
        return [m2 for m in (*self.twin.modules(), *(t for _, _, t, _ in self._units)) for m2 in m.modules()]

    @classmethod
    def of(cls, module: nn.Module) -> ClientsForm | None:
        """The clients form of ``module``, or None where it cannot have one (``NoClientsForm``) or where no layer
        with parameters has a stacked form (nothing to gain over the vmap path)."""
        try:
            form = cls(module)
        except NoClientsForm as e:
            log.debug("no clients form: %s", e)
            return None
        return form if STACKED in form.layers.values() else None

    def _convert(self, mod: nn.Module, prefix: str) -> None:
        for name, child in list(mod.named_children()):
            path = f"{prefix}{name}"
            if not any(True for _ in child.parameters()):  # nothing per client (e.g. a frozen base layer's buffers):
                continue  # it runs as it is on the K clients' merged rows
            stacked = _stacked_form(child)
            if stacked is not None:
                if isinstance(stacked, StackedBatchNorm):  # its statistics are recorded under the module's names
                    stacked.prefix = f"{path}."
                setattr(mod, name, stacked)
                self.layers[path] = STACKED
            elif any(True for _ in child.parameters(recurse=False)):
                # a module with parameters of its own and code we cannot see: vmapped (or looped) as a whole
                names = [n for n, _ in child.named_parameters()]
                self._units.append((path, child, copy.deepcopy(child, {id(b): b for b in child.buffers()}), names))
                child.forward = _unit_forward(path, child, self._units[-1][2], names, VMAP)
                self.layers[path] = VMAP
            elif any(True for _ in child.parameters()):  # a container: its own code runs on the merged batch
                self._convert(child, f"{path}.")

    def loop_unit(self, path: str) -> None:
        """Run the fallback unit ``path`` client by client (where vmap cannot run it)."""
        for p, unit, template, names in self._units:
            if p == path:
                unit.forward = _unit_forward(p, unit, template, names, LOOP)
                self.layers[path] = LOOP

    def __call__(self, params: dict[str, Tensor], x: Tensor) -> Tensor:
        if x.device != self._device:  # the run's device: the twin's buffers follow the examples
            self.to(x.device)
        k, n = x.shape[0], x.shape[1]
        out = functional_call(self.twin, params, (x.reshape(k * n, *x.shape[2:]),))
        return out.reshape(k, n, *out.shape[1:])

    def to(self, device: torch.device) -> None:
        """Move the twin's buffers to ``device`` (its parameters are placeholders: a run supplies them).  A buffer
        shared with the module is the module's own tensor again where the module is on ``device`` (moved after the
        twin was made), and a copy only where it is not."""
        device = torch.empty(0, device=device).device  # "cuda" names the device a tensor calls "cuda:0"
        linked = {(id(m2), name): src._buffers[sname] for m2, name, src, sname in self._links}
        for m2 in self._buffer_holders():
            for name, b in list(m2._buffers.items()):
                if b is not None:
                    own = linked.get((id(m2), name))
                    m2._buffers[name] = own if own is not None and own.device == device else b.to(device)
        self._device = device

    def logits(self, params: dict[str, Tensor], x: Tensor, binary: bool) -> Tensor:
        """``self(params, x)`` with a binary model's (K, B, 1) outputs as (K, B) (the model's clients logits)."""
        out = self(params, x)
        if binary and out.dim() > 2 and out.shape[-1] == 1:
            return out.reshape(out.shape[:-1])
        return out

    def check(self, x: Tensor, module: nn.Module, params: dict[str, Tensor], num_classes: int, binary: bool,
              nll: Callable[[Tensor, Tensor], Tensor]) -> bool:
        """Check the form once on examples ``x`` (n >= 3, already through the model's input transform): three
        clients' models (weights drawn around ``params``, the model's initial ones) on their own examples, outputs and
        gradients of the form against ``module`` applied to each, to 1e-4 of their scale (``verify``); ``nll(out, y)``
        is the model's per-sample loss.  A form that does not reproduce the module is not used (``usable`` turns
        False; the reason is logged and kept in ``reason``).  Later calls return the outcome (``Model.check_features``
        and ``models.stacking.verify_clients`` call it)."""
        if self.usable is not None:
            return self.usable
        n = x.shape[0] // 3
        if n < 1:
            raise ModelError("verifying a clients form needs at least 3 examples")
        gen = torch.Generator().manual_seed(0)

        def near(name: str, v: Tensor, i: int) -> Tensor:  # client i's weights: far enough apart that mixing them shows
            if i == 0 or not v.is_floating_point():
                return v
            if name.rsplit(".", 1)[-1] == "running_var":  # a batch-norm variance stays positive
                return v * torch.exp(0.5 * torch.randn(v.shape, generator=gen)).to(v)
            scale = max(float(v.detach().float().std()) if v.numel() > 1 else 0.0, float(v.detach().abs().mean()), 0.05)
            return v + 0.5 * scale * torch.randn(v.shape, generator=gen).to(v)

        stacked = {k: torch.stack([near(k, v, i) for i in range(3)]) for k, v in params.items()}
        xs = x[:3 * n].reshape(3, n, *x.shape[1:])
        ys = torch.randint(0, num_classes, (3, n), generator=gen).to(x.device)
        mask = torch.ones(3, n, device=x.device)

        def module_out(p: dict[str, Tensor], xi: Tensor) -> Tensor:  # the module itself on transformed examples
            out = functional_call(module, p, (xi,))
            return out.reshape(out.shape[:-1]) if binary and out.shape[-1:] == (1,) else out

        def losses(p: dict[str, Tensor], x: Tensor, y: Tensor, mask: Tensor) -> Tensor:  # each client's mean loss
            return (nll(self.logits(p, x, binary), y) * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)

        batch_norm = any(isinstance(m, StackedBatchNorm) for m in self.twin.modules())

        def compare() -> str | None:
            with torch.no_grad():
                got = self.logits(stacked, xs, binary)
                if batch_norm:
                    with batchnorm.training(mask):
                        got_train = self.logits(stacked, xs, binary)
            grads, _ = clients_value_and_grad(losses, stacked, xs, ys, mask)
            for i in range(3):
                p = {k: v[i] for k, v in stacked.items()}
                with torch.no_grad():
                    want = module_out(p, xs[i])
                if got[i].shape != want.shape:
                    return f"outputs shaped {tuple(got[i].shape)} instead of {tuple(want.shape)}"
                if not _close(got[i], want):
                    return (f"outputs differ from the module's by {float((got[i] - want).abs().max()):.3g} (its code "
                            "mixes examples, or its batch axis is not the first)")
                if batch_norm:  # and in training: each client normalized with its own batch's statistics
                    with torch.no_grad(), batchnorm.training(mask[i]):
                        want = module_out(p, xs[i])
                    if not _close(got_train[i], want):
                        return ("outputs in training (batch statistics) differ from the module's by "
                                f"{float((got_train[i] - want).abs().max()):.3g}")

                def loss(q: dict[str, Tensor], i: int = i) -> Tensor:  # ``Model.loss``'s mean over the real samples
                    return (nll(module_out(q, xs[i]), ys[i]) * mask[i]).sum(-1) / mask[i].sum().clamp_min(1.0)

                for k, g in value_and_grad_of(loss, p)[0].items():
                    if not _close(grads[k][i], g):
                        err = float((grads[k][i] - g).abs().max())
                        return f"the gradient of {k!r} differs from the module's by {err:.3g}"
            return None

        return self.verify(compare)

    def verify(self, compare: Callable[[], str | None]) -> bool:
        """Run ``compare`` (the form against the module on real examples: ``check``), which returns
        None where they agree and the difference otherwise.  A fallback unit that vmap cannot run is switched to the
        loop and the comparison repeated.  Sets ``usable`` and ``reason``; returns usable."""
        while True:
            try:
                diff = compare()
                break
            except Exception as e:  # a fallback unit vmap cannot run (or a stacked layer the code misuses)
                unit = getattr(e, "fedmtl_unit", None)
                if unit is None or self.layers.get(unit) != VMAP:
                    diff = f"{type(e).__name__}: {e}"
                    break
                self.loop_unit(unit)  # that unit client by client, and again
        self.usable, self.reason = diff is None, diff or ""
        if diff is not None:
            log.info("the clients form of this module is not used: %s", diff)
        return diff is None


class NoClientsForm(ValueError):
    """A module that cannot have a clients form (and why)."""


def clients_value_and_grad(losses: Callable[..., Tensor], params: dict[str, Tensor], *args: Any
                           ) -> tuple[dict[str, Tensor], Tensor]:
    """(gradients, (K,) losses) of K clients' models (params (K, ...)) by autograd through ``losses(params, *args)``,
    which returns each client's loss: the gradient of their sum with respect to client k's parameters is exactly k's
    own loss's (zeros for a parameter the losses do not read)."""
    with torch.enable_grad():
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        loss = losses(leaves, *args)
        grads = torch.autograd.grad(loss.sum(), list(leaves.values()), allow_unused=True)
    return ({k: torch.zeros_like(v) if g is None else g for (k, v), g in zip(params.items(), grads, strict=True)},
            loss.detach())


def _close(a: Tensor, b: Tensor) -> bool:
    """Equal to 1e-4 of their scale (a clients form against its module: sums in another order)."""
    return bool(torch.allclose(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max().clamp_min(1e-3))))


__all__ = ["LOOP", "STACKED", "VMAP", "ClientsForm", "NoClientsForm", "StackedAttention", "StackedBatchNorm",
           "StackedConv", "StackedEmbedding", "StackedGroupNorm", "StackedLayerNorm", "StackedLinear", "StackedRNN"]
