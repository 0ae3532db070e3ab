"""Conversion between fedmtl pytrees / scalars and Flower records.

Payloads and updates are pytrees of tensors (dicts, tuples, NamedTuples); they travel as an
``ArrayRecord`` whose keys are the leaves' paths (e.g. ``['params']['fc.weight']``), so FedEM's M stacked
components are one named (M, ...) array each.  The receiver rebuilds the tree from a template of the same
structure (both ends build the same algorithm and model from the same config), checking that names,
shapes and dtypes agree.  Metrics and configuration are scalars and lists of scalars; integers (client
ids, counts) stay integers and never pass through floating point.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord

from ..tree import Tree, TreeError, from_named, to_named


class RecordError(ValueError):
    """A record does not match the expected tree."""


def tree_to_record(tree: Tree) -> ArrayRecord:
    return ArrayRecord({name: leaf.detach().cpu().contiguous() for name, leaf in to_named(tree).items()})


def record_to_tree(record: ArrayRecord, template: Tree, device: torch.device | str = "cpu",
                   leading: bool = False) -> Tree:
    """Rebuild a tree shaped like ``template`` from ``record`` (names, shapes and dtypes must match; with
    ``leading`` the length of stacked leaves may differ, as a payload whose stack grows)."""
    named = {name: torch.from_numpy(np.ascontiguousarray(record[name].numpy())) for name in record.keys()}
    for name, ref in to_named(template).items():  # Flower's arrays are at least 1-d: scalars come back as (1,)
        if ref.dim() == 0 and name in named and tuple(named[name].shape) == (1,):
            named[name] = named[name].reshape(())
    try:
        return from_named(named, template, device, leading)
    except TreeError as e:
        raise RecordError(str(e)) from None


def _scalar(v: Any) -> Any:
    if isinstance(v, bool | str):
        return v
    if isinstance(v, int | np.integer):
        return int(v)
    if isinstance(v, float | np.floating):
        return float(v)
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    if isinstance(v, list | tuple | np.ndarray | torch.Tensor):
        items = [_scalar(x) for x in (v.tolist() if hasattr(v, "tolist") else v)]
        if items and len({type(x) for x in items}) > 1:
            raise RecordError(f"a list must hold one scalar type, got {sorted({type(x).__name__ for x in items})}")
        return items
    raise RecordError(f"not a scalar or list of scalars: {type(v).__name__}")


def to_config(values: dict[str, Any]) -> ConfigRecord:
    return ConfigRecord({k: _scalar(v) for k, v in values.items()})


def to_metrics(values: dict[str, Any]) -> MetricRecord:
    out = {}
    for k, v in values.items():
        s = _scalar(v)
        if isinstance(s, str | bool):
            raise RecordError(f"metric {k!r} must be numeric, got {type(s).__name__}")
        out[k] = s
    return MetricRecord(out)


def from_record(record: ConfigRecord | MetricRecord) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, list) else v) for k, v in record.items()}
