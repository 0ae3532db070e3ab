"""A warm node-local worker beside a SuperNode: ``fedmtl flower worker --socket PATH``.

Flower (1.41, 1.42) starts a ClientApp process for every message a SuperNode receives (its ``subprocess`` and
``process`` isolation modes both run one task per process): each message pays an interpreter start, the import of
torch and fedmtl, and the node's data and model built again (seconds).  The worker does that once.  It runs
beside the SuperNode, as the same user, and serves the fedmtl ClientApp's handlers (``fedmtl.flower.apps``:
query, train, evaluate, gossip) over a Unix socket; the project's ClientApp (``relay_app``, written by
``fedmtl flower app``) imports neither torch nor fedmtl and only forwards each message to it when the node config
names the socket (``fedmtl-worker="/path/worker.sock"``), else runs the handlers itself as before.

**Who may connect.**  The socket is created in a directory only its user can enter (0700) with mode 0600, and
every connection's peer credentials (``SO_PEERCRED``) must show the worker's own user id: only processes of the
node's user reach it.  Requests are framed (magic, lengths checked against limits) and hold Flower's own protobuf
messages (``flwr.common.serde``): nothing is unpickled.

**State.**  The worker keeps one Flower ``Context`` and one ``NodeCache`` per run id (the two most recent runs):
the node's data, model and client store stay warm within a run, its ``context.state`` too, and a new run (a
resumed server is a new run) starts from the node's state files as a fresh ClientApp process would.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flwr.app import Context, Message, RecordDict
from flwr.common.serde import message_from_proto, recorddict_to_proto
from flwr.proto.message_pb2 import Message as ProtoMessage

from .apps import NodeCache, RunCaches, handle_evaluate, handle_mix, handle_pull, handle_query, handle_train
from .relay_app import MAGIC, MAX_HEADER, read_exact

log = logging.getLogger("fedmtl")

#: frame: MAGIC, 8-byte header length, JSON header, 8-byte body length, body (a protobuf message); the ClientApp
#: side (``relay_app``) defines MAGIC, MAX_HEADER and the reading of exact lengths
MAX_BODY = 1 << 34

HANDLERS: dict[str, Callable[[Message, Context, str, NodeCache], Message]] = {
    "query": handle_query, "train": handle_train, "evaluate": handle_evaluate, "train.pull": handle_pull,
    "train.mix": handle_mix,
}


class WorkerError(RuntimeError):
    """A request the worker cannot serve (malformed frame, unknown message type, another user)."""


class SocketRefused(WorkerError, ValueError):
    """A socket path the worker will not serve on, found before it serves (``fedmtl flower worker``: one line,
    exit 2)."""


#: the longest path a Unix socket address holds on Linux (sun_path, less its terminating NUL)
MAX_SOCKET_PATH = 107


def _short(path: Path | str, n: int = 80) -> str:
    text = str(path)
    return text if len(text) <= n else "..." + text[-(n - 3):]


def _read_exact(conn: socket.socket, n: int) -> bytes:
    return read_exact(conn, n, WorkerError)


def send_frame(conn: socket.socket, header: dict[str, Any], body: bytes) -> None:
    head = json.dumps(header).encode()
    conn.sendall(MAGIC + struct.pack("<Q", len(head)) + head + struct.pack("<Q", len(body)))
    conn.sendall(body)


def recv_frame(conn: socket.socket, max_body: int = MAX_BODY) -> tuple[dict[str, Any], bytes]:
    if _read_exact(conn, 4) != MAGIC:
        raise WorkerError("not a fedmtl worker frame")
    (n,) = struct.unpack("<Q", _read_exact(conn, 8))
    if n > MAX_HEADER:
        raise WorkerError(f"header of {n} bytes (at most {MAX_HEADER})")
    try:
        header = json.loads(_read_exact(conn, n))
    except ValueError as e:
        raise WorkerError(f"malformed header ({e})") from None
    if not isinstance(header, dict):
        raise WorkerError("malformed header (not an object)")
    (m,) = struct.unpack("<Q", _read_exact(conn, 8))
    if m > max_body:
        raise WorkerError(f"body of {m} bytes (at most {max_body})")
    return header, _read_exact(conn, m)


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, uid, _ = struct.unpack("3i", creds)
    return int(uid)


class Worker:
    """Serves the ClientApp's handlers on ``socket_path`` (see the module docstring)."""

    def __init__(self, socket_path: str | Path, keep_runs: int = 2):
        self.path = Path(socket_path)
        self.keep_runs = keep_runs
        self.contexts: OrderedDict[int, Context] = OrderedDict()
        self.runs = RunCaches(keep_runs)
        self.lock = threading.Lock()
        self.served = 0
        self.last = ""  # the last message served: "TYPE (run R)"

    def bind(self) -> socket.socket:
        """The listening socket: its directory made 0700 if new and refused if others may enter it, the socket
        0600; a stale socket file of a dead worker is replaced; a live socket, a symbolic link, any other file there
        or a path too long for a Unix socket is refused (``SocketRefused``) before anything is served."""
        d, shown = self.path.parent, _short(self.path)
        if len(os.fsencode(self.path)) > MAX_SOCKET_PATH:
            raise SocketRefused(f"{shown}: a Unix socket path holds at most {MAX_SOCKET_PATH} bytes; this one has "
                                f"{len(os.fsencode(self.path))} (choose a shorter one)")
        try:
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
            st = d.stat()
        except OSError as e:
            raise SocketRefused(f"{shown}: cannot make its directory ({e.strerror or e})") from None
        if not stat.S_ISDIR(st.st_mode):
            raise SocketRefused(f"{shown}: its directory is not a directory")
        if st.st_uid != os.getuid() or st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SocketRefused(f"{shown}: the socket's directory must belong to this user and be closed to others "
                                f"(chmod 700 {_short(d)}); it is {stat.filemode(st.st_mode)}")
        if self.path.is_symlink():
            raise SocketRefused(f"{shown}: is a symbolic link; refusing to follow or replace it")
        if self.path.exists():
            if not stat.S_ISSOCK(self.path.lstat().st_mode):
                raise SocketRefused(f"{shown}: exists and is not a socket; refusing to replace it")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(self.path))
            except (ConnectionRefusedError, FileNotFoundError):
                self.path.unlink(missing_ok=True)  # a dead worker's socket
            except OSError as e:
                raise SocketRefused(f"{shown}: cannot check the socket there ({e.strerror or e})") from None
            else:
                raise SocketRefused(f"{shown}: another worker is listening there")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(str(self.path))
            os.chmod(self.path, 0o600)
            sock.listen(8)
        except OSError as e:
            sock.close()
            raise SocketRefused(f"{shown}: cannot listen there ({e.strerror or e})") from None
        finally:
            os.umask(old)
        return sock

    def serve(self, stop: threading.Event | None = None, ready: Callable[[], None] | None = None,
              sock: socket.socket | None = None) -> None:
        """Accept connections until ``stop`` is set (or forever) on ``sock`` (the one ``bind`` returned; None:
        bind now); one request per connection."""
        sock = self.bind() if sock is None else sock
        sock.settimeout(0.5)
        if ready is not None:
            ready()
        try:
            while stop is None or not stop.is_set():
                try:
                    conn, _ = sock.accept()
                except TimeoutError:
                    continue
                threading.Thread(target=self._serve_one, args=(conn,), daemon=True).start()
        finally:
            sock.close()
            self.path.unlink(missing_ok=True)

    def _serve_one(self, conn: socket.socket) -> None:
        with conn:
            try:
                if _peer_uid(conn) != os.getuid():
                    raise WorkerError("a process of another user connected; refused")
                header, body = recv_frame(conn)
                with self.lock:  # one message at a time, as a SuperNode runs them
                    t0 = time.perf_counter()
                    reply = self.handle(header, body)
                    dt = time.perf_counter() - t0
                send_frame(conn, {"ok": True}, reply)
                print(f"served {self.last} in {dt:.3f} s", flush=True)  # the operator's log, one line a message
            except Exception as e:  # noqa: BLE001 (the reason goes back to the ClientApp, which raises it)
                log.warning("fedmtl worker: %s: %s", type(e).__name__, e)
                try:
                    send_frame(conn, {"ok": False, "error": f"{type(e).__name__}: {' '.join(str(e).split())[:2000]}"},
                               b"")
                except OSError:
                    pass

    def _context(self, run_id: int, node_id: int, node_config: dict[str, Any], run_config: dict[str, Any]) -> tuple[
            Context, NodeCache]:
        if run_id not in self.contexts:
            self.contexts[run_id] = Context(run_id=run_id, node_id=node_id, node_config=node_config,
                                            state=RecordDict(), run_config=run_config)
            while len(self.contexts) > self.keep_runs:
                self.contexts.popitem(last=False)
        self.contexts.move_to_end(run_id)
        return self.contexts[run_id], self.runs.of(run_id)

    def handle(self, header: dict[str, Any], body: bytes) -> bytes:
        """One message (``header``: node and run config; ``body``: the message as Flower's protobuf) -> the reply's
        content as Flower's protobuf."""
        try:
            msg = message_from_proto(ProtoMessage.FromString(body))
        except Exception as e:
            raise WorkerError(f"the message is not a Flower message ({type(e).__name__})") from None
        kind = msg.metadata.message_type
        if kind not in HANDLERS:
            raise WorkerError(f"no handler for message type {kind!r}")
        node_config, run_config = header.get("node_config"), header.get("run_config")
        if not isinstance(node_config, dict) or not isinstance(run_config, dict):
            raise WorkerError("the header holds no node_config / run_config objects")
        if not isinstance(run_config.get("fedmtl-config"), str):
            raise WorkerError("the run config has no fedmtl-config (the experiment's TOML)")
        context, nodes = self._context(int(msg.metadata.run_id), int(msg.metadata.dst_node_id), node_config,
                                       run_config)
        reply = HANDLERS[kind](msg, context, str(run_config["fedmtl-config"]), nodes)
        self.served += 1
        self.last = f"{kind} (run {msg.metadata.run_id})"
        return recorddict_to_proto(reply.content).SerializeToString()
