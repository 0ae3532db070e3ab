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

# the SuperLink as the operator's machine reaches it (DEPLOY.md step 3: flower-superlink ... --port 9091)
[superlink.deployment]
address = "127.0.0.1:9091"
root-certificates = "{certs}/ca.crt"
"""

DEPLOY = """# Deploying this experiment over Flower (TLS + SuperNode authentication)

The full operator's guide is fedmtl's DEPLOY.md (certificates, registering sites, node-local data, monitoring,
resuming, key rotation, and what a site must never share).  The steps for this project, {n} SuperNodes, run from
{cwd} on the server (`certs/`, `state/` and `runs/` there; `flwr-config.toml` names `certs/ca.crt`):

1. Server machine: a CA (its key in `ca/`, never copied anywhere) and the SuperLink's certificate for the names
   and addresses the sites dial (here 127.0.0.1; put the server's name and public address in `subjectAltName`):

       mkdir -p -m 700 ca certs state
       openssl req -x509 -newkey rsa:2048 -nodes -keyout ca/ca.key -out certs/ca.crt -days 365 -subj /CN=fedmtl-ca
       openssl req -newkey rsa:2048 -nodes -keyout certs/server.key -out certs/server.csr -subj /CN=127.0.0.1 \\
           -addext "subjectAltName=IP:127.0.0.1,DNS:localhost"
       openssl x509 -req -in certs/server.csr -CA certs/ca.crt -CAkey ca/ca.key -CAcreateserial \\
           -out certs/server.pem -days 365 -copy_extensions copy

2. Every site: its own key pair; only `siteI.pub` goes to the server operator, and `certs/ca.crt` (only that file)
   comes to the site.

       ssh-keygen -t ecdsa -b 384 -N "" -f keys/site0

3. Server: the SuperLink (listening on every interface; the registered nodes kept in `state/` across restarts),
   then register every site's public key:

       flower-superlink --ssl-ca-certfile certs/ca.crt --ssl-certfile certs/server.pem \\
           --ssl-keyfile certs/server.key --enable-supernode-auth --host 0.0.0.0 --port 9091 \\
           --database state/superlink.db --disable-runtime-dependency-installation
       flwr supernode register keys/site0.pub deployment     # ... for every site

4. Every site: its clients' data as `client_<k>.npz` files plus `dataset.json` in a data directory (ids
   0..N-1 over all sites; `fedmtl data export CONFIG --out DIR --clients A-B` writes a built-in dataset's
   share), the node's warm worker (data, model and imports kept across messages; as the SuperNode's user), then
   the SuperNode (`--port`: its own local port; a second SuperNode on one machine takes another, e.g. 9095):

       fedmtl flower worker --socket /srv/s0/run/worker.sock
       flower-supernode --superlink 127.0.0.1:9091 --root-certificates certs/ca.crt \\
           --auth-supernode-private-key keys/site0 --port 9094 \\
           --node-config 'data-dir="/srv/s0/data" state-dir="/srv/s0/state" fedmtl-worker="/srv/s0/run/worker.sock"'

5. Server (`flwr-config.toml` copied to $FLWR_HOME/config.toml, default ~/.flwr/config.toml):

       flwr run . deployment --stream --run-config "fedmtl-out='{cwd}/runs/exp1' fedmtl-num-nodes={n}"
       fedmtl watch {cwd}/runs/exp1      # round, accuracy, p10, dropped and excluded clients, ETA

The server writes `runs/exp1/` (config.toml, metrics.csv, checkpoint.pt, clients.csv, summary.json); the same
`flwr run` command resumes an interrupted run from its checkpoint.
"""


#: what ``write_project`` writes into its folder
PROJECT_FILES = ("pyproject.toml", "fedmtl_app", "flwr-config.toml", "DEPLOY.md")


def write_project(cfg: ExperimentConfig, out: str | Path, num_nodes: int, home: str | Path | None = None) -> Path:
    """Write the project for ``cfg`` whose server waits for ``num_nodes`` SuperNodes; its DEPLOY.md and
    ``flwr-config.toml`` put the certificates, the SuperLink's database and the runs under ``home`` (default: the
    current directory, where the operator runs the steps)."""
    if cfg.flower.secure_aggregation:
        cfg.flower.protocol(num_nodes)  # SecAgg+ needs at least 3 nodes and no overflow: refused before writing
    home = Path(home if home is not None else Path.cwd()).resolve()
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
    (out / "flwr-config.toml").write_text(FLWR_CONFIG.format(n=num_nodes, certs=home / "certs"))
    (out / "DEPLOY.md").write_text(DEPLOY.format(n=num_nodes, cwd=home))
    return out
