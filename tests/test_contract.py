"""The contract suite (``fedmtl.testing.check_algorithm``) over every registered algorithm, and a self-test that
it catches algorithms that break the contract."""

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from torch import nn

import fedmtl
from fedmtl import BatchNorm, Model
from fedmtl.algorithms import ALGORITHMS, FedAvg
from fedmtl.models import build_model
from fedmtl.optim import SGD
from fedmtl.testing import ContractError, check_algorithm

# hyper-parameters for the toy task where a default is tuned for other data (Per-FedAvg's beta = 0.001
# is the paper's MNIST value; with it 15 rounds barely move the loss)
TOY = {"perfedavg": {"beta": 0.05}, "clustered": {"warmup_rounds": 2}, "pfedme": {"personal_lr": 0.05},
       "mocha": {"lam": 0.01, "omega_every": 2}, "fedrep": {"head_epochs": 1},
       "fedbabu": {"finetune_epochs": 1, "finetune_lr": 0.05}}
# methods that split the model into a body and a head need a model that has one
BODY_HEAD = {"fedper", "fedrep", "lgfedavg", "fedbabu", "omnifedge", "knnper", "moon", "fedrod", "fedala"}
# momentum makes the control-variate correction unstable on the toy task (the paper's local steps are plain SGD)
OPT = {"scaffold": SGD(0.1)}


def toy_model(name: str) -> Model | None:
    """The model each algorithm runs on the toy task (None: the contract suite's linear model); a fresh one each
    call (an engine moves its model's module to the run's device)."""
    if name == "mocha":
        return build_model("linear", 10, 2, bias=False)
    if name in BODY_HEAD:
        return build_model("mlp", 10, 2, hidden=(16,))
    if name == "fedbn":  # FedBN needs batch-norm layers
        return Model.from_module(nn.Sequential(nn.Linear(10, 16), BatchNorm(16), nn.ReLU(), nn.Linear(16, 1)), 2)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_registered_algorithm_keeps_the_contract(name, small_data):
    model = toy_model(name)
    res = check_algorithm(ALGORITHMS[name], TOY.get(name, {}), data=small_data, model=model, opt=OPT.get(name),
                          # Omni-Fedge: one gradient query a round; FedBABU: a frozen random head
                          toy_rounds=45 if name in ("omnifedge", "fedbabu") else 15)
    assert set(res) == {"capabilities", "loop_equals_vmap", "no_input_mutation", "deterministic", "learns",
                        "checkpoint_round_trip", "nan_excluded", "private_release"}


@dataclass(frozen=True)
class MutatesPayload(FedAvg):
    name: ClassVar[str] = "bad_mutates"

    def client_update(self, ctx, payload, state, batches, lr):
        out = super().client_update(ctx, payload, state, batches, lr)
        payload["weight"].add_(0.0 * payload["weight"] + 1e-3)  # in place: forbidden
        return out


@dataclass(frozen=True)
class GlobalRandom(FedAvg):
    name: ClassVar[str] = "bad_random"

    def aggregate(self, ctx, server, updates, weights, clients):
        new = super().aggregate(ctx, server, updates, weights, clients)
        return new._replace(params={k: v + 1e-3 * torch.randn_like(v) for k, v in new.params.items()})


@dataclass(frozen=True)
class NoLearning(FedAvg):
    name: ClassVar[str] = "bad_static"

    def client_update(self, ctx, payload, state, batches, lr):
        _, st, loss = super().client_update(ctx, payload, state, batches, lr)
        return payload, st, loss


@dataclass(frozen=True)
class LoopOnly(FedAvg):
    """A Python branch on a tensor value: fine one client at a time, impossible under vmap."""

    name: ClassVar[str] = "bad_branch"

    def client_update(self, ctx, payload, state, batches, lr):
        params, st, loss = super().client_update(ctx, payload, state, batches, lr)
        if float(loss) > 10.0:
            params = payload
        return params, st, loss


@dataclass(frozen=True)
class SaysStateless(fedmtl.Algorithm):
    """Keeps a per-client model but does not declare keeps_client_state."""

    name: ClassVar[str] = "bad_capability"

    def init_client(self, ctx, server):
        return (server.params,)

    def client_update(self, ctx, payload, state, batches, lr):
        p, loss = fedmtl.local_sgd(ctx.model.value_and_grad, state[0], batches, lr, ctx.opt)
        return payload, (p,), loss


@pytest.mark.parametrize("cls,check", [(MutatesPayload, "no_input_mutation"), (GlobalRandom, "deterministic"),
                                       (NoLearning, "learns"), (LoopOnly, "loop_equals_vmap"),
                                       (SaysStateless, "capabilities")])
def test_check_algorithm_catches_broken_algorithms(cls, check, small_data):
    with pytest.raises(ContractError, match=f"fails '{check}'"):
        check_algorithm(cls, data=small_data)


def test_check_algorithm_passes_a_correct_plugin(small_data):
    @dataclass(frozen=True)
    class HalfStep(FedAvg):
        """FedAvg whose server moves half way to the clients' average (a server learning rate of 0.5)."""

        name: ClassVar[str] = "halfstep_selftest"
        server_lr: float = 0.5

        def aggregate(self, ctx, server, updates, weights, clients):
            new = super().aggregate(ctx, server, updates, weights, clients)
            return new._replace(params={k: (1 - self.server_lr) * server.params[k] + self.server_lr * v
                                        for k, v in new.params.items()})

    assert all(v == "ok" for v in check_algorithm(HalfStep, {"server_lr": 0.7}, data=small_data).values())
    with pytest.raises(ContractError, match="constructing"):
        check_algorithm(HalfStep, {"no_such_field": 1})


@dataclass(frozen=True)
class OneNaN(FedAvg):
    name: ClassVar[str] = "bad_one_nan"

    def client_update(self, ctx, payload, state, batches, lr):
        params, st, loss = super().client_update(ctx, payload, state, batches, lr)
        return params, st, torch.where(batches.n == 3.0, loss * float("nan"), loss)


def test_excluded_updates_are_logged_with_their_clients(caplog):
    from fedmtl import FederatedData
    from fedmtl.testing import run_rounds, simulator

    rng = torch.Generator().manual_seed(0)
    train = [(torch.randn(n, 4, generator=rng), torch.randint(0, 2, (n,), generator=rng)) for n in (5, 3, 6)]
    data = FederatedData.from_arrays(train, train)
    with caplog.at_level("WARNING", logger="fedmtl"):
        _, rows = run_rounds(simulator(OneNaN(), data), 2)
    assert [r["excluded"] for r in rows] == [1, 1]
    assert "excluded 1 client update(s) with NaN/Inf: clients [1]" in caplog.text
