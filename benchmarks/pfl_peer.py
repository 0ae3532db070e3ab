"""``fedmtl bench pfl``: fedmtl side by side with pfl-research (Apple's ``pfl`` package, PyTorch backend) on the
workload of pfl-research's published CIFAR-10 benchmark, both timed in one process on the same device and threads.

The peer (Granqvist et al., "pfl-research: simulation framework for accelerating research in Private Federated
Learning", 2024; ``benchmarks/image_classification`` of github.com/apple/pfl-research, config ``baseline.yaml``,
dataset ``cifar10_iid``, model ``simple_cnn``, algorithm ``fedavg``): 1,000 users of 50 IID examples (the 50,000
CIFAR-10 training images, 50 a user), a cohort of 50 users a round, one local epoch of SGD at rate 0.1 with batch 10,
FedAvg with a central SGD step of rate 1.0 on the averaged model difference, central evaluation every 10 rounds
with batch 10,000.  The model: pfl-research's ``simple_cnn``, conv3x3(32)-ReLU-conv3x3(64)-ReLU-maxpool2-
dense(12,544 -> 128)-ReLU-dense(128 -> 10), fedmtl's registered ``cnn_pfl``.

What is the same on both sides, by construction:

* **the examples**: CIFAR-shaped arrays (3 x 32 x 32 floats, 10 classes) drawn once from ``--seed`` (no download):
  each class has a fixed random template, coarse (8 x 8 blocks upsampled 4x, per channel), and an example is its
  class's template times ``SIGNAL`` plus standard normal noise, so the task is learnable; labels uniform.  Client
  k holds examples 50k .. 50k + 49 on both sides (pfl: ``FederatedDataset.from_slices`` over the same tensors in its
  NHWC layout, as its CIFAR loader gives them; fedmtl: a ``FederatedData`` split), and the held-out set of
  ``--eval-examples`` is the central evaluation set of both.  The JSON records a SHA-256 of each side's own
  examples (``examples_sha256``), taken from what each framework was given;
* **the starting weights**: one draw of pfl's initialization (Glorot-uniform weights, PyTorch's default biases),
  copied into both;
* **the hyperparameters** above.  pfl's config weights users uniformly (``weight_by_samples: false``); every user
  holds 50 examples, so that equals the example-count weighting used on both sides here (pfl's
  ``WeightByDatapoints``, fedmtl's FedAvg average).

Deviation from the peer's benchmark, on both sides: ``simple_cnn``'s two dropout layers (0.25, 0.5) are left out
(fedmtl's engine has no train/eval mode: ``fedmtl.models.cnn``); ``--pfl-dropout`` puts them back on pfl's side
only (then the two sides train different models).  What each side does on its own: pfl samples its cohort with
replacement (its ``random`` user sampler) and iterates a user's examples in order, and in every round whose index
is a multiple of 10 it also evaluates each trained user on its own data before and after training (its
``NNAlgorithmParams.evaluation_frequency``); fedmtl samples 50 distinct clients and shuffles their batches.

The floor, measured in the same run: the same model trained centrally on a round's number of examples (2,500), one
epoch at the clients' batch of 10 and one at batch 500; the faster is ``central_round_s``, and
``fedmtl_round_vs_central`` / ``pfl_round_vs_central`` are each round against it (a speed-up over pfl above
``pfl_round_vs_central`` would need a round faster than training the same examples centrally).

Timing: ``--rounds`` rounds after one untimed warm-up round (round 0).  The two frameworks alternate round by round
in one process (pfl's round r, then fedmtl's round r and the floor's two epochs, run from pfl's callback), so that
all see the same load on a shared machine.  pfl's round is timed from the end of its previous one to its
``after_central_iteration`` callback (its central evaluation callback runs before that, so an evaluation belongs to
its round on both sides), fedmtl's round around ``Engine.round`` and its evaluation, CUDA work waited for on both.
Both frameworks evaluate centrally before round 0 and after rounds 10, 20, ...; the accuracies reported are a final
central evaluation after the last timed round.
Figures, never assertions.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import os
import platform
import statistics
import sys
import time
import types
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fedmtl.algorithms import FedAvg
from fedmtl.data.federated import ClientGroup, FederatedData, Split
from fedmtl.engine.executors import make_executor
from fedmtl.engine.spec import RunConfig, RunSpec
from fedmtl.models import build_model
from fedmtl.optim import SGD
from fedmtl.runs.driver import make_engine
from fedmtl.runs.report import write_json

from .common import add_device, add_out, add_rounds, add_threads, central_epoch, device_name, out_path, sync

#: pfl-research's CIFAR-10 benchmark (``baseline.yaml``, ``cifar10_iid``)
CLIENTS, PER_CLIENT, COHORT, BATCH, LOCAL_LR, CENTRAL_LR = 1000, 50, 50, 10, 0.1, 1.0
EVAL_EVERY, EVAL_BATCH = 10, 10_000
SHAPE, CLASSES = (3, 32, 32), 10
#: the class templates' amplitude against unit noise (the synthetic task's difficulty)
SIGNAL = 0.1


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out(p)
    add_rounds(p, default=20)
    add_threads(p)
    add_device(p)
    p.add_argument("--clients", type=int, default=CLIENTS, help="the population (each with --examples examples)")
    p.add_argument("--examples", type=int, default=PER_CLIENT, help="training examples per client")
    p.add_argument("--cohort", type=int, default=COHORT, help="clients sampled per round")
    p.add_argument("--eval-examples", type=int, default=2000, help="the held-out central evaluation set")
    p.add_argument("--seed", type=int, default=0, help="the examples, the starting weights and both runs")
    p.add_argument("--pfl-dropout", action="store_true",
                   help="pfl's side with simple_cnn's two dropout layers (0.25, 0.5) as in its benchmark; fedmtl has "
                        "none, so the sides then train different models")


# ---------------------------------------------------------------------------------------------- the shared inputs
def make_arrays(clients: int, per_client: int, eval_examples: int, seed: int
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(x_train, y_train, x_eval, y_eval): x (n, 3, 32, 32) float32, y (n,) int64, client k owning training rows
    ``k * per_client ..``; the examples of the module docstring."""
    rng = np.random.default_rng(seed)
    coarse = rng.standard_normal((CLASSES, SHAPE[0], 8, 8), dtype=np.float32)
    templates = torch.from_numpy(coarse).repeat_interleave(4, 2).repeat_interleave(4, 3) * SIGNAL

    def draw(n: int) -> tuple[Tensor, Tensor]:
        y = torch.from_numpy(rng.integers(0, CLASSES, n)).long()
        x = torch.from_numpy(rng.standard_normal((n, *SHAPE), dtype=np.float32))
        return x.add_(templates[y]), y

    x, y = draw(clients * per_client)
    xe, ye = draw(eval_examples)
    return x, y, xe, ye


def sha256(pairs: Iterable[tuple[Tensor, Tensor]]) -> str:
    """SHA-256 over (x, y) pairs in order: x as contiguous NCHW float32 bytes, y as int64 bytes."""
    h = hashlib.sha256()
    for x, y in pairs:
        h.update(x.detach().cpu().contiguous().numpy().tobytes())
        h.update(y.detach().cpu().long().numpy().tobytes())
    return h.hexdigest()


def pfl_module(dropout: bool) -> nn.Module:
    """pfl-research's ``simple_cnn`` on NHWC inputs (its first layer turns them to NCHW), dropout optional."""

    class ToNCHW(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x.permute(0, 3, 1, 2)

    flat = 14 * 14 * 64
    return nn.Sequential(ToNCHW(), nn.Conv2d(3, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Dropout(0.25 if dropout else 0.0), nn.Flatten(), nn.Linear(flat, 128), nn.ReLU(),
                         nn.Dropout(0.5 if dropout else 0.0), nn.Linear(128, CLASSES))


def initial_weights(seed: int) -> list[Tensor]:
    """The starting weights of both sides, in parameter order: pfl's initialization (Glorot-uniform weights,
    PyTorch's default biases) of a seeded module."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        m = pfl_module(False)
        for layer in m.modules():
            if isinstance(layer, nn.Conv2d | nn.Linear):
                nn.init.xavier_uniform_(layer.weight)
    return [p.detach().clone() for p in m.parameters()]


def summary(rounds: list[float]) -> tuple[float, float]:
    return statistics.median(rounds), statistics.fmean(rounds)


# ---------------------------------------------------------------------------------------------- fedmtl
class FedmtlRounds:
    """FedAvg on fedmtl's engine, the executor picked by ``auto``, one round a call of ``step``; a central evaluation
    of the global model on the held-out set before round 0 (here) and after rounds 10, 20, ... (in ``step``)."""

    def __init__(self, args: argparse.Namespace, arrays: tuple[Tensor, Tensor, Tensor, Tensor], start: list[Tensor]):
        x, y, xe, ye = arrays
        self.device = args.device
        offsets = torch.arange(args.clients + 1, dtype=torch.long) * args.examples
        empty = Split(torch.empty(0, *SHAPE), torch.empty(0, dtype=torch.long),
                      torch.zeros(args.clients + 1, dtype=torch.long))
        data = FederatedData(ClientGroup(Split(x, y, offsets), empty), CLASSES, name="pfl-cifar10-synthetic")
        model = build_model("cnn_pfl", SHAPE, CLASSES)
        names = [k for k, _ in model.module.named_parameters()]
        self.model = model = dataclasses.replace(model, initial_params=dict(zip(names, start, strict=True)))
        spec = RunSpec(RunConfig(rounds=args.rounds + 1, seed=args.seed, batch_size=BATCH, local_epochs=1,
                                 clients_per_round=args.cohort, runner="auto", device=args.device,
                                 eval_every=EVAL_EVERY, checkpoint_every=0), SGD(lr=LOCAL_LR))
        self.sim = make_engine(FedAvg(), model, data, spec)
        self.executor = make_executor("auto", model, torch.device(args.device)).name
        self.sha = sha256([data.seen.train.client(k) for k in range(args.clients)] + [(xe, ye)])
        self.xe, self.ye = xe.to(args.device), ye.to(args.device)
        self.state = self.sim.init_state()
        self.accuracy_before = self.evaluate()
        self.times: list[float] = []

    def evaluate(self) -> float:
        params, xe, ye = self.state.server.params, self.xe, self.ye
        with torch.no_grad():
            correct = sum(int((self.model.apply(params, xe[i:i + EVAL_BATCH]).argmax(-1) == ye[i:i + EVAL_BATCH])
                              .sum()) for i in range(0, len(ye), EVAL_BATCH))
        return correct / len(ye)

    def step(self, r: int) -> None:
        """Round ``r`` (0: the warm-up), timed."""
        t = time.perf_counter()
        self.sim.round(self.state)
        if r and r % EVAL_EVERY == 0:
            self.evaluate()
        sync(self.device)
        self.times.append(time.perf_counter() - t)


class CentralFloor:
    """The floor: the same model (``simple_cnn`` without dropout, the shared starting weights, NCHW inputs) trained
    centrally on a round's worth of examples (cohort x examples per client: the first ones of the training set), one
    epoch of SGD at rate 0.1 and batch ``batch`` (the clients' batch of 10: the same steps as the per-client loops;
    cohort x 10: one step per batch position, as ``bench peers``' floor), one epoch a call of ``step``: what a round
    costs with no federation at all."""

    def __init__(self, args: argparse.Namespace, arrays: tuple[Tensor, Tensor, Tensor, Tensor], start: list[Tensor],
                 batch: int):
        n = args.cohort * args.examples
        module = pfl_module(False)[1:]  # its NHWC -> NCHW permute left out: these inputs are NCHW
        with torch.no_grad():
            for p, w in zip(module.parameters(), start, strict=True):
                p.copy_(w)
        self.device = args.device
        self.epoch = central_epoch(module, arrays[0][:n], arrays[1][:n], batch, LOCAL_LR, args.device, args.seed)
        self.times: list[float] = []

    def step(self, r: int) -> None:
        """One epoch (``r`` 0: the warm-up), timed."""
        t = time.perf_counter()
        self.epoch()
        sync(self.device)
        self.times.append(time.perf_counter() - t)


# ---------------------------------------------------------------------------------------------- pfl
def pfl_side(args: argparse.Namespace, arrays: tuple[Tensor, Tensor, Tensor, Tensor], start: list[Tensor],
             between: Callable[[int], None] = lambda r: None) -> dict[str, Any]:
    """pfl's own set-up (its ``benchmarks/image_classification/pytorch/train.py`` with ``cifar10_iid``): a
    ``PyTorchModel`` with a local ``torch.optim.SGD`` and a central SGD of rate 1.0, users from
    ``FederatedDataset.from_slices`` with the ``random`` user sampler, ``SimulatedBackend``, ``FederatedAveraging``,
    ``NNTrainHyperParams`` / ``NNEvalHyperParams``, a ``CentralEvaluationCallback`` every 10 rounds.  ``between(r)``
    runs after pfl's round r, outside its timing (``run``: fedmtl's round r)."""
    os.environ["PFL_PYTORCH_DEVICE"] = args.device  # pfl places its model and tensors on its default device
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.callback.central_evaluation import CentralEvaluationCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel

    x, y, xe, ye = arrays
    device = torch.device(args.device)
    np.random.seed(args.seed)  # pfl's samplers draw from numpy's global generator, its benchmark seeds both
    torch.manual_seed(args.seed)
    # pfl's CIFAR loader gives images as NHWC arrays, turned to tensors on the device (``to_tensor``)
    x_nhwc, xe_nhwc = x.permute(0, 2, 3, 1).contiguous().to(device), xe.permute(0, 2, 3, 1).contiguous().to(device)
    y_d, ye_d = y.to(device), ye.to(device)
    n = args.examples
    users = {k: [x_nhwc[k * n:(k + 1) * n], y_d[k * n:(k + 1) * n]] for k in range(args.clients)}
    train = FederatedDataset.from_slices(users, get_user_sampler("random", range(args.clients)))
    central = Dataset(raw_data=[xe_nhwc, ye_d])

    module = pfl_module(args.pfl_dropout)
    with torch.no_grad():
        for p, w in zip(module.parameters(), start, strict=True):
            p.copy_(w)
    module.to(device)

    def loss(self: nn.Module, inputs: Tensor, targets: Tensor, eval: bool = False) -> Tensor:
        self.eval() if eval else self.train()
        return nn.functional.cross_entropy(self(inputs), targets.long())

    @torch.no_grad()
    def metrics(self: nn.Module, inputs: Tensor, targets: Tensor, eval: bool = True) -> dict[str, Any]:
        self.eval() if eval else self.train()
        logits = self(inputs)
        return {"loss": Weighted(nn.functional.cross_entropy(logits, targets.long(), reduction="sum").item(),
                                 len(inputs)),
                "accuracy": Weighted((logits.argmax(-1) == targets.long()).sum().item(), len(inputs))}

    module.loss = types.MethodType(loss, module)  # what PyTorchModel calls (pfl's benchmark attaches them so too)
    module.metrics = types.MethodType(metrics, module)
    model = PyTorchModel(model=module, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD([p for p in module.parameters() if p.requires_grad],
                                                           CENTRAL_LR))
    backend = SimulatedBackend(training_data=train, val_data=None, postprocessors=[WeightByDatapoints()])
    eval_params = NNEvalHyperParams(local_batch_size=EVAL_BATCH)

    class Clock(TrainingProcessCallback):
        """Each round's seconds, from the end of the previous one (after the central evaluation callback; what
        ``between`` does in between is not counted)."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.t = 0.0

        def on_train_begin(self, *, model: Any) -> Metrics:
            self.t = time.perf_counter()
            return Metrics()

        def after_central_iteration(self, aggregate_metrics: Metrics, model: Any, *, central_iteration: int
                                    ) -> tuple[bool, Metrics]:
            sync(args.device)
            self.times.append(time.perf_counter() - self.t)
            between(central_iteration)
            self.t = time.perf_counter()
            return False, Metrics()

    clock = Clock()

    def accuracy() -> float:
        m = model.evaluate(central, lambda name: name, eval_params)
        v = m["accuracy"]
        return float(v.overall_value if hasattr(v, "overall_value") else v)

    acc0 = accuracy()
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(central_num_iterations=args.rounds + 1, evaluation_frequency=EVAL_EVERY,
                                           train_cohort_size=args.cohort, val_cohort_size=0),
        backend=backend, model=model,
        model_train_params=NNTrainHyperParams(local_learning_rate=LOCAL_LR, local_num_epochs=1,
                                              local_batch_size=BATCH),
        model_eval_params=eval_params,
        callbacks=[CentralEvaluationCallback(central, model_eval_params=eval_params, frequency=EVAL_EVERY), clock],
        send_metrics_to_platform=False)
    given = [(users[k][0].permute(0, 3, 1, 2), users[k][1]) for k in range(args.clients)]
    return {"rounds_s": clock.times[1:], "accuracy": accuracy(), "accuracy_before": acc0,
            "threads": torch.get_num_threads(),
            "examples_sha256": sha256([*given, (xe_nhwc.permute(0, 3, 1, 2), ye_d)])}


# ---------------------------------------------------------------------------------------------- the run
def run(args: argparse.Namespace) -> dict[str, Any]:
    import pfl.version

    torch.set_num_threads(args.threads)
    arrays = make_arrays(args.clients, args.examples, args.eval_examples, args.seed)
    start = initial_weights(args.seed)
    rounds = FedmtlRounds(args, arrays, start)
    floors = {b: CentralFloor(args, arrays, start, b) for b in (BATCH, args.cohort * BATCH)}

    def between(r: int) -> None:  # pfl's round r, then fedmtl's, then the floors' epochs: all see the same load
        rounds.step(r)
        for floor in floors.values():
            floor.step(r)

    peer = pfl_side(args, arrays, start, between)  # they alternate round by round (module docstring)
    fed = {"rounds_s": rounds.times[1:], "accuracy": rounds.evaluate(), "accuracy_before": rounds.accuracy_before,
           "executor": rounds.executor, "threads": torch.get_num_threads(), "examples_sha256": rounds.sha}
    for name, side in (("fedmtl", fed), ("pfl", peer)):
        print(f"{name}: {statistics.median(side['rounds_s']):.3f} s/round (median), accuracy {side['accuracy']:.3f}",
              flush=True)
    f_med, f_mean = summary(fed["rounds_s"])
    p_med, p_mean = summary(peer["rounds_s"])
    central = {b: statistics.median(f.times[1:]) for b, f in floors.items()}
    floor = min(central.values())  # the faster batch: the floor
    print(f"central floor: {floor:.3f} s a round's examples (batch {min(central, key=central.__getitem__)}); fedmtl "
          f"{f_med / floor:.2f}x, pfl {p_med / floor:.2f}x of it", flush=True)
    return {
        "benchmark": "pfl", "device": device_name(args.device), "torch": torch.__version__,
        "pfl": pfl.version.__version__, "threads": args.threads,
        "torch_threads": {"fedmtl": fed["threads"], "pfl": peer["threads"]},
        "machine": platform.machine(), "cpu_count": os.cpu_count(),
        "workload": {"source": "pfl-research benchmarks/image_classification (cifar10_iid, simple_cnn, fedavg)",
                     "clients": args.clients, "examples_per_client": args.examples, "cohort": args.cohort,
                     "local_batch_size": BATCH, "local_epochs": 1, "local_lr": LOCAL_LR, "central_lr": CENTRAL_LR,
                     "central_eval_every": EVAL_EVERY, "central_eval_batch": EVAL_BATCH,
                     "eval_examples": args.eval_examples, "input_shape": list(SHAPE), "classes": CLASSES,
                     "data": f"synthetic: class templates x {SIGNAL} + N(0, 1) noise, seed {args.seed}",
                     "model": "cnn_pfl: conv3x3(32)-relu-conv3x3(64)-relu-maxpool2-dense128-relu-dense10",
                     "pfl_dropout": args.pfl_dropout},
        "rounds_timed": args.rounds, "warmup_rounds": 1, "order": "alternating rounds (pfl, fedmtl)",
        "fedmtl_executor": fed["executor"],
        "fedmtl_round_s": f_med, "pfl_round_s": p_med, "speedup_vs_pfl": p_med / f_med,
        "fedmtl_round_mean_s": f_mean, "pfl_round_mean_s": p_mean, "speedup_vs_pfl_mean": p_mean / f_mean,
        # the floor (``CentralFloor``): one central epoch over a round's number of examples, per batch size; the
        # best of them, and each framework's round against it
        **{f"central_round_s_batch{b}": v for b, v in central.items()},
        "central_round_s": floor, "fedmtl_round_vs_central": f_med / floor, "pfl_round_vs_central": p_med / floor,
        "fedmtl_rounds_s": fed["rounds_s"], "pfl_rounds_s": peer["rounds_s"],
        "fedmtl_accuracy": fed["accuracy"], "pfl_accuracy": peer["accuracy"],
        "fedmtl_accuracy_before": fed["accuracy_before"], "pfl_accuracy_before": peer["accuracy_before"],
        "examples_sha256": {"fedmtl": fed["examples_sha256"], "pfl": peer["examples_sha256"]},
        "same_examples": fed["examples_sha256"] == peer["examples_sha256"],
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def main(args: argparse.Namespace) -> int:
    try:
        import pfl  # noqa: F401
    except ImportError:
        print("error: fedmtl bench pfl needs pfl-research's package pfl (make bench-pfl installs it)", file=sys.stderr)
        return 2
    res = run(args)
    write_json(out_path(args.out), res)
    for k, v in res.items():
        if not k.endswith("rounds_s"):
            print(f"{k:28s} {v:.4f}" if isinstance(v, float) else f"{k:28s} {v}")
    return 0


__all__ = ["FedmtlRounds", "add_arguments", "initial_weights", "main", "make_arrays", "pfl_module", "run", "sha256"]
