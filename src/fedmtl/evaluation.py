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

Results are always the state at the end of the run (final round), never the best round.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor
from torch.func import vmap

from . import tree as T
from .data.federated import ClientGroup, epoch_orders, padded, round_batches

if TYPE_CHECKING:
    from .simulate import SimState, Simulator


def _chunks(counts_max: Tensor, elems_per_example: int, budget: int) -> list[Tensor]:
    out, start, n = [], 0, counts_max.numel()
    order = torch.arange(n)
    while start < n:
        nmax, end = 1, start
        while end < n:
            cand = max(nmax, int(counts_max[end]))
            if end > start and (end - start + 1) * cand * elems_per_example > budget:
                break
            nmax, end = cand, end + 1
        out.append(order[start:end])
        start = end
    return out


def _scores(logp: Tensor, y: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per-client (correct count, summed NLL) from (k, n, C) log-probabilities."""
    nll = -torch.gather(logp, -1, y.unsqueeze(-1)).squeeze(-1)
    correct = (logp.argmax(-1) == y).to(logp.dtype)
    return (correct * mask).sum(-1), (torch.nan_to_num(nll, nan=float("inf")) * mask).sum(-1)


def evaluate_group(sim: Simulator, state: SimState, group: ClientGroup, seen: bool, lr: float) -> dict[str, Any]:
    alg, ctx, cfg = sim.alg, sim.ctx, sim.cfg
    n_clients = group.num_clients
    splits = group.splits()
    payload = alg.payload(state.server)
    per_ex = int(np.prod(sim.data.feature_shape)) or 1
    cmax = torch.stack([s.counts.cpu() for s in splits.values()]).max(0).values
    res = {
        k: {"correct": torch.zeros(n_clients, dtype=torch.float64), "nll": torch.zeros(n_clients, dtype=torch.float64)}
        for k in splits
    }
    orders = None
    if alg.needs_adaptation or not seen:
        g = torch.Generator().manual_seed(int(cfg.seed) * 7919 + state.round * 104729 + (0 if seen else 1))
        orders = epoch_orders(group.train.counts.cpu(), alg.adapt_epochs, g)
    all_clients = torch.arange(n_clients)
    init_one = None if seen else alg.init_client(ctx, state.server)

    def personalize(p: Any, s: Any, b: Any) -> Any:
        return alg.personalize(ctx, p, s, b, lr, seen)

    def predict(es: Any, x: Tensor) -> Tensor:
        return alg.predict_log_proba(ctx, es, x)

    per_client = sim.runner == "loop"
    for idx in _chunks(cmax, per_ex, cfg.eval_chunk_elems):
        dev_idx = idx.to(sim.device)
        if seen:
            states = T.take(state.clients, dev_idx)
        else:
            states = T.broadcast(init_one, len(idx))
        batches = None
        if orders is not None:
            batches = round_batches(group.train, all_clients, orders, idx, cfg.batch_size)
        if not T.leaves(states) and batches is None:  # same state for every client (a global model)
            eval_states = T.broadcast(personalize(payload, states, None), len(idx))
        elif per_client:
            es_list = [personalize(payload, T.take(states, i), None if batches is None else T.take(batches, i))
                       for i in range(len(idx))]
            eval_states = T.stack(es_list)
        else:
            in_b = None if batches is None else 0
            eval_states = vmap(personalize, in_dims=(None, 0, in_b))(payload, states, batches)
        for name, split in splits.items():
            x, y, mask = padded(split, idx)
            if per_client:
                logp = torch.stack([predict(T.take(eval_states, i), x[i]) for i in range(len(idx))])
            else:
                logp = vmap(predict)(eval_states, x)
            c, l = _scores(logp, y, mask)
            res[name]["correct"][idx] = c.double().cpu()
            res[name]["nll"][idx] = l.double().cpu()
    out: dict[str, Any] = {}
    for name, split in splits.items():
        n = split.counts.cpu().double()
        safe = n.clamp_min(1)
        out[name] = {
            "acc": (res[name]["correct"] / safe).numpy(),
            "loss": (res[name]["nll"] / safe).numpy(),
            "n": n.numpy(),
        }
    return out


def summarize(per_client: dict[str, Any]) -> dict[str, float]:
    """Flat summary ``{"<group>_<split>_<metric>": value}`` from ``Simulator.evaluate`` output."""
    out: dict[str, float] = {}
    for gname, splits in per_client.items():
        for sname, m in splits.items():
            n = np.asarray(m["n"], dtype=float)
            has = n > 0
            if not has.any():
                continue
            acc, loss, n = np.asarray(m["acc"])[has], np.asarray(m["loss"])[has], n[has]
            k = max(1, int(np.ceil(0.1 * acc.size)))
            pre = f"{gname}_{sname}_"
            out[pre + "acc"] = float((acc * n).sum() / n.sum())
            out[pre + "acc_mean"] = float(acc.mean())
            out[pre + "acc_p10"] = float(np.percentile(acc, 10))
            out[pre + "acc_bottom10_mean"] = float(np.sort(acc)[:k].mean())
            out[pre + "loss"] = float((loss * n).sum() / n.sum())
    if "seen_test_acc_mean" in out and "unseen_test_acc_mean" in out:
        out["participation_gap"] = out["unseen_test_acc_mean"] - out["seen_test_acc_mean"]
    return out
