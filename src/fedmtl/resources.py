"""The configs that ship inside the package (``fedmtl/configs/``, also reachable as ``configs/`` in a checkout):
``fedmtl run synthetic/fedem`` or ``fedmtl run configs/synthetic/fedem.toml`` works in any folder after
``pip install fedmtl``; reproductions read their configs from here."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def configs_root() -> Path:
    return Path(str(resources.files("fedmtl") / "configs"))


def bundled_configs() -> list[str]:
    """Names of the bundled configs, as ``group/name`` (e.g. ``synthetic/fedem``)."""
    root = configs_root()
    return sorted(str(p.relative_to(root).with_suffix("")) for p in root.glob("**/*.toml"))


def config_path(name: str | Path) -> Path:
    """The bundled config ``name``: ``synthetic/fedem``, ``synthetic/fedem.toml``, ``configs/synthetic/fedem.toml``."""
    text = str(name).replace("\\", "/")
    if text.startswith("configs/"):
        text = text[len("configs/"):]
    if not text.endswith(".toml"):
        text += ".toml"
    return configs_root() / text


def resolve_config(path: str | Path) -> Path:
    """``path`` if it names a file; else the bundled config of that name if there is one; else ``path``."""
    p = Path(path)
    if p.exists():
        return p
    bundled = config_path(path)
    return bundled if bundled.is_file() else p


__all__ = ["bundled_configs", "config_path", "configs_root", "resolve_config"]
