"""``fedmtl flower app``: write a Flower app project (``flwr run`` launches it) for an experiment config.

The project holds the resolved experiment config in its run config (key ``fedmtl-config``), a ServerApp
and a ClientApp that are two lines each (``fedmtl.flower.make_server_app()`` / ``make_client_app()``), a
Flower configuration for a local simulation and for a TLS deployment, and DEPLOY.md: the recipe for a
SuperLink and one SuperNode per partition with TLS certificates and registered node keys.
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

One SuperLink, one SuperNode per partition (client) of the federation: {n} SuperNodes, partition ids
0..{last}.  Every machine installs `fedmtl[flower]`; each SuperNode builds the federation from the same
config and seed and trains only on its own partition (`partition-id`).

1. Certificates (a CA, and a server certificate for the SuperLink's address), e.g. with OpenSSL:

       openssl req -x509 -newkey rsa:2048 -nodes -keyout certs/ca.key -out certs/ca.crt -days 365 -subj /CN=fedmtl-ca
       openssl req -newkey rsa:2048 -nodes -keyout certs/server.key -out certs/server.csr -subj /CN=127.0.0.1 \\
           -addext "subjectAltName=IP:127.0.0.1,DNS:localhost"
       openssl x509 -req -in certs/server.csr -CA certs/ca.crt -CAkey certs/ca.key -CAcreateserial \\
           -out certs/server.pem -days 365 -copy_extensions copy

   (`fedmtl.flower.deploy.make_certificates(dir)` writes the same files with Python's `cryptography`.)

2. One key pair per SuperNode (elliptic-curve, OpenSSH format; or `fedmtl.flower.deploy.make_node_keys`):

       ssh-keygen -t ecdsa -b 384 -N "" -f keys/node0      # ... node{last}

3. The SuperLink with TLS and SuperNode authentication (Flower 1.41 serves the Fleet and Control APIs on one
   HTTPS port, `--port`, default 9091; the app's dependencies are already installed, hence the last flag):

       flower-superlink --ssl-ca-certfile certs/ca.crt --ssl-certfile certs/server.pem \\
           --ssl-keyfile certs/server.key --enable-supernode-auth --port 9091 \\
           --disable-runtime-dependency-installation

4. Register each node's public key with the SuperLink (Control API; only registered keys may connect):

       flwr supernode register keys/node0.pub deployment     # ... for every node

5. Start the SuperNodes (one per partition):

       flower-supernode --superlink 127.0.0.1:9091 --root-certificates certs/ca.crt \\
           --auth-supernode-private-key keys/node0 --node-config "partition-id=0 num-partitions={n}" \\
           --port 9094        # a free local port per SuperNode on one machine

   A node may serve several clients: `--node-config 'partition-ids="0-49" num-partitions={n}'`.
   A node whose key was not registered is refused by the SuperLink.

6. Run the experiment (copy flwr-config.toml to $FLWR_HOME/config.toml first):

       flwr run . deployment --stream

`fedmtl.flower.deploy.LocalDeployment` runs exactly these steps on 127.0.0.1 (the test suite uses it).

The server writes `flower-run/summary.json` and checkpoints `flower-run/checkpoint.pt` after every round; a
restarted run resumes from it.  Set `FEDMTL_FLOWER_STATE_DIR` on a SuperNode to keep its client state
(FedEM's pi, Ditto's personal model) in a file across runs.  A SuperNode that crashes or does not answer
within the round timeout is a dropped client for that round.
"""


def write_project(cfg: ExperimentConfig, out: str | Path, num_clients: int) -> Path:
    out = Path(out)
    pkg = out / "fedmtl_app"
    pkg.mkdir(parents=True, exist_ok=True)
    text = dumps(cfg.raw)
    (out / "pyproject.toml").write_text(PYPROJECT.format(source=cfg.source, config=json.dumps(text), n=num_clients))
    (pkg / "__init__.py").write_text('"""fedmtl experiment as a Flower app."""\n')
    (pkg / "server_app.py").write_text(
        '"""ServerApp: fedmtl\'s round loop (config from the run config)."""\n\n'
        "from fedmtl.flower import make_server_app\n\napp = make_server_app()\n")
    (pkg / "client_app.py").write_text(
        '"""ClientApp: the node\'s partition trains with the algorithm\'s client_update."""\n\n'
        "from fedmtl.flower import make_client_app\n\napp = make_client_app()\n")
    (out / "flwr-config.toml").write_text(FLWR_CONFIG.format(n=num_clients, certs=(out / "certs").resolve()))
    (out / "DEPLOY.md").write_text(DEPLOY.format(n=num_clients, last=num_clients - 1))
    return out
