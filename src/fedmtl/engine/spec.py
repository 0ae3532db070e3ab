"""What a run is, besides its algorithm, model, clients and federation: the ``[run]`` table (``RunConfig``) and the
one typed spec the engine takes (``RunSpec``: the run, the local optimizer and the server-side tables)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..machine import check_device
from ..optim import SGD
from ..privacy import PrivacyConfig
from ..robust.aggregators import RobustConfig
from ..robust.attacks import AttackConfig
from ..schema import Annotated, Range, check_fields, shown
from .async_config import AsyncConfig
from .executors import ExecutorName
from .resident import DataOnDevice
from .server_opt import ServerOptConfig
from .systems import SystemsConfig

#: at most this many seeds in one run (``run.seeds``, ``--seeds``)
MAX_SEEDS = 1000
#: the largest seed
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class RunConfig:
    """The ``[run]`` table: everything about a run that is not the algorithm."""

    #: communication rounds
    rounds: Annotated[int, Range(1, 10**7)] = 200
    #: the run's seed: model initialization, client sampling, batch orders, systems draws, attackers
    seed: Annotated[int, Range(0, MAX_SEED)] = 1234
    #: local mini-batch size
    batch_size: Annotated[int, Range(1, 10**7)] = 128
    #: local epochs per round
    local_epochs: Annotated[int, Range(1, 10**4)] = 1
    #: leave out each epoch's last partial batch, as DataLoader(drop_last=True) (a client with fewer examples than a
    #: batch then trains on none); with local_epochs = 1
    drop_last: bool = False
    #: fraction of the clients sampled each round (Poisson sampling under [privacy]: the inclusion probability q)
    sampling_rate: Annotated[float, Range(0, 1, lo_open=True)] = 1.0
    #: > 0: clients sampled each round (overrides sampling_rate)
    clients_per_round: Annotated[int, Range(0, 10**9)] = 0
    #: the local executor: auto, stacked, vmap or loop
    runner: ExecutorName = "auto"
    #: at most this many clients per batched call (0 = no limit)
    chunk_size: Annotated[int, Range(0, 10**9)] = 0
    #: steps: group clients into vmap calls by their number of local steps; none: one group
    bucketing: Literal["steps", "none"] = "steps"
    #: the stacked executor's local step (forward, backward and update of all clients): auto, on a GPU recorded once
    #: as a CUDA graph and replayed (one launch a step), eager on a CPU; true, compiled with torch.compile (CUDA
    #: graphs on a GPU; pays on long runs of models with many small operations); false, eager.  Where recording or
    #: compiling fails, the step runs eagerly with one warning.  No effect on the numbers
    compile: bool | Literal["auto"] = "auto"
    #: cpu, cuda or cuda:<i> (i the index of one of the machine's GPUs)
    device: str = "cpu"
    #: keep every client's examples on the device, moved there once in their stored dtype (true); on the host, each
    #: call's batches copied over (false); or resident where they take at most half the device's free memory (auto).
    #: No effect on a CPU and none on the numbers
    data_on_device: DataOnDevice = "auto"
    #: evaluate every this many rounds (and after the last)
    eval_every: Annotated[int, Range(1, 10**7)] = 10
    #: checkpoint every this many rounds (0 = never)
    checkpoint_every: Annotated[int, Range(0, 10**7)] = 10
    #: bound on the elements one chunk of evaluated clients holds: its padded examples times an example's peak
    #: activations (estimated once from the model), plus each client's own model (2**26: 256 MiB in float32)
    eval_chunk_elems: Annotated[int, Range(1, 2**40)] = 2**26
    #: > 0: evaluate a fixed uniform sample of this many clients per group
    eval_clients: Annotated[int, Range(0, 10**9)] = 0
    #: memory, or mmap: client states in files of the run directory
    client_store: Literal["memory", "mmap"] = "memory"
    #: torch intra-op threads (0 = leave torch's default)
    threads: Annotated[int, Range(0, 1024)] = 0
    #: several seeds: independent replicas of the run, batched (fedmtl.runs.seeds)
    seeds: tuple[Annotated[int, Range(0, MAX_SEED)], ...] = ()
    #: > 0: this fraction of every seen client's training examples becomes its validation split (``seen_val_*``
    #: metrics), carved deterministically (the same examples for every seed and every run of the config; at least
    #: one example stays for training); the test split is untouched.  What ``fedmtl tune`` measures its objective on
    val_fraction: Annotated[float, Range(0, 1, hi_open=True)] = 0.0

    def __post_init__(self) -> None:
        check_fields(self, "run")
        check_device(self.device)
        if not (isinstance(self.data_on_device, bool) or self.data_on_device == "auto"):
            raise ValueError(f"run.data_on_device must be true, false or 'auto', got {shown(self.data_on_device)}")
        if not (isinstance(self.compile, bool) or self.compile == "auto"):
            raise ValueError(f"run.compile must be true, false or 'auto', got {shown(self.compile)}")
        if self.drop_last and self.local_epochs > 1:
            # later epochs would visit examples the first epoch dropped, outside the first epoch's index space (the
            # per-example state some methods keep, FedEM's responsibilities): one epoch per round only
            raise ValueError("run.drop_last = true needs run.local_epochs = 1")
        if len(set(self.seeds)) != len(self.seeds) or len(self.seeds) > MAX_SEEDS:
            raise ValueError(f"run.seeds must be distinct (at most {MAX_SEEDS}), got {shown(list(self.seeds))}")


@dataclass(frozen=True)
class RunSpec:
    """Everything ``Engine`` runs besides the algorithm, model, clients and federation: the ``[run]`` table, the
    local optimizer, the systems model and the server-side tables the update pipeline is built from
    (``fedmtl.engine.updates``).  Its fields are the config tables marked ``engine`` in ``fedmtl.config.Tables``,
    under the same names (``ExperimentConfig.run_spec()``)."""

    run: RunConfig = field(default_factory=RunConfig)
    optim: SGD = field(default_factory=SGD)
    systems: SystemsConfig = field(default_factory=SystemsConfig)
    robust: RobustConfig = field(default_factory=RobustConfig)
    attack: AttackConfig = field(default_factory=AttackConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    server_opt: ServerOptConfig = field(default_factory=ServerOptConfig)
    asynchronous: AsyncConfig = field(default_factory=AsyncConfig)
