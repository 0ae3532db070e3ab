"""``WireGrid``: a ServerApp ``Grid`` whose SuperNodes live in this process, for tests and measurements of the
Flower apps without a SuperLink.  Every message crosses a serialization boundary both ways (Flower's protobuf, as
on the wire: nothing is shared between the server and a node; ``bytes_out`` / ``bytes_in`` count what a SuperLink
would carry, ``bytes_by_type`` the same per message type), then passes through the ClientApp's mods
(``relay_app.secure_mod``) and the handler of its type, with a ``Context`` per node kept across messages as a
SuperNode keeps it; an exception becomes an error reply, as on a SuperNode."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.proto.message_pb2 import Message as ProtoMessage

from . import apps
from .relay_app import secure_mod

Handler = Callable[[Message, Context, str, apps.NodeCache], Message]


def _wire(msg: Message) -> tuple[Message, int]:
    """``msg`` after a round trip through Flower's protobuf, and its size in bytes."""
    data = message_to_proto(msg).SerializeToString()
    return message_from_proto(ProtoMessage.FromString(data)), len(data)


class WireGrid:
    """``nodes``: node id -> node config (e.g. ``{"partition-ids": "0-2"}``).  ``received``: every reply the server
    pulled (what a ServerApp receives); ``pushed``: every message it sent."""

    HANDLERS: dict[str, Handler] = {"query": apps.handle_query, "train": apps.handle_train,
                                    "evaluate": apps.handle_evaluate, "train.pull": apps.handle_pull,
                                    "train.mix": apps.handle_mix}

    def __init__(self, cfg_text: str, nodes: dict[int, dict[str, Any]]):
        self.cfg_text = cfg_text
        self.contexts = {nid: Context(run_id=1, node_id=nid, node_config=dict(nc), state=RecordDict(),
                                      run_config={}) for nid, nc in nodes.items()}
        self.caches = {nid: apps.NodeCache() for nid in nodes}
        self.replies: dict[str, Message] = {}
        self.pushed: list[Message] = []
        self.received: list[Message] = []
        self.bytes_out = self.bytes_in = 0
        self.bytes_by_type: dict[str, int] = {}
        self._count = 0

    @classmethod
    def spread(cls, cfg_text: str, clients: int, nodes: int) -> WireGrid:
        """``clients`` seen clients over ``nodes`` SuperNodes (ids 100, 101, ...) in contiguous blocks."""
        bounds = [i * clients // nodes for i in range(nodes + 1)]
        return cls(cfg_text, {100 + i: {"partition-ids": f"{a}-{b - 1}"}
                              for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))})

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def push_messages(self, messages: Any) -> list[str]:
        ids = []
        for msg in messages:
            self._count += 1
            msg.metadata.__dict__["_message_id"] = f"m{self._count}"  # what the SuperLink does
            self.pushed.append(msg)
            got, size = _wire(msg)
            self.bytes_out += size
            kind = msg.metadata.message_type
            self.bytes_by_type[kind] = self.bytes_by_type.get(kind, 0) + size
            nid = msg.metadata.dst_node_id
            handler = self.HANDLERS[msg.metadata.message_type]

            def call(m: Message, ctx: Context, handler: Handler = handler, nid: int = nid) -> Message:
                return handler(m, ctx, self.cfg_text, self.caches[nid])

            try:
                rep = secure_mod(got, self.contexts[nid], call)
            except Exception as e:  # noqa: BLE001 (a SuperNode turns a failed handler into an error reply)
                rep = Message(Error(1, f"{type(e).__name__}: {e}"), reply_to=got)
            rep, size = _wire(rep)
            self.bytes_in += size
            self.bytes_by_type[kind] += size
            self.replies[msg.metadata.message_id] = rep
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Any) -> list[Message]:
        out = [self.replies.pop(i) for i in list(message_ids) if i in self.replies]
        self.received += out
        return out


@contextmanager
def server_identity(run_id: int = 1) -> Iterator[None]:
    """The identity Flower gives a ServerApp process (a new ``Message`` reads its run, node and task ids), for a
    ServerApp run in this process over a ``WireGrid``; restored at exit."""
    from flwr.supercore.task_identity import TaskIdentity

    names = ("_run_id", "_node_id", "_task_id")
    saved: dict[str, Any] = {n: TaskIdentity.__dict__.get(n) for n in names}
    for n, v in zip(names, (run_id, 0, 1), strict=True):
        setattr(TaskIdentity, n, v)
    try:
        yield
    finally:
        for n, old in saved.items():
            setattr(TaskIdentity, n, old)


__all__ = ["WireGrid", "server_identity"]
