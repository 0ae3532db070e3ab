"""``fedmtl reproduce fedem-vs-ifca``: why IFCA (k = 3) scores above FedEM (M = 3) on FedEM's own synthetic data.

One seed of each (the main job's configs, ``configs/synthetic/fedem.toml`` and ``ifca.toml``), then:

* how concentrated the generator's mixture weights are (the clients' true pi) and FedEM's learned ones;
* FedEM's prediction rule: the pi-weighted mixture (Eq. 6) against the argmax-pi component alone and against the
  component of lowest training loss (IFCA's choice), on the same learned components;
* how well each method's three models recover the generator's components: cosine similarity to the true
  theta_m (best matching), norms and biases;
* IFCA's choices: clients per model, and how often a client picks the model of its true dominant component.

Written to ``summary.json`` (a JSON file of measured numbers).
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import load
from ..runs.driver import run_experiment


def _linear(comps: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    w = comps["weight"].reshape(comps["weight"].shape[0], -1).float()
    b = comps["bias"].reshape(-1).float()
    return w, b


def run(out: str | Path, quick: bool = False, seed: int = 1) -> dict[str, Any]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rounds = ["run.rounds=20"] if quick else []
    summary: dict[str, Any] = {"seed": seed}
    data = None
    for alg in ("fedem", "ifca"):
        cfg = load(f"synthetic/{alg}", ["run.checkpoint_every=0", f"run.seed={seed}", *rounds])
        data = data if data is not None else cfg.build_data()
        res = run_experiment(cfg, None, progress=False, data=data)
        theta = np.asarray(data.meta["theta"])
        true_pi = np.asarray(data.meta["pi"])[: data.seen.num_clients]
        server: Any = res.server
        comps = server.components if alg == "fedem" else server.models
        w, b = _linear(comps)
        cos = (w.numpy() / np.linalg.norm(w.numpy(), axis=1, keepdims=True)) @ \
            (theta / np.linalg.norm(theta, axis=1, keepdims=True)).T
        best = max(itertools.permutations(range(len(w))), key=lambda p: sum(cos[i, p[i]] for i in range(len(p))))
        tr, te = data.seen.train, data.seen.test
        picks, acc_mix, acc_top, acc_train_best = [], [], [], []
        states: Any = res.client_states()
        pi = states.pi.numpy() if alg == "fedem" else None
        for k in range(data.seen.num_clients):
            xt, yt = tr.client(k)
            train_loss = torch.nn.functional.binary_cross_entropy_with_logits(
                xt.float() @ w.T + b, yt.float().unsqueeze(1).expand(-1, len(w)), reduction="none").mean(0)
            pick = int(train_loss.argmin())
            picks.append(pick)
            if pi is not None:
                x, y = te.client(k)
                p1 = torch.sigmoid(x.float() @ w.T + b)  # (n, M)
                mix = (p1 * torch.from_numpy(pi[k]).float()).sum(1)  # (n,) the mixture's P(y = 1)
                acc_mix.append(float(((mix > 0.5).long() == y).float().mean()))
                acc_top.append(float(((p1[:, int(pi[k].argmax())] > 0.5).long() == y).float().mean()))
                acc_train_best.append(float(((p1[:, pick] > 0.5).long() == y).float().mean()))
        picks_a = np.array(picks)
        entry: dict[str, Any] = {
            "seen_test_acc_mean": res.final["seen_test_acc_mean"],
            "cosine_to_true_components": [float(cos[i, best[i]]) for i in range(len(best))],
            "norms": np.linalg.norm(w.numpy(), axis=1).tolist(), "biases": b.tolist(),
            "clients_per_model_by_train_loss": np.bincount(picks_a, minlength=len(w)).tolist(),
            "train_loss_pick_is_true_dominant": float(np.mean([best[p] == t for p, t in
                                                                zip(picks_a, true_pi.argmax(1), strict=True)])),
        }
        if pi is not None:
            entry.update({"mixture_acc": float(np.mean(acc_mix)), "argmax_pi_component_acc": float(np.mean(acc_top)),
                          "lowest_train_loss_component_acc": float(np.mean(acc_train_best)),
                          "learned_pi_mean_max": float(pi.max(1).mean()),
                          "learned_pi_frac_max_over_0.8": float((pi.max(1) > 0.8).mean())})
        summary[alg] = entry
        summary["true_pi"] = {"mean_max": float(true_pi.max(1).mean()),
                              "frac_max_over_0.5": float((true_pi.max(1) > 0.5).mean()),
                              "frac_max_over_0.8": float((true_pi.max(1) > 0.8).mean())}
    summary["seconds"] = time.perf_counter() - t0
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=1))
    return summary
