"""A small character-level transformer (decoder blocks: pre-norm causal self-attention and an MLP), written with
plain ``nn.Linear`` projections so that low-rank adapters (``fedmtl.models.lora``) can target them by name: each
block's ``attn.q``, ``attn.k``, ``attn.v``, ``attn.o``, ``mlp.fc1``, ``mlp.fc2``, and the output ``head``.

It reads token ids (n, seq_len) and returns the next token's logits (n, vocab) from the last position: the LEAF
Shakespeare task (Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018).  Every operation batches under
``torch.func.vmap`` (attention written out with matrix products and a fixed causal mask, no dropout).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..machine import check_parameters
from ..schema import Annotated, Range
from .base import Model, ModelError


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        n, t, d = x.shape
        h = self.heads

        def split(z: Tensor) -> Tensor:
            return z.reshape(n, t, h, d // h).transpose(1, 2)  # (n, h, t, d_h)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // h) + mask  # mask: 0 on and below the diagonal, -inf above
        out = F.softmax(att, dim=-1) @ v
        return self.o(out.transpose(1, 2).reshape(n, t, d))


class MLP(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, hidden: int):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(d), Attention(d, heads), nn.LayerNorm(d), MLP(d, hidden)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class CharTransformer(nn.Module):
    """Token and position embeddings, ``layers`` pre-norm blocks, a final LayerNorm and the output ``head``."""

    mask: Tensor

    def __init__(self, vocab: int, seq_len: int, d: int = 128, layers: int = 3, heads: int = 4, mlp_ratio: int = 4):
        super().__init__()
        if d % heads:
            raise ModelError(f"char_transformer: d_model {d} is not a multiple of heads {heads}")
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, heads, mlp_ratio * d) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)
        self.register_buffer("mask", torch.full((seq_len, seq_len), float("-inf")).triu(1), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        t = x.shape[1]
        z = self.tok(x.long()) + self.pos.weight[:t]
        for b in self.blocks:
            z = b(z, self.mask[:t, :t])
        return self.head(self.ln(z[:, -1]))


def char_transformer(input_shape: tuple[int, ...], num_classes: int, meta: dict[str, Any] | None = None,
                     d_model: Annotated[int, Range(8, 4096)] = 128, layers: Annotated[int, Range(1, 64)] = 3,
                     heads: Annotated[int, Range(1, 64)] = 4, mlp_ratio: Annotated[int, Range(1, 16)] = 4) -> Model:
    """A ``CharTransformer`` for token windows of ``input_shape = (seq_len,)`` over ``num_classes`` tokens."""
    if len(input_shape) != 1:
        raise ModelError(f"char_transformer reads token windows (n, seq_len), got features of shape {input_shape}")
    d = d_model  # attention (4 d^2) and MLP (2 r d^2) per layer, embeddings and head, before any allocation
    check_parameters(layers * (4 + 2 * mlp_ratio) * d * (d + 1) + (2 * num_classes + int(input_shape[0])) * (d + 1),
                     f"[model] char_transformer with d_model = {d}, layers = {layers}, mlp_ratio = {mlp_ratio}")
    module = CharTransformer(num_classes, int(input_shape[0]), d_model, layers, heads, mlp_ratio)
    model = Model.from_module(module, num_classes, output="multiclass", name="char_transformer", head=("head.weight",
                                                                                                        "head.bias"))
    object.__setattr__(model, "token_input", True)
    return model


__all__ = ["CharTransformer", "char_transformer"]
