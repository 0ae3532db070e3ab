"""Integer ranges typed by people: ``--seeds 1-5``, ``--clients 0,3,7``, a Flower node's ``partition-ids="0-49"``.

Bounded work before validation: a range's endpoints are parsed and checked against their bound, and the number of
integers the whole text names is counted, **before** any list is built from it, so a typo such as ``9-999999999``
costs microseconds and a one-line error, never gigabytes of memory.  Errors are ``ValueError`` (or the caller's
class) naming ``what`` and echoing the text cut short (``fedmtl.schema.shown``).
"""

from __future__ import annotations

import re

from .schema import shown

__all__ = ["parse_ids", "spans"]

_PART = re.compile(r"\s*([0-9]{1,19})\s*(?:-\s*([0-9]{1,19})\s*)?")


def spans(text: str, lo: int, hi: int, what: str, error: type[Exception] = ValueError,
          max_count: int | None = None) -> list[tuple[int, int]]:
    """The inclusive ranges ``[(a, b), ...]`` that ``text`` names ("A-B", "A", comma-separated), in the order
    written, each inside ``[lo, hi]``; with ``max_count``, they name at most that many integers in all.  Nothing
    but the spans is built."""
    if not isinstance(text, str):
        raise error(f"{what} {shown(text)}: expected ranges like 0-49 or lists like 0,3,7")
    out: list[tuple[int, int]] = []
    total = 0
    for part in text.split(","):
        if not part.strip():
            continue
        m = _PART.fullmatch(part)
        if m is None:
            raise error(f"{what} {shown(text)}: {shown(part.strip())} is not a non-negative integer or a range "
                        "A-B (e.g. 0-49 or 0,3,7)")
        a = int(m.group(1))
        b = int(m.group(2)) if m.group(2) is not None else a
        if not lo <= a <= b <= hi:
            raise error(f"{what} {shown(text)}: {a}-{b} is not a range within {lo}-{hi}" if a != b else
                        f"{what} {shown(text)}: {a} is not within {lo}-{hi}")
        total += b - a + 1
        if max_count is not None and total > max_count:
            raise error(f"{what} {shown(text)}: names more than {max_count} values (at most {max_count})")
        out.append((a, b))
    if not out:
        raise error(f"{what} {shown(text)}: names nothing")
    return out


def parse_ids(text: str, n: int, what: str, error: type[Exception] = ValueError) -> list[int]:
    """The sorted distinct ids in ``[0, n)`` that ``text`` names (overlapping ranges merged first: at most ``n``
    ids are ever built)."""
    if n < 1:
        raise error(f"{what} {shown(text)}: there are no ids to choose from")
    merged: list[list[int]] = []
    for a, b in sorted(spans(text, 0, n - 1, what, error)):
        if merged and a <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [k for a, b in merged for k in range(a, b + 1)]
