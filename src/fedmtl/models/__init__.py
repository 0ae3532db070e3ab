"""The built-in models, registered under their config names (``[model] name``).

``linear`` and ``mlp`` (``dense``), ``cnn_femnist``, ``cnn_bn``, ``cnn_cifar`` and ``cnn_pfl`` (``cnn``),
``lstm`` (``lstm``), ``char_transformer`` (``transformer``), ``resnet`` (``resnet``: the CIFAR ResNet-18).
A model builder is ``(input_shape, num_classes, meta=None, **kwargs) -> Model``; its keyword arguments are the
``[model]`` table's keys.  ``fedmtl.register_model`` adds more.
"""

from __future__ import annotations

from ..registry import MODELS, register_model
from .base import Model, ModelError
from .cnn import bn_cnn, cifar_cnn, femnist_cnn, pfl_cnn
from .dense import linear, mlp
from .lstm import CharLSTM, char_lstm, lstm_forward
from .resnet import resnet
from .transformer import CharTransformer, char_transformer

for _name, _fn in (("linear", linear), ("mlp", mlp), ("cnn_femnist", femnist_cnn), ("cnn_bn", bn_cnn),
                   ("cnn_cifar", cifar_cnn), ("cnn_pfl", pfl_cnn),
                   ("lstm", char_lstm), ("char_transformer", char_transformer), ("resnet", resnet)):
    register_model(_name, replace=True)(_fn)


def build_model(name: str, input_shape: int | tuple[int, ...], num_classes: int,
                meta: dict[str, object] | None = None, **kwargs: object) -> Model:
    """Build a registered model for inputs of ``input_shape`` (an int means a flat vector)."""
    if name not in MODELS:
        raise ModelError(f"unknown model {name!r}; available: {sorted(MODELS)}")
    shape = (input_shape,) if isinstance(input_shape, int) else tuple(input_shape)
    model = MODELS[name](input_shape=shape, num_classes=num_classes, meta=meta, **kwargs)
    if not isinstance(model, Model):
        raise ModelError(f"model builder {name!r} returned {type(model).__name__}, not a fedmtl.Model")
    return model


__all__ = ["CharLSTM", "CharTransformer", "build_model", "char_lstm", "char_transformer", "cifar_cnn", "femnist_cnn",
           "linear", "lstm_forward", "mlp", "pfl_cnn", "resnet"]
