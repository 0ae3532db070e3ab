"""Vision and text models (registered into ``fedmtl.model.MODELS`` on import)."""

from . import register  # noqa: F401
from .cnn import cifar_cnn, femnist_cnn
from .lstm import CharLSTM, char_lstm, lstm_forward

__all__ = ["CharLSTM", "char_lstm", "cifar_cnn", "femnist_cnn", "lstm_forward"]
