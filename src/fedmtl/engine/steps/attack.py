"""Attack injection (the ``[attack]`` table, experiments only): the round's attackers' updates are replaced by
what they send (``fedmtl.robust.attacks.corrupt``), and what they send is screened like every other update."""

from __future__ import annotations

import torch
from torch import Tensor

from ... import tree as T
from ...robust.aggregators import reference_of
from ...robust.attacks import AttackConfig, corrupt
from .base import RoundInfo, Setting, Updates


class AttackStep:
    """Replace the valid updates of the clients ``attackers`` by the attack's; exclude the non-finite ones sent."""

    def __init__(self, cfg: AttackConfig, attackers: Tensor):
        self.cfg, self.attackers = cfg, attackers

    @classmethod
    def build(cls, s: Setting) -> AttackStep | None:
        # labelflip poisons the attackers' data before training (``make_engine``): nothing to do on the updates
        attackers = s.spec.attack.attackers(s.num_clients, s.spec.run.seed)
        return cls(s.spec.attack, attackers) if attackers.numel() and s.spec.attack.kind != "labelflip" else None

    def __call__(self, u: Updates, info: RoundInfo) -> Updates:
        attacking = torch.isin(u.ids, self.attackers)
        rows = torch.nonzero(attacking & u.valid).flatten()
        if not rows.numel():
            return u
        honest = torch.nonzero(~attacking & u.valid).flatten()  # what omniscient attackers see
        sent = corrupt(self.cfg, u.updates, reference_of(u.updates, info.payload), rows, info.seed, info.round, honest)
        u = u._replace(updates=sent)
        sent_ok = T.all_finite_rows(sent).cpu() if T.leaves(sent) else u.valid.clone()
        bad_sent = u.valid & ~sent_ok
        return u.revalidate(u.valid & sent_ok) if bool(bad_sent.any()) else u
