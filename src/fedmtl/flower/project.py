"""``fedmtl flower app``: write a Flower app project (``flwr run`` launches it) for an experiment config.

The project holds the resolved experiment config in its run config (key ``fedmtl-config``), a ServerApp
of two lines (``fedmtl.flower.make_server_app()``), a ClientApp that forwards each message to the node's warm
worker (``fedmtl.flower.relay_app``: ``fedmtl flower worker``) or handles it itself, a
Flower configuration for a local simulation and for a TLS deployment, and DEPLOY.md: this project's steps
(fedmtl's own DEPLOY.md is the full operator's guide).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..config import ExperimentConfig, dumps

PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "fedmtl-app"
version = "1.0.0"
description = "fedmtl experiment {source} as a Flower app"
dependencies = ["fedmtl[flower]"]

[tool.hatch.build.targets.wheel]
packages = ["fedmtl_app"]

[tool.flwr.app]
publisher = "fedmtl"

[tool.flwr.app.components]
serverapp = "fedmtl_app.server_app:app"
clientapp = "fedmtl_app.client_app:app"

[tool.flwr.app.config]
fedmtl-config = {config}
fedmtl-out = "flower-run"
fedmtl-overwrite = false
fedmtl-num-nodes = {n}
"""

FLWR_CONFIG = """# Flower configuration (copy to $FLWR_HOME/config.toml, default ~/.flwr/config.toml)
[superlink]
default = "local"

[superlink.local]
address = ":local:"
options.num-supernodes = {n}

[superlink.deployment]
address = "127.0.0.1:9091"
root-certificates = "{certs}/ca.crt"
"""

DEPLOY = """# Deploying this experiment over Flower (TLS + SuperNode authentication)

The full operator's guide is fedmtl's DEPLOY.md (certificates, registering sites, node-local data, monitoring,
resuming, key rotation, and what a site must never share).  The steps for this project, {n} SuperNodes:

1. Server machine: a CA (its key in `ca/`, never copied anywhere) and the SuperLink's certificate:

       mkdir -p ca certs && chmod 700 ca certs
       openssl req -x509 -newkey rsa:2048 -nodes -keyout ca/ca.key -out certs/ca.crt -days 365 -subj /CN=fedmtl-ca
       openssl req -newkey rsa:2048 -nodes -keyout certs/server.key -out certs/server.csr -subj /CN=127.0.0.1 \\
           -addext "subjectAltName=IP:127.0.0.1,DNS:localhost"
       openssl x509 -req -in certs/server.csr -CA certs/ca.crt -CAkey ca/ca.key -CAcreateserial \\
           -out certs/server.pem -days 365 -copy_extensions copy

2. Every site: its own key pair; only `siteI.pub` goes to the server operator.

       ssh-keygen -t ecdsa -b 384 -N "" -f keys/site0

3. Server: the SuperLink, then register every site's public key:

       flower-superlink --ssl-ca-certfile certs/ca.crt --ssl-certfile certs/server.pem \\
           --ssl-keyfile certs/server.key --enable-supernode-auth --port 9091 \\
           --disable-runtime-dependency-installation
       flwr supernode register keys/site0.pub deployment     # ... for every site

4. Every site: its clients' data as `client_<k>.npz` files plus `dataset.json` in a data directory (ids
   0..N-1 over all sites; `fedmtl data export CONFIG --out DIR --clients A-B` writes a built-in dataset's
   share), then the SuperNode:

       flower-supernode --superlink 127.0.0.1:9091 --root-certificates certs/ca.crt \\
           --auth-supernode-private-key keys/site0 \\
           --node-config 'data-dir="/srv/site0/data" state-dir="/srv/site0/state" \\
                          fedmtl-worker="/srv/site0/run/worker.sock"'
   and, as the same user, the node's warm worker (data, model and imports kept across messages):
       fedmtl flower worker --socket /srv/site0/run/worker.sock

5. Server (flwr-config.toml copied to $FLWR_HOME/config.toml):

       flwr run . deployment --stream

The server writes `flower-run/` (metrics.csv, checkpoint.pt, summary.json); the same command resumes an
interrupted run from its checkpoint.
"""


def write_project(cfg: ExperimentConfig, out: str | Path, num_nodes: int) -> Path:
    """Write the project for ``cfg`` whose server waits for ``num_nodes`` SuperNodes."""
    out = Path(out)
    pkg = out / "fedmtl_app"
    pkg.mkdir(parents=True, exist_ok=True)
    text = dumps(cfg.raw)
    (out / "pyproject.toml").write_text(PYPROJECT.format(source=cfg.source, config=json.dumps(text), n=num_nodes))
    (pkg / "__init__.py").write_text('"""fedmtl experiment as a Flower app."""\n')
    (pkg / "server_app.py").write_text(
        '"""ServerApp: fedmtl\'s round loop (config from the run config)."""\n\n'
        "from fedmtl.flower import make_server_app\n\napp = make_server_app()\n")
    # the ClientApp forwards each message to the node's warm worker (node config fedmtl-worker), else runs it itself
    (pkg / "client_app.py").write_text((Path(__file__).parent / "relay_app.py").read_text())
    (out / "flwr-config.toml").write_text(FLWR_CONFIG.format(n=num_nodes, certs=(out / "certs").resolve()))
    (out / "DEPLOY.md").write_text(DEPLOY.format(n=num_nodes))
    return out
