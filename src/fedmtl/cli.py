"""Command-line interface: ``fedmtl run | sweep | tune | compare | data | list | main | reproduce | flower | bench``.

Plugins (algorithms, models, datasets registered with ``fedmtl.register_*``) are loaded from the entry-point
group ``fedmtl.plugins`` at start and from ``--import MODULE`` (repeatable) on the commands that read a config.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import json
import logging
import math
import re
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn, TypeVar, overload

from .config import ConfigError
from .engine.distributed import RankLost
from .engine.evaluation import HEADLINE, SEEN_TEST_ACC_MEAN
from .registry import RegistryError, import_plugins, load_plugins
from .runs.rundir import is_out_of_space
from .schema import shown


def _own_config(args: argparse.Namespace) -> tuple[str, str | None]:
    """``fedmtl run --resume --out DIR`` without a CONFIG: the run directory's own resolved ``config.toml`` (with
    the --set overrides it was started with), and the seeds of a several-seeds run directory."""
    from .runs.rundir import layout

    if not (args.resume and args.out):
        raise ConfigError("fedmtl run needs a CONFIG (a TOML file or a bundled config name); only --resume --out DIR "
                          "can leave it out (the run directory holds its config)")
    out = Path(args.out)
    lay = layout(out)
    if (out / "config.toml").is_file():
        return str(out / "config.toml"), None
    if lay.kind == "seeds" and lay.seeds:
        return str(out / f"seed-{lay.seeds[0]}" / "config.toml"), ",".join(map(str, lay.seeds))
    raise ConfigError(f"--resume --out {out}: no run there to resume (no config.toml); pass the CONFIG to start it")


def _cmd_run(args: argparse.Namespace) -> int:
    from .engine.distributed import launched
    from .runs.driver import run_experiment

    with _sigterm_deferred():  # a rank torchrun stops because another refused the same input refuses it too
        cfg = _run_config(args)
        _refuse_seeds_under_torchrun(args, cfg, launched())
    out = args.out or str(Path("runs") / Path(args.config).stem)
    keys = HEADLINE
    if cfg.run.seeds:
        from .runs.seeds import run_seeds

        res = run_seeds(cfg, out=out, resume=args.resume, overwrite=args.overwrite)
        print(f"{cfg.algorithm['name']} on {cfg.data['name']}, {cfg.run.rounds} rounds, seeds {list(cfg.run.seeds)} "
              f"-> {out}  (%, mean +- std over seeds [95% interval])")
        for k in keys:
            st = res.final.get(k)
            if st and st["mean"] is not None:
                ci = f"[{100 * st['ci95_low']:.2f}, {100 * st['ci95_high']:.2f}]" if st["ci95_low"] is not None else ""
                print(f"  {k:28s} {100 * st['mean']:7.2f} +- {100 * st['std']:5.2f}  {ci}")
        return 0
    from .engine.distributed import Group

    if args.executor == "distributed" or launched():  # a rank of a torchrun job
        group = Group.start(cfg.run.device, args.dist_timeout)
        try:
            if not group.is_writer:  # every rank runs the same server step: rank 0 alone reports
                logging.getLogger("fedmtl").setLevel(logging.ERROR)
            result = run_experiment(cfg, out, resume=args.resume, overwrite=args.overwrite, group=group,
                                    progress=group.is_writer)
            # the ranks leave together: a rank that tore its process group down while rank 0 still wrote the run's
            # files could abort in gloo's teardown and have torchrun stop rank 0 mid-write
            group.barrier("finish the run together")
        finally:
            group.close()
        if not group.is_writer:
            return 0
    else:
        result = run_experiment(cfg, out, resume=args.resume, overwrite=args.overwrite)
    summary = result.summary
    final = summary["final"]
    print(f"{cfg.algorithm['name']} on {cfg.data['name']}, {summary['rounds']} rounds -> {out}  (%)")
    for k in keys:
        if k in final:
            print(f"  {k:28s} {100 * final[k]:7.2f}")
    return 0


def _run_config(args: argparse.Namespace) -> Any:
    """The validated config of ``fedmtl run`` (its CONFIG, or the run directory's own, with --set, --device and
    --seeds)."""
    from .config import load

    if args.config is None:
        args.config, seeds = _own_config(args)
        args.seeds = args.seeds or seeds
    overrides = list(args.set)
    if args.device is not None:  # as written, quoted: "" or "cuda:0 " is checked (run.device), not dropped
        overrides.append(f"run.device={_toml_string(args.device)}")
    if args.seeds is not None:
        overrides.append(f"run.seeds=[{parse_seeds(args.seeds)}]")
    return load(args.config, overrides)


def _toml_string(text: str) -> str:
    """``text`` as a TOML basic string (JSON's escapes are TOML's for these characters)."""
    return json.dumps(text, ensure_ascii=False)


def _refuse_seeds_under_torchrun(args: argparse.Namespace, cfg: Any, ranked: bool) -> None:
    """Several seeds are one process's batched computation: a rank of a torchrun job refuses them (every rank the
    same way) before anything is written."""
    if cfg.run.seeds and (args.executor == "distributed" or ranked):
        raise ConfigError(f"{args.config}: several seeds (--seeds / run.seeds = {shown(list(cfg.run.seeds))}) do not "
                          "run under torchrun: start one torchrun job per seed (--set run.seed=S --out DIR/seed-S), or "
                          "run the seeds in one process (fedmtl run --seeds ...)")


def _positive_seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {shown(text)}") from None
    if not 1 <= v <= 86400:
        raise argparse.ArgumentTypeError(f"{v:g} s: between 1 and 86400 seconds")
    return v


def _number_in(lo: float, hi: float, kind: type[int] | type[float] = float, lo_open: bool = False
               ) -> Callable[[str], float]:
    """An argparse type: a finite ``kind`` number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""

    def parse(text: str) -> float:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {'a whole' if kind is int else 'a'} number: {shown(text)}") from None
        if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
            raise argparse.ArgumentTypeError(f"{shown(text, bare=True)}: expected a number in "
                                             f"{'(' if lo_open else '['}{lo:g}, {hi:g}]")
        return v

    return parse


def parse_seeds(text: str) -> str:
    """``--seeds 1,2,3`` or ``--seeds 1-5`` -> the TOML list body "1, 2, 3" (in the order written).  The ranges are
    checked (seeds in [0, 2^63 - 1], at most ``MAX_SEEDS`` of them) before a list is built: ``0-99999999999`` is
    a one-line error, not a MemoryError."""
    from .engine.spec import MAX_SEED, MAX_SEEDS
    from .ranges import spans

    parts = spans(text, 0, MAX_SEED, "--seeds", ConfigError, max_count=MAX_SEEDS)
    return ", ".join(str(s) for a, b in parts for s in range(a, b + 1))


def _cmd_sweep(args: argparse.Namespace) -> int:
    from .runs.sweep import run_sweep

    out = args.out or str(Path("runs") / f"sweep-{Path(args.config).stem}")
    sets = list(args.set) + ([f"run.seeds=[{parse_seeds(args.seeds)}]"] if args.seeds is not None else [])
    run_sweep(args.config, sets, out, resume=args.resume, overwrite=args.overwrite)
    print(f"written: {out}/sweep.json, sweep.csv, sweep.png")
    return 0


def _cmd_tune(args: argparse.Namespace) -> int:
    from .runs.tune import DEFAULT_OBJECTIVE, tune

    out = args.out or str(Path("runs") / f"tune-{Path(args.config).stem}")
    sets = list(args.set) + ([f"run.device={_toml_string(args.device)}"] if args.device is not None else [])
    s = tune(args.config, args.space, trials=args.trials, seed=args.seed, out=out, sets=sets,
             resume=args.resume, objective=args.objective or DEFAULT_OBJECTIVE, direction=args.direction,
             last=args.last, batch_trials=args.batch_trials, prune=not args.no_prune,
             progress="off" if args.quiet else True)
    best = "none completed" if s.best_value is None else f"{s.objective} = {s.best_value:.4f} with {s.best_params}"
    print(f"best: {best} (trial {s.best_trial}); {s.complete} complete, {s.pruned} pruned, {s.failed} failed"
          + (f", {s.interrupted} interrupted and re-run" if s.interrupted else ""))
    for key, end in s.at_edge.items():
        print(f"note: the best {key} lies at the {end} end of the range searched: the optimum may lie outside it")
    written = [f for f in ("best.toml", "trials.csv", "trials.md", "tune.json", "history.png")
               if (Path(out) / f).exists()]
    print(f"written: {out}/{', '.join(written)}; the study: {out}/study.db")
    return 0


def _cmd_data(args: argparse.Namespace) -> int:
    from .config import load
    from .data.federated import describe

    if len(args.what) == 2 and args.what[0] == "export":
        from .data.npz import check_target, export, parse_range

        if not args.out:
            raise ConfigError("fedmtl data export: --out DIR is required")
        check_target(args.out, args.overwrite)  # before the data is built
        cfg = load(args.what[1], args.set)
        data = cfg.build_data()
        n = data.seen.num_clients
        ids = parse_range(args.clients, n) if args.clients else list(range(n))
        export(data, args.out, ids, overwrite=args.overwrite)
        print(f"written: {args.out}/dataset.json and {len(ids)} client_<k>.npz files (clients "
              f"{ids[0]}-{ids[-1]} of {n})")
        return 0
    if len(args.what) != 1:
        raise ConfigError("usage: fedmtl data CONFIG  |  fedmtl data export CONFIG --out DIR [--clients A-B]")
    cfg = load(args.what[0], args.set)
    data = cfg.build_data()
    print(describe(data))
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    from .config import ALGORITHMS, DATASETS, MODELS
    from .registry import MODEL_BUILDER_ARGS, describe, field_table
    from .resources import bundled_configs

    def keys(target: object, given: tuple[str, ...] = MODEL_BUILDER_ARGS) -> None:
        rows = field_table(target, given)
        if not rows:
            print("  (no keys)")
        width = max((len(r[0]) for r in rows), default=0)
        for name, tp, default, doc in rows:
            print(f"  {name:{width}s}  {tp} = {default}" + (f"\n  {'':{width}s}  {doc}" if doc else ""))

    if args.algorithm:
        if args.algorithm not in ALGORITHMS:
            raise ConfigError(f"--algorithm {shown(args.algorithm)}: not one of {sorted(ALGORITHMS)}")
        cls = ALGORITHMS[args.algorithm]
        print(f"{args.algorithm}: {describe(cls)}")
        keys(cls)
        return 0
    if args.table:
        from .config import TABLES

        if args.table not in TABLES:
            raise ConfigError(f"--table {shown(args.table)}: not one of {sorted(TABLES)} (the [algorithm] table: "
                              "--algorithm NAME; [data] and [model]: --dataset NAME, --model NAME)")
        print(f"[{args.table}]: every key with its type, valid range and default")
        keys(TABLES[args.table].cls)
        return 0
    for flag, registry in (("dataset", DATASETS), ("model", MODELS)):
        name = getattr(args, flag)
        if name:
            if name not in registry:
                raise ConfigError(f"--{flag} {shown(name)}: not one of {sorted(registry)}")
            print(f"[{'data' if flag == 'dataset' else 'model'}] name = {name!r}: its keys with type, valid range and "
                  "default")
            keys(registry[name], () if flag == "dataset" else MODEL_BUILDER_ARGS)
            return 0
    print("algorithms (fedmtl list --algorithm NAME for their hyperparameters):")
    for name, cls in sorted(ALGORITHMS.items()):
        print(f"  {name:12s} {describe(cls)}")
    from .engine.async_config import ASYNC_MODES

    able = ", ".join(n for n, c in sorted(ALGORITHMS.items()) if c.runs_async)
    print(f"asynchronous modes ([async] mode = NAME; fedmtl list --table async; for {able}):")
    for name, doc in ASYNC_MODES.items():
        print(f"  {name:12s} {doc}")
    print("datasets:  " + ", ".join(sorted(DATASETS)))
    print("models:    " + ", ".join(sorted(MODELS)))
    print("configs (bundled; fedmtl run NAME works in any folder):")
    for c in bundled_configs():
        print(f"  {c}")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from .runs.comparison import OUTPUTS, compare
    from .runs.rundir import check_output

    check_output(args.out, overwrite=args.overwrite, names=OUTPUTS)
    compare(args.runs, args.out, args.metric)
    print(f"written: {args.out}/compare.md, compare.json, curves.png, clients.png")
    return 0


def _cmd_watch(args: argparse.Namespace) -> int:
    from .runs.watch import watch

    try:
        return watch(args.run_dir, interval=args.interval, once=args.once)
    except KeyboardInterrupt:  # Ctrl-C ends the watching, never the run
        return 0


def _cmd_tables(args: argparse.Namespace) -> int:
    from .experiments.tables import regenerate

    differ = regenerate(Path(args.results), check=args.check)
    if args.check and differ:
        print(f"fedmtl tables: stored tables differ from their measurements: {', '.join(differ)} (fedmtl tables "
              "rewrites them)", file=sys.stderr)
        return 1
    print("rewritten: " + (", ".join(differ) if differ and not args.check else "nothing (every table matches)"))
    return 0


def _check_reproduction_out(args: argparse.Namespace) -> None:
    """A reproduction's --out that already holds files: continued with --resume (its finished runs read back, the
    interrupted ones continued), replaced with --overwrite (every run started over), else refused."""
    from .runs.rundir import check_output

    check_output(args.out, overwrite=args.overwrite, resume=args.resume)


def _cmd_main(args: argparse.Namespace) -> int:
    from .experiments.common import starting_over, summary_figure
    from .experiments.fedem import main_job
    from .runs.report import quick_mode, run_figures

    _check_reproduction_out(args)
    with quick_mode(args.quick), run_figures(False), starting_over(args.overwrite):
        main_job(Path(args.out), quick=args.quick)
        summary_figure(Path(args.out), "FedEM synthetic data: final test accuracy across clients")
    return 0


def _cmd_reproduce(args: argparse.Namespace) -> int:
    from .experiments import SUMMARIES, reproduction
    from .experiments.common import starting_over, summary_figure
    from .runs.report import quick_mode, run_figures

    extra: dict[str, object] = {}
    if args.probe_edges:
        return _probe_edges(args)
    if args.name == "tuned":
        from .experiments.tuned import check_device_option

        check_device_option(args.device)
        extra = {"trials": args.trials, "methods": _names(args.methods, "--methods"),
                 "federations": _names(args.federations, "--federations"), "device": args.device}
    else:
        given = [f for f, v in (("--trials", args.trials), ("--methods", args.methods),
                                ("--federations", args.federations), ("--device", args.device)) if v is not None]
        if given:
            raise ConfigError(f"{', '.join(given)}: options of fedmtl reproduce tuned only")
    if args.trials is not None and not 1 <= args.trials <= 100_000:
        raise ConfigError(f"--trials {args.trials}: a whole number of trials in [1, 100000]")
    _check_reproduction_out(args)
    t0 = time.perf_counter()
    # the runs draw no figure of their own: the reproduction's tables and figures, and one summary figure (every
    # dataset's methods, average and bottom-decile accuracy, mean +- std over seeds)
    with quick_mode(args.quick), run_figures(False), starting_over(args.overwrite):
        reproduction(args.name)(Path(args.out), quick=args.quick, **extra)
        summary_figure(Path(args.out), f"{args.name}: {SUMMARIES.get(args.name, '')}".rstrip(": "))
    written = sorted(p.name for p in Path(args.out).iterdir() if p.suffix in (".md", ".json", ".png", ".csv"))
    print(f"fedmtl reproduce {args.name}: {time.perf_counter() - t0:.0f} s; results in {args.out}"
          + (f" ({', '.join(written)})" if written else ""), flush=True)
    return 0


def _probe_edges(args: argparse.Namespace) -> int:
    """``fedmtl reproduce tuned --out DIR --probe-edges``: the stored table's values at an end of their range,
    measured beyond it (``experiments.tuned_edges``); nothing is tuned."""
    if args.name != "tuned":
        raise ConfigError("--probe-edges: an option of fedmtl reproduce tuned only")
    given = [f for f, v in (("--quick", args.quick), ("--trials", args.trials), ("--overwrite", args.overwrite)) if v]
    if given:
        raise ConfigError(f"--probe-edges reads the table in --out as it is: {', '.join(given)} does not apply")
    from .experiments.tuned import check_device_option
    from .experiments.tuned_edges import probe

    check_device_option(args.device)
    t0 = time.perf_counter()
    probe(Path(args.out), _names(args.methods, "--methods"), _names(args.federations, "--federations"), args.device)
    print(f"fedmtl reproduce tuned --probe-edges: {time.perf_counter() - t0:.0f} s; results in {args.out} "
          "(edges.json, edges.md)", flush=True)
    return 0


def _names(text: str | None, option: str) -> list[str] | None:
    """``a,b`` -> ``["a", "b"]``; None where the option was not given.  A given option naming nothing (``""``, ``,``)
    is refused: it would read as "all" further on."""
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ConfigError(f"{option} {shown(text)}: names nothing (a comma-separated list; leave it out for all)")
    return names


def _cmd_flower(args: argparse.Namespace) -> int:
    from .config import dumps, load

    if args.action == "worker":
        if not args.socket:
            raise ConfigError("fedmtl flower worker needs --socket PATH (the SuperNode's node config fedmtl-worker)")
        from .flower.worker import Worker

        worker = Worker(args.socket)
        sock = worker.bind()  # every refusal (SocketRefused: one line, exit 2) comes before "serving"
        print(f"fedmtl flower worker: serving {args.socket}", flush=True)
        worker.serve(sock=sock)
        return 0
    if not args.config:
        raise ConfigError(f"fedmtl flower {args.action} needs a CONFIG")

    cfg = load(args.config, args.set + ([f"run.device={_toml_string(args.device)}"] if args.device is not None else []))
    try:
        import flwr  # noqa: F401
    except ImportError:
        raise ConfigError("Flower is not installed: pip install 'fedmtl[flower]'") from None
    n = cfg.build_data().seen.num_clients
    if args.clients and args.clients != n:
        raise ConfigError(f"--clients {args.clients}: {args.config} has {n} seen clients")
    if not 0 <= args.nodes <= n:
        raise ConfigError(f"--nodes {args.nodes}: between 1 and {args.config}'s {n} seen clients")
    if args.action == "app":
        from .flower.project import PROJECT_FILES, write_project
        from .runs.rundir import check_output

        if args.resume:
            raise ConfigError("fedmtl flower app: --resume is for simulate (an app project is written whole; "
                              "--overwrite replaces one)")
        check_output(args.out or "flower-app", overwrite=args.overwrite, names=PROJECT_FILES)
        out = write_project(cfg, args.out or "flower-app", args.nodes or n)
        print(f"wrote a Flower app project to {out} (flwr run {out}); deployment recipe: {out / 'DEPLOY.md'}")
        return 0
    import os

    from .flower.simulation import simulate
    from .machine import torch_device
    from .runs.rundir import RESULTS, check_output

    try:  # the simulated nodes compute here (an app project may name a device this machine lacks: its nodes have it)
        torch_device(cfg.run.device)
    except ValueError as e:
        raise ConfigError(f"{args.config}: {e}") from None
    if args.out:  # the ServerApp continues a checkpoint it finds: only with --resume here
        check_output(args.out, overwrite=args.overwrite, resume=args.resume, names=RESULTS)
    res = simulate(dumps(cfg.raw), n, args.out or "", cpus=args.cpus or os.cpu_count() or 1, nodes=args.nodes,
                   cpus_per_node=args.cpus_per_node, gpus_per_node=args.gpus_per_node, ray_address=args.ray_address,
                   overwrite=args.overwrite)
    print(json.dumps(res.final, indent=1))
    return 0


BENCH_CHECKOUT = ("fedmtl bench runs from a source checkout (the benchmarks/ package); clone the repository "
                  "and run it there")


def _benchmarks() -> ModuleType | None:
    """The top-level ``benchmarks`` package of a checkout (next to ``src/``), or None where there is none."""
    try:
        import benchmarks
    except ImportError:
        root = Path(__file__).resolve().parents[2]
        if not (root / "benchmarks" / "__init__.py").is_file():
            return None
        sys.path.insert(0, str(root))
        try:
            import benchmarks
        except ImportError:
            return None
    return benchmarks


def _cmd_bench(args: argparse.Namespace) -> int:
    bm = _benchmarks()
    if bm is None:
        print(f"fedmtl: {BENCH_CHECKOUT}", file=sys.stderr)
        return EXIT_INPUT
    status: int = bm.run(args.bench, args)
    return status


_N = TypeVar("_N")


class _LazyParser(argparse.ArgumentParser):
    """A sub-command parser whose arguments are added when it is used: a benchmark's flags come from its module,
    imported only when that benchmark is asked for (``fedmtl bench NAME --help`` shows them)."""

    def __init__(self, *args: Any, add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._add_arguments = add_arguments

    @overload
    def parse_known_args(self, args: Iterable[str] | None = None, namespace: None = None
                         ) -> tuple[argparse.Namespace, list[str]]: ...

    @overload
    def parse_known_args(self, args: Iterable[str] | None, namespace: _N) -> tuple[_N, list[str]]: ...

    @overload
    def parse_known_args(self, *, namespace: _N) -> tuple[_N, list[str]]: ...

    def parse_known_args(self, args: Iterable[str] | None = None, namespace: Any = None) -> tuple[Any, list[str]]:
        if self._add_arguments is not None:
            add, self._add_arguments = self._add_arguments, None
            add(self)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        _refuse(self, message)


def _bench_parser(sub: Any) -> None:
    """``fedmtl bench NAME [its flags]``: a sub-command per benchmark of the checkout's ``benchmarks`` package."""
    b = sub.add_parser("bench", help="speed benchmarks (write JSON; from a source checkout)",
                       description="Speed benchmarks, each with its own flags: fedmtl bench NAME --help.")
    b.set_defaults(fn=_cmd_bench)
    bm = _benchmarks()
    if bm is None:  # an install without the checkout: the command says so when run
        b.add_argument("bench", metavar="NAME")
        b.add_argument("rest", nargs=argparse.REMAINDER)
        return
    names = b.add_subparsers(dest="bench", required=True, metavar="NAME", parser_class=_LazyParser)
    for name, what in bm.BENCHMARKS.items():
        names.add_parser(name, help=what, description=f"fedmtl bench {name}: {what}",
                         add_arguments=functools.partial(_bench_args, bm, name))


def _bench_args(bm: Any, name: str, p: argparse.ArgumentParser) -> None:
    """A benchmark's own flags, and -v / -q / --no-progress after its name as after every command's."""
    bm.load(name).add_arguments(p)
    _output_args(p)


class _Parser(argparse.ArgumentParser):
    """argparse with a "did you mean" for misspelled flags and subcommands."""

    def error(self, message: str) -> NoReturn:
        import difflib

        words = re.findall(r"(?:unrecognized arguments|invalid choice): (.*)", message)
        if words:
            known = [s for a in self._actions for s in a.option_strings]
            for a in self._actions:
                if isinstance(a, argparse._SubParsersAction):
                    known += list(a.choices)
                    for sp in a.choices.values():
                        known += [s for b in sp._actions for s in b.option_strings]
            for w in re.findall(r"'?(--?[\w-]+|[a-z][\w-]*)'?", words[0])[:3]:
                near = difflib.get_close_matches(w, sorted(set(known)), n=1)
                if near and near[0] != w:
                    message += f" (did you mean {near[0]}?)"
                    break
        _refuse(self, message)


def _refuse(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """argparse's refusal as one line (no usage block), exit code 2, every value it quotes cut short (``shown``)."""
    message = re.sub(r"'([^']{60,})'?", lambda m: shown(m.group(1)), " ".join(message[:4000].split()))
    parser.exit(2, f"{parser.prog}: error: {message[:600]} (--help shows the usage)\n")


@functools.lru_cache(maxsize=1)
def _parser() -> argparse.ArgumentParser:
    """``build_parser()``, built once per process (parsing leaves a parser as it was; ``main`` may run many times in
    one process: a sweep, a tuning study, the tests)."""
    return build_parser()


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="fedmtl", description="Personalized and federated multi-task learning")
    _output_args(p, False)
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run one experiment from a TOML config")
    r.add_argument("config", nargs="?", help="a TOML file or a bundled config name; with --resume --out DIR it may be "
                   "left out: the run directory's own config.toml")
    r.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE", help="override a config value")
    r.add_argument("--out", help="run directory (default runs/<config name>)")
    r.add_argument("--resume", action="store_true", help="continue from the run directory's checkpoint")
    r.add_argument("--overwrite", action="store_true", help="replace the results a run directory already holds")
    r.add_argument("--device",
                   help="cpu, cuda or cuda:N (N a GPU index; same as --set run.device=...)")
    r.add_argument("--executor", choices=["distributed"], help="distributed: this process is a rank of a torchrun "
                   "job (torchrun --nproc-per-node R -m fedmtl run CONFIG ...); detected from torchrun's environment")
    r.add_argument("--dist-timeout", type=_positive_seconds, default=1800.0, metavar="SECONDS",
                   help="distributed: how long a rank waits for the others before the run stops (default 1800)")
    r.add_argument("--seeds", help="several seeds, e.g. 1,2,3 or 1-5: independent replicas run as "
                   "one batched computation; per-seed folders plus mean, std and 95%% interval (same as --set "
                   "run.seeds=[...])")
    _plugins_arg(r)
    _output_args(r)
    r.set_defaults(fn=_cmd_run)

    sw = sub.add_parser("sweep", help="run a config for several values of one or more keys")
    sw.add_argument("config")
    sw.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=V1,V2,...")
    sw.add_argument("--out")
    sw.add_argument("--seeds",
                    help="run every setting with each of these seeds (e.g. 1-3); the plot shows bands")
    _again_args(sw, "an interrupted sweep (settings with a checkpoint continue)", "every setting starts over")
    _plugins_arg(sw)
    _output_args(sw)
    sw.set_defaults(fn=_cmd_sweep)

    tu = sub.add_parser("tune", help="search hyperparameters with Optuna (TPE, median pruning) on a validation "
                                     "split; resumable, shareable by several processes")
    tu.add_argument("config")
    tu.add_argument("--space", required=True, metavar="SPACE.toml",
                    help="the search space: [table] key = { low, high [, log, int, step] } or { choices = [...] }; "
                    "a file or a bundled space's name (fedavg_lr)")
    tu.add_argument("--trials", type=int, default=20, help="trials in the study (default 20; counted over every "
                    "process working on it)")
    tu.add_argument("--seed", type=int, default=0, help="the TPE sampler's seed (default 0)")
    tu.add_argument("--out", help="the study's folder (default runs/tune-<config name>)")
    tu.add_argument("--resume", action="store_true", help="continue the study in --out (also: a second process "
                    "working on it)")
    tu.add_argument("--objective", help="the validation metric to optimize (default seen_val_acc_mean; "
                    "seen_val_loss, seen_val_acc_p10, ...)")
    tu.add_argument("--direction", choices=["maximize", "minimize"], help="default: minimize a loss, maximize "
                    "an accuracy")
    tu.add_argument("--last", type=int, default=3, help="the objective: the metric's mean over this many last "
                    "evaluated rounds (default 3)")
    tu.add_argument("--batch-trials", type=int, default=1, metavar="K", help="train K trials together as one "
                    "batched computation, as seeds are (a space over optim.lr and the algorithm's real-valued "
                    "hyperparameters only; vmap or loop executor)")
    tu.add_argument("--no-prune", action="store_true", help="run every trial to its last round (no median pruning)")
    tu.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE", help="override a config value")
    tu.add_argument("--device", help="cpu, cuda or cuda:N: where the trials run (same as --set run.device=...)")
    _plugins_arg(tu)
    _output_args(tu)
    tu.set_defaults(fn=_cmd_tune)

    d = sub.add_parser("data", help="print a config's dataset statistics, or 'export' it as per-client .npz files "
                                    "(the node-local format of a Flower SuperNode's data-dir)",
                       usage="fedmtl data CONFIG [--set TABLE.KEY=VALUE ...]\n"
                             "       fedmtl data export CONFIG --out DIR [--clients 0-49] [--overwrite] "
                             "[--set TABLE.KEY=VALUE ...]")
    d.add_argument("what", nargs="+", metavar="CONFIG", help="a config (statistics), or: export CONFIG")
    d.add_argument("--out", help="export: the data directory to write")
    d.add_argument("--clients", help="export: which seen clients, e.g. 0-49 or 0,3,7 (default: all)")
    d.add_argument("--overwrite", action="store_true", help="export: replace the export DIR already holds (its "
                   "other clients' files removed)")
    d.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE")
    _plugins_arg(d)
    _output_args(d)
    d.set_defaults(fn=_cmd_data)

    cp = sub.add_parser("compare", help="runs side by side: a Markdown table (mean +- std over seeds), curves with "
                                       "seed bands, per-client accuracy distributions")
    cp.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (fedmtl run, with or without --seeds)")
    cp.add_argument("--metric", default=SEEN_TEST_ACC_MEAN, help="the metric to sort by and to plot per round")
    cp.add_argument("--out", required=True)
    cp.add_argument("--overwrite", action="store_true", help="replace the comparison --out already holds")
    _output_args(cp)
    cp.set_defaults(fn=_cmd_compare)

    w = sub.add_parser("watch", help="follow a run while it runs (simulated or over Flower): round, accuracy, p10, "
                                     "dropped and excluded clients, ETA",
                       description="fedmtl watch: follow a run directory while its run runs (fedmtl run, a Flower "
                                   "ServerApp's fedmtl-out); ends when the run finishes (exit 0) or stops unfinished "
                                   "(exit 1)")
    w.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (--out of fedmtl run, fedmtl-out of a Flower "
                   "run); a run with several seeds is followed seed by seed")
    w.add_argument("--interval", type=float, default=2.0, help="seconds between two reads, 0.01 to 3600 "
                   "(default 2)")
    w.add_argument("--once", action="store_true", help="print the run's state now and exit")
    _output_args(w)
    w.set_defaults(fn=_cmd_watch)

    ls = sub.add_parser("list", help="list algorithms, datasets, models and bundled configs")
    ls.add_argument("--algorithm", metavar="NAME", help="each hyperparameter of one algorithm: type, valid range, "
                    "default, doc")
    ls.add_argument("--table", metavar="TABLE", help="each key of a config table (run, optim, systems, robust, attack, "
                    "privacy, log, server_opt, async, flower): type, valid range, default, doc")
    ls.add_argument("--dataset", metavar="NAME", help="each [data] key of a dataset: type, valid range, default")
    ls.add_argument("--model", metavar="NAME", help="each [model] key of a model: type, valid range, default")
    _plugins_arg(ls)
    _output_args(ls)
    ls.set_defaults(fn=_cmd_list)

    tb = sub.add_parser("tables", help="regenerate the stored result tables from their stored measurements")
    tb.add_argument("--results", default="benchmarks/results", help="the results directory")
    tb.add_argument("--check", action="store_true", help="write nothing; exit 1 naming every table that differs")
    _output_args(tb)
    tb.set_defaults(fn=_cmd_tables)
    m = sub.add_parser("main", help="the main job: reproduce fedem-synthetic into results/")
    m.add_argument("--out", default="results")
    m.add_argument("--quick", action="store_true", help="a smoke run: 10 rounds, two seeds")
    _again_args(m, "what --out holds (finished runs read back, interrupted ones continued)", "every run starts over")
    _output_args(m)
    m.set_defaults(fn=_cmd_main)

    from .experiments import REPRODUCTIONS, summaries

    rp = sub.add_parser("reproduce", help="reproduce a paper's experiment (tables, plots)",
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        description="Reproduce an experiment; its results page in the handbook gives its measured "
                                    "duration.\n\n" + "\n".join(f"  {n:27s}{d}" for n, d in summaries().items()))
    rp.add_argument("name", choices=sorted(REPRODUCTIONS), metavar="NAME", help="one of the experiments above")
    rp.add_argument("--out", required=True)
    rp.add_argument("--quick", action="store_true", help="a short smoke version")
    rp.add_argument("--trials", type=int, help="tuned: trials per method and federation (default: the budget's)")
    rp.add_argument("--methods", help="tuned: these registered methods only (comma-separated)")
    rp.add_argument("--federations", help="tuned: these federations only (fmnist_mlp, fmnist_cnn, synthetic_mixture)")
    rp.add_argument("--device", help="tuned: run the trials and reruns on cpu, cuda or cuda:N (the tuned configs keep "
                                     "the federation's own device; each row records the one it ran on)")
    rp.add_argument("--probe-edges", action="store_true",
                    help="tuned: measure the table in --out beyond the ends of the ranges where a tuned value lies at "
                         "one (edges.json, edges.md); tunes nothing")
    _again_args(rp, "what --out holds (finished runs read back, interrupted ones continued)", "every run starts over")
    _output_args(rp)
    rp.set_defaults(fn=_cmd_reproduce)

    fl = sub.add_parser("flower", help="run over Flower: 'simulate' (simulation engine) or 'app' (write a project)",
                        usage="fedmtl flower simulate CONFIG [--nodes N] [--cpus N] [--out DIR] [options]\n"
                              "       fedmtl flower app CONFIG [--nodes N] [--out DIR] [options]\n"
                              "       fedmtl flower worker --socket PATH")
    fl.add_argument("action", choices=["simulate", "app", "worker"])
    fl.add_argument("config", nargs="?", help="simulate, app: the experiment config")
    fl.add_argument("--socket", help="worker: the Unix socket to serve (node config fedmtl-worker of the SuperNode)")
    fl.add_argument("--clients", type=int, default=0, help="simulate: check that the config has this many seen "
                    "clients; app: SuperNodes the project's DEPLOY.md describes")
    fl.add_argument("--nodes", type=int, default=0, help="simulate: virtual SuperNodes, each serving a block of "
                    "clients (default: one per client)")
    fl.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE")
    fl.add_argument("--out", help="simulate: run directory; app: project directory (default flower-app)")
    again = fl.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="simulate: continue the run --out holds")
    again.add_argument("--overwrite", action="store_true", help="simulate: replace the run --out holds; app: replace "
                       "the project --out holds")
    fl.add_argument("--device",
                    help="cpu, cuda or cuda:N (N a GPU index; same as --set run.device=...)")
    fl.add_argument("--cpus", type=_number_in(0, 10**5, int), default=0, help="simulate: CPUs of the Ray cluster "
                    "started for the run (default: this machine's)")
    fl.add_argument("--cpus-per-node", type=_number_in(0, 1024, lo_open=True), default=1.0, help="simulate: CPUs "
                    "each virtual SuperNode reserves (default 1: as many nodes run at once as there are CPUs)")
    fl.add_argument("--gpus-per-node", type=_number_in(0, 64), default=0.0, help="simulate: GPUs each virtual "
                    "SuperNode reserves; a fraction shares a GPU (e.g. 0.25: four nodes per GPU); needs run.device = "
                    "cuda")
    fl.add_argument("--ray-address", default="", help="simulate: join a running Ray cluster ('auto', or the HOST:PORT "
                    "of `ray start --head`) instead of starting one; its CPUs and GPUs are the cluster's")
    _plugins_arg(fl)
    _output_args(fl)
    fl.set_defaults(fn=_cmd_flower)

    _bench_parser(sub)
    return p


def _again_args(p: argparse.ArgumentParser, resume: str, overwrite: str) -> None:
    """--resume and --overwrite of a command that writes a folder: without either, one that holds files is refused."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--resume", action="store_true", help=f"continue {resume}")
    g.add_argument("--overwrite", action="store_true", help=f"replace what --out holds: {overwrite}")


def _output_args(p: argparse.ArgumentParser, sub: bool = True) -> None:
    """-v / -q / --no-progress, before or after the command (``fedmtl -q run X`` = ``fedmtl run X -q``)."""
    kw: dict[str, object] = {"default": argparse.SUPPRESS} if sub else {"default": False}
    p.add_argument("-v", "--verbose", action="store_true", help="more detail: a line for every round, INFO logs",
                   **kw)  # type: ignore[arg-type]
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing but results and errors",
                   **kw)  # type: ignore[arg-type]
    p.add_argument("--no-progress", action="store_true", help="plain lines instead of a progress bar, also on a "
                   "terminal (outside a terminal lines are the default)", **kw)  # type: ignore[arg-type]


def _plugins_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import a module that registers algorithms, models or datasets (repeatable)")


def main(argv: list[str] | None = None) -> int:
    load_plugins()
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR if args.quiet else logging.WARNING,
                        format="%(levelname)s %(message)s")
    from .runs.progress import default

    progress = default("off" if args.quiet else "lines" if args.no_progress else "auto", verbose=args.verbose)
    term = _Sigterm()
    try:
        previous = signal.signal(signal.SIGTERM, term)
    except ValueError:  # not the main thread: leave signals alone
        term.settle()
        previous = None
    try:
        import_plugins(getattr(args, "imports", []))
        with progress:  # what progress=True means, for this command only
            return args.fn(args)
    except (ConfigError, RegistryError) as e:
        term.settle()
        print(f"fedmtl: config error: {_line(str(e))}", file=sys.stderr)
        _refused_on_every_rank(args)
        return EXIT_INPUT
    except ValueError as e:  # DataError, ModelError, CheckpointError, RunDirError, ...
        term.settle()
        msg = " ".join([*str(e).split("\n"), *getattr(e, "__notes__", [])])
        source = getattr(args, "config", None)
        if isinstance(source, str) and source not in msg and not getattr(e, "names_its_file", False):
            msg = f"{shown(source, MAX_WORD, bare=True)}: {msg}"  # the file whose settings led here
        print(f"fedmtl: error: {_line(msg)}", file=sys.stderr)
        _refused_on_every_rank(args)
        return EXIT_INPUT
    except RankLost as e:
        term.settle()
        print(f"fedmtl: distributed run stopped: {e}{_resume_hint(args)} (the same torchrun command)", file=sys.stderr)
        return EXIT_RANK_LOST
    except KeyboardInterrupt:
        term.settle()
        if argv is None:  # the program itself, about to exit: a late Ctrl-C must not turn exit 130 into a traceback
            _ignore_sigint()
        print(f"fedmtl: interrupted{_resume_hint(args)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except _Terminated:
        term.settle()
        from .engine.distributed import launched

        if getattr(args, "command", "") == "run" and launched():
            # torchrun stops every rank with SIGTERM once one rank has failed (or it was itself told to stop): for a
            # rank, a SIGTERM is the distributed run stopping, whichever reached it first
            print(f"fedmtl: distributed run stopped: torchrun stopped this rank (SIGTERM: another rank failed, or the "
                  f"job was stopped){_resume_hint(args)} (the same torchrun command)", file=sys.stderr)
            return EXIT_RANK_LOST
        print(f"fedmtl: terminated (SIGTERM){_resume_hint(args)}", file=sys.stderr)
        return EXIT_TERMINATED
    except BrokenPipeError:  # the reader went away (fedmtl list | head): nothing more to say
        term.settle()
        sys.stderr.close()
        return 0
    except OSError as e:
        term.settle()
        if e.errno == errno.ENAMETOOLONG:  # a path given on the command line or in a config: invalid input
            name = str(e.filename)
            print(f"fedmtl: error: a file name too long for the system ({len(name)} characters): "
                  f"{name[:60]}...", file=sys.stderr)
            return EXIT_INPUT
        print(f"fedmtl: {_line(_os_error(e, args))}", file=sys.stderr)
        return EXIT_OS
    finally:
        term.settle()
        if previous is not None:
            from .engine.distributed import launched

            # a rank of a torchrun job keeps the exit code it has: torchrun's SIGTERM, stopping the job while this
            # process exits, would turn it into -15
            signal.signal(signal.SIGTERM, signal.SIG_IGN if launched() else previous)


# Exit codes (README, "Command line"): 0 success; 1 an unexpected error (a bug: a traceback is printed);
# 2 invalid input (config, data, model/data mismatch, run directory in use or holding results, unusable
# checkpoint), one line naming the file and key; 3 the operating system refused a write (out of disk space,
# permissions), one line naming the file and the checkpoint to resume from; 4 a distributed run lost a rank (or
# torchrun stopped this rank with SIGTERM); 130 interrupted (Ctrl-C); 143 terminated (SIGTERM).  After 3, 4, 130
# and 143 the last checkpoint is intact.
EXIT_INPUT, EXIT_OS, EXIT_RANK_LOST, EXIT_INTERRUPTED, EXIT_TERMINATED = 2, 3, 4, 130, 143


def _line(message: str) -> str:
    """An error message as the one line the command line prints: its lines joined, and cut at ``MAX_LINE``
    characters (each value in it is already cut, ``fedmtl.schema.shown``; this bounds what a value no check knew of
    could add).  A single word (a path, a value) longer than ``MAX_WORD`` keeps its ends only."""
    words = (w if len(w) <= MAX_WORD else f"{w[:MAX_WORD // 2]}...{w[-MAX_WORD // 4:]}" for w in message.split())
    return shown(" ".join(words), MAX_LINE, bare=True)


MAX_LINE = 2000
MAX_WORD = 240
_TEMPORARY = re.compile(r"\.(.+)\.[A-Za-z0-9_]{8}\.tmp")  # report.atomic's and checkpoint.save's names


def written_file(e: OSError) -> Path | None:
    """The user's file an ``OSError`` of a write is about: the destination of a rename (``filename2``) or the file
    whose temporary (``.NAME.XXXXXXXX.tmp``, ``report.atomic``) was being written, never the temporary itself."""
    name = getattr(e, "filename2", None) or getattr(e, "filename", None)
    if not name:
        return None
    path = Path(str(name))
    m = _TEMPORARY.fullmatch(path.name)
    return path.with_name(m.group(1)) if m else path


def _os_error(e: OSError, args: argparse.Namespace) -> str:
    """The one line for a write the operating system refused: what, which file, and what to do: where the file is
    in the way (a directory where a file is written), move it, then resume (or start into another directory)."""
    what = "out of disk space" if is_out_of_space(e) else f"cannot write ({e.strerror or e})"
    path = written_file(e)
    if path is None:
        return f"{what}{_resume_hint(args)}"
    if path.is_dir() and path.suffix:  # a directory where a file (metrics.csv, checkpoint.pt) is written
        hint = _resume_hint(args)
        return (f"{what}: {path} is a directory, where the run writes a file: move it out of the way"
                + (hint if "resume with" in hint else f", then run the same command again{hint}"))
    return f"{what}: {path}{_resume_hint(args)}"


class _Terminated(BaseException):
    pass


@contextlib.contextmanager
def _sigterm_deferred() -> Iterator[None]:
    """Hold a SIGTERM back while a command checks its input: a refusal raised meanwhile wins over it (each rank of a
    torchrun job that refuses its input says why, even when torchrun stops it because another rank refused first);
    otherwise it is raised at the end."""
    pending: list[int] = []
    try:
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: pending.append(signum))
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
    if pending:
        raise _Terminated()


def _refused_on_every_rank(args: argparse.Namespace, timeout: float = 15.0) -> None:
    """A rank of a torchrun job that refuses its input waits (at most ``timeout`` seconds) until every rank has refused
    it too: torchrun stops the job as soon as one rank exits, and a slower rank, stopped before it got as far, would
    not say why.  The ranks count their refusals in torchrun's own store (a courtesy: any failure ends the wait)."""
    from .engine.distributed import launched

    if getattr(args, "command", "") != "run" or not launched():
        return
    import datetime
    import os

    try:
        from torch.distributed import TCPStore

        store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=3), wait_for_workers=False)
        world = int(os.environ["WORLD_SIZE"])
        deadline = time.monotonic() + timeout
        if store.add("fedmtl/refused", 1) < world:
            while store.add("fedmtl/refused", 0) < world and time.monotonic() < deadline:
                time.sleep(0.05)
    except Exception:  # noqa: BLE001 (no store, a store gone: the rank exits at once)
        return


class _Sigterm:
    """The SIGTERM handler of a command: the first SIGTERM raises ``_Terminated`` (the command stops, names its
    checkpoint, exits 143; a rank of a torchrun job: 4), unless the command's outcome is already settled (an error
    being reported, a result returned), which a late SIGTERM must not turn into a traceback."""

    def __init__(self) -> None:
        self.armed = True

    def settle(self) -> None:
        self.armed = False

    def __call__(self, signum: int, frame: object) -> None:
        if self.armed:
            self.armed = False
            raise _Terminated()


def _ignore_sigint() -> None:
    with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _resume_hint(args: argparse.Namespace) -> str:
    """'; the last checkpoint is round R of DIR: resume with ...' for the run that was cut short (for a study: that
    --resume continues it)."""
    if getattr(args, "command", "") == "tune":
        out = Path(args.out or Path("runs") / f"tune-{Path(args.config).stem}")
        with contextlib.suppress(OSError):
            if (out / "study.db").is_file():
                return (f"; {out}/study.db keeps every finished trial: continue the study with the same command and "
                        "--resume")
        return ""
    if getattr(args, "command", "") != "run":
        return ""
    from .runs.rundir import layout, resume_command

    out = Path(args.out or Path("runs") / Path(args.config).stem)
    try:
        lay = layout(out)
        ckpt = out / "checkpoint.pt"
        seeds = sorted(out.glob("seed-*/checkpoint.pt"))
        has_ckpt = ckpt.exists()
    except OSError:  # an --out the system cannot look up: nothing there to resume
        return ""
    if lay.kind == "seeds" and seeds:  # several seeds: each seed folder has its own checkpoint
        return f"; {len(seeds)} seed folder(s) of {out} hold a checkpoint: resume with {resume_command(out, lay)}"
    if not has_ckpt:
        return f"; no checkpoint was written to {out}"
    try:
        from .runs.checkpoint import load

        rnd = load(ckpt)["round"]
    except Exception:  # noqa: BLE001 (a hint only)
        return f"; see {ckpt}"
    return f"; the last checkpoint is round {rnd} in {ckpt}: resume with {resume_command(out, lay)}"


if __name__ == "__main__":
    sys.exit(main())
