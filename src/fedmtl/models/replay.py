"""The stacked executor's local steps replayed as CUDA graphs (``run.compile = "auto"`` on a GPU).

A step of K clients' local SGD (``optim.local_sgd_clients``: the forward, the backward and the update of the live
clients' stacked parameters) is a few dozen small kernels whose launches, not their arithmetic, bound a GPU round
(measured in ``docs/results/speed.md``).  ``StepGraphs`` records one step as a CUDA graph
(``torch.cuda.CUDAGraph``) and replays it: one launch for the whole step.

A graph replays the kernels it recorded on the memory it recorded them with, so everything a step reads or writes
lives at a fixed address: the stacked parameters, momentum buffers and the loss accumulators are *held* tensors
(``hold``), allocated once per shape and refilled at each call of ``local_sgd_clients``; each step's batch is copied
into the recorded steps' input buffers before its replay.  Steps differ in the number of live clients (the prefix
``ClientBatches.live[s]``) and in the hyper-parameters baked into the kernels (a Python learning rate): one graph per
distinct step, keyed by those and the batch's shapes.  A step is run eagerly the first time its key is met (that run
also initializes what the step needs lazily, e.g. a cuBLAS workspace), recorded the second time, and replayed from
then on, so the capture is paid on steps that recur: with the same clients every round, from the third round on.
At most ``MAX_GRAPHS`` graphs are kept per signature (least recently used dropped).

Where a capture fails (an operation that cannot be recorded), the step runs eagerly from then on with one warning.
The arithmetic is the same kernels on the same values: a replayed round equals the eager one (``tests/test_device.py``
on a GPU, to 1e-6; ``tests/test_replay.py`` on the CPU to the bit, where the same bookkeeping runs with the recorded
step executed again instead of replayed: ``EMULATE``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

#: graphs kept per signature (``StepGraphs``); the least recently replayed is dropped beyond it
MAX_GRAPHS = 64

#: tests only: on a CPU, run ``StepGraphs``' bookkeeping (held tensors, input buffers, the eager-record-replay
#: schedule) with a "replay" that calls the recorded step again on its input buffers
EMULATE = False


def replays(device: torch.device) -> bool:
    """Whether steps on ``device`` can be replayed: a CUDA device (or the CPU under ``EMULATE``)."""
    return device.type == "cuda" or EMULATE


class _Graph:
    """One recorded step: the graph (``None`` under ``EMULATE``), its input buffers and the step to re-run."""

    def __init__(self, graph: Any, inputs: tuple[Tensor | None, ...], body: Callable[..., None]):
        self.graph, self.inputs, self.body = graph, inputs, body

    def replay(self, args: tuple[Tensor | None, ...]) -> None:
        for buf, a in zip(self.inputs, args, strict=True):
            if buf is not None:
                assert a is not None
                buf.copy_(a, non_blocking=True)
        if self.graph is None:
            self.body(*self.inputs)
        else:
            self.graph.replay()


class StepGraphs:
    """The held tensors and the recorded steps of one signature of ``local_sgd_clients`` (its clients' count, the
    parameters' shapes, the optimizer's state): see the module's docstring.  Kept in the model's ``cache``
    (``step_graphs``)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.held: dict[str, Tensor] = {}
        # the recorded steps' input buffers, one per argument position, shared: a step of n live clients reads the
        # first n rows (steps differ in their leading dimension only), so they cost one step's batch, not one each
        self.inputs: dict[int, Tensor] = {}
        self.graphs: OrderedDict[Hashable, _Graph] = OrderedDict()
        self.met: set[Hashable] = set()
        self.failed = False
        self.pool: Any = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        # the stream the steps are recorded on; a step's first, eager run runs there too, so that what the step's
        # libraries set up lazily per stream (cuBLAS and cuDNN workspaces, kernels loaded on first use) exists
        # before the recording, during which they may not be made
        self.stream: Any = torch.cuda.Stream(device) if device.type == "cuda" else None

    def hold(self, name: str, value: Tensor, zero: bool = False) -> Tensor:
        """The held tensor ``name`` of ``value``'s shape and dtype, refilled with ``value`` (with zeros where
        ``zero``).  The same tensor as the last call's where the shape and dtype are too, else a fresh one, which
        drops the graphs recorded on the old."""
        t = self.held.get(name)
        if t is None or t.shape != value.shape or t.dtype != value.dtype:
            if t is not None:
                self.graphs.clear()
                self.met.clear()
            t = self.held[name] = torch.empty(value.shape, dtype=value.dtype, device=self.device)
        if zero:
            t.zero_()
        else:
            t.copy_(value)
        return t

    def step(self, key: Hashable, body: Callable[..., None], args: tuple[Tensor | None, ...]) -> None:
        """Run ``body(*args)``: eagerly the first time ``key`` is met, recorded the second (then replayed), replayed
        after.  ``body`` reads and writes only held tensors besides ``args``, and its shapes, hyper-parameters and
        branches are fixed by ``key`` and the shapes of ``args``."""
        key = (key, tuple(None if a is None else (a.shape, a.dtype) for a in args))
        g = self.graphs.get(key)
        if g is not None:
            self.graphs.move_to_end(key)
            g.replay(args)
            return
        if self.failed or key not in self.met:
            self.met.add(key)
            self._eager(body, args)
            return
        g = self._record(body, args)
        if g is None:
            body(*args)
            return
        self.graphs[key] = g
        if len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)
        g.replay(args)

    def _eager(self, body: Callable[..., None], args: tuple[Tensor | None, ...]) -> None:
        if self.stream is None or self.failed:
            body(*args)
            return
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            body(*args)
        current.wait_stream(self.stream)  # the steps after it, and whatever reuses its inputs' memory, wait for it

    def _input(self, i: int, a: Tensor) -> Tensor:
        """The first ``len(a)`` rows of the shared input buffer of argument ``i`` (grown or remade where ``a`` does not
        fit it, which drops the graphs recorded on the old one)."""
        buf = self.inputs.get(i)
        if buf is None or buf.shape[1:] != a.shape[1:] or buf.dtype != a.dtype or buf.shape[0] < a.shape[0]:
            if buf is not None:
                self.graphs.clear()
            rows = a.shape[0] if buf is None or buf.shape[1:] != a.shape[1:] else max(a.shape[0], buf.shape[0])
            buf = self.inputs[i] = torch.empty((rows, *a.shape[1:]), dtype=a.dtype, device=self.device)
        return buf[:a.shape[0]]

    def _record(self, body: Callable[..., None], args: tuple[Tensor | None, ...]) -> _Graph | None:
        inputs = tuple(None if a is None else self._input(i, a) for i, a in enumerate(args))
        try:
            graph = self._capture(body, inputs)
        except Exception as e:  # an operation that cannot be recorded: eager from now on
            self.failed = True
            self.graphs.clear()
            first = e  # the error that broke the recording, not the capture's end that reports it
            while first.__context__ is not None and isinstance(first.__context__, Exception):
                first = first.__context__
            log.warning("run.compile: recording the stacked step as a CUDA graph failed (%s: %s); the steps run "
                        "eagerly", type(first).__name__, str(first).splitlines()[0] if str(first) else "",
                        exc_info=log.isEnabledFor(logging.DEBUG))
            return None
        return _Graph(graph, inputs, body)

    def _capture(self, body: Callable[..., None], inputs: tuple[Tensor | None, ...]) -> Any:
        """``body`` on ``inputs`` recorded as a CUDA graph (``None`` under ``EMULATE``).  Recording runs nothing:
        the held tensors are untouched until the replay that follows."""
        if self.device.type != "cuda":
            return None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            body(*inputs)
        return graph


def step_graphs(cache: dict[str, Any], signature: Hashable, device: torch.device) -> StepGraphs:
    """The ``StepGraphs`` of ``signature`` kept in a model's ``cache``."""
    table = cache.setdefault("step_graphs", {})
    g = table.get(signature)
    if g is None:
        g = table[signature] = StepGraphs(device)
    return g


__all__ = ["EMULATE", "MAX_GRAPHS", "StepGraphs", "replays", "step_graphs"]
