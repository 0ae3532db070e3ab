"""fedmtl: personalized and federated multi-task learning.

The public API (everything else is internal and free to change)::

    import fedmtl

    data = fedmtl.FederatedData.from_arrays(train=[(x0, y0), (x1, y1)], test=[(xt0, yt0), (xt1, yt1)])
    model = fedmtl.Model.from_module(torch.nn.Linear(20, 4), num_classes=4)
    result = fedmtl.run({"algorithm": {"name": "fedem"}, "run": {"rounds": 20}}, data=data, model=model)
    result.final["seen_test_acc_mean"]

``fedmtl.compare(run_dirs, out)`` puts finished runs side by side (``fedmtl compare``); ``fedmtl.tune(config, space,
trials=..., seed=..., out=...)`` searches hyperparameters on a validation split (``fedmtl tune``, Optuna).
``register_algorithm`` / ``register_model`` / ``register_dataset`` / ``register_aggregator`` / ``register_attack``
add your own (``fedmtl run --import MODULE`` loads them on the command line), and
``fedmtl.testing.check_algorithm`` runs the contract suite on an algorithm of your own.
"""

from .algorithms.base import Algorithm, ClientId, Context, GlobalModel
from .api import run
from .batchnorm import BatchNorm
from .data.federated import DataError, FederatedData
from .models.base import Model, ModelError
from .optim import SGD, Batches, local_sgd, masked_steps
from .registry import register_algorithm, register_dataset, register_model
from .robust.aggregators import register_aggregator
from .robust.attacks import register_attack
from .runs.comparison import compare
from .runs.driver import RunResult
from .runs.seeds import SeedsResult
from .runs.tune import TuneSummary, tune

__version__ = "0.2.0"

__all__ = [
    "SGD", "Algorithm", "BatchNorm", "Batches", "ClientId", "Context", "DataError", "FederatedData", "GlobalModel",
    "Model", "ModelError", "RunResult", "SeedsResult", "TuneSummary", "__version__", "compare", "local_sgd",
    "masked_steps", "register_aggregator", "register_algorithm", "register_attack", "register_dataset",
    "register_model", "run", "tune",
]
