"""Optional TensorBoard logging (the ``[log]`` table): ``tensorboard = true`` writes event files to the run
directory's ``tensorboard/`` folder through ``torch.utils.tensorboard.SummaryWriter`` (needs the ``tensorboard``
package: ``pip install 'fedmtl[tensorboard]'``).

Written: every round's scalars from ``metrics.csv`` (``train/loss``, ``train/lr``, ``train/clients``, ...,
``privacy/epsilon``) and at every evaluation the evaluation metrics (``eval/seen_test_acc_mean``, ...) and the
histogram of per-client test accuracy (``clients/seen_test_acc``, ``clients/unseen_test_acc``).  View with
``tensorboard --logdir RUN_DIR``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class LogConfig:
    """The ``[log]`` table."""

    tensorboard: bool = False

    def __post_init__(self) -> None:
        if self.tensorboard:
            try:
                import tensorboard  # noqa: F401
            except ImportError:
                raise ValueError("log.tensorboard = true needs the tensorboard package: "
                                 "pip install 'fedmtl[tensorboard]'") from None


_TRAIN_KEYS = {"train_loss": "train/loss", "lr": "train/lr", "clients": "train/clients", "dropped": "train/dropped",
               "excluded": "train/excluded", "est_time_s": "train/est_time_s", "epsilon": "privacy/epsilon"}


class Board:
    """One run's TensorBoard writer."""

    def __init__(self, logdir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(logdir))

    def round(self, row: dict[str, Any], per_client: dict[str, Any] | None) -> None:
        step = int(row["round"])
        for key, value in row.items():
            if key == "round" or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if not math.isfinite(float(value)):
                continue
            tag = _TRAIN_KEYS.get(key, f"eval/{key}")
            self.writer.add_scalar(tag, float(value), step)
        if per_client is not None:
            for group, splits in per_client.items():
                test = splits.get("test")
                if test is not None and len(test["acc"]):
                    self.writer.add_histogram(f"clients/{group}_test_acc", np.asarray(test["acc"], dtype=np.float64),
                                              step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
