"""Per-client evaluation and its summaries.

Every client of a group is evaluated on each of its splits (train / val / test) with the state it
predicts with (``Algorithm.personalize``: the global model, its own model, a fine-tuned copy, a
mixture...).  Summaries over clients (``summarize``):

* ``acc`` — sample-weighted mean accuracy (total correct / total examples; the FedEM reference logs);
* ``acc_mean`` — unweighted mean over clients ("average across clients");
* ``acc_p10`` — **bottom decile = the 10th percentile** of per-client accuracy (numpy's linear
  interpolation).  ``acc_bottom10_mean`` — mean accuracy of the worst 10% of clients, the other
  reading of "bottom decile"; both are reported so published numbers can be compared with either;
* ``loss`` — sample-weighted mean negative log-likelihood.

Results are always the state at the end of the run (final round), never the best round.  With
``run.eval_clients = N`` the summaries are over a fixed uniform sample of N clients per group.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

#: what ``summarize`` reports for every group ("seen", "unseen") and split ("train", "val", "test")
Statistic = Literal["acc", "acc_mean", "acc_p10", "acc_bottom10_mean", "loss"]


def metric(group: str, split: str, statistic: Statistic) -> str:
    """The name of a summary metric: ``metric("seen", "test", "acc_mean")`` is ``"seen_test_acc_mean"``."""
    return f"{group}_{split}_{statistic}"


# The metric names the package reads by name (every other one is ``metric(group, split, statistic)``)
#: mean test accuracy over the seen clients ("average across clients")
SEEN_TEST_ACC_MEAN = metric("seen", "test", "acc_mean")
#: the 10th percentile of the seen clients' test accuracy (the bottom decile)
SEEN_TEST_ACC_P10 = metric("seen", "test", "acc_p10")
#: mean test accuracy of the worst 10% of the seen clients
SEEN_TEST_ACC_BOTTOM10_MEAN = metric("seen", "test", "acc_bottom10_mean")
#: sample-weighted test accuracy over the seen clients
SEEN_TEST_ACC = metric("seen", "test", "acc")
SEEN_TRAIN_ACC_MEAN = metric("seen", "train", "acc_mean")
SEEN_TRAIN_LOSS = metric("seen", "train", "loss")
SEEN_TEST_LOSS = metric("seen", "test", "loss")
#: mean test accuracy over the clients held out of training
UNSEEN_TEST_ACC_MEAN = metric("unseen", "test", "acc_mean")
#: unseen minus seen mean test accuracy
PARTICIPATION_GAP = "participation_gap"
#: what ``fedmtl run`` prints, in this order
HEADLINE = (SEEN_TEST_ACC_MEAN, SEEN_TEST_ACC_P10, SEEN_TEST_ACC_BOTTOM10_MEAN, UNSEEN_TEST_ACC_MEAN, PARTICIPATION_GAP)


def chunks(counts_max: Tensor, elems_per_example: int, budget: int, elems_per_client: int = 0) -> list[Tensor]:
    """Positions grouped so that each group's evaluation (clients x (largest client x ``elems_per_example`` +
    ``elems_per_client``) elements: the activations of its padded examples and the clients' own models) stays within
    ``budget`` elements (always at least one client a group).  The positions go in order of their clients' sizes, so
    that a group pads its clients to a size close to their own: where client sizes vary widely (the Shakespeare
    roles), much less padding than in the clients' own order.  Which clients share a group never changes a metric."""
    out, start, n = [], 0, counts_max.numel()
    order = torch.argsort(counts_max, stable=True)
    counts_max = counts_max[order]
    while start < n:
        nmax, end = 1, start
        while end < n:
            cand = max(nmax, int(counts_max[end]))
            if end > start and (end - start + 1) * (cand * elems_per_example + elems_per_client) > budget:
                break
            nmax, end = cand, end + 1
        out.append(order[start:end])
        start = end
    return out


def scores(logp: Tensor, y: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per-client (correct count, summed NLL) from (k, n, C) log-probabilities, labels and padding masks."""
    nll = -torch.gather(logp, -1, y.unsqueeze(-1)).squeeze(-1)
    correct = (logp.argmax(-1) == y).to(logp.dtype)
    return (correct * mask).sum(-1), (torch.nan_to_num(nll, nan=float("inf")) * mask).sum(-1)


def per_client(correct: Tensor, nll: Tensor, n: Tensor, clients: Tensor) -> dict[str, Any]:
    """One split's per-client metrics: ``{"acc", "loss", "n", "client"}`` arrays."""
    n = n.double().cpu()
    safe = n.clamp_min(1)
    return {"acc": (correct.double().cpu() / safe).numpy(), "loss": (nll.double().cpu() / safe).numpy(),
            "n": n.numpy(), "client": clients.cpu().numpy()}


def summarize(per_client: dict[str, Any]) -> dict[str, float]:
    """Flat summary ``{"<group>_<split>_<metric>": value}`` from ``Engine.evaluate`` output
    (``{group: {split: per_client(...)}}``)."""
    out: dict[str, float] = {}
    for gname, splits in per_client.items():
        for sname, m in splits.items():
            n = np.asarray(m["n"], dtype=float)
            has = n > 0
            if not has.any():
                continue
            acc, loss, n = np.asarray(m["acc"])[has], np.asarray(m["loss"])[has], n[has]
            k = max(1, int(np.ceil(0.1 * acc.size)))
            out[metric(gname, sname, "acc")] = float((acc * n).sum() / n.sum())
            out[metric(gname, sname, "acc_mean")] = float(acc.mean())
            out[metric(gname, sname, "acc_p10")] = float(np.percentile(acc, 10))
            out[metric(gname, sname, "acc_bottom10_mean")] = float(np.sort(acc)[:k].mean())
            out[metric(gname, sname, "loss")] = float((loss * n).sum() / n.sum())
    if SEEN_TEST_ACC_MEAN in out and UNSEEN_TEST_ACC_MEAN in out:
        out[PARTICIPATION_GAP] = out[UNSEEN_TEST_ACC_MEAN] - out[SEEN_TEST_ACC_MEAN]
    return out
