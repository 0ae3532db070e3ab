"""Declared valid ranges of numeric configuration keys: the config schema's numbers.

A numeric field of a config table (``RunConfig``, ``SGD``, ``PrivacyConfig``, an algorithm dataclass, a dataset or
model builder's keyword argument) declares its range in its annotation::

    lr: Annotated[float, Range(0, 1000, lo_open=True)] = 0.1        # (0, 1000]
    rounds: Annotated[int, Range(1, 10**7)] = 200                   # [1, 10^7]
    lr_milestones: tuple[Annotated[float, Range(0, 1, True, True)], ...] = ()   # each item in (0, 1)

``fedmtl.config`` checks every value against its range when a config is read (the error names the file and the
key), the dataclasses check it again in ``__post_init__`` through ``check_fields`` (so Python callers get the same
refusal), ``fedmtl list --table NAME`` / ``--algorithm NAME`` print the ranges, and the config fuzz test
(``tests/test_fuzz.py``) generates its cases from them: a new key with a declared range is fuzzed without anyone
writing a case.

Beyond its range, every float a config holds is finite, of magnitude at most ``MAX_FLOAT`` and, unless it is 0,
at least ``MIN_MAGNITUDE``: 1e-320 is a subnormal float that means nothing as a learning rate, a sampling rate or
a decay factor.

A string key whose values are the names of a registry (``[robust] aggregator``, ``[attack] kind``) declares it with
``OneOf``: ``Annotated[str, OneOf(AGGREGATORS, "fedmtl.register_aggregator")]``.  Its choices are the registry's
names when the value is checked, so a name registered by a plugin is as valid as a built-in one; it is checked,
described and listed as a ``Literal[...]`` key is (``choices_of``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import reprlib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

__all__ = ["MAX_FLOAT", "MAX_INT", "MAX_ITEMS", "MIN_MAGNITUDE", "SHOWN_CHARS", "Annotated", "DataSeed", "Fraction",
           "OneOf", "Range", "check_fields", "check_number", "choices_hint", "choices_of", "describe_type", "range_of",
           "shown", "strip", "type_hints"]

MAX_FLOAT = 1e30
MAX_INT = 10**9
MIN_MAGNITUDE = 1e-12
#: at most this many items in a list a config holds (checked before any item is converted)
MAX_ITEMS = 10_000
#: at most this many characters of a value are echoed in an error message (``shown``)
SHOWN_CHARS = 80


def brief(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``value`` on one line (a string as it is, anything else by its bounded repr), whitespace collapsed and cut to
    ``limit`` characters, "..." marking the cut: for exception texts and names inside a message."""
    text = value if isinstance(value, str) else shown(value, limit)
    text = " ".join(text[: 4 * limit].split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def shown(value: Any, limit: int = SHOWN_CHARS, bare: bool = False) -> str:
    """``repr(value)`` cut to about ``limit`` characters, with the full length where cut: the one way an error
    message echoes a value a user or a node gave, so that a 900 KB string or a list of 10^5 items makes a line of
    a hundred characters, not of a megabyte.  The repr is built bounded (``reprlib``): a huge list or a deeply
    nested value costs no more than a small one.  ``bare``: a string without its quotes (a table or file name)."""
    if bare and isinstance(value, str):
        return value if len(value) <= limit else f"{value[:limit]}... ({len(value)} characters)"
    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxlong, r.maxother = 3, limit, limit, limit
    r.maxlist = r.maxtuple = r.maxdict = r.maxset = r.maxfrozenset = r.maxdeque = r.maxarray = 12
    text = r.repr(value)
    size = len(value) if isinstance(value, str | bytes | list | tuple | dict | set) else None
    if len(text) > limit:
        text = text[:limit] + "..."
    elif size is None or size <= 12 or (isinstance(value, str | bytes) and size <= limit):
        return text
    unit = "characters" if isinstance(value, str) else "bytes" if isinstance(value, bytes) else "items"
    return f"{text} ({size} {unit})" if size is not None else text


@dataclass(frozen=True)
class Range:
    """The interval a number must lie in: ``[lo, hi]``, either end open (``lo_open`` / ``hi_open``) or absent
    (``None``: unbounded on that side, within ``MAX_FLOAT`` / ``MAX_INT``)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    #: the smallest magnitude a non-zero float may have (``MIN_MAGNITUDE`` unless a key needs tinier values)
    min_magnitude: float = MIN_MAGNITUDE

    def contains(self, v: float) -> bool:
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return not (self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi))

    def text(self) -> str:
        """``(0, 1000]``, ``[1, 10^7]``, ``>= 0``."""
        if self.lo is not None and self.hi is not None:
            return f"{'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {_num(self.lo)}"
        if self.hi is not None:
            return f"{'<' if self.hi_open else '<='} {_num(self.hi)}"
        return "any"


class OneOf:
    """The values a string key may take: the names of ``registry`` at the time of checking (``how``: what adds
    one, named in the refusal)."""

    def __init__(self, registry: Mapping[str, Any], how: str):
        self.registry, self.how = registry, how

    def names(self) -> tuple[str, ...]:
        return tuple(self.registry)

    def __repr__(self) -> str:
        return f"OneOf({list(self.registry)})"


#: a dataset's seed
DataSeed = Annotated[int, Range(0, 2**32 - 1)]
#: a fraction of the examples or clients held out (test, validation, unseen): [0, 1)
Fraction = Annotated[float, Range(0, 1, hi_open=True)]


def _num(v: float) -> str:
    if isinstance(v, int) and v == 2**63 - 1:
        return "2^63 - 1"
    if isinstance(v, int) and abs(v) >= 10**4 and math.log10(abs(v)).is_integer():
        return f"10^{int(math.log10(abs(v)))}"
    if isinstance(v, int) and v >= 2**20 and (v & (v - 1)) == 0:
        return f"2^{v.bit_length() - 1}"
    return f"{v:g}"


def check_number(value: float, rng: Range | None, where: str) -> None:
    """Raise ``ValueError`` naming ``where`` unless ``value`` is a sane setting inside ``rng``: a float is finite, of
    magnitude at most ``MAX_FLOAT`` and, unless 0, at least the range's ``min_magnitude``; an int is at most
    ``MAX_INT`` in magnitude unless its range declares a larger upper bound (seeds)."""
    if isinstance(value, float):
        if not math.isfinite(value) or abs(value) > MAX_FLOAT:
            raise ValueError(f"{where} must be a finite number of magnitude <= {MAX_FLOAT:g}, got {shown(value)}")
        tiny = rng.min_magnitude if rng is not None else MIN_MAGNITUDE
        if value != 0 and abs(value) < tiny:
            raise ValueError(f"{where} = {shown(value)} is below {tiny:g} in magnitude, which means nothing as a "
                             f"setting{' (0 is allowed)' if rng is None or rng.contains(0) else ''}")
    elif isinstance(value, int) and abs(value) > MAX_INT and (rng is None or rng.hi is None or rng.hi <= MAX_INT):
        raise ValueError(f"{where}: {shown(value)} is beyond any sane size (|value| <= {MAX_INT:g})")
    if rng is not None and not rng.contains(value):
        raise ValueError(f"{where} must be in {rng.text()}, got {shown(value)}")


def describe_type(tp: Any, plural: bool = False) -> str:
    """An annotation in words, its declared range included: ``int`` -> "an integer", ``Annotated[int, Range(1,
    10**5)]`` -> "an integer in [1, 10^5]", ``tuple[Width, ...] | list[Width]`` -> "a list of integers in [1,
    10^5]", ``Literal["a", "b"]`` -> "one of 'a', 'b'": what an error message says a key expects (never a
    ``typing`` repr)."""
    rng, choices = range_of(tp), choices_of(tp)
    tp = strip(tp)
    origin = typing.get_origin(tp)
    where = f" in {rng.text()}" if rng is not None and rng.lo is not None and rng.hi is not None else (
        f" {rng.text()}" if rng is not None else "")
    if choices is not None:
        return "one of " + ", ".join(repr(a) for a in choices)
    if origin in (typing.Union, types.UnionType):
        words: list[str] = []
        for arg in typing.get_args(tp):
            if arg is not type(None):
                w = describe_type(arg, plural)
                if w not in words:
                    words.append(w)
        return " or ".join(words) or "nothing"
    if origin in (tuple, list):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return "lists" if plural else "a list" + (f" of {describe_type(args[0], True)}" if args else "")
    for kind, one, many in ((bool, "true or false", "true or false values"), (int, "an integer", "integers"),
                            (float, "a number", "numbers"), (str, "a string", "strings")):
        if tp is kind:
            return (many if plural else one) + where
    name = getattr(tp, "__name__", None)
    return name if isinstance(name, str) else "a value"


def range_of(tp: Any) -> Range | None:
    """The ``Range`` of an ``Annotated[..., Range(...)]`` annotation (None for any other)."""
    if typing.get_origin(tp) is Annotated:
        return next((m for m in tp.__metadata__ if isinstance(m, Range)), None)
    return None


def choices_of(tp: Any) -> tuple[Any, ...] | None:
    """The values a ``Literal[...]`` annotation allows, or the current names of a ``OneOf`` registry (through
    ``Annotated``); None for any other annotation."""
    if typing.get_origin(tp) is Annotated:
        one = next((m for m in tp.__metadata__ if isinstance(m, OneOf)), None)
        if one is not None:
            return one.names()
        tp = strip(tp)
    return typing.get_args(tp) if typing.get_origin(tp) is typing.Literal else None


def choices_hint(tp: Any) -> str:
    """What a refusal of a ``OneOf`` key adds after its choices: how to add one (empty for any other key)."""
    one = next((m for m in tp.__metadata__ if isinstance(m, OneOf)), None) \
        if typing.get_origin(tp) is Annotated else None
    return f" ({one.how} adds one)" if one is not None else ""


def strip(tp: Any) -> Any:
    """The annotation without its ``Annotated`` wrapper."""
    return typing.get_args(tp)[0] if typing.get_origin(tp) is Annotated else tp


@functools.cache
def _hints(obj: Any) -> dict[str, Any]:
    return typing.get_type_hints(obj, include_extras=True)


def type_hints(obj: Any) -> dict[str, Any]:
    """``typing.get_type_hints(obj, include_extras=True)``, cached per class or function."""
    if isinstance(obj, functools.partial):  # a builder with some arguments fixed: the function's hints
        return type_hints(obj.func)
    try:
        return _hints(obj)
    except TypeError:  # unhashable: not cached
        return typing.get_type_hints(obj, include_extras=True)


def _check(value: Any, tp: Any, where: str) -> None:
    allowed = choices_of(tp)
    if allowed is not None:
        if value not in allowed:
            raise ValueError(f"{where} must be one of {', '.join(map(str, allowed))}, got {shown(value)}"
                             f"{choices_hint(tp)}")
        return
    if isinstance(value, bool):
        return
    if isinstance(value, int | float):
        check_number(value, range_of(tp), where)
    elif isinstance(value, tuple | list):
        args = typing.get_args(strip(tp))
        if args:
            for i, v in enumerate(value):
                _check(v, args[0], f"{where}[{i}]")


def check_fields(obj: Any, table: str) -> None:
    """Check every init field of the dataclass instance ``obj``: a ``Literal[...]`` field against its choices, a
    numeric one against its declared range (and the finite / magnitude rules); the error names ``table.field``.
    The one validation of the config dataclasses (``config._coerce`` adds the types and conversions of TOML values;
    ``fedmtl list --table`` documents the same annotations)."""
    hints = type_hints(type(obj))
    for f in dataclasses.fields(obj):
        if f.init:
            _check(getattr(obj, f.name), hints.get(f.name, Any), f"{table}.{f.name}")
