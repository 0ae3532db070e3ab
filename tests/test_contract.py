"""The contract suite (``fedmtl.testing.check_algorithm``) over every registered algorithm, and a self-test that
it catches algorithms that break the contract."""

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

import fedmtl
from fedmtl.algorithms import ALGORITHMS, FedAvg
from fedmtl.testing import ContractError, check_algorithm, parametrize_with_checks

# one item per algorithm and check; each algorithm runs with the toy settings it declares (Algorithm.toy).  The
# checks other than QUICK_CHECKS (a second or less each) are in the slow tier (tests/conftest.py marks them)
QUICK_CHECKS = ("capabilities", "no_input_mutation")


@pytest.mark.slow
@parametrize_with_checks(ALGORITHMS)
def test_every_registered_algorithm_keeps_the_contract(algorithm, check, small_data):
    assert check_algorithm(algorithm, data=small_data, checks=(check,)) == {check: "ok"}


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


@dataclass(frozen=True)
class FineTunesUndeclared(FedAvg):
    """Fine-tunes on the client's training batches before evaluation but forgets needs_adaptation = True."""

    name: ClassVar[str] = "forgot_adaptation"

    def personalize(self, ctx, payload, state, batches, lr, seen):
        return fedmtl.local_sgd(ctx.model.value_and_grad, payload, batches, lr, ctx.opt)[0]


def test_a_forgotten_needs_adaptation_is_named(small_data):
    with pytest.raises(ContractError, match="must declare needs_adaptation = True"):
        check_algorithm(FineTunesUndeclared, data=small_data, checks=("learns",))


@pytest.mark.parametrize("cls,check", [(MutatesPayload, "no_input_mutation"), (GlobalRandom, "deterministic"),
                                       (NoLearning, "learns"), (LoopOnly, "loop_equals_vmap"),
                                       (SaysStateless, "capabilities")])
def test_check_algorithm_catches_broken_algorithms(cls, check, small_data):
    with pytest.raises(ContractError, match=f"fails '{check}'"):
        check_algorithm(cls, data=small_data)


@pytest.mark.slow
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
