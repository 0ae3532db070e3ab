"""MkDocs hooks: the pages generated at build time, into the site only (nothing here is written to the tree).

* ``reference/config.md``: every key of every config table, with its type, declared range and default, from the
  same source ``fedmtl list --table`` / ``--algorithm`` / ``--dataset`` / ``--model`` print
  (``fedmtl.config.TABLES``, the registries and ``fedmtl.registry.field_table``, which reads the ranges
  declared in the dataclasses' annotations, ``fedmtl.schema``).  No second description of the config exists.
* ``results/data/<path>.md``: one page per JSON file under ``benchmarks/results/``: what it records about the
  machine (device, torch, threads, CPU count) and a table of its keys and values; the JSON files and the figures
  beside them are copied into the site under the same path, so pages can show and link them.

Listed in ``mkdocs.yml`` under ``hooks:``.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DATA_URI = "results/data"
#: keys a benchmark JSON may record about where it was measured, in the order they are shown
MACHINE_KEYS = ("device", "machine", "cpu_count", "torch", "torch_threads", "threads", "gpu", "cuda")
COPIED = (".json", ".png", ".csv", ".svg")

log = logging.getLogger("mkdocs.hooks.fedmtl")


# ---------------------------------------------------------------------------------------------- configuration keys


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _keys_table(target: Any, given: tuple[str, ...] | None = None) -> str:
    from fedmtl.registry import MODEL_BUILDER_ARGS, field_table

    rows = field_table(target, MODEL_BUILDER_ARGS if given is None else given)
    if not rows:
        return "(no keys)\n"
    out = ["| key | type and valid range | default | meaning |", "|---|---|---|---|"]
    out += [f"| `{name}` | {_cell(tp)} | `{_cell(default)}` | {_cell(doc)} |" for name, tp, default, doc in rows]
    return "\n".join(out) + "\n"


def config_reference() -> str:
    """The configuration reference page, from the config dataclasses and builders themselves."""
    from fedmtl.config import ALGORITHMS, DATASETS, MODELS, TABLES
    from fedmtl.registry import describe

    parts = [
        "# Configuration keys",
        "",
        "Generated when the handbook is built, from the config dataclasses and builder signatures: each key with "
        "its type, its declared valid range (`fedmtl.schema`) and its default, exactly what `fedmtl list --table "
        "NAME`, `--algorithm NAME`, `--dataset NAME` and `--model NAME` print. A value outside its range is refused "
        "when the config is read, naming the file and the key; see [Configuration](../guide/configuration.md) "
        "for the file format.",
        "",
        "## Fixed tables",
        "",
    ]
    for table, t in TABLES.items():
        parts += [f"### `[{table}]`", "", f"`{t.cls.__module__}.{t.cls.__name__}`", "", _keys_table(t.cls)]
    parts += ["## `[algorithm]`: one set of keys per `name`", "",
              "The table's `name` picks the algorithm; its other keys are the algorithm dataclass's fields.", ""]
    for name, cls in sorted(ALGORITHMS.items()):
        parts += [f"### `name = \"{name}\"`", "", _cell(describe(cls)), "", _keys_table(cls)]
    parts += ["## `[data]`: one set of keys per `name`", "",
              "The table's `name` picks the dataset builder; its other keys are the builder's keyword arguments.", ""]
    for name, fn in sorted(DATASETS.items()):
        parts += [f"### `name = \"{name}\"`", "", _keys_table(fn, ())]
    parts += ["## `[model]`: one set of keys per `name`", ""]
    for name, fn in sorted(MODELS.items()):
        parts += [f"### `name = \"{name}\"`", "", _keys_table(fn)]
    return "\n".join(parts) + "\n"


# ------------------------------------------------------------------------------------------------ benchmark results


def _value(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return f"`{json.dumps(v)}`"
    if isinstance(v, float):
        return f"{v:.6g}" if math.isfinite(v) else str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return _cell(v)
    return f"`{_cell(json.dumps(v))}`"  # a list of scalars, inline


def _flatten(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        if not obj:
            return [(prefix, {})]
        rows = []
        for k, v in obj.items():
            rows += _flatten(v, f"{prefix}.{k}" if prefix else str(k))
        return rows
    if isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        rows = []
        for i, v in enumerate(obj):
            rows += _flatten(v, f"{prefix}[{i}]")
        return rows
    return [(prefix, obj)]


def _table(rows: list[tuple[str, Any]]) -> str:
    out = ["| key | value |", "|---|---|"]
    out += [f"| `{_cell(k)}` | {_value(v)} |" for k, v in rows]
    return "\n".join(out) + "\n"


def _machine_line(data: Any) -> str:
    if not isinstance(data, dict):
        return ""
    found = [f"{k} `{data[k]}`" for k in MACHINE_KEYS if k in data and not isinstance(data[k], (dict, list))]
    if not found:
        return ("This file records no device, torch version or thread count; the page that discusses it says "
                "where it was measured.")
    return "Recorded by the benchmark: " + ", ".join(found) + "."


def result_page(path: Path) -> str:
    """One benchmark JSON as a page: the machine it records and its keys and values (nested tables as sections)."""
    rel = path.relative_to(RESULTS)
    data = json.loads(path.read_text())
    parts = [f"# `{rel.as_posix()}`", "",
             f"Generated when the handbook is built from `benchmarks/results/{rel.as_posix()}` "
             f"([raw JSON]({path.name})).", "", _machine_line(data), ""]
    if isinstance(data, dict):
        flat = [(k, v) for k, v in data.items() if not isinstance(v, dict)]
        nested = [(k, v) for k, v in data.items() if isinstance(v, dict)]
        if flat:
            parts.append(_table(_flatten(dict(flat))))
        for k, v in nested:
            parts += [f"## `{_cell(k)}`", "", _table(_flatten(v)) if v else "(empty)", ""]
    else:
        parts.append(_table(_flatten(data, "value")))
    figures = sorted(p for p in path.parent.glob("*.png"))
    if figures and path.parent != RESULTS:
        parts += ["## Figures in this folder", ""]
        parts += [f"![{p.stem}]({p.name})" for p in figures]
    return "\n".join(parts) + "\n"


def _result_files() -> list[Path]:
    return sorted(RESULTS.rglob("*.json")) if RESULTS.is_dir() else []


def results_index() -> str:
    parts = ["# Benchmark files", "",
             "Every JSON file under `benchmarks/results/`, as written by the `fedmtl bench ...` and `fedmtl reproduce "
             "...` commands, rendered as a table when the handbook is built. Each file records the machine it was "
             "measured on where the benchmark knows it (device, torch version, thread count, CPU count). The "
             "pages under *Results* discuss these numbers.", "",
             "| file | measured on |", "|---|---|"]
    for p in _result_files():
        rel = p.relative_to(RESULTS).with_suffix(".md").as_posix()
        try:
            data = json.loads(p.read_text())
        except ValueError:
            continue
        where = ""
        if isinstance(data, dict):
            where = ", ".join(f"{k} {data[k]}" for k in ("device", "torch", "torch_threads") if k in data)
        parts.append(f"| [`{p.relative_to(RESULTS).as_posix()}`]({rel}) | {_cell(where) or '(not recorded)'} |")
    return "\n".join(parts) + "\n"


# ------------------------------------------------------------------------------------------------------ the hooks


def on_config(config: Any) -> Any:
    """Snippets resolve from the repository root whatever the working directory; the generated benchmark pages
    join the navigation under Results."""
    snippets = config.mdx_configs.setdefault("pymdownx.snippets", {})
    snippets["base_path"] = [str(ROOT)]
    entries: list[Any] = [{"Overview": f"{DATA_URI}/index.md"}]
    for p in _result_files():
        rel = p.relative_to(RESULTS)
        entries.append({rel.as_posix(): f"{DATA_URI}/{rel.with_suffix('.md').as_posix()}"})
    for section in config.nav or []:
        if isinstance(section, dict) and "Results" in section:
            section["Results"].append({"Benchmark files": entries})
    return config


def on_files(files: Files, config: Any) -> Files:
    files.append(File.generated(config, "reference/config.md", content=config_reference()))
    files.append(File.generated(config, f"{DATA_URI}/index.md", content=results_index()))
    for p in sorted(RESULTS.rglob("*")) if RESULTS.is_dir() else []:
        if not p.is_file() or p.suffix not in COPIED:
            continue
        rel = p.relative_to(RESULTS).as_posix()
        files.append(File.generated(config, f"{DATA_URI}/{rel}", abs_src_path=str(p)))
        if p.suffix == ".json":
            try:
                page = result_page(p)
            except ValueError as e:  # a malformed JSON fails the strict build, naming the file
                log.warning("benchmarks/results/%s: not valid JSON (%s)", rel, e)
                continue
            files.append(File.generated(config, f"{DATA_URI}/{Path(rel).with_suffix('.md').as_posix()}",
                                        content=page))
    return files
