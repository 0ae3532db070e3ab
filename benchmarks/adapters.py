"""``fedmtl bench adapters``: what low-rank adapters cost per client, and a round of many clients' adapters.

* **Sizes** for character transformers of several widths (``char_transformer``), rank ``--rank`` adapters on the
  attention projections q and v (peft's usual choice) and on every projection: the bytes a client uploads per round
  (its adapters) against the full model's, and the state a client keeps (its adapters) against a full copy.
* **Round time** of ``--clients`` clients each taking ``--steps`` SGD steps of batch ``--batch`` on their adapters
  (FedAvg over rank-``--rank`` adapters, d = 96, 2 blocks, windows of 80 tokens): fedmtl's vectorized executors
  (``stacked`` and ``vmap``) against a per-client loop written the way peer libraries write it (one adapted module,
  ``torch.optim.SGD`` and ``DataLoader`` per client, clients one after another, the adapters loaded in and read out
  with ``state_dict``), and against the floor: the same model's adapters trained centrally on the same examples in
  the same number of batches of the same size.
Figures are measured and written to JSON, never asserted in tests.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from fedmtl.config import validate
from fedmtl.data.federated import FederatedData
from fedmtl.models import build_model
from fedmtl.models.lora import AdapterConfig, apply_adapters
from fedmtl.runs.driver import build_local
from fedmtl.runs.report import write_json

from .common import add_device, add_out, add_rounds, add_threads, device_name, out_path, peak_rss_mb, time_rounds

SEQ, VOCAB = 80, 80
ALL = ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.fc1", "mlp.fc2")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out(p)
    add_rounds(p, default=3)
    add_threads(p)
    add_device(p)
    p.add_argument("--clients", type=int, default=100, help="clients per round (default 100)")
    p.add_argument("--steps", type=int, default=2, help="local SGD steps per client (default 2)")
    p.add_argument("--batch", type=int, default=16, help="windows per batch (default 16)")
    p.add_argument("--rank", type=int, default=8, help="the adapters' rank (default 8)")
    p.add_argument("--chunk", type=int, default=0, help="run.chunk_size: clients per vectorized call (0 = all)")


def sizes(rank: int) -> list[dict[str, Any]]:
    """Bytes uploaded and kept per client with adapters against the full model, for several model sizes."""
    out = []
    for d, layers in ((96, 2), (256, 4), (512, 8)):
        module = build_model("char_transformer", (SEQ,), VOCAB, d_model=d, layers=layers, heads=4).module
        full = sum(p.numel() * p.element_size() for p in module.parameters())
        for name, target in (("q,v", ("attn.q", "attn.v")), ("all projections", ALL)):
            ad = apply_adapters(module, AdapterConfig(rank=rank, alpha=2.0 * rank, target=target))
            up = sum(p.numel() * p.element_size() for p in ad.parameters())
            out.append({"d_model": d, "layers": layers, "target": name, "full_model_bytes": full,
                        "adapter_bytes": up, "upload_fraction": up / full})
    return out


def _data(clients: int, per_client: int, seed: int = 0) -> FederatedData:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randint(0, VOCAB, (per_client + 4, SEQ), generator=g, dtype=torch.uint8) for _ in range(clients)]
    return FederatedData.from_arrays(train=[(x[:per_client], x[:per_client, -1].long()) for x in xs],
                                     test=[(x[per_client:], x[per_client:, -1].long()) for x in xs],
                                     num_classes=VOCAB)


class PeerLoop:
    """Per client: a deep copy of the adapted module with the global adapters loaded, its own ``torch.optim.SGD`` and
    ``DataLoader``, ``steps`` steps, the adapters read back with ``state_dict`` and averaged."""

    def __init__(self, module: torch.nn.Module, data: FederatedData, batch: int, lr: float, device: torch.device):
        self.template, self.batch, self.lr, self.device = module.to(device), batch, lr, device
        tr = data.seen.train
        self.sets = [TensorDataset(*(t.to(device) for t in tr.client(k))) for k in range(tr.num_clients)]
        self.glob = {k: v.detach().clone() for k, v in module.named_parameters()}

    def round(self) -> None:
        acc = {k: torch.zeros_like(v) for k, v in self.glob.items()}
        for ds in self.sets:
            m = copy.deepcopy(self.template)
            m.load_state_dict(self.glob, strict=False)
            opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=self.lr)
            for x, y in DataLoader(ds, batch_size=self.batch, shuffle=True):
                loss = torch.nn.functional.cross_entropy(m(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            for k, v in m.state_dict().items():
                if k in acc:
                    acc[k] += v
        self.glob = {k: v / len(self.sets) for k, v in acc.items()}


class Floor:
    """The same adapted model trained centrally on the same examples: one pass in batches of the same size."""

    def __init__(self, module: torch.nn.Module, data: FederatedData, batch: int, lr: float, device: torch.device):
        self.m = copy.deepcopy(module).to(device)
        tr = data.seen.train
        self.x, self.y = tr.x.to(device), tr.y.to(device)
        self.batch = batch
        self.opt = torch.optim.SGD([p for p in self.m.parameters() if p.requires_grad], lr=lr)

    def round(self) -> None:
        for i in range(0, len(self.y), self.batch):
            loss = torch.nn.functional.cross_entropy(self.m(self.x[i:i + self.batch]), self.y[i:i + self.batch])
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()


def _reset_peak(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)


def _peak(res: dict[str, Any], dev: torch.device, what: str) -> None:
    """The GPU memory a round of ``what`` took at its peak (data and base model included), in MiB."""
    if dev.type == "cuda":
        res[f"gpu_peak_mb_{what}"] = torch.cuda.max_memory_allocated(dev) / 2**20


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device or "cpu")
    data = _data(args.clients, args.steps * args.batch)
    rank, lr = args.rank, 0.5
    res: dict[str, Any] = {"torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                           "device": device_name(str(dev)), "platform": platform.platform(), "cpus": os.cpu_count(),
                           "clients": args.clients, "steps": args.steps, "batch": args.batch, "rank": rank,
                           "chunk_size": args.chunk, "rounds_timed": args.rounds, "sizes": sizes(rank)}
    raw = {"model": {"name": "char_transformer", "d_model": 96, "layers": 2, "heads": 4,
                     "adapters": {"rank": rank, "alpha": 2.0 * rank, "target": list(ALL)}},
           "algorithm": {"name": "fedavg"}, "optim": {"lr": lr},
           "run": {"rounds": 10_000, "batch_size": args.batch, "eval_every": 10_000, "checkpoint_every": 0,
                   "device": str(dev), "chunk_size": args.chunk}}
    for runner in ("stacked", "vmap"):
        raw["run"]["runner"] = runner
        cfg = validate({**raw, "data": {"name": "shakespeare"}})  # (the data is given: the table is never built)
        eng = build_local(cfg, data)
        st = eng.init_state()
        _reset_peak(dev)
        times = time_rounds(lambda eng=eng, st=st: eng.round(st), args.rounds)
        res[f"round_seconds_{runner}"] = statistics.median(times)
        res[f"path_{runner}"] = eng.clients.executor.name
        _peak(res, dev, runner)
    module = build_local(cfg, data).model.module
    peer = PeerLoop(module, data, args.batch, lr, dev)
    _reset_peak(dev)
    res["round_seconds_peer_loop"] = statistics.median(time_rounds(peer.round, args.rounds))
    _peak(res, dev, "peer_loop")
    floor = Floor(module, data, args.batch, lr, dev)
    res["round_seconds_floor"] = statistics.median(time_rounds(floor.round, args.rounds))
    best = min(res["round_seconds_stacked"], res["round_seconds_vmap"])
    res["speedup_vs_peer_loop"] = res["round_seconds_peer_loop"] / best
    res["round_vs_floor"] = best / res["round_seconds_floor"]
    res["peak_rss_mb"] = peak_rss_mb()
    write_json(out_path(args.out), res)
    print({k: v for k, v in res.items() if k != "sizes"})
    for s in res["sizes"]:
        print(f"d={s['d_model']:4d} layers={s['layers']} {s['target']:16s} upload {s['adapter_bytes'] / 1024:8.1f} KiB"
              f" = {100 * s['upload_fraction']:.2f}% of {s['full_model_bytes'] / 2**20:.1f} MiB")
    return 0
