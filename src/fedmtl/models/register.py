"""Adds the vision and text models to the model registry."""

from ..model import MODELS
from .cnn import cifar_cnn, femnist_cnn
from .lstm import char_lstm

MODELS.update({"cnn_femnist": femnist_cnn, "cnn_cifar": cifar_cnn, "lstm": char_lstm})
