"""The names of a run's metrics, defined once.

Every evaluation reports, per client group (``seen``: the clients that train; ``unseen``: held out of training)
and split (``train``, ``val``, ``test``), statistics of per-client accuracy (``fedmtl.engine.evaluation``):
``{group}_{split}_{stat}``, e.g. ``seen_test_acc_mean``.  Code that reads a metric uses these names (or
``metric(group, split, stat)``) rather than spelling the string, so a renamed metric is renamed everywhere.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict

Group = Literal["seen", "unseen"]
SplitName = Literal["train", "val", "test"]
#: the statistics every evaluation reports: accuracy and loss pooled over examples (``acc``, ``loss``), and over
#: clients: the mean, the 10th percentile (bottom decile) and the mean of the worst 10% of per-client accuracy
Stat = Literal["acc", "acc_mean", "acc_p10", "acc_bottom10_mean", "loss"]
STATS: tuple[str, ...] = ("acc", "acc_mean", "acc_p10", "acc_bottom10_mean", "loss")


def metric(group: Group | str, split: SplitName | str, stat: Stat | str) -> str:
    """The name of ``stat`` of ``group``'s ``split``: ``metric("seen", "test", "acc_mean") == "seen_test_acc_mean"``."""
    return f"{group}_{split}_{stat}"


#: mean test accuracy over the seen clients (the headline figure)
SEEN_TEST_ACC = metric("seen", "test", "acc_mean")
#: bottom decile: the 10th percentile of the seen clients' test accuracy
SEEN_TEST_P10 = metric("seen", "test", "acc_p10")
#: mean test accuracy of the worst 10% of seen clients
SEEN_TEST_WORST10 = metric("seen", "test", "acc_bottom10_mean")
SEEN_TRAIN_ACC = metric("seen", "train", "acc_mean")
#: mean test accuracy over the unseen clients (held out of training, adapted locally where the method does)
UNSEEN_TEST_ACC = metric("unseen", "test", "acc_mean")
#: unseen minus seen mean test accuracy
PARTICIPATION_GAP = "participation_gap"

#: the headline metrics with short labels (tables, progress lines, plots)
HEADLINE: tuple[tuple[str, str], ...] = ((SEEN_TEST_ACC, "avg"), (SEEN_TEST_P10, "p10 (bottom decile)"),
                                         (SEEN_TEST_WORST10, "worst 10% mean"), (UNSEEN_TEST_ACC, "unseen avg"),
                                         (PARTICIPATION_GAP, "participation gap"))


class RunSummary(TypedDict, total=False):
    """``summary.json`` and ``RunResult.summary`` (``engine.driver``)."""

    algorithm: str
    data: str
    seed: int
    rounds: int  # rounds run
    final: dict[str, float]  # metric name (this module) -> value after the last round
    excluded_updates: int  # non-finite updates excluded over the run
    dropped_updates: int  # updates of sampled clients that did not arrive
    train_seconds_this_process: float
    seconds_per_round: float | None
    round_seconds: list[float]
    lr_decay_from_rounds: list[int]
    config: dict[str, Any]  # the resolved configuration
    path: dict[str, str]  # {"executor": ..., "model": ...}: how the clients ran
    attackers: list[int]  # [attack]: the attacking clients
    epsilon: float  # [privacy]: spent after the run's rounds, at ``delta``
    delta: float
    noise_multiplier: float
    reproducible_noise: bool


__all__ = ["HEADLINE", "PARTICIPATION_GAP", "SEEN_TEST_ACC", "SEEN_TEST_P10", "SEEN_TEST_WORST10", "SEEN_TRAIN_ACC",
           "STATS", "UNSEEN_TEST_ACC", "RunSummary", "metric"]
