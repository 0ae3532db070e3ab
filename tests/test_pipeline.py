"""The round's update pipeline (``fedmtl.engine.updates``) and the engine's error reports."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
import torch

from fedmtl import FederatedData
from fedmtl.algorithms import FedAvg
from fedmtl.engine.server_opt import AdaptiveState, ServerOptConfig, legacy_state_names
from fedmtl.engine.updates import UPDATE_STEPS
from fedmtl.privacy import PrivacyConfig
from fedmtl.robust.aggregators import RobustConfig
from fedmtl.robust.attacks import AttackConfig

from .conftest import make_sim


def test_steps_are_built_from_the_tables_in_their_fixed_order(small_data):
    assert list(UPDATE_STEPS) == ["attack", "clip", "robust", "privacy"]
    assert make_sim(FedAvg(), small_data).pipeline.steps == {}
    eng = make_sim(FedAvg(), small_data, attack=AttackConfig(kind="signflip", fraction=0.25),
                   robust=RobustConfig(aggregator="median", clip_norm=1.0), server_opt=ServerOptConfig("adam"))
    assert list(eng.pipeline.steps) == ["attack", "clip", "robust"]
    assert eng.pipeline.server is not None and eng.privacy is None
    dp = make_sim(FedAvg(), small_data, privacy=PrivacyConfig(clip_norm=1.0, noise_multiplier=1.0))
    assert list(dp.pipeline.steps) == ["privacy"] and dp.pipeline.releases_empty_rounds
    assert dp.privacy is not None and dp.privacy.noise_multiplier == 1.0
    with pytest.raises(ValueError, match=r"\[privacy\] combines the updates by its noised mean"):
        make_sim(FedAvg(), small_data, privacy=PrivacyConfig(clip_norm=1.0, noise_multiplier=1.0),
                 robust=RobustConfig(aggregator="median"))


def test_server_optimizer_states_are_named_tuples_and_old_checkpoint_names_still_load(small_data):
    eng = make_sim(FedAvg(), small_data, server_opt=ServerOptConfig("adam"))
    st = eng.init_state()
    assert isinstance(st.server_opt, AdaptiveState)
    assert legacy_state_names({"['m']['fc.weight']": 1, "['v']['fc.bias']": 2, ".m['x']": 3}) == {
        ".m['fc.weight']": 1, ".v['fc.bias']": 2, ".m['x']": 3}


@dataclass(frozen=True)
class _FailsOnThreeSteps(FedAvg):
    """FedAvg that raises inside the client update of the client with three local batches."""

    name: ClassVar[str] = "fails_on_three"

    def client_update(self, ctx, payload, state, batches, lr):
        steps = len(batches.mask) if isinstance(batches.mask, list) else batches.mask.shape[0]  # loop / under vmap
        if steps == 3:
            raise FloatingPointError("boom in this client")
        return super().client_update(ctx, payload, state, batches, lr)


def test_an_exception_in_a_client_update_names_algorithm_round_client_and_stage():
    rng = np.random.default_rng(0)
    sizes = [32, 64, 96, 32]  # batch 32: 1, 2, 3, 1 local steps; client 2 has three
    train = [(rng.normal(size=(n, 4)).astype(np.float32), rng.integers(0, 2, n)) for n in sizes]
    test = [(rng.normal(size=(8, 4)).astype(np.float32), rng.integers(0, 2, 8)) for _ in sizes]
    data = FederatedData.from_arrays(train, test, num_classes=2)
    eng = make_sim(_FailsOnThreeSteps(), data, runner="loop", batch_size=32)
    st = eng.init_state()
    with pytest.raises(FloatingPointError, match="boom in this client") as info:
        eng.round(st)
    note = " ".join(info.value.__notes__)
    assert "fails_on_three's client_update, round 1, client 2 (loop executor)" in note, note
    eng = make_sim(_FailsOnThreeSteps(), data, runner="vmap", batch_size=32, bucketing="none")
    with pytest.raises(FloatingPointError) as info:
        eng.round(eng.init_state())
    # one batched call over the padded (K, 3, B) batches: every client of the call is named
    assert "one of clients [0, 1, 2, 3] (one batched vmap call" in " ".join(info.value.__notes__)
    assert torch.get_num_threads() >= 1
