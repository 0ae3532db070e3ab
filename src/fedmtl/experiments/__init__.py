"""Paper reproductions: ``fedmtl reproduce NAME [--quick] --out DIR`` and ``fedmtl main`` (``make run``).

One module per reproduction; the method tables (methods and their config settings, paper numbers, seeds) are TOML
files beside the modules, shipped as package data.  The registry maps a reproduction's name to ``module:function``;
the module is imported only when that reproduction runs (``reproduction(name)``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

#: name -> ``module:function`` of this package; the function takes ``(out: Path, quick: bool = False)``
REPRODUCTIONS: dict[str, str] = {
    "robustness": "robustness:run",
    "async": "async_clock:run",
    "mocha": "mocha_skewed:everything",
    "mocha-skewed": "mocha_skewed:run",
    "networked": "networked:run",
    "networked-flow": "networked:flow",
    "fedem-synthetic": "fedem:fedem_synthetic",
    "fedem-vs-ifca": "fedem_ifca:run",
    "personalization": "personalization:personalization",
    "personalization-comparison": "personalization:comparison",
    "perfedavg": "perfedavg:run",
    "peer-fedper": "peer_fedper:run",
    "omnifedge-fmnist": "omnifedge:omnifedge_fmnist",
    "fmnist": "fedem:fmnist",
    "fmnist-cnn": "personalization:fmnist_cnn",
}


def reproduction(name: str) -> Callable[..., Any]:
    """The function that runs reproduction ``name`` (a key of ``REPRODUCTIONS``)."""
    module, _, function = REPRODUCTIONS[name].partition(":")
    fn: Callable[..., Any] = getattr(importlib.import_module(f"{__name__}.{module}"), function)
    return fn


__all__ = ["REPRODUCTIONS", "reproduction"]
