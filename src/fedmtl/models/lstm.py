"""Next-character LSTM (LEAF / FedEM Shakespeare model): embedding 8 -> 2-layer LSTM(256) -> dense.

``torch.func.vmap`` over ``nn.LSTM`` has no batching rule for the CPU RNN kernel and falls back to a
slow per-sample path, so the forward pass is written with matrix products (``lstm_forward``): the
input projections of all time steps in one product per layer, then the recurrence; vmap over clients
turns those into batched products.  It reads ``nn.LSTM``'s own parameters (gate order i, f, g, o) and
equals the module's output (tested).  Outside torch.func transforms (the loop runner, evaluation on
one client) the module itself runs, with nn.LSTM's fused CPU kernel and plain autograd, faster than any
batched form written with matmuls here, so the ``auto`` runner loops over clients for this model on CPU.  On a
GPU too: vmapped, each step dispatches the recurrence's small batched operations one by one (thousands per step)
where cuDNN runs one fused kernel per client.  The prediction is made from the last time step.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..machine import check_parameters
from ..schema import Annotated, Range
from ..tree import Params
from .base import Model
from .clientstack import ClientsForm


class CharLSTM(nn.Module):
    def __init__(self, vocab: int, embed: int = 8, hidden: int = 256, layers: int = 2):
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, layers, batch_first=True)
        self.decoder = nn.Linear(hidden, vocab)
        self.layers = layers

    def forward(self, x: Tensor) -> Tensor:  # the module path: reference for the functional one
        h, _ = self.lstm(self.embedding(x.long()))
        return self.decoder(h[:, -1])


def lstm_forward(params: Params, x: Tensor, layers: int = 2) -> Tensor:
    """(n, T) character indices -> (n, vocab) logits of the next character."""
    return lstm_features(params, x, layers) @ params["decoder.weight"].T + params["decoder.bias"]


def lstm_features(params: Params, x: Tensor, layers: int = 2) -> Tensor:
    """(n, T) character indices -> (n, hidden): the last layer's state at the last step (the decoder's input)."""
    h_in = F.embedding(x.long(), params["embedding.weight"])  # (n, T, E)
    n, steps = h_in.shape[0], h_in.shape[1]
    h = h_in.new_zeros(())
    for layer in range(layers):
        w_ih, w_hh = params[f"lstm.weight_ih_l{layer}"], params[f"lstm.weight_hh_l{layer}"]
        gx = h_in @ w_ih.T + (params[f"lstm.bias_ih_l{layer}"] + params[f"lstm.bias_hh_l{layer}"])  # (n, T, 4H)
        hidden = w_hh.shape[1]
        h = gx.new_zeros(n, hidden)
        c = gx.new_zeros(n, hidden)
        outs = []
        for t in range(steps):
            i, f, g, o = (gx[:, t] + h @ w_hh.T).chunk(4, dim=-1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            if layer < layers - 1:
                outs.append(h)
        if layer < layers - 1:
            h_in = torch.stack(outs, dim=1)
    return h


def char_lstm(
    input_shape: tuple[int, ...],
    num_classes: int,
    meta: dict[str, object] | None = None,
    embed: Annotated[int, Range(1, 10**4)] = 8,
    hidden: Annotated[int, Range(1, 10**5)] = 256,
    layers: Annotated[int, Range(1, 64)] = 2,
) -> Model:
    h = hidden  # the gates' weights and biases of each layer, the embedding and the decoder, before any allocation
    check_parameters(sum(4 * h * ((embed if i == 0 else h) + h + 2) for i in range(layers))
                     + num_classes * (embed + h + 1), f"[model] lstm with embed = {embed}, hidden = {h}, layers = "
                     f"{layers}")
    module = CharLSTM(num_classes, embed, hidden, layers)
    # on a GPU the stacked executor runs all clients' recurrences as one (the clients form's stacked gates); on a CPU
    # each client's fused nn.LSTM kernel is faster (the loop)
    return Model(module, "multiclass", num_classes, name="lstm", forward=lambda p, x: lstm_forward(p, x, layers),
                 module_when_eager=True, prefer_loop_on_cpu=True, prefer_loop_on_cuda=True, token_input=True,
                 head=("decoder.weight", "decoder.bias"), embed=lambda p, x: lstm_features(p, x, layers),
                 clients_form=ClientsForm.of(module))
