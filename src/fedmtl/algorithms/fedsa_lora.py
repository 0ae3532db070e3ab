"""FedSA-LoRA: selective aggregation of low-rank adapters.

Guo, Sun, Wang, Li, Liu, Li, "Selective Aggregation for Low-Rank Adaptation in Federated Learning", ICLR 2025.

The model is a frozen base with LoRA adapters (``[model.adapters]``, ``fedmtl.models.lora``).  The paper observes
that the A matrices learn what is general across clients and the B matrices what is client-specific, and shares
only A: a sampled client trains A and B together for ``run.local_epochs`` epochs from the received A matrices and its
own B matrices, keeps B and sends A; the server averages the A matrices weighted by sample counts.  Modules trained in
full beside the adapters (``train``, e.g. a new classifier) are shared with A.  This is FedPer with the B matrices
as the personal part: a client that never trained (unseen) starts from the initial B (zero: the base model) and
trains it, A fixed, for ``unseen_head_epochs`` epochs before testing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..models.base import Model
from ..tree import Params
from .adapters import check_adapters, split_b
from .base import Toy
from .fedper import FedPer


@dataclass(frozen=True)
class FedSALoRA(FedPer):
    """FedSA-LoRA: the adapters' A matrices averaged by the server, the B matrices each client's own."""

    name: ClassVar[str] = "fedsa_lora"
    toy: ClassVar[Toy] = Toy(model="lora", sgd_lr=0.5, rounds=30)  # adapters from B = 0: slower on the toy task
    supports_batch_norm: ClassVar[bool] = False

    def check_model(self, model: Model) -> None:
        check_adapters(model, self.name)

    def split(self, model: Model, params: Params) -> tuple[Params, Params]:
        """(shared, personal): the A matrices (and fully trained modules), the B matrices."""
        return split_b(model, params, self.name)


__all__ = ["FedSALoRA"]
