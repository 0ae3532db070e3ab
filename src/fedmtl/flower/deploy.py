"""Deployment helpers: TLS certificates and SuperNode key pairs written with ``cryptography``.

``make_certificates(dir, ca_dir)`` writes a self-signed CA and a server certificate for the SuperLink valid
for 127.0.0.1 / localhost (or the given hosts): ``dir`` gets ``ca.crt`` (the only file every node receives),
``server.pem`` and ``server.key`` (the SuperLink's); the CA's private key goes to ``ca_dir`` (default: a
sibling ``<dir>-ca``), apart from everything that is copied to any machine.  ``make_node_keys(dir, n)``
writes n elliptic-curve (NIST P-384) key pairs in OpenSSH format (as ``ssh-keygen -t ecdsa -b 384`` writes
them): what ``flower-supernode --auth-supernode-private-key`` and ``flwr supernode register`` read.  Every
private key is written 0600 (and its directory 0700) through a unique temporary name.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, data: bytes, private: bool = False) -> None:
    """Write ``data`` atomically; a private key 0600 from its first byte (never world-readable, not even briefly)."""
    from ..report import atomic

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
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalDeployment:
    """A real SuperLink (TLS, SuperNode authentication) and SuperNodes on 127.0.0.1, as processes.

    ``with LocalDeployment(workdir, partitions=[[0], [1]]) as dep: dep.run(app_dir, out_dir)`` registers one
    key per SuperNode, starts the nodes (node i serves ``partitions[i]`` of the config's federation, or, with
    ``data_dirs``, the clients whose ``.npz`` files are in ``data_dirs[i]``), launches ``flwr run`` and stops
    every process at exit (by the process groups it started).  ``start_unregistered_node()`` starts a node
    whose key was never registered (the SuperLink must refuse it).  Executables come from the running
    interpreter's environment.
    """

    def __init__(self, workdir: str | Path, partitions: list[list[int]] | None = None,
                 data_dirs: list[str | Path] | None = None):
        import sys

        if (partitions is None) == (data_dirs is None):
            raise ValueError("give the nodes either partitions (of the config's federation) or data_dirs")
        self.dir = Path(workdir)
        self.node_configs = ([f'data-dir="{Path(d).resolve()}"' for d in data_dirs] if data_dirs is not None else
                             [f'partition-ids="{",".join(str(k) for k in p)}"' for p in partitions or []])
        self.partitions = partitions
        self.bin = Path(sys.executable).parent
        self.port = free_port()
        self.env = {**os.environ, "FLWR_HOME": str(self.dir / "flwr-home"),
                    "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}"}
        self.procs: list[tuple[str, object]] = []

    # -------------------------------------------------------------------------------- processes
    def _spawn(self, name: str, args: list[str]) -> object:
        import subprocess

        log = open(self.dir / f"{name}.log", "w")  # noqa: SIM115 (closed in stop)
        # its own process group, so that stop() ends it and the ServerApp / ClientApp processes it spawns
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.dir,
                             start_new_session=True)
        self.procs.append((name, p))
        return p

    def _cli(self, *args: str, timeout: float = 120) -> str:
        import subprocess

        r = subprocess.run([str(self.bin / "flwr"), *args], env=self.env, cwd=self.dir, capture_output=True,
                           text=True, timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"flwr {' '.join(args)} failed ({r.returncode}): {r.stdout[-2000:]}{r.stderr[-2000:]}")
        return r.stdout

    def __enter__(self) -> LocalDeployment:
        import time

        self.dir.mkdir(parents=True, exist_ok=True)
        certs = make_certificates(self.dir / "certs")
        self.keys = make_node_keys(self.dir / "keys", len(self.node_configs) + 1)
        home = self.dir / "flwr-home"
        home.mkdir(exist_ok=True)
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "deployment"\n\n[superlink.deployment]\naddress = "127.0.0.1:{self.port}"\n'
            f'root-certificates = "{certs / "ca.crt"}"\n')
        self._spawn("superlink", [
            str(self.bin / "flower-superlink"), "--ssl-ca-certfile", str(certs / "ca.crt"),
            "--ssl-certfile", str(certs / "server.pem"), "--ssl-keyfile", str(certs / "server.key"),
            "--enable-supernode-auth", "--host", "127.0.0.1", "--port", str(self.port),
            "--database", str(self.dir / "superlink.db"), "--disable-runtime-dependency-installation"])
        deadline = time.time() + 90
        while True:
            try:
                self._cli("supernode", "ls", "deployment", timeout=30)
                break
            except RuntimeError:
                if time.time() > deadline:
                    self.stop()
                    raise
                time.sleep(1)
        for i, node_config in enumerate(self.node_configs):
            self._cli("supernode", "register", str(self.keys[i][1]), "deployment")
            self._spawn(f"supernode{i}", [
                str(self.bin / "flower-supernode"), "--superlink", f"127.0.0.1:{self.port}",
                "--root-certificates", str(certs / "ca.crt"), "--auth-supernode-private-key", str(self.keys[i][0]),
                "--node-config", node_config, "--host", "127.0.0.1", "--port", str(free_port())])
        return self

    def start_unregistered_node(self) -> object:
        return self._spawn("unregistered", [
            str(self.bin / "flower-supernode"), "--superlink", f"127.0.0.1:{self.port}",
            "--root-certificates", str(self.dir / "certs" / "ca.crt"),
            "--auth-supernode-private-key", str(self.keys[-1][0]), "--node-config", 'partition-ids="0"',
            "--host", "127.0.0.1", "--port", str(free_port()), "--max-retries", "3", "--max-wait-time", "30"])

    def online_nodes(self) -> int:
        return self._cli("supernode", "ls", "deployment").count("online")

    def run(self, app_dir: str | Path, out_dir: str | Path, timeout: float = 900) -> str:
        """``flwr run`` the app (streaming its log) and wait for it; returns the log."""
        return self._cli("run", str(app_dir), "deployment", "--stream", "--run-config",
                         f"fedmtl-out='{Path(out_dir).resolve()}' fedmtl-num-nodes={len(self.node_configs)}",
                         timeout=timeout)

    def stop(self) -> None:
        """End every process this deployment started, with its children (by process group, never by name)."""
        import signal
        import subprocess

        for _, p in reversed(self.procs):
            assert isinstance(p, subprocess.Popen)
            for sig in (signal.SIGTERM, signal.SIGKILL):  # SIGKILL: what is left of the group after 10 s
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:  # the whole group has ended
                    break
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    pass
        self.procs.clear()

    def __exit__(self, *exc: object) -> None:
        self.stop()
