"""The registries (algorithms, models, datasets, robust aggregators, attacks) and the decorators that extend them.

A config's ``[algorithm] name``, ``[model] name``, ``[data] name``, ``[robust] aggregator`` and ``[attack] kind``
are looked up here.  Built-ins register themselves when their modules are imported (``fedmtl.algorithms``,
``fedmtl.models``, ``fedmtl.data``, ``fedmtl.robust``); plugins register with the decorators and are imported by
``fedmtl run --import MODULE`` or through the entry-point group ``fedmtl.plugins`` (``load_plugins``).  The
decorators of aggregators and attacks live beside their contract checks (``fedmtl.robust.aggregators``,
``fedmtl.robust.attacks``), built on ``register_checked``::

    @fedmtl.register_algorithm
    @dataclass(frozen=True)
    class MyAlg(fedmtl.Algorithm):
        name: ClassVar[str] = "myalg"
        ...

    @fedmtl.register_model("tiny")
    def tiny(input_shape, num_classes, meta=None, width: int = 8) -> fedmtl.Model: ...

    @fedmtl.register_dataset("mydata")
    def mydata(num_clients: int = 10, seed: int = 0) -> fedmtl.FederatedData: ...

    @fedmtl.register_aggregator("mymedian")
    def mymedian(updates, weights, config: RobustConfig) -> Tree: ...  # the rows of weight > 0, combined

    @fedmtl.register_attack("myattack")
    def myattack(r: AttackRound) -> Tree: ...  # what the attackers r.attackers send

This module imports nothing from the rest of the package, so every module may import it.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, TypeVar

log = logging.getLogger("fedmtl")

if TYPE_CHECKING:  # for annotations only: this module imports nothing of the package at run time
    from .algorithms.base import Algorithm

ALGORITHMS: dict[str, type[Algorithm]] = {}
MODELS: dict[str, Callable[..., Any]] = {}
DATASETS: dict[str, Callable[..., Any]] = {}
#: ``[robust] aggregator`` -> ``(updates (K, ...), weights (K,), RobustConfig) -> one update``
AGGREGATORS: dict[str, Callable[..., Any]] = {}
#: ``[attack] kind`` -> ``(AttackRound) -> what the round's attackers send``
ATTACKS: dict[str, Callable[..., Any]] = {}
#: names whose meaning the engine fixes (the algorithm's own mean, no attack): never replaced
RESERVED = {"aggregator": "mean", "attack": "none"}

PLUGIN_GROUP = "fedmtl.plugins"
C = TypeVar("C")
F = TypeVar("F", bound=Callable[..., Any])


class RegistryError(ValueError):
    """A registration that cannot be accepted (name taken, wrong kind of object)."""


def _check_name(name: object, kind: str) -> str:
    if not isinstance(name, str) or not name or any(c.isspace() for c in name):
        raise RegistryError(f"{kind} name must be a non-empty string without spaces, got {name!r}")
    return name


def _add(registry: dict[str, Any], name: str, obj: Any, kind: str, replace: bool) -> None:
    if name in registry and registry[name] is not obj and not replace:
        raise RegistryError(f"{kind} {name!r} is already registered ({registry[name]!r}); "
                            f"pass replace=True to override it")
    registry[name] = obj


def register_algorithm(cls: type[C] | None = None, *, replace: bool = False) -> Any:
    """Class decorator: add an ``Algorithm`` subclass (a frozen dataclass with a ``name`` class attribute)."""

    def deco(c: type[C]) -> type[C]:
        from .algorithms.base import Algorithm  # a function-level import: the registry stays import-free

        if not (isinstance(c, type) and issubclass(c, Algorithm)):
            raise RegistryError(f"register_algorithm needs a subclass of fedmtl.Algorithm, got {c!r}")
        own = [k for k, v in c.__dict__.get("__annotations__", {}).items() if "ClassVar" not in str(v)]
        undecorated = own and "__dataclass_fields__" not in c.__dict__  # its new fields would be silently ignored
        if undecorated or not dataclasses.is_dataclass(c) or not c.__dataclass_params__.frozen:  # type: ignore
            raise RegistryError(f"{c.__name__} must be a frozen dataclass (@dataclass(frozen=True)): "
                                "its fields are its hyper-parameters")
        name = _check_name(getattr(c, "name", None), "algorithm")
        if name == Algorithm.name:
            raise RegistryError(f"{c.__name__} needs its own class attribute name: ClassVar[str] = '...'")
        _add(ALGORITHMS, name, c, "algorithm", replace)
        return c

    return deco(cls) if cls is not None else deco


def _register_fn(registry: dict[str, Any], kind: str, name: str | Callable[..., Any] | None,
                 replace: bool) -> Any:
    def deco(fn: F, label: str | None = None) -> F:
        if not callable(fn):
            raise RegistryError(f"register_{kind} decorates a builder function, got {fn!r}")
        _add(registry, _check_name(label or fn.__name__, kind), fn, kind, replace)
        return fn

    if callable(name):  # used bare: @register_model
        return deco(name)
    return lambda fn: deco(fn, name)


def register_model(name: str | Callable[..., Any] | None = None, *, replace: bool = False) -> Any:
    """Decorator for a model builder ``(input_shape, num_classes, meta=None, **kwargs) -> Model``; the keyword
    arguments are the ``[model]`` table's keys.  ``@register_model`` uses the function's name."""
    return _register_fn(MODELS, "model", name, replace)


def register_dataset(name: str | Callable[..., Any] | None = None, *, replace: bool = False) -> Any:
    """Decorator for a dataset builder ``(**kwargs) -> FederatedData``; its keyword arguments are the
    ``[data]`` table's keys.  ``@register_dataset`` uses the function's name."""
    return _register_fn(DATASETS, "dataset", name, replace)


def register_checked(registry: dict[str, Any], kind: str, name: str | Callable[..., Any] | None, replace: bool,
                     arity: int, signature: str, check: Callable[[str, Callable[..., Any]], None]) -> Any:
    """A decorator (``@deco``, ``@deco("name")``, ``deco("name")(fn)``) that registers a function after checking it:
    it takes ``arity`` positional arguments (``signature`` in words) and passes ``check(name, fn)`` (which raises
    ``RegistryError``), run with the function registered (a config naming it is valid while it runs) and undone when
    it fails.  ``fedmtl.register_aggregator`` and ``fedmtl.register_attack`` (``fedmtl.robust``) are two."""

    def deco(fn: F, label: str | None = None) -> F:
        import inspect

        if not callable(fn):
            raise RegistryError(f"register_{kind} needs a function {signature}, got {fn!r}")
        key = _check_name(label or getattr(fn, "__name__", None), kind)
        try:
            inspect.signature(fn).bind(*([None] * arity))
        except TypeError as e:
            raise RegistryError(f"register_{kind}({key!r}): {fn!r} must be a function {signature}; it cannot take "
                                f"{arity} positional argument{'s' if arity > 1 else ''} ({e})") from None
        except ValueError:  # no signature to read (a builtin): the check below calls it
            pass
        if RESERVED.get(kind) == key and key in registry and registry[key] is not fn:
            raise RegistryError(f"{kind} {key!r} cannot be replaced: the engine gives it its fixed meaning")
        before = registry.get(key)
        _add(registry, key, fn, kind, replace)
        try:
            check(key, fn)
        except BaseException:
            if before is None:
                registry.pop(key, None)
            else:
                registry[key] = before
            raise
        return fn

    if callable(name):  # used bare: @register_aggregator
        return deco(name)
    return lambda fn: deco(fn, name)


def import_plugins(modules: list[str]) -> None:
    """Import modules that register algorithms, models, datasets, aggregators or attacks (``fedmtl run --import
    MODULE``): a module name (found on the current folder first, then PYTHONPATH and the installed packages) or a
    ``.py`` file's path."""
    import os
    import sys
    from pathlib import Path

    from .schema import SHOWN_CHARS, brief

    for mod in modules:
        path = Path(mod)
        text = " ".join(mod[-4 * SHOWN_CHARS:].split())
        # a long path cut at its start: the file's name is what the reader needs
        name = text if len(text) <= SHOWN_CHARS else "..." + text[-(SHOWN_CHARS - 3):]
        try:
            if mod.endswith(".py") or os.sep in mod or "/" in mod:  # a file: ./mymodule.py, plugins/alg.py
                if not path.is_file():
                    raise RegistryError(f"--import {name}: no such file")
                spec = importlib.util.spec_from_file_location(path.stem, path)
                if spec is None or spec.loader is None:
                    raise RegistryError(f"--import {name}: not a Python module")
                module = importlib.util.module_from_spec(spec)
                sys.modules[path.stem] = module
                spec.loader.exec_module(module)
                continue
            if "" not in sys.path and os.getcwd() not in sys.path:  # a module in the current folder, as python -m
                sys.path.insert(0, os.getcwd())
            importlib.import_module(mod)
        except RegistryError as e:  # refused here, or a registration of the plugin's: the message names the plugin
            if str(e).startswith(f"--import {name}:"):
                raise
            raise RegistryError(f"--import {name}: {e}") from e
        except SystemExit as e:  # the plugin called sys.exit(): the command must not end as if it had succeeded
            raise RegistryError(f"--import {name}: importing it called sys.exit({brief(e.code, 60)}); a plugin "
                                "module must not exit") from e
        except ImportError as e:
            raise RegistryError(f"--import {name}: cannot import it ({brief(str(e), 200)}); is it in the current "
                                "folder, on PYTHONPATH or installed? (a file: --import ./path/to/module.py)") from e
        except Exception as e:  # the plugin's own code failed: one line naming it, the traceback from Python itself
            raise RegistryError(f"--import {name}: importing it raised {type(e).__name__}: {brief(str(e), 200)} "
                                f"(python -c 'import {brief(path.stem)}' shows the traceback)") from e


_loaded_entry_points = False


def load_plugins() -> list[str]:
    """Import every module named in the entry-point group ``fedmtl.plugins`` (once per process).

    A package declares, in its pyproject.toml::

        [project.entry-points."fedmtl.plugins"]
        mypkg = "mypkg.fedmtl_plugin"
    """
    global _loaded_entry_points
    if _loaded_entry_points:
        return []
    _loaded_entry_points = True
    names = []
    for ep in entry_points(group=PLUGIN_GROUP):
        try:
            ep.load()
        except (Exception, SystemExit) as e:  # a broken plugin (one calling sys.exit too) must not take the CLI down
            log.warning("fedmtl plugin %s (%s) failed to load: %s", ep.name, ep.value, e)
            continue
        names.append(ep.name)
    return names


def describe(cls: type) -> str:
    """What an algorithm is, in whole sentences: the first paragraph of its own class docstring, else of its
    module's docstring."""
    import sys

    own = cls.__dict__.get("__doc__") or ""
    if own.startswith(cls.__name__ + "("):  # the signature dataclasses put where no docstring is written
        own = ""
    text = (own or sys.modules[cls.__module__].__doc__ or "").strip()
    return " ".join(text.split("\n\n")[0].split())


def field_docs(cls: type) -> dict[str, str]:
    """``#:`` comments written directly above a dataclass's fields (over its MRO; a subclass's doc wins), or a field's
    ``metadata={"doc": ...}`` (which wins over a comment: a plugin defined where no source can be read has no
    comments)."""
    import dataclasses
    import inspect
    import re

    docs: dict[str, str] = {}
    meta = {f.name: str(f.metadata["doc"]) for f in dataclasses.fields(cls) if "doc" in f.metadata} \
        if dataclasses.is_dataclass(cls) else {}
    for klass in reversed(cls.__mro__):
        try:
            lines = inspect.getsource(klass).splitlines()
        except (OSError, TypeError):
            continue
        pending: list[str] = []
        for ln in lines:
            s = ln.strip()
            if s.startswith("#:"):
                pending.append(s[2:].strip())
                continue
            m = re.match(r"^(\w+)\s*:", s)
            if m and pending:
                docs[m.group(1)] = " ".join(pending)
            pending = []
    return {**docs, **meta}


#: what the engine passes to a model builder itself (not keys of [model])
MODEL_BUILDER_ARGS = ("input_shape", "num_classes", "meta")


def field_table(cls: Any, given: tuple[str, ...] = MODEL_BUILDER_ARGS) -> list[tuple[str, str, str, str]]:
    """(name, type, default, doc) of every hyperparameter (init field) of a config dataclass (an algorithm,
    ``RunConfig``, ...) or keyword argument of a builder function; a declared range (``fedmtl.schema``) is part of
    the type (``float in (0, 1000]``).  ``given``: a builder's arguments that are not keys (a model builder's
    ``input_shape``, ``num_classes`` and ``meta`` come from the data; a dataset builder gives ``()``: its
    ``num_classes`` is a key)."""
    import dataclasses
    import inspect
    import types
    import typing

    from .schema import choices_of, range_of, strip, type_hints

    hints = type_hints(cls)
    docs = field_docs(cls) if isinstance(cls, type) else {}
    if dataclasses.is_dataclass(cls):
        fields = [(f.name, f.default if f.default is not dataclasses.MISSING else
                   f.default_factory() if f.default_factory is not dataclasses.MISSING else "(required)")
                  for f in dataclasses.fields(cls) if f.init]
    else:
        # a builder's own ``name`` is never a key (the table's ``name`` picks the builder), nor are the arguments a
        # registered functools.partial fixes (``fashion_mnist``: idx_federation with name = "fashion_mnist")
        skip = {*given, "name", *(getattr(cls, "keywords", None) or {})}
        fields = [(n, p.default if p.default is not p.empty else "(required)")
                  for n, p in inspect.signature(cls).parameters.items()
                  if n not in skip and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    rows = []
    for name, default in fields:
        tp = hints.get(name, Any)
        rng = range_of(tp)
        base = strip(tp)
        optional, choices = "", ""
        if typing.get_origin(base) in (typing.Union, types.UnionType):  # tuple | list, float | None: the first
            args = typing.get_args(base)
            optional = " or None" if type(None) in args else ""
            if any(choices_of(a) is not None for a in args):  # bool | Literal["auto"]: every choice
                choices = " | ".join(" | ".join(map(repr, choices_of(a) or ())) if choices_of(a) is not None
                                     else getattr(a, "__name__", str(a)) for a in args if a is not type(None))
            base = next(a for a in args if a is not type(None))
            rng = rng or range_of(base)
            base = strip(base)
        if typing.get_origin(base) in (tuple, list) and typing.get_args(base):
            rng = rng or range_of(typing.get_args(base)[0])
            base = typing.get_origin(base)
        if choices_of(tp) is not None:  # Literal[...], or a registry's names (OneOf): the choices of now
            text = " | ".join(repr(a) for a in choices_of(tp) or ())
        elif typing.get_origin(base) is typing.Literal:
            text = " | ".join(repr(a) for a in typing.get_args(base))
        else:
            text = getattr(base, "__name__", None) or str(base).replace("typing.", "")
        if rng is not None:
            where = rng.text() if rng.text()[0] in "<>" else f"in {rng.text()}"
            text += f" {where}" if base in (int, float) else f" of values {where}"
        text = choices or text
        text += optional
        shown = repr(default) if isinstance(default, str) and default != "(required)" else \
            str(default).lower() if isinstance(default, bool) else str(default)
        rows.append((name, text, shown, docs.get(name, "")))
    return rows
