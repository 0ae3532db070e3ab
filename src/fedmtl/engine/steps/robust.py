"""Robust combination (``robust.aggregator``, ``robust.bucketing``): the algorithm's ``aggregate`` combines the
round's updates with the run's robust aggregator instead of the weighted mean, after bucketing if asked
(``fedmtl.robust.aggregators``).  Bucketing's permutation is drawn from the round's own generator, so a resumed run
repeats an uninterrupted one exactly."""

from __future__ import annotations

from ...robust.aggregators import BUCKETING_STREAM, Combine, RobustConfig
from ..sampling import clients_per_round, round_generator
from .base import RoundInfo, Setting, Updates


class RobustCombination:
    """Set the round's ``combine`` to the ``[robust]`` aggregator (bucketed with the round's permutation)."""

    def __init__(self, cfg: RobustConfig):
        self.cfg = cfg
        self.fixed: Combine | None = None if cfg.bucketing > 1 else cfg.combiner()

    @classmethod
    def build(cls, s: Setting) -> RobustCombination | None:
        cfg = s.spec.robust
        if cfg.aggregator == "mean" and cfg.bucketing <= 1:
            return None
        if not s.algorithm.averages_updates:
            raise ValueError(f"robust.aggregator = {cfg.aggregator!r} / robust.bucketing = {cfg.bucketing}: "
                             f"{s.algorithm.name} does not average client updates (each update is its own client's "
                             "entry); only robust.clip_norm applies")
        if cfg.aggregator == "bulyan":
            rows = cfg.inputs_per_round(clients_per_round(s.spec.run, s.num_clients))
            f = cfg.num_byzantine
            if rows < 4 * f + 3:
                raise ValueError(f"robust.aggregator = 'bulyan' with robust.num_byzantine = {f} needs at least "
                                 f"{4 * f + 3} updates per round (4f + 3); this run's rounds give it {rows}"
                                 f"{' bucket means' if cfg.bucketing > 1 else ''}: set num_byzantine <= "
                                 f"{max(0, (rows - 3) // 4)}")
        return cls(cfg)

    def __call__(self, u: Updates, info: RoundInfo) -> Updates:
        combine = self.fixed or self.cfg.combiner(round_generator(info.seed, info.round, BUCKETING_STREAM))
        return u._replace(ctx=u.ctx._replace(combine=combine))
