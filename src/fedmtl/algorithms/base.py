"""The algorithm contract: pure functions written once, for one client.

An algorithm is a frozen dataclass whose fields are its hyper-parameters.  The round loop
(``fedmtl.engine.round``) calls, per round::

    payload = alg.payload(server)                                               # what the server broadcasts
    update, state', loss = alg.client_update(ctx, payload, state, batches, lr)  # ONE client
    server' = alg.aggregate(ctx, server, updates, weights, clients)            # stacked (K, ...) updates
    server', states' = alg.sync(ctx, server', all states)                      # only if syncs_clients

``client_update`` must be vmap-safe (no ``.item()``, no Python branching on tensor values, no in-place
updates, a fixed number of steps: ``optim.masked_steps``).  The ``stacked`` executor (K clients as one eager
computation) calls ``client_update_clients`` instead: the one hook through which a method receives its clients' batched
form (``optim.ClientBatches``), written by the methods that have one (``clients_form``); the others run on the
executor's fallback.  Evaluation calls ``personalize`` (one client:
the state it predicts with, possibly after local adaptation on its training batches) then
``predict_log_proba``.  Client and server states are typed pytrees: NamedTuples of tensors and
``Params`` dicts, declared in the algorithm's own module.

Capabilities are class attributes, read by the engine and by Flower:

* ``needs_adaptation`` — ``personalize`` uses the client's training batches (fine-tuning, EM for pi, ...);
* ``keeps_client_state`` — clients keep state across rounds (FedEM's pi, Ditto's personal model);
* ``syncs_clients`` — after aggregation, ``sync`` mixes the states of all clients (gossip).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar, cast

import torch
from torch import Tensor

from .. import tree as T
from ..data.federated import Orders, epoch_orders, steps_per_epoch
from ..models.base import Model
from ..optim import SGD, Batches, ClientBatches
from ..schema import check_fields
from ..tree import Combine, Params, Tree, TreeT


class Context(NamedTuple):
    """What every algorithm function may read besides its state: the model and local solver."""

    model: Model
    opt: SGD
    num_clients: int
    total_train: float  # total number of training examples over all seen clients
    local_epochs: int = 1  # epochs in the batches that client_update receives
    rounds: int = 0  # rounds of the run (0: unknown)
    max_train: int = 0  # the largest training set of any seen client (per-example client state: MOCHA's duals)
    # how the server combines stacked updates (K, ...) with weights (K,): the weighted mean, or a robust
    # aggregator of the run's [robust] table (fedmtl.robust); aggregate() calls it wherever it averages
    combine: Combine = T.weighted_mean
    # > 0 in a round under [privacy] (fedmtl.privacy): the fixed denominator of the noised mean that ``combine``
    # returns.  Such a round always releases: aggregate() must call combine even when no update is valid (or none
    # was sent: K = 0 rows), and must compute what it releases from combine's output only
    dp_denominator: float = 0.0
    #: the weights the engine passed to ``aggregate`` and their sum, read on the host before they were copied to the
    #: device: ``nobody`` then needs no wait for the device (``fedmtl.hostsync``).  Other weights are summed.
    weights_total: tuple[Tensor, float] | None = None

    @property
    def private(self) -> bool:
        return self.dp_denominator > 0


class GlobalModel(NamedTuple):
    """Server state of methods with one global model."""

    params: Params


class ClientId(NamedTuple):
    """Client state of methods whose server keeps per-client entries (cluster ids, heads, tasks)."""

    id: Tensor  # () long, the client's federation-wide id


#: an algorithm's server state (a NamedTuple of tensors and ``Params``: ``GlobalModel``, FedEM's ``Mixture``, ...)
ServerT = TypeVar("ServerT", bound=Tree)
#: one client's state (a NamedTuple, or ``()`` for methods whose clients keep nothing); stacked (K, ...) where the
#: engine holds several
ClientT = TypeVar("ClientT", bound=Tree)
#: what the server broadcasts, a client's update for the server, the state a client predicts with: trees whose types
#: each algorithm names in its own signatures (parameters an override narrows, so any tree here)
Payload = Any
Update = Any
EvalState = Any



class Toy(NamedTuple):
    """How the contract suite (``fedmtl.testing``) runs an algorithm on its toy federation, declared on the algorithm:
    hyper-parameters where a default is tuned for other data, the toy model (``linear``, ``linear_nobias``, ``mlp``:
    one with a body and a head, ``batchnorm``: one with batch-norm layers, ``lora``: a frozen MLP with low-rank
    adapters), a plain-SGD learning rate instead of the
    suite's momentum SGD (None: the suite's), and the rounds of the ``learns`` check."""

    kwargs: dict[str, Any] = {}
    model: str = "linear"
    sgd_lr: float | None = None
    rounds: int = 15


@dataclass(frozen=True)
class Algorithm(Generic[ServerT, ClientT]):
    """Base class, generic over the server state ``ServerT`` and the client state ``ClientT`` (``FedAvg`` is an
    ``Algorithm[GlobalModel, tuple[()]]``, ``FedEM`` an ``Algorithm[Mixture, MixtureWeights]``); subclasses override
    what differs.  The defaults describe a single global model (``GlobalModel``) and clients that keep nothing
    (``()``): a subclass with other states overrides the methods that build or read them.

    The contract, per round::

        payload = alg.payload(server)                                               # what the server broadcasts
        update, state', loss = alg.client_update(ctx, payload, state, batches, lr)  # ONE client
        server' = alg.aggregate(ctx, server, updates, weights, clients)             # stacked (K, ...) updates

    and per evaluation ``personalize`` (one client's predicting state) then ``predict_log_proba``.

    * A frozen dataclass: its fields are the hyperparameters (``[algorithm]`` keys).  Describe a field with a ``#:``
      comment above it or ``dataclasses.field(default=..., metadata={"doc": "..."})``; give numbers a range with
      ``Annotated[float, fedmtl.schema.Range(lo, hi)]``.  ``name`` (a ClassVar) is the registry name.
    * ``client_update`` is pure and vmap-safe: no ``.item()``, no Python branching on tensor values, no in-place
      changes of its inputs, a fixed number of steps (``optim.local_sgd`` masks the padded ones).
    * ``client_update_clients`` (optional) is the same update for K clients at once on the ``stacked`` executor
      (``optim.ClientBatches``, ``optim.local_sgd_clients``): the one hook for the batched clients form; a method
      without it (``clients_form``) trains on the stacked executor's fallback.
    * Capabilities are class attributes: ``needs_adaptation`` (``personalize`` reads the client's training batches:
      without it, it gets ``batches=None``), ``keeps_client_state`` (clients keep state across rounds),
      ``syncs_clients`` (gossip after aggregation), ``averages_updates``, ``supports_batch_norm``, ``runs_async``.
    * ``fedmtl.testing.check_algorithm(YourClass)`` runs the contract suite (loop equals vmap, no input mutation,
      determinism, learning on a toy task, checkpoint round trip, NaN exclusion, private release, everything on).
    """

    name: ClassVar[str] = "base"
    needs_adaptation: ClassVar[bool] = False
    #: epochs of training batches personalize() gets when needs_adaptation is True
    adapt_epochs: ClassVar[int] = 1
    keeps_client_state: ClassVar[bool] = False
    #: what the training loss of a round (``metrics.csv``'s ``train_loss``, the progress bar's and lines' ``loss``)
    #: measures, where it is not simply the trained model's loss (Ditto: the global model's)
    loss_label: ClassVar[str] = "loss"
    syncs_clients: ClassVar[bool] = False
    averages_updates: ClassVar[bool] = True  # aggregate() averages client updates (robust aggregators apply)
    #: trains only through ``local_sgd`` with ``Model.value_and_grad`` (or ``train_part``), so a model's batch-norm
    #: running statistics are assigned, never stepped (``fedmtl.batchnorm``); methods with their own update rule or loss
    #: leave it False and refuse models with batch norm
    supports_batch_norm: ClassVar[bool] = False
    #: the clients' ``ClientBatches`` on the stacked executor also carry their first epochs whole (``first``, ``pos``:
    #: per-sample weights read them; FedEM's E-step in ``client_update_clients``)
    stacked_first_epoch: ClassVar[bool] = False
    #: fields of the server state (NamedTuple field names) that are released without noise under ``[privacy]``
    #: because they do not depend on the clients' data, each with the reason (``fedmtl.testing``'s
    #: ``private_release`` check accepts exactly these as equal with and without noise)
    public_server_state: ClassVar[dict[str, str]] = {}

    #: clients send models in the coordinates of the payload and ``aggregate`` combines them (a weighted mean, possibly
    #: with the method's own server rule): the asynchronous modes (``[async]``, ``fedmtl.engine.asynchronous``) can
    #: rebase a stale update on the current payload and mix the method's aggregate into the server
    runs_async: ClassVar[bool] = False

    #: how the contract suite runs it on the toy task (``Toy``)
    toy: ClassVar[Toy] = Toy()

    def __post_init__(self) -> None:
        check_fields(self, "algorithm")  # choices of Literal fields, declared ranges of numeric ones (fedmtl.schema)

    @classmethod
    def clients_form(cls) -> bool:
        """Whether the algorithm has a clients form: the class that wrote the ``client_update`` in use (or a subclass
        of it) also wrote ``client_update_clients``.  A subclass that overrides ``client_update`` without writing
        ``client_update_clients`` again does not inherit the form (it would run the parent's update on the stacked
        executor); the base class's ``client_update_clients`` is none."""
        for klass in cls.__mro__:
            if "client_update_clients" in klass.__dict__:
                return klass is not Algorithm
            if "client_update" in klass.__dict__:
                return False
        return False

    def check_privacy(self) -> None:
        """Refuse ``[privacy]`` (``ValueError``) where this method's server would release something not computed
        from the noised mean alone.  The default allows methods that average updates (``averages_updates``)."""
        if not self.averages_updates:
            raise ValueError(f"[privacy]: {self.name} does not average client updates; user-level DP applies to "
                             "methods whose server averages model updates")

    def check_model(self, model: Model) -> None:
        """Refuse, before any work, a model this method cannot use (body/head methods: a model without a head)."""

    def check_optim(self, opt: SGD) -> None:
        """Refuse (``ValueError``), or warn about, local optimizer settings this method is not made for."""

    def train_epochs(self, local_epochs: int) -> int:
        """Epochs of batches ``client_update`` receives each round (``run.local_epochs``; FedRep adds its head
        epochs)."""
        return local_epochs

    # -- server ---------------------------------------------------------------------------------
    def init_server(self, ctx: Context, params: Params, seed: int) -> ServerT:
        # the default server (one global model): a subclass whose ServerT is not GlobalModel overrides it
        return cast(ServerT, GlobalModel(params))

    def payload(self, server: ServerT) -> Payload:
        """What the server broadcasts (default: the ``params`` field of the server state)."""
        # the default reads a server state with a params field (GlobalModel, or a NamedTuple extending it)
        return cast(GlobalModel, server).params

    def aggregate(self, ctx: Context, server: ServerT, updates: Update, weights: Tensor, clients: Tensor) -> ServerT:
        """``weights`` (K,) are n_k for valid updates and 0 for excluded (NaN/Inf) ones; ``clients`` (K,)
        are the ids of the clients the updates come from.  The default replaces the ``params`` of the
        server state (a NamedTuple) by the weighted mean of the updates and keeps every other field."""
        if nobody(ctx, weights):
            return server
        # as payload(): a NamedTuple server state with a params field; its other fields are kept
        return cast(ServerT, cast(GlobalModel, server)._replace(params=ctx.combine(updates, weights)))

    def update_like(self, ctx: Context, payload: Payload) -> Update:
        """One client's update as far as its structure goes (leaf names, shapes, dtypes): under ``[privacy]`` a round
        in which nobody trained aggregates zero rows of it.  Default: the payload's structure."""
        return payload

    def sync(self, ctx: Context, server: ServerT, clients: ClientT) -> tuple[ServerT, ClientT]:
        """``syncs_clients`` methods: after aggregation, the stacked states of ALL clients (gossip)."""
        return server, clients

    def gossip_edges(self, server: ServerT) -> Tensor | None:
        """``syncs_clients`` methods: the communication graph's edges (E, 2) that ``sync`` mixes over, so that a relay
        (Flower's server-relayed gossip) forwards each client only its neighbours' states; None: every client may
        read every other."""
        return None

    def sync_average(self, server: ServerT, mean_state: ClientT) -> ServerT:
        """``syncs_clients`` methods over Flower (server-relayed gossip): the server state after a ``sync`` whose
        clients' new states average to ``mean_state`` (one client state), computed without the clients' states.
        Only methods whose server keeps nothing but that average can be relayed."""
        raise NotImplementedError(f"{self.name} cannot run as server-relayed gossip over Flower")

    # -- client ---------------------------------------------------------------------------------
    def init_client(self, ctx: Context, server: ServerT) -> ClientT:
        """State one client starts with (unbatched); default: none."""
        # clients that keep nothing: a subclass whose ClientT is not tuple[()] overrides it
        return cast(ClientT, ())

    def init_clients(self, ctx: Context, server: ServerT, ids: Tensor) -> ClientT:
        """Stacked initial states of clients ``ids`` (default: ``init_client`` repeated).  The client store
        calls it lazily, when a client is first read."""
        one = self.init_client(ctx, server)
        stacked: ClientT = T.tmap(lambda x: x.unsqueeze(0).expand(len(ids), *x.shape).clone(), one)
        return stacked

    def draw_orders(self, counts: Tensor, epochs: int, batch_size: int, generator: torch.Generator) -> Orders:
        """The round's batch orders for clients with ``counts`` examples: ``train_epochs`` independent uniform
        permutations each (``epoch_orders``).  Methods that sample their batches otherwise override it (Per-FedAvg)."""
        return epoch_orders(counts, self.train_epochs(epochs), generator)

    def step_budget(self, counts: Tensor, batch_size: int, epochs: int) -> Tensor:
        """(K,) local steps each client's device works through in a round (the systems layer's budget; a
        straggler does a fraction of them): batches per epoch x epochs."""
        return steps_per_epoch(counts, batch_size) * self.train_epochs(epochs)

    def client_update(self, ctx: Context, payload: Payload, state: ClientT, batches: Batches,
                      lr: float) -> tuple[Update, ClientT, Tensor]:
        """One client's round: (its update for the server, its new state, its mean training loss)."""
        raise NotImplementedError

    def client_update_clients(self, ctx: Context, payload: Payload, states: ClientT, batches: ClientBatches,
                              lr: float) -> tuple[Update, ClientT, Tensor]:
        """The clients form: ``client_update`` of K clients at once, the hook the ``stacked`` executor calls instead
        of ``client_update`` (stacked (K, ...) updates, states and (K,) losses).  ``payload`` is the one payload all K
        receive, ``states`` theirs stacked, ``batches`` their ``optim.ClientBatches`` (eager, no torch.func
        transform: each local step runs on the clients still live, ``optim.local_sgd_clients``).  It must equal
        ``client_update`` client by client up to rounding (the contract suite checks stacked against loop).  Written
        only by methods whose update is local SGD of the model and elementwise arithmetic on its results
        (``local_sgd_clients`` on ``ctx.model``; FedEM also its E-step over ``batches.first``): ``clients_form`` says
        whether an algorithm has one, and the stacked executor hands the others to its fallback (vmap or loop)."""
        raise NotImplementedError(f"{self.name} has no clients form (client_update_clients)")

    # -- evaluation -----------------------------------------------------------------------------
    def personalize(self, ctx: Context, payload: Payload, state: ClientT, batches: Batches | None, lr: float,
                    seen: bool) -> EvalState:
        """The state one client predicts with (default: the broadcast global model).  ``lr``: the personalization
        rate, ``optim.lr`` (the schedule's initial value: ``Engine.eval_plan``), for methods that take steps here."""
        return payload

    def predict_log_proba(self, ctx: Context, eval_state: EvalState, x: Tensor) -> Tensor:
        """(n, C) log class probabilities for one client."""
        return ctx.model.log_proba(ctx.model.apply(eval_state, x))



def nobody(ctx: Context, weights: Tensor) -> bool:
    """No valid update to aggregate, and no private release due (``Context.dp_denominator``): keep the server."""
    known = ctx.weights_total
    total = known[1] if known is not None and known[0] is weights else float(weights.sum())
    return total <= 0 and not ctx.private


def scalar_mean(values: Tensor, weights: Tensor) -> Tensor:
    """(float64) sum_k w_k v_k / sum_k w_k of one scalar per update (FedNova's tau_eff, q-FFL's mean h_k); the rows
    with w_k = 0 (excluded: NaN / Inf) stay out, whatever they hold."""
    w = weights.to(torch.float64)  # values may sit on the CPU (a loop runner's step counts) and weights on the device
    v = torch.where(w > 0, values.reshape(-1).to(w.device, torch.float64), torch.zeros_like(w))
    return (v * w).sum() / w.sum()


def check_positive(name: str, value: float, strict: bool = True) -> None:
    if (value <= 0) if strict else (value < 0):
        raise ValueError(f"algorithm.{name} must be {'>' if strict else '>='} 0, got {value}")


def row(stacked: TreeT, i: Tensor) -> TreeT:
    """Entry ``i`` (a 0-d long tensor, vmap-safe) of every leaf of a stacked tree."""
    return T.tmap(lambda m: m.index_select(0, i.reshape(1).to(torch.long)).squeeze(0), stacked)
