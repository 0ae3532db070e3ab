"""The one round loop.  Every algorithm, on every executor (vmap, loop, Flower), runs through ``Engine.round``:

    sample -> systems draw (stragglers, drops) -> broadcast -> run clients -> validate (NaN/Inf, failed
    replies) -> aggregate -> (clients keep their new states) -> post-round sync (gossip) -> [evaluate,
    checkpoint: ``engine.driver``]

Randomness comes only from the run's seed: round r draws its client sample, batch orders and evaluation
adaptation batches from generators seeded with ``(seed, r, purpose)``, so a resumed run repeats an
uninterrupted one exactly and every executor sees identical data.  Sampling costs O(clients sampled), not
O(population): the engine never touches the clients it did not sample (``ClientStore``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
from torch import Tensor

from .. import tree as T
from ..algorithms.base import Algorithm, Context
from ..data.federated import FederatedData, Orders, epoch_orders, usable_counts
from ..model import Model, ModelError
from ..optim import SGD
from ..privacy import Accountant, PrivacyConfig, calibrate, dp_combine, sampling_probability, secure_generator
from ..registry import ALGORITHMS
from ..robust.aggregators import BUCKETING_STREAM, RobustConfig, clip_updates, reference_of
from ..robust.attacks import AttackConfig, corrupt
from ..schema import Annotated, Range, check_fields
from ..server_opt import ServerOptConfig
from ..tree import Tree
from .clients import Clients, TrainOut
from .executors import ExecutorName
from .systems import SystemsModel

log = logging.getLogger("fedmtl")


def batch_norm_methods() -> list[str]:
    """The registered methods that train models with batch norm (``Algorithm.supports_batch_norm``)."""
    return sorted(n for n, cls in ALGORITHMS.items() if cls.supports_batch_norm)


@dataclass(frozen=True)
class RunConfig:
    """The ``[run]`` table: everything about a run that is not the algorithm."""

    #: communication rounds
    rounds: Annotated[int, Range(1, 10**7)] = 200
    #: the run's seed: model initialization, client sampling, batch orders, systems draws, attackers
    seed: Annotated[int, Range(0, 2**63 - 1)] = 1234
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
    #: cpu, cuda or cuda:<i>
    device: str = "cpu"
    #: evaluate every this many rounds (and after the last)
    eval_every: Annotated[int, Range(1, 10**7)] = 10
    #: checkpoint every this many rounds (0 = never)
    checkpoint_every: Annotated[int, Range(0, 10**7)] = 10
    #: bound on the elements of a padded evaluation tensor
    eval_chunk_elems: Annotated[int, Range(1, 2**40)] = 2**24
    #: > 0: evaluate a fixed uniform sample of this many clients per group
    eval_clients: Annotated[int, Range(0, 10**9)] = 0
    #: memory, or mmap: client states in files of the run directory
    client_store: Literal["memory", "mmap"] = "memory"
    #: torch intra-op threads (0 = leave torch's default)
    threads: Annotated[int, Range(0, 1024)] = 0
    #: several seeds: independent replicas of the run, batched (fedmtl.engine.seeds)
    seeds: tuple[Annotated[int, Range(0, 2**63 - 1)], ...] = ()

    def __post_init__(self) -> None:
        check_fields(self, "run")
        if self.runner not in ("auto", "stacked", "vmap", "loop"):
            raise ValueError(f"run.runner must be 'auto', 'stacked', 'vmap' or 'loop', got {self.runner!r}")
        if self.bucketing not in ("steps", "none"):
            raise ValueError(f"run.bucketing must be 'steps' or 'none', got {self.bucketing!r}")
        if self.client_store not in ("memory", "mmap"):
            raise ValueError(f"run.client_store must be 'memory' or 'mmap', got {self.client_store!r}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"run.device must be 'cpu' or 'cuda[:i]', got {self.device!r}")
        if self.drop_last and self.local_epochs > 1:
            # later epochs would visit examples the first epoch dropped, outside the first epoch's index space (the
            # per-example state some methods keep, FedEM's responsibilities): one epoch per round only
            raise ValueError("run.drop_last = true needs run.local_epochs = 1")
        if len(set(self.seeds)) != len(self.seeds) or len(self.seeds) > 1000:
            raise ValueError(f"run.seeds must be distinct (at most 1000), got {list(self.seeds)}")


def round_generator(seed: int, round_idx: int, stream: int = 0) -> torch.Generator:
    """Generator for one round and one purpose, independent of everything that came before."""
    mixed = np.random.SeedSequence([seed, round_idx, stream]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(mixed) & ((1 << 63) - 1))


def sample_without_replacement(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """A uniform k-subset of range(n), sorted, in O(k) expected time for k <= n/2: the first k distinct values
    of i.i.d. uniform draws (a uniformly random subset by symmetry).  Larger k: a permutation prefix."""
    if 2 * k > n:
        return np.sort(rng.permutation(n)[:k])
    chosen = np.zeros(0, dtype=np.int64)
    while len(chosen) < k:
        draw = rng.integers(0, n, size=int(1.1 * (k - len(chosen))) + 16)
        pool = np.concatenate([chosen, draw])
        _, first = np.unique(pool, return_index=True)
        chosen = pool[np.sort(first)][:k]  # first occurrences, in draw order
    return np.sort(chosen)


def poisson_sample(cfg: RunConfig, num_clients: int, round_idx: int) -> Tensor:
    """Poisson sampling: every client joins round ``round_idx`` independently with probability q (``clients_per_round
    / N``, else ``sampling_rate``).  Drawn as a Binomial(N, q) count and a uniform subset of that size (the same
    distribution, in O(count))."""
    q = sampling_probability(cfg.sampling_rate, cfg.clients_per_round, num_clients)
    rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, round_idx, 1]))
    k = int(rng.binomial(num_clients, q))
    if k == 0:
        return torch.zeros(0, dtype=torch.long)
    if k == num_clients:
        return torch.arange(num_clients)
    return torch.from_numpy(sample_without_replacement(rng, num_clients, k))


def clients_per_round(cfg: RunConfig, num_clients: int) -> int:
    """K, the clients a round samples: ``clients_per_round``, else ``round(sampling_rate * N)`` (at least 1)."""
    return min(cfg.clients_per_round or max(1, int(round(cfg.sampling_rate * num_clients))), num_clients)


def sample_clients(cfg: RunConfig, num_clients: int, round_idx: int) -> Tensor:
    """The clients of round ``round_idx`` (sorted ids): everyone, or a uniform sample without replacement of
    ``clients_per_round`` (else ``round(sampling_rate * num_clients)``) clients."""
    k = clients_per_round(cfg, num_clients)
    if k == num_clients:
        return torch.arange(num_clients)
    rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, round_idx, 1]))
    return torch.from_numpy(sample_without_replacement(rng, num_clients, k))


class Federation(NamedTuple):
    """What the server knows about the clients: their number and sizes, never their data."""

    train_counts: Tensor  # (N,) long, training examples of each seen client
    feature_shape: tuple[int, ...]
    num_classes: int
    meta: dict[str, Any]
    unseen_train_counts: Tensor | None = None  # (U,) long

    @classmethod
    def of(cls, data: FederatedData) -> Federation:
        unseen = None if data.unseen is None else data.unseen.train.counts.clone()
        return cls(data.seen.train.counts.clone(), data.feature_shape, data.num_classes, data.meta, unseen)

    @property
    def num_clients(self) -> int:
        return int(self.train_counts.numel())

    def counts(self, group: str) -> Tensor:
        c = self.train_counts if group == "seen" else self.unseen_train_counts
        if c is None:
            raise KeyError(f"no {group} clients")
        return c


DIVERGED_AFTER = 3  # consecutive rounds in which every update is non-finite


class TrainingDiverged(ValueError):
    """Every client update was non-finite for ``DIVERGED_AFTER`` rounds in a row."""


class RoundPlan(NamedTuple):
    """A round as ``Engine.plan`` lays it out, before any client runs."""

    round: int
    ids: Tensor  # (K,) the clients that train (sampled, not dropped), sorted
    counts: Tensor  # (K,) their training examples
    orders: Orders | None  # their batch orders (None when nobody trains)
    lr: float
    payload: Tree
    n_sampled: int
    n_dropped: int
    est_seconds: float


@dataclass
class EngineState:
    """Everything of a run besides the clients' own states: what a checkpoint holds with the store's rows."""

    round: int
    server: Tree
    history: list[dict[str, Any]] = field(default_factory=list)
    counters: dict[str, Any] = field(default_factory=lambda: {"excluded_updates": 0})
    server_opt: Tree = field(default_factory=dict)  # the [server_opt] optimizer's state (moments), if any


class Engine:
    """Runs ``algorithm`` on ``clients`` (``LocalClients`` in a simulation, ``FlowerClients`` over Flower)."""

    def __init__(self, algorithm: Algorithm, model: Model, opt: SGD, cfg: RunConfig, clients: Clients,
                 federation: Federation, systems: SystemsModel | None = None, robust: RobustConfig | None = None,
                 attack: AttackConfig | None = None, privacy: PrivacyConfig | None = None,
                 server_opt: ServerOptConfig | None = None):
        if cfg.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"run.device = {cfg.device!r} but this machine has no CUDA device "
                             "(torch.cuda.is_available() is False); use run.device = 'cpu'")
        if federation.num_classes < 2:
            raise ValueError("the round engine trains classifiers: its data needs num_classes >= 2 "
                             "(real-valued targets are for the networked GTV solver, fedmtl.networked)")
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        algorithm.check_model(model)
        if model.batch_norm and not algorithm.supports_batch_norm:
            raise ModelError(f"model {model.name!r} has batch-norm layers, which {algorithm.name} does not support "
                             "(its update rule or loss would step or ignore their running statistics); the methods "
                             f"that do: {batch_norm_methods()}. Use a model without batch norm (e.g. cnn_femnist)")
        self.alg, self.model, self.opt, self.cfg = algorithm, model, opt, cfg
        self.clients, self.fed = clients, federation
        self.systems = systems or SystemsModel()
        self.robust, self.attack = robust or RobustConfig(), attack or AttackConfig()
        self.server_opt = server_opt or ServerOptConfig()
        if (self.robust.aggregator != "mean" or self.robust.bucketing > 1) and not algorithm.averages_updates:
            raise ValueError(f"robust.aggregator = {self.robust.aggregator!r} / robust.bucketing = "
                             f"{self.robust.bucketing}: {algorithm.name} does not average client updates (each update "
                             "is its own client's entry); only robust.clip_norm applies")
        if self.robust.aggregator == "bulyan":
            rows = self.robust.inputs_per_round(clients_per_round(cfg, federation.num_clients))
            f = self.robust.num_byzantine
            if rows < 4 * f + 3:
                raise ValueError(f"robust.aggregator = 'bulyan' with robust.num_byzantine = {f} needs at least "
                                 f"{4 * f + 3} updates per round (4f + 3); this run's rounds give it {rows}"
                                 f"{' bucket means' if self.robust.bucketing > 1 else ''}: set num_byzantine <= "
                                 f"{max(0, (rows - 3) // 4)}")
        self.attackers = self.attack.attackers(federation.num_clients, cfg.seed)
        self.privacy = privacy or PrivacyConfig()
        self.accountant: Accountant | None = None
        self.noise_multiplier = self.privacy.noise_multiplier
        self.dp_denominator = 0.0
        if self.privacy.enabled:
            algorithm.check_privacy()
            if self.robust.aggregator != "mean" or self.robust.bucketing > 1:
                raise ValueError(f"[privacy] combines the updates by its noised mean, whose noise is calibrated to "
                                 f"that sum's sensitivity; robust.aggregator = {self.robust.aggregator!r} / "
                                 f"robust.bucketing = {self.robust.bucketing} cannot replace it (robust.clip_norm can "
                                 "be used with [privacy])")
            n = federation.num_clients
            k = clients_per_round(cfg, n)
            # the true inclusion probability (Poisson) or the sample size (fixed): what runs is what is accounted
            poisson = self.privacy.sampling == "poisson"
            q = sampling_probability(cfg.sampling_rate, cfg.clients_per_round, n) if poisson else k / n
            self.dp_denominator = q * n if poisson else float(k)  # the expected participants, or the sample size
            if self.privacy.target_epsilon > 0:
                self.noise_multiplier = calibrate(self.privacy, cfg.rounds, n, k, q)
                log.info("privacy: noise multiplier %.4f spends epsilon %.3g at delta %.1e over %d rounds",
                         self.noise_multiplier, self.privacy.target_epsilon, self.privacy.delta, cfg.rounds)
            self.accountant = Accountant(self.privacy, self.noise_multiplier, n, k, q)
            if self.privacy.reproducible_noise:
                log.warning("privacy.reproducible_noise = true: the DP noise is drawn from run.seed, so anyone who "
                            "knows the seed can remove it; the run's privacy guarantee does not hold")
        self.device = torch.device(cfg.device)
        model.module.to(self.device)
        self._n_params = sum(int(p.numel()) for p in model.module.parameters())
        self.check_memory()
        self.ctx = Context(model, opt, federation.num_clients, float(federation.train_counts.sum()), cfg.local_epochs,
                           cfg.rounds, int(federation.train_counts.max()), self.robust.combiner())
        self.eval_ids = {g: self._eval_sample(g) for g in clients.groups}

    def check_memory(self, replicas: int = 1) -> None:
        """Refuse, before allocating anything, a run whose models alone need more memory than the machine has:
        M models (FedEM's components) on the server, and per client of one batched call its copy, gradients
        and momentum; ``replicas`` runs with several seeds batched together (their clients share the calls)."""
        from ..config import physical_memory

        n = self.fed.num_clients
        m = int(getattr(self.alg, "num_components", 1) or 1)
        k = clients_per_round(self.cfg, n)
        width = min(replicas * k, self.cfg.chunk_size or replicas * k)
        need = 4.0 * self._n_params * m * (3 * width + 4 * replicas)
        have = physical_memory()
        if need > 0.8 * have:
            reps = f" x {replicas} replicas (seeds)" if replicas > 1 else ""
            raise ValueError(f"{m} model(s) of {self._n_params} parameters{reps} for {width} clients per batched call "
                             f"need about {need / 2**30:.1f} GiB, more than this machine's {have / 2**30:.1f} GiB "
                             "(fewer components, a smaller model, or run.chunk_size)")

    # ------------------------------------------------------------------------------------------ state
    def init_state(self, resume: dict[str, Any] | None = None) -> EngineState:
        """A fresh run (the clients' stores opened empty), or, with ``resume`` (a loaded checkpoint), the
        checkpoint's round, server and history with the clients' states restored."""
        params = T.to(self.model.start(self.cfg.seed), self.device)
        # an algorithm builds its server state's extra tensors (assignments, counters) where it likes; they live on
        # the run's device from here on
        server0 = T.to(self.alg.init_server(self.ctx, params, self.cfg.seed), self.device)
        self.server_opt.check(server0, self.alg.name)
        opt0 = self.server_opt.init(server0.params) if self.server_opt.enabled else {}
        if resume is None:
            self.clients.start(self.ctx, server0)
            return EngineState(round=0, server=server0, server_opt=opt0)
        server = T.from_named(resume["server"], server0, self.device)
        opt = T.from_named(resume.get("server_opt", {}), opt0, self.device) if T.leaves(opt0) else opt0
        self.clients.start(self.ctx, server0, resume["clients"], int(resume["round"]))
        return EngineState(int(resume["round"]), server, list(resume["history"]), dict(resume["counters"]), opt)

    def _eval_sample(self, group: str) -> Tensor:
        n = int(self.fed.counts(group).numel())
        k = self.cfg.eval_clients
        if not k or k >= n:
            return torch.arange(n)
        rng = np.random.default_rng(np.random.SeedSequence([self.cfg.seed, 11, 0 if group == "seen" else 1]))
        return torch.from_numpy(sample_without_replacement(rng, n, k))

    # ------------------------------------------------------------------------------------------ one round
    def _sample(self, r: int) -> Tensor:
        if self.privacy.enabled and self.privacy.sampling == "poisson":
            return poisson_sample(self.cfg, self.fed.num_clients, r)
        return sample_clients(self.cfg, self.fed.num_clients, r)

    def round(self, state: EngineState) -> dict[str, Any]:
        """One round: ``plan`` it, train its clients, ``finish`` it."""
        plan = self.plan(state)
        out = None if plan.ids.numel() == 0 else self.clients.train(plan.payload, plan.ids, plan.orders, plan.lr,
                                                                   plan.round)
        return self.finish(state, plan, out)

    def plan(self, state: EngineState) -> RoundPlan:
        """What round ``state.round`` asks of the clients: the sample (less dropped clients), their batch orders
        (straggler limits applied), the learning rate and the payload.  Pure in the state: nothing is changed."""
        r, cfg, alg = state.round, self.cfg, self.alg
        ids = self._sample(r)
        lr = self.opt.lr_at(r, cfg.rounds)
        payload = alg.payload(state.server)
        counts = self.fed.train_counts[ids]
        usable = usable_counts(counts, cfg.batch_size, cfg.drop_last)
        budget = alg.step_budget(usable, cfg.batch_size, cfg.local_epochs).numpy()
        draw = self.systems.draw(cfg.seed, r, ids.numpy())
        done = self.systems.steps(draw, budget)
        est = self._estimated_seconds(payload, draw, budget, done)
        n_sampled = len(ids)
        n_dropped = int(draw.dropped.sum())
        if n_dropped:
            keep = ~draw.dropped
            ids, counts, done = ids[torch.from_numpy(keep)], counts[torch.from_numpy(keep)], done[keep]
        orders = None
        if len(ids):
            orders = alg.draw_orders(counts, cfg.local_epochs, cfg.batch_size, round_generator(cfg.seed, r, 2))
            orders = orders._replace(limit=torch.from_numpy(done))
        return RoundPlan(r, ids, counts, orders, lr, payload, n_sampled, n_dropped, est)

    def finish(self, state: EngineState, plan: RoundPlan, out: TrainOut | None) -> dict[str, Any]:
        """Validate the clients' results ``out`` of ``plan``, aggregate them and advance ``state`` a round."""
        r, cfg, alg = plan.round, self.cfg, self.alg
        ids, counts, payload = plan.ids, plan.counts, plan.payload
        state.counters["est_time_s"] = float(state.counters.get("est_time_s", 0.0)) + plan.est_seconds
        if out is None and self.privacy.enabled:  # nobody trained: a private round still releases its noise
            out = self._no_updates(payload)
        row: dict[str, Any] = {"round": r + 1, "lr": plan.lr, "clients": len(ids), "dropped": plan.n_dropped}
        excluded, loss = 0, float("nan")
        if out is not None:
            failed = out.failed.cpu()
            valid = out.ok.cpu() & ~failed
            bad = ~out.ok.cpu() & ~failed
            excluded = int(bad.sum())
            if excluded:
                log.warning("round %d: excluded %d client update(s) with NaN/Inf: clients %s", r, excluded,
                            ids[bad].tolist()[:20])
            if bool(failed.any()):
                n_failed = int(failed.sum())
                row["dropped"] += n_failed
                row["clients"] -= n_failed
                log.warning("round %d: %d of %d clients failed to answer: %s", r, n_failed, len(ids),
                            ids[failed].tolist()[:20])
            updates = out.updates
            if self.attackers.numel() and self.attack.kind != "labelflip":
                attacking = torch.isin(ids, self.attackers)
                rows = torch.nonzero(attacking & valid).flatten()
                if rows.numel():
                    honest = torch.nonzero(~attacking & valid).flatten()  # what omniscient attackers see
                    updates = corrupt(self.attack, updates, reference_of(updates, payload), rows, cfg.seed, r, honest)
                    # what an attacker sends is checked like the rest
                    sent_ok = T.all_finite_rows(updates).cpu() if T.leaves(updates) else valid.clone()
                    bad_sent = valid & ~sent_ok
                    if bool(bad_sent.any()):
                        excluded += int(bad_sent.sum())
                        valid &= sent_ok
            weights = counts.to(torch.float64) * valid.to(torch.float64)
            if self.robust.clip_norm > 0:
                updates = clip_updates(updates, reference_of(updates, payload), weights, self.robust.clip_norm)
            ctx = self.ctx
            if self.robust.bucketing > 1:  # bucketing's permutation: one generator per round (resumes are exact)
                ctx = ctx._replace(combine=self.robust.combiner(round_generator(cfg.seed, r, BUCKETING_STREAM)))
            if self.privacy.enabled:
                ctx, updates = self._private(payload, updates, weights, r)
            before = state.server
            state.server = T.to(alg.aggregate(ctx, state.server, updates, weights.to(self.device), ids), self.device)
            if self.server_opt.enabled and state.server is not before:
                params, state.server_opt = self.server_opt.step(before.params, state.server.params, state.server_opt)
                state.server = state.server._replace(params=params)
            ok = out.losses.detach().cpu()[valid]
            loss = float(ok.float().mean()) if ok.numel() else float("nan")
        if alg.syncs_clients:  # decentralized: every client gossips with its neighbours, sampled or not
            state.server = self.clients.gossip(lambda s, c: alg.sync(self.ctx, s, c), state.server, r)
        if excluded and row["clients"] - excluded <= 0:  # nobody's update could be used
            state.counters["all_excluded_streak"] = int(state.counters.get("all_excluded_streak", 0)) + 1
            if state.counters["all_excluded_streak"] >= DIVERGED_AFTER:
                raise TrainingDiverged(f"every client update was NaN/Inf in rounds {r + 2 - DIVERGED_AFTER}-{r + 1}: "
                                       f"training diverged (optim.lr = {self.opt.lr:g} too large?); nothing is "
                                       "reported as a result")
        else:
            state.counters["all_excluded_streak"] = 0
        if self.accountant is not None:
            row["epsilon"] = self.accountant.epsilon_after(r + 1)
        state.counters["excluded_updates"] = int(state.counters.get("excluded_updates", 0)) + excluded
        state.counters["dropped_updates"] = int(state.counters.get("dropped_updates", 0)) + row["dropped"]
        state.round = r + 1
        return {**row, "excluded": excluded, "train_loss": loss, "est_time_s": state.counters["est_time_s"]}

    def _private(self, payload: Tree, updates: Tree, weights: Tensor, r: int) -> tuple[Context, Tree]:
        """User-level DP (``fedmtl.privacy``): clip every update's deviation from the payload to ``clip_norm`` and
        combine by a noisy sum over the fixed denominator (q N, or the sample size), the noise drawn from the
        operating system's CSPRNG (``privacy.reproducible_noise``: from the run's seed, insecure)."""
        ref = reference_of(updates, payload)
        if ref is None:
            raise ValueError(f"[privacy]: {self.alg.name}'s client updates are not model-shaped like its payload; "
                             "user-level DP needs updates it can clip against the broadcast model")
        p = self.privacy
        updates = clip_updates(updates, ref, weights, p.clip_norm)
        gen = round_generator(self.cfg.seed, r, 5) if p.reproducible_noise else secure_generator()
        combine = dp_combine(ref, p.clip_norm, self.noise_multiplier, self.dp_denominator, gen)
        return self.ctx._replace(combine=combine, dp_denominator=self.dp_denominator), updates

    def _no_updates(self, payload: Tree) -> TrainOut:
        """A round's results when no client trained: zero rows shaped like the payload (under ``[privacy]``)."""
        none = torch.zeros(0, dtype=torch.bool)
        like = self.alg.update_like(self.ctx, payload)
        return TrainOut(T.tmap(lambda p: p.unsqueeze(0)[:0], like), torch.zeros(0), none, none)

    def _estimated_seconds(self, payload: Tree, draw: Any, budget: Any, done: Any) -> float:
        """Estimated wall-clock seconds of this round on the systems model's device network: the compute of
        the round's clock cycle (or of its slowest node, in ``wait`` mode) at 6 FLOPs per parameter per
        example (forward and backward), plus the payload down and an update as large up."""
        step_flops = 6.0 * self._n_params * self.cfg.batch_size
        nbytes = float(sum(int(x.numel()) * x.element_size() for x in T.leaves(payload)))
        steps = self.systems.compute_time_steps(draw, budget, done)
        return self.systems.time_model.round_seconds(steps * step_flops, nbytes, nbytes)

    # ------------------------------------------------------------------------------------------ evaluation
    def evaluate(self, state: EngineState, groups: tuple[str, ...] = ("seen", "unseen")) -> dict[str, Any]:
        """Per-client accuracy and loss on every split of every group (of the fixed evaluation sample).

        Returns ``{group: {split: {"acc": (C,), "loss": (C,), "n": (C,), "client": (C,)}}}`` (numpy arrays).
        """
        out: dict[str, Any] = {}
        for group in groups:
            if group in self.clients.groups:
                out[group] = self.clients.evaluate(group, *self.eval_plan(state, group))
        return out

    def eval_plan(self, state: EngineState, group: str) -> tuple[Tree, Tree, Tensor, Orders | None, float]:
        """What evaluating ``group`` at ``state`` asks of the clients: (payload, server, client ids, adaptation
        orders, learning rate)."""
        lr = self.opt.lr_at(max(state.round - 1, 0), self.cfg.rounds)
        ids = self.eval_ids[group]
        seen = group == "seen"
        adapt = None
        if self.alg.needs_adaptation or not seen:
            g = torch.Generator().manual_seed(int(self.cfg.seed) * 7919 + state.round * 104729 + (not seen))
            adapt = epoch_orders(self.fed.counts(group)[ids], self.alg.adapt_epochs, g)
        return self.alg.payload(state.server), state.server, ids, adapt, lr
