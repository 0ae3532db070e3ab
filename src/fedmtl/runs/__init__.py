"""Everything around a run's rounds: the driver (evaluation, checkpoints, resume, the run directory), several
seeds as one batched run, checkpoints, run directories and their locks, reports and figures, progress output,
metric loggers, ``fedmtl watch``, ``fedmtl compare`` and sweeps.

The one entry is ``execute(cfg, ...)``: a validated config run in this process, one seed (``RunResult``) or the
seeds of ``run.seeds`` batched together (``SeedsResult``).  ``fedmtl.run`` goes through it (``fedmtl run`` calls
its two halves itself, to print per-seed lines and to run as a rank of a torchrun job); the modules below it are
internal.

==============  ===================================================================
``driver``      one run end to end (``run_experiment``); the run directory layout
``seeds``       several seeds as independent replicas batched into one run
``checkpoint``  atomic checkpoints and exact resume
``rundir``      run directories: locks, refusing to overwrite, resume advice
``report``      tables, JSON, CSV and figures
``progress``    a progress bar or plain lines
``loggers``     TensorBoard, MLflow and registered loggers (``[log]``)
``watch``       ``fedmtl watch``: a running run's progress and ETA
``comparison``  ``fedmtl compare``: runs side by side with seed bands
``sweep``       ``fedmtl sweep``: grids over config keys
==============  ===================================================================
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import ExperimentConfig
    from ..data.federated import FederatedData
    from ..models.base import Model
    from .driver import RunResult
    from .seeds import SeedsResult


def execute(cfg: ExperimentConfig, out: str | Path | None = None, *, resume: bool = False,
            progress: bool | str = True, data: FederatedData | None = None, model: Model | None = None,
            overwrite: bool = False) -> RunResult | SeedsResult:
    """Run ``cfg`` in this process: its seeds batched together when ``run.seeds`` is set (``SeedsResult``, each
    seed's run directory ``out/seed-<S>``), else one run (``RunResult``, run directory ``out``)."""
    if cfg.run.seeds:
        from .seeds import run_seeds

        return run_seeds(cfg, out=out, resume=resume, progress=progress, data=data, model=model, overwrite=overwrite)
    from .driver import run_experiment

    return run_experiment(cfg, out, resume=resume, progress=progress, data=data, model=model, overwrite=overwrite)


__all__ = ["execute"]
