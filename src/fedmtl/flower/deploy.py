"""Deployment helpers: TLS certificates and SuperNode key pairs written with ``cryptography``, and
``LocalDeployment``, a real SuperLink and SuperNodes on this machine as processes it owns, started with the
arguments DEPLOY.md gives an operator (``superlink_args``, ``supernode_args``: the SuperLink listening on every
interface, each SuperNode with a Runtime API port of its own).

``make_certificates(dir, ca_dir)`` writes a self-signed CA and a server certificate for the SuperLink valid
for 127.0.0.1 / localhost (or the given hosts): ``dir`` gets ``ca.crt`` (the only file every node receives),
``server.pem`` and ``server.key`` (the SuperLink's); the CA's private key goes to ``ca_dir`` (default: a
sibling ``<dir>-ca``), apart from everything that is copied to any machine.  ``make_node_keys(dir, n)``
writes n elliptic-curve (NIST P-384) key pairs in OpenSSH format (as ``ssh-keygen -t ecdsa -b 384`` writes
them): what ``flower-supernode --auth-supernode-private-key`` and ``flwr supernode register`` read.  Every
private key is written 0600 (and its directory 0700) through a unique temporary name.

``LocalDeployment`` waits for readiness by polling (every ``poll`` seconds up to ``ready_timeout``, default
300 s or ``FEDMTL_DEPLOY_TIMEOUT``) rather than trusting one short timeout, and ends every process it started,
with their descendants, by process group and process id (never by name), on every way out of its ``with``
block: success, exception, failed readiness, ``KeyboardInterrupt``.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from ..runs.rundir import alive


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, data: bytes, private: bool = False) -> None:
    """Write ``data`` atomically; a private key 0600 from its first byte (never world-readable, not even briefly)."""
    from ..files import atomic

    with atomic(path, "wb", private=private) as fh:
        fh.write(data)


def _private_dir(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    return d


def make_certificates(out: str | Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"), days: int = 30,
                      ca_dir: str | Path | None = None) -> Path:
    out = Path(out)
    _private_dir(out)  # holds server.key
    ca_home = _private_dir(Path(ca_dir) if ca_dir is not None else out.with_name(out.name + "-ca"))
    now = dt.datetime.now(dt.UTC)
    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ca = (x509.CertificateBuilder().subject_name(_name("fedmtl-ca")).issuer_name(_name("fedmtl-ca"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    cert = (x509.CertificateBuilder().subject_name(_name(hosts[0])).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    nopass = serialization.NoEncryption()
    _write(ca_home / "ca.key", ca_key.private_bytes(pem, serialization.PrivateFormat.TraditionalOpenSSL, nopass),
           private=True)
    _write(out / "ca.crt", ca.public_bytes(pem))
    _write(out / "server.pem", cert.public_bytes(pem))
    _write(out / "server.key", key.private_bytes(pem, serialization.PrivateFormat.TraditionalOpenSSL, nopass),
           private=True)
    return out


def make_node_keys(out: str | Path, n: int, prefix: str = "node") -> list[tuple[Path, Path]]:
    out = _private_dir(Path(out))
    pairs = []
    for i in range(n):
        key = ec.generate_private_key(ec.SECP384R1())
        priv, pub = out / f"{prefix}{i}", out / f"{prefix}{i}.pub"
        _write(priv, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                       serialization.NoEncryption()), private=True)
        _write(pub, key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH))
        pairs.append((priv, pub))
    return pairs


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def superlink_args(certs: Path, port: int, database: Path, host: str = "0.0.0.0") -> list[str]:
    """``flower-superlink``'s arguments for a deployment (what DEPLOY.md tells an operator to run): TLS from
    ``certs`` (``ca.crt``, ``server.pem``, ``server.key``), SuperNode authentication, the registered nodes kept in
    ``database`` across restarts, listening on ``host:port`` (``0.0.0.0``: every interface, so that sites on other
    machines can connect; Flower's default, 127.0.0.1, accepts this machine only)."""
    return ["--ssl-ca-certfile", str(certs / "ca.crt"), "--ssl-certfile", str(certs / "server.pem"),
            "--ssl-keyfile", str(certs / "server.key"), "--enable-supernode-auth", "--host", host, "--port", str(port),
            "--database", str(database), "--disable-runtime-dependency-installation"]


def supernode_args(superlink: str, ca: Path, key: Path, node_config: str, port: int) -> list[str]:
    """``flower-supernode``'s arguments: dial ``superlink`` (host:port) over TLS trusting ``ca``, authenticate with
    the private ``key``, serve ``node_config``; ``port`` is the node's own local Runtime API (127.0.0.1), which
    every SuperNode on one machine needs distinct (Flower's default 9094 lets only one start)."""
    return ["--superlink", superlink, "--root-certificates", str(ca), "--auth-supernode-private-key", str(key),
            "--node-config", node_config, "--port", str(port)]


# ---------------------------------------------------------------------------------------------- processes
def _proc_stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, parent pid, session id, start time in clock ticks) of a Linux process; None if it is gone (or
    there is no ``/proc``)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        rest = text[text.rindex(")") + 2 :].split()  # the fields after the command name (which may hold spaces)
        return rest[0], int(rest[1]), int(rest[3]), int(rest[19])
    except (OSError, ValueError, IndexError):
        return None


def _process_table() -> dict[int, tuple[str, int, int, int]]:
    """pid -> ``_proc_stat`` of every process (empty where there is no ``/proc``)."""
    out: dict[int, tuple[str, int, int, int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if name.isdigit() and (st := _proc_stat(int(name))) is not None:
            out[int(name)] = st
    return out


def running(pid: int, start: int | None = None) -> bool:
    """Whether process ``pid`` runs (exists and is not a zombie); with ``start`` (its start time, from
    ``/proc``), whether it is still that process and not a later one that reuses the number."""
    st = _proc_stat(pid)
    if st is None:  # gone, or no /proc: ask the kernel
        return not Path("/proc/self/stat").exists() and alive(pid)
    return st[0] not in ("Z", "X") and (start is None or st[3] == start)


def _signal_pid(pid: int, start: int | None, sig: int) -> None:
    """Send ``sig`` to ``pid`` if it is still the process first seen (same start time)."""
    if running(pid, start):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _exists(path: Path) -> Callable[[float], bool]:
    """A readiness check: ``path`` exists (a worker's socket once it listens)."""
    return lambda _: path.exists()


class LocalDeployment:
    """A real SuperLink (TLS, SuperNode authentication) and SuperNodes on 127.0.0.1, as processes.

    ``with LocalDeployment(workdir, partitions=[[0], [1]]) as dep: dep.wait_for_nodes(2); dep.run(app_dir,
    out_dir)`` registers one key per SuperNode, starts the nodes (node i serves ``partitions[i]`` of the
    config's federation, or, with ``data_dirs``, the clients whose ``.npz`` files are in ``data_dirs[i]``),
    launches ``flwr run`` and stops every process at exit.  ``workers=True`` starts beside every node its warm
    worker (``fedmtl flower worker``) and names its socket in the node config.  ``start_unregistered_node()``
    starts a node whose key was never registered (the SuperLink must refuse it).  Executables come from the
    running interpreter's environment.

    Readiness (the SuperLink answering ``flwr supernode ls``, nodes online) is polled every ``poll`` seconds up
    to ``ready_timeout`` seconds overall (default ``FEDMTL_DEPLOY_TIMEOUT`` or 300), each ``flwr`` call allowed
    what is left of that time; a SuperLink or SuperNode that exits meanwhile ends the wait at once, naming its
    log.  A ``flwr`` call is a Python process of its own (about a second of CPU), so it is made only once the
    cheap signs hold: the SuperLink's port accepts connections, the nodes' logs show the id the SuperLink gave
    them (and every tenth poll regardless).  The workers start together, while the SuperLink comes up.  The
    deployment owns its processes: each starts in a session (process group) of its own, and
    ``stop()`` (run by ``__exit__``, and by ``__enter__`` when starting fails) sends SIGTERM to those groups and
    to every descendant (found through ``/proc``, even in a session of its own, e.g. the SuperLink's SuperExec,
    and recognized by its start time so that a reused pid is never signalled), then SIGKILL to what is left
    after ``grace`` seconds, and reaps them.  ``started`` lists every pid it started (kept after ``stop``);
    ``pids()`` those of its processes and their descendants that run now.
    """

    def __init__(self, workdir: str | Path, partitions: list[list[int]] | None = None,
                 data_dirs: list[str | Path] | None = None, ready_timeout: float | None = None,
                 poll: float = 1.0, grace: float = 10.0, workers: bool = False, host: str = "0.0.0.0"):
        if (partitions is None) == (data_dirs is None):
            raise ValueError("give the nodes either partitions (of the config's federation) or data_dirs")
        if ready_timeout is None:
            env = os.environ.get("FEDMTL_DEPLOY_TIMEOUT", "300")
            try:
                ready_timeout = float(env)
            except ValueError:
                raise ValueError(f"FEDMTL_DEPLOY_TIMEOUT={env!r}: expected a number of seconds") from None
        if not ready_timeout > 0 or not poll > 0 or grace < 0:
            raise ValueError(f"ready_timeout ({ready_timeout}) and poll ({poll}) must be > 0, grace ({grace}) >= 0")
        self.dir = Path(workdir)
        self.node_configs = ([f'data-dir="{Path(d).resolve()}"' for d in data_dirs] if data_dirs is not None else
                             [f'partition-ids="{",".join(str(k) for k in p)}"' for p in partitions or []])
        self.partitions = partitions
        self.host = host  # the SuperLink listens here: every interface, as a real deployment (nodes dial 127.0.0.1)
        self.commands: dict[str, list[str]] = {}  # process name -> the command it was started with
        self.workers = workers  # a warm worker beside every SuperNode (fedmtl flower worker, node config fedmtl-worker)
        self.ready_timeout, self.poll, self.grace = float(ready_timeout), float(poll), float(grace)
        self.bin = Path(sys.executable).parent
        self.port = free_port()
        self.env = {**os.environ, "FLWR_HOME": str(self.dir / "flwr-home"),
                    "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}"}
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.started: list[int] = []
        self._logs: list[IO[str]] = []
        self._seen: dict[int, int] = {}  # pid -> start time of every descendant seen so far
        self._may_exit: set[str] = {"unregistered"}  # processes expected to end on their own

    # -------------------------------------------------------------------------------- processes
    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        """Start ``args`` in a session of its own (so ``stop`` ends it with what it spawns), logging to
        ``<workdir>/<name>.log``."""
        log = open(self.dir / f"{name}.log", "w")  # noqa: SIM115 (closed in stop)
        self._logs.append(log)
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.dir,
                             start_new_session=True)
        self.commands[name] = args
        self.procs.append((name, p))
        self.started.append(p.pid)
        return p

    def _cli(self, *args: str, timeout: float = 120) -> str:
        """``flwr ARGS`` to completion (its stdout); a failure is a ``RuntimeError``, a call that outlives
        ``timeout`` seconds a ``TimeoutError``.  The call runs in a session of its own, killed on every way
        out that leaves it running (timeout, ``KeyboardInterrupt``)."""
        p = subprocess.Popen([str(self.bin / "flwr"), *args], env=self.env, cwd=self.dir, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"flwr {' '.join(args)} did not finish within {timeout:.0f} s") from None
        finally:
            if p.returncode is None:  # not reaped yet: its group id cannot have been reused
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        if p.returncode != 0:
            raise RuntimeError(f"flwr {' '.join(args)} failed ({p.returncode}): {out[-2000:]}{err[-2000:]}")
        return out

    def _check_alive(self) -> None:
        """A SuperLink or SuperNode that has exited is an error naming its log."""
        for name, p in self.procs:
            if name not in self._may_exit and p.poll() is not None:
                raise RuntimeError(f"the {name} process exited with code {p.returncode}; see "
                                   f"{self.dir / (name + '.log')}")

    def _wait(self, what: str, ready: Callable[[float], bool], timeout: float | None = None) -> None:
        """Poll ``ready(seconds_left)`` every ``poll`` seconds until it holds (a ``RuntimeError`` or
        ``TimeoutError`` from it counts as "not yet"), for at most ``timeout`` (``ready_timeout``) seconds
        overall; then a one-line ``TimeoutError`` naming ``what``, the deadline and the last error."""
        limit = self.ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        last = ""
        while True:
            self._check_alive()
            try:
                if ready(max(deadline - time.monotonic(), 1.0)):
                    return
                last = ""
            except (RuntimeError, TimeoutError) as e:
                last = " ".join(str(e).split())[:300]
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{what} not ready after {limit:g} s (logs in {self.dir})"
                                   + (f"; last error: {last}" if last else ""))
            time.sleep(min(self.poll, left))

    def __enter__(self) -> LocalDeployment:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        certs = make_certificates(self.dir / "certs")
        self.keys = make_node_keys(self.dir / "keys", len(self.node_configs) + 1)
        home = self.dir / "flwr-home"
        home.mkdir(exist_ok=True)
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "deployment"\n\n[superlink.deployment]\naddress = "127.0.0.1:{self.port}"\n'
            f'root-certificates = "{certs / "ca.crt"}"\n')
        self._spawn("superlink", [str(self.bin / "flower-superlink"), *superlink_args(
            certs, self.port, self.dir / "superlink.db", self.host)])
        # the workers start together, while the SuperLink comes up: each one's start (torch's import) overlaps the rest
        socks = [self.dir / f"worker{i}" / "worker.sock" for i in range(len(self.node_configs))]
        if self.workers:
            for i, sock in enumerate(socks):
                _private_dir(sock.parent)
                self._spawn(f"worker{i}", [sys.executable, "-m", "fedmtl", "flower", "worker", "--socket", str(sock)])
        self._wait("the SuperLink", self._link_ready)
        for i in range(len(self.node_configs)):
            self._cli("supernode", "register", str(self.keys[i][1]), "deployment",
                      timeout=max(self.ready_timeout, 120))
        for i, (node_config, sock) in enumerate(zip(self.node_configs, socks, strict=True)):
            if self.workers:
                self._wait(f"worker {i}", _exists(sock))
                node_config = f'{node_config} fedmtl-worker="{sock}"'
            self._spawn(f"supernode{i}", [str(self.bin / "flower-supernode"), *supernode_args(
                f"127.0.0.1:{self.port}", certs / "ca.crt", self.keys[i][0], node_config, free_port())])

    def _link_ready(self, left: float) -> bool:
        """The SuperLink answers ``flwr supernode ls`` (TLS up, its database open) within ``left`` seconds.  Each
        ``flwr`` call is a Python process (a second of CPU): it is made once the link's port accepts connections."""
        if not self._port_open():
            raise RuntimeError(f"nothing accepts connections on the SuperLink's port 127.0.0.1:{self.port} yet")
        self._cli("supernode", "ls", "deployment", timeout=left)
        return True

    def _port_open(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1.0).close()
        except OSError:
            return False
        return True

    def start_unregistered_node(self) -> subprocess.Popen[bytes]:
        """A SuperNode whose key was never registered (it gives up after 3 tries; the SuperLink refuses it)."""
        return self._spawn("unregistered", [str(self.bin / "flower-supernode"), *supernode_args(
            f"127.0.0.1:{self.port}", self.dir / "certs" / "ca.crt", self.keys[-1][0], 'partition-ids="0"',
            free_port()), "--max-retries", "3", "--max-wait-time", "30"])

    def online_nodes(self, timeout: float | None = None) -> int:
        """How many SuperNodes the SuperLink lists as online now."""
        return self._cli("supernode", "ls", "deployment",
                         timeout=max(self.ready_timeout, 120) if timeout is None else timeout).count("online")

    def wait_for_nodes(self, n: int | None = None, timeout: float | None = None) -> None:
        """Poll until ``n`` (default: every started) SuperNodes are online, for at most ``timeout``
        (``ready_timeout``) seconds; a ``TimeoutError`` after that."""
        want = len(self.node_configs) if n is None else n
        polls = itertools.count()

        def ready(left: float) -> bool:
            # the authoritative count (``flwr supernode ls``, a process of its own) once as many nodes' logs show the
            # id the SuperLink gave them, and every tenth poll whatever the logs say
            if self._nodes_logged() < want and next(polls) % 10:
                return False
            return self.online_nodes(left) >= want

        self._wait(f"{want} SuperNode(s) online", ready, timeout)

    def _nodes_logged(self) -> int:
        """How many started SuperNodes' logs show the node id the SuperLink gave them (Flower's "SuperNode ID")."""
        n = 0
        for i in range(len(self.node_configs)):
            try:
                n += "SuperNode ID" in (self.dir / f"supernode{i}.log").read_text(errors="replace")
            except OSError:
                pass
        return n

    def run(self, app_dir: str | Path, out_dir: str | Path, timeout: float = 900) -> str:
        """``flwr run`` the app (streaming its log) and wait for it; returns the log."""
        return self._cli("run", str(app_dir), "deployment", "--stream", "--run-config",
                         f"fedmtl-out='{Path(out_dir).resolve()}' fedmtl-num-nodes={len(self.node_configs)}",
                         timeout=timeout)

    def _descendants(self) -> dict[int, int]:
        """pid -> start time of the running descendants of the started processes and the members of their
        sessions (a descendant that starts a session of its own is found through its parent; one whose parent
        has already gone, through its session), added to those seen before."""
        table = _process_table()
        # a session id is never reused while the session has members; a pid may be once it has been reaped,
        # so only processes not reaped yet are parents to look under
        sessions = {p.pid for _, p in self.procs}
        roots = {p.pid for _, p in self.procs if p.returncode is None}
        children: dict[int, list[int]] = {}
        for pid, (_, ppid, _, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        found = {pid for pid, (_, _, sid, _) in table.items() if sid in sessions} - sessions
        todo = list(roots | found)
        while todo:
            for c in children.get(todo.pop(), []):
                if c not in found and c not in sessions:
                    found.add(c)
                    todo.append(c)
        for pid in found:  # a descendant now: this process, whatever an earlier one of that number was
            self._seen[pid] = table[pid][3]
        return {pid: start for pid, start in self._seen.items() if running(pid, start)}

    def pids(self) -> list[int]:
        """The pids of this deployment's processes and their descendants that run now."""
        own = [p.pid for _, p in self.procs if p.poll() is None]
        return sorted(set(own) | set(self._descendants()))

    def _signal_all(self, sig: int) -> None:
        for _, p in self.procs:
            if p.poll() is None:  # not reaped: p.pid is still its group's id
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        for pid, start in self._descendants().items():
            _signal_pid(pid, start, sig)

    def stop(self) -> None:
        """End every process this deployment started, with their descendants (by process group and pid, never
        by name): SIGTERM, up to ``grace`` seconds to exit, then SIGKILL, whatever interrupts the wait."""
        try:
            self._descendants()  # remember the tree while its parents still run
            self._signal_all(signal.SIGTERM)
            deadline = time.monotonic() + self.grace
            while time.monotonic() < deadline and self.pids():
                time.sleep(0.1)
        finally:
            try:
                self._signal_all(signal.SIGKILL)
                for _, p in self.procs:
                    try:
                        p.wait(10)
                    except subprocess.TimeoutExpired:  # unkillable (uninterruptible sleep): leave it
                        pass
                deadline = time.monotonic() + 5
                while self._descendants() and time.monotonic() < deadline:  # reparented ones: init reaps them
                    time.sleep(0.05)
            finally:
                self.procs.clear()
                self._seen.clear()
                for log in self._logs:
                    log.close()
                self._logs.clear()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
