"""ClientApp of a fedmtl Flower app project (``fedmtl flower app`` copies this file into the project as
``fedmtl_app/client_app.py``).

With node config ``fedmtl-worker="/path/worker.sock"`` every message is forwarded to the node's warm worker
(``fedmtl flower worker --socket /path/worker.sock``, started beside the SuperNode as the same user): this module
imports neither torch nor fedmtl, so the process Flower starts for each message costs little more than Flower's
own start.  Without it, the message is handled in this process by ``fedmtl.flower.make_client_app()``'s handlers
(which import torch and build the node's data and model for each message).

The exchange: one Unix-socket connection per message; a frame ``b"FMW1"``, the 8-byte length of a JSON header
(node config, run config), the header, the 8-byte length of the message as Flower's protobuf, the message; the
reply frame holds ``{"ok": true}`` and the reply's content as Flower's protobuf, or ``{"ok": false, "error": ...}``.

Under secure aggregation (``flower.secure_aggregation = true``) this app's ``secure_mod`` runs Flower's SecAgg+
client side here, keeping the node's protocol keys in the run's context state; only the training stage reaches the
worker, whose reply the mod masks before it leaves the node.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.common.serde import message_to_proto, recorddict_from_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

MAGIC = b"FMW1"
MAX_HEADER = 1 << 20
TIMEOUT_S = 3600.0


def secure_mod(msg: Message, context: Context, call_next: Any) -> Message:
    """The ClientApp mod of secure aggregation: a train message of the SecAgg+ protocol (it carries Flower's
    ``secaggplus_configs`` record) goes through Flower's ``secaggplus_mod``, which keeps the node's keys in the
    run's ``context.state`` and masks what the train handler replies; any other message passes as it is."""
    from flwr.client.mod import secaggplus_mod
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    if msg.metadata.message_type == "train" and RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


app = ClientApp(mods=[secure_mod])
_local: list[Any] = []  # the in-process app, built on first use where no worker is configured


def read_exact(conn: socket.socket, n: int, error: type[Exception] = RuntimeError) -> bytes:
    """Exactly ``n`` bytes from ``conn`` (the worker's framing, shared with ``fedmtl.flower.worker``)."""
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(min(n - len(buf), 1 << 22))
        if not chunk:
            raise error(f"the connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _plain(config: Any) -> dict[str, Any]:
    return {str(k): v for k, v in dict(config).items()}


def relay(msg: Message, context: Context) -> Message:
    """``msg`` handled by the worker named in the node config, or here."""
    path = context.node_config.get("fedmtl-worker")
    if not path:
        if not _local:
            from fedmtl.flower import make_client_app

            _local.append(make_client_app())  # no mods: this app's own already ran
        answer: Message = _local[0](message=msg, context=context)
        return answer
    head = json.dumps({"node_config": _plain(context.node_config),
                       "run_config": _plain(context.run_config)}).encode()
    body = message_to_proto(msg).SerializeToString()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(TIMEOUT_S)
        try:
            conn.connect(str(path))
        except OSError as e:
            raise RuntimeError(f"fedmtl worker at {path} is not reachable ({e}): start it beside the SuperNode with "
                               f"fedmtl flower worker --socket {path}") from None
        conn.sendall(MAGIC + struct.pack("<Q", len(head)) + head + struct.pack("<Q", len(body)))
        conn.sendall(body)
        if read_exact(conn, 4) != MAGIC:
            raise RuntimeError(f"{path}: not a fedmtl worker")
        (n,) = struct.unpack("<Q", read_exact(conn, 8))
        if n > MAX_HEADER:
            raise RuntimeError(f"{path}: a reply header of {n} bytes")
        reply = json.loads(read_exact(conn, n))
        (m,) = struct.unpack("<Q", read_exact(conn, 8))
        content = read_exact(conn, m)
    if not reply.get("ok"):
        raise RuntimeError(f"fedmtl worker at {path}: {reply.get('error', 'failed')}")
    return Message(recorddict_from_proto(ProtoRecordDict.FromString(content)), reply_to=msg)


@app.query()
def _query(msg: Message, context: Context) -> Message:
    return relay(msg, context)


@app.train()
def _train(msg: Message, context: Context) -> Message:
    return relay(msg, context)


@app.evaluate()
def _evaluate(msg: Message, context: Context) -> Message:
    return relay(msg, context)


@app.train("pull")
def _pull(msg: Message, context: Context) -> Message:
    return relay(msg, context)


@app.train("mix")
def _mix(msg: Message, context: Context) -> Message:
    return relay(msg, context)
