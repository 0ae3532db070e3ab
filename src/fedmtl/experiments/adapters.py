"""``fedmtl reproduce adapters``: personalized fine-tuning of a pretrained model with low-rank adapters.

A character transformer (``configs/shakespeare/adapters``: 2 blocks, d = 96, about 250 k weights) is pretrained
centrally on the roles of the first half of the Shakespeare plays (in name order), then personalized per speaking
role on the other half (no play in common; LEAF's construction, each role's lines split 80/20 in time) by six
methods: FedAvg of the whole model, FedAvg over rank-8 adapters, Local adapters (no communication), Ditto, FedSA-LoRA
and FedEM over M = 3 adapter sets, each with 3 seeds.  Reported: the final round's next-character accuracy, mean and
10th percentile over clients, mean ± std over seeds, beside the pretrained base alone (no fine-tuning), and what
each client uploads per round.  Written: ``adapters.md``, ``summary.json``, ``summary.png`` (every method's average
and bottom decile), ``base_eval.json`` (the base alone), ``fedem_mixture.json`` (``mixture_diagnosis``: why FedEM-LoRA
does or does not beat FedAvg-LoRA) and ``base.safetensors`` (the pretrained weights, reused when the run is
continued).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import tree as T
from ..config import load
from ..engine.evaluation import SEEN_TEST_ACC_MEAN, SEEN_TEST_ACC_P10
from ..models.lora import seeded_base
from ..resources import config_path
from ..runs.driver import build_data
from ..runs.progress import Progress
from ..runs.report import markdown_table, write_json
from .common import publish, record_figure, run_method_seeds

#: label -> bundled config (configs/shakespeare/adapters/<name>.toml)
METHODS: dict[str, str] = {"FedAvg-full": "fedavg_full", "FedAvg-LoRA": "fedavg_lora", "Local-LoRA": "local_lora",
                           "Ditto-LoRA": "ditto_lora", "FedSA-LoRA": "fedsa_lora", "FedEM-LoRA": "fedem_lora"}
SEEDS = [1, 2, 3]


#: the order the methods run in (the table keeps ``METHODS``' order): the costliest, FedEM-LoRA, right after the two
#: baselines it is compared with
RUN_ORDER = ("FedAvg-full", "FedAvg-LoRA", "FedEM-LoRA", "Local-LoRA", "Ditto-LoRA", "FedSA-LoRA")


def message_bytes(cfg: Any, data: Any) -> dict[str, int]:
    """What one sampled client of ``cfg``'s method receives (``download_bytes``: the server's payload) and sends
    (``upload_bytes``: its update, e.g. FedEM's M adapter sets, FedSA-LoRA's A matrices only, nothing for Local) per
    round; what it trains (``trained_bytes``: the model's trainable parameters) and the whole model, base and
    adapters (``model_bytes``)."""
    from ..runs.driver import build_local

    engine = build_local(cfg, data)
    payload = engine.alg.payload(engine.init_state(None).server)

    def size(tree: Any) -> int:
        return sum(int(v.numel()) * v.element_size() for v in T.leaves(tree))

    return {"download_bytes": size(payload), "upload_bytes": size(engine.alg.update_like(engine.ctx, payload)),
            "trained_bytes": size(engine.model.init(0)),
            "model_bytes": sum(v.numel() * v.element_size() for v in engine.model.module.state_dict().values())}


def pretrain(out: Path, quick: bool = False, epochs: int = 1, batch: int = 64, lr: float = 3e-3) -> Path:
    """Train the adapters configs' transformer centrally on the pretraining plays (every role's windows pooled,
    stride 20) with AdamW for ``epochs`` epochs; write ``out/base.safetensors`` and ``out/pretrain.json`` (loss and
    next-character accuracy on those plays' held-out windows).  A base already there from the same settings is
    reused."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = load(config_path("shakespeare/adapters/fedavg_full"), ["data.plays=pretrain", "data.stride=20",
                                                                 "data.min_samples=0"])
    settings = {"model": {k: v for k, v in cfg.model.items() if k != "weights"}, "data": cfg.data, "epochs": epochs,
                "batch": batch, "lr": lr, "quick": quick}
    done = out / "pretrain.json"
    if (out / "base.safetensors").exists() and done.exists() and json.loads(done.read_text()).get("settings") == \
            json.loads(json.dumps(settings)):
        return out / "base.safetensors"
    data = build_data(cfg, Progress())
    train, test = data.seen.train, data.seen.test
    model = cfg.build_model(data.feature_shape, data.num_classes, data.meta)
    module = model.module
    g = torch.Generator().manual_seed(0)
    seeded_base(module, 0)  # the weights pretraining starts from, the same on every machine
    opt = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=0.01)
    x, y = train.x, train.y
    steps = 30 if quick else epochs * (len(y) // batch)
    t0 = time.perf_counter()
    module.train()
    losses = []
    for s in range(steps):
        if s % max(1, len(y) // batch) == 0:
            order = torch.randperm(len(y), generator=g)
        i = order[(s % max(1, len(y) // batch)) * batch:][:batch]
        loss = torch.nn.functional.cross_entropy(module(x[i]), y[i].long())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    module.eval()
    correct, total, tl = 0, 0, 0.0
    with torch.no_grad():
        for j in range(0, len(test.y), 1024):
            logits = module(test.x[j:j + 1024])
            correct += int((logits.argmax(1) == test.y[j:j + 1024]).sum())
            tl += float(torch.nn.functional.cross_entropy(logits, test.y[j:j + 1024].long(), reduction="sum"))
            total += len(test.y[j:j + 1024])
    save_file({k: v.detach().contiguous() for k, v in module.state_dict().items()}, str(out / "base.safetensors"))
    info = {"settings": settings, "steps": steps, "train_windows": int(len(y)), "test_windows": total,
            "final_train_loss": float(np.mean(losses[-50:])), "test_loss": tl / total, "test_acc": correct / total,
            "seconds": time.perf_counter() - t0, "parameters": sum(p.numel() for p in module.parameters())}
    write_json(done, info)
    print(f"pretrained on {len(y)} windows of {len({c.split('_')[0] for c in data.meta['clients']})} plays: "
          f"test acc {100 * info['test_acc']:.1f}% ({info['seconds']:.0f} s)", flush=True)
    return out / "base.safetensors"


def run(out: Path, quick: bool = False) -> dict[str, Any]:
    """Pretrain (or reuse) the base, then every method of ``METHODS`` with ``SEEDS`` on the personalization plays."""
    out.mkdir(parents=True, exist_ok=True)
    base = pretrain(out, quick)
    ov = ["run.rounds=2", "run.eval_every=2", "run.checkpoint_every=2", "run.clients_per_round=4",
          "data.min_samples=200"] if quick else []
    seeds = SEEDS[:1] if quick else SEEDS
    results: dict[str, Any] = {}
    data = None
    for k, label in enumerate(RUN_ORDER):
        name = METHODS[label]
        print(f"[{k + 1}/{len(METHODS)}] {label}", flush=True)
        full = name == "fedavg_full"
        sets = [*ov, f"model.weights={base}"] if full else [*ov, f"model.adapters.base={base}"]
        cfg = load(config_path(f"shakespeare/adapters/{name}"), sets)
        if data is None:
            data = build_data(cfg, Progress())
        t0 = time.perf_counter()
        results[label] = run_method_seeds(cfg, out / "runs" / label, data, seeds)
        # training time over every round of its seeds, interrupted and continued or not (evaluation excluded)
        train_seconds = results[label]["seconds_per_round"] * sum(results[label]["rounds"])
        results[label].update(**message_bytes(cfg, data), train_seconds=train_seconds)
        f = results[label]["final"]
        print(f"{label:12s} avg {100 * f[SEEN_TEST_ACC_MEAN]:5.1f}  p10 {100 * f[SEEN_TEST_ACC_P10]:5.1f}  "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    assert data is not None
    results = {label: results[label] for label in METHODS}  # the table's order
    record_figure(out, f"Shakespeare roles, {data.seen.num_clients} clients ({'quick' if quick else 'full'})",
                  results)
    pre = json.loads((out / "pretrain.json").read_text())
    rows = {label: {"avg": 100 * r["final"][SEEN_TEST_ACC_MEAN], "avg_std": 100 * r["final_std"][SEEN_TEST_ACC_MEAN],
                    "bottom_decile": 100 * r["final"][SEEN_TEST_ACC_P10],
                    "bottom_decile_std": 100 * r["final_std"][SEEN_TEST_ACC_P10],
                    "upload_bytes": r["upload_bytes"], "download_bytes": r["download_bytes"],
                    "trained_bytes": r["trained_bytes"],
                    "model_bytes": r["model_bytes"], "rounds": r["rounds"], "train_seconds": r["train_seconds"]}
            for label, r in results.items()}
    summary = {"methods": rows, "seeds": seeds, "clients": data.seen.num_clients, "quick": quick,
               "pretrain": {k: pre[k] for k in ("test_acc", "steps", "train_windows", "parameters", "seconds")},
               "train_seconds": sum(r["train_seconds"] for r in rows.values())}
    base_evaluation(out, load(config_path("shakespeare/adapters/fedavg_lora"), [*ov, f"model.adapters.base={base}"]),
                    data)
    if not quick:
        mixture_diagnosis(out, data)
    publish(out, "adapters.md", summary, adapters_markdown)
    return rows


def base_evaluation(out: Path, cfg: Any, data: Any) -> dict[str, float]:
    """The pretrained base alone (``cfg``: an adapter method, its adapters at their B = 0 start: no fine-tuning) on
    the personalization roles, evaluated by the engine as the methods are (mean and 10th percentile over clients of
    their test accuracy, %): the reference each method's gain is measured from.  Written to ``out/base_eval.json``."""
    from ..engine.evaluation import summarize
    from ..runs.driver import build_local

    engine = build_local(cfg, data)
    f = summarize(engine.evaluate(engine.init_state(None), ("seen",)))
    row = {"avg": 100 * f[SEEN_TEST_ACC_MEAN], "bottom_decile": 100 * f[SEEN_TEST_ACC_P10],
           "loss": f["seen_test_loss"]}
    write_json(out / "base_eval.json", row)
    return row


def mixture_diagnosis(out: Path, data: Any = None, label: str = "FedEM-LoRA", windows: int = 64) -> dict[str, Any]:
    """Why FedEM over adapters does or does not beat FedAvg over them, measured from ``out/runs/<label>``'s last
    checkpoints (one per seed); written to ``out/fedem_mixture.json``.  Per seed: the clients' mixture weights (the
    clients sampled at least once: their largest weight, median and maximum, and their entropy's minimum as a
    fraction of ln M, 1 = uniform) and how far apart the M components' adapter updates are as weights
    (``spread``: sqrt(sum_m ||D_m - mean D||^2 / sum_m ||D_m||^2) over every adapted layer's D_m = B_m A_m, 0 when
    the components are identical, 1 when they are orthogonal with equal norms).  With ``data`` (the run's
    federated data), also how far apart they are as predictors: on up to ``windows`` training windows of each of those
    clients, each component's mean next-character loss (nats); ``nll_gap_*``: per client, the best component's loss
    below the worst's (median and maximum over clients); ``example_llr_median``: per window, the largest
    log-likelihood ratio between two components, median over windows (what FedEM's E-step sees)."""
    from ..runs import checkpoint

    seeds: dict[str, Any] = {}
    for ck in sorted((out / "runs" / label).glob("seed-*/checkpoint.pt")):
        saved = checkpoint.load(ck)
        pi = next(v for k, v in saved["clients"].items() if k not in ("kind", "ids")).double()
        m = pi.shape[1]
        ent = -(pi * pi.clamp_min(1e-300).log()).sum(1) / np.log(m)
        server = saved["server"]
        num = den = 0.0
        for k, a in server.items():
            if not k.endswith("lora_A']"):
                continue
            d = torch.einsum("mor,mri->moi", server[k.replace("lora_A", "lora_B")].double(), a.double())
            num += float(((d - d.mean(0)) ** 2).sum())
            den += float((d ** 2).sum())
        top = pi.max(1).values
        row = {"round": saved["round"], "clients": int(pi.shape[0]), "components": m,
               "max_weight_median": float(top.median()), "max_weight_max": float(top.max()),
               "entropy_min_over_ln_m": float(ent.min()), "spread": float(np.sqrt(num / den)) if den else 0.0}
        if data is not None:
            row.update(_likelihood_gaps(load(out / "runs" / label / "config.toml"), data, server,
                                        saved["clients"]["ids"], m, windows))
        seeds[ck.parent.name] = row
    summary = {"method": label, "seeds": seeds}
    write_json(out / "fedem_mixture.json", summary)
    return summary


def _likelihood_gaps(cfg: Any, data: Any, server: dict[str, torch.Tensor], ids: torch.Tensor, m: int,
                     windows: int) -> dict[str, float]:
    """``mixture_diagnosis``'s per-component losses of the clients ``ids`` (see there)."""
    model = cfg.build_model(data.feature_shape, data.num_classes, data.meta)
    comps = [{k[len(".components['"):-2]: v[j] for k, v in server.items() if k.startswith(".components[")}
             for j in range(m)]
    train, gaps, llr = data.seen.train, [], []
    with torch.no_grad():
        for c in ids.tolist():
            lo, hi = int(train.offsets[c]), int(train.offsets[c + 1])
            x, y = train.x[lo:min(hi, lo + windows)], train.y[lo:min(hi, lo + windows)].long()
            logp = torch.stack([-model.nll(model.apply(p, x), y) for p in comps])  # (M, windows)
            nll = -logp.mean(1)
            gaps.append(float(nll.max() - nll.min()))
            llr.append(logp.max(0).values - logp.min(0).values)
    every = torch.cat(llr)
    return {"nll_gap_median": float(np.median(gaps)), "nll_gap_max": float(np.max(gaps)),
            "example_llr_median": float(every.median()), "windows_per_client": windows}


def adapters_markdown(results: Path) -> str:
    """``adapters.md`` from the stored ``summary.json`` (``fedmtl tables`` regenerates it)."""
    s: dict[str, Any] = json.loads((results / "summary.json").read_text())
    pre = s["pretrain"]
    head = (f"# Personalizing a pretrained character transformer per Shakespeare role: next-character accuracy (%), "
            f"final round, mean ± std over seeds {s['seeds']}\n\n"
            f"{s['clients']} roles of the plays the base never saw; the base ({pre['parameters']:,} weights) was "
            f"pretrained on {pre['train_windows']:,} windows of the other plays ({100 * pre['test_acc']:.1f}% on their "
            "held-out windows).  `upload` / `download` = bytes a sampled client sends / receives per round.\n\n")
    body = [[label, f"{r['avg']:.1f} ± {r['avg_std']:.1f}", f"{r['bottom_decile']:.1f} ± {r['bottom_decile_std']:.1f}",
             f"{r['upload_bytes'] / 1024:.0f} KiB", f"{r['download_bytes'] / 1024:.0f} KiB",
             f"{100 * r['trained_bytes'] / max(s['methods']['FedAvg-full']['trained_bytes'], 1):.1f}%"]
            for label, r in s["methods"].items()]
    if (results / "base_eval.json").exists():  # the reference: the pretrained base, not fine-tuned
        b = json.loads((results / "base_eval.json").read_text())
        body.insert(0, ["pretrained base (no fine-tuning)", f"{b['avg']:.1f}", f"{b['bottom_decile']:.1f}", "-", "-",
                        "-"])
    table = head + markdown_table(["method", "avg", "p10", "upload", "download", "trained / full model"], body)
    mix = results / "fedem_mixture.json"
    if not mix.exists():
        return table
    runs = list(json.loads(mix.read_text())["seeds"].values())
    lines = [f"\nFedEM-LoRA's mixture at round {runs[0]['round']} (`fedem_mixture.json`, {len(runs)} seeds, "
             f"M = {runs[0]['components']}): a client's largest weight has median "
             f"{np.median([r['max_weight_median'] for r in runs]):.3f} (at most "
             f"{max(r['max_weight_max'] for r in runs):.3f}); the components' adapter updates spread "
             f"{np.mean([r['spread'] for r in runs]):.2f} around their mean"]
    if "nll_gap_median" in runs[0]:
        lines.append(f"; on a client's windows the best component's loss is "
                     f"{np.median([r['nll_gap_median'] for r in runs]):.3f} nats below the worst's (median, at most "
                     f"{max(r['nll_gap_max'] for r in runs):.3f})")
    return table + "".join(lines) + ".\n"


__all__ = ["METHODS", "RUN_ORDER", "SEEDS", "adapters_markdown", "base_evaluation", "message_bytes",
           "mixture_diagnosis", "pretrain", "run"]
