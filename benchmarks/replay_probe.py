"""Whether the stacked executor's steps are recorded as CUDA graphs (``run.compile = "auto"``,
``fedmtl.models.replay``) for the models of ``bench models`` and the batch-norm CNN, and if not, the full traceback
of the first failed recording (fedmtl's log at DEBUG).  Not a benchmark: a diagnosis for ``benchmarks/gpu_run.sh``
(``python -m benchmarks.replay_probe --device cuda``); prints one line per model and algorithm."""

from __future__ import annotations

import argparse
import logging
import time

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args(argv)
    from fedmtl.algorithms import FedAvg, FedEM
    from fedmtl.data.federated import ClientGroup, FederatedData, Split
    from fedmtl.models import build_model, replay
    from fedmtl.testing import run_rounds, simulator

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("fedmtl.models.replay").setLevel(logging.DEBUG)  # a failed recording's whole traceback
    g = torch.Generator().manual_seed(0)
    sizes = (40, 25, 33, 18)
    images = [torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8, generator=g) for n in sizes]
    labels = [torch.randint(0, 10, (n,), generator=g) for n in sizes]
    img = FederatedData(ClientGroup(Split.from_lists(images, labels), Split.from_lists(images, labels)), 10,
                        meta={"input": "image", "mean": 0.3, "std": 0.3})
    chars = [torch.randint(0, 80, (n, 20), dtype=torch.uint8, generator=g) for n in sizes]
    nxt = [torch.randint(0, 80, (n,), generator=g) for n in sizes]
    txt = FederatedData(ClientGroup(Split.from_lists(chars, nxt), Split.from_lists(chars, nxt)), 80)
    replayed: list[int] = []
    original = replay._Graph.replay

    def counted(self: replay._Graph, a: tuple) -> None:
        replayed.append(1)
        original(self, a)

    replay._Graph.replay = counted  # type: ignore[method-assign]
    for name, data, kw in (("mlp", img, {}), ("cnn_femnist", img, {}), ("cnn_bn", img, {}),
                           ("lstm", txt, {"hidden": 32, "embed": 8})):
        for alg in (FedAvg(), FedEM(num_components=2)):
            replayed.clear()
            try:
                m = build_model(name, data.feature_shape, data.num_classes, data.meta, **kw)
                eng = simulator(alg, data, m, runner="stacked", batch_size=8, device=args.device)
                t0 = time.perf_counter()
                run_rounds(eng, args.rounds)
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                print(f"{name} {alg.name}: {len(replayed)} replayed steps in {args.rounds} rounds "
                      f"({time.perf_counter() - t0:.2f} s)", flush=True)
            except Exception as e:  # the probe goes on to the next model
                print(f"{name} {alg.name}: {type(e).__name__}: {e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
