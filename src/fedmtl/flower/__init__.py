"""Run fedmtl algorithms over Flower (optional extra ``fedmtl[flower]``; the only package importing flwr)."""

from .apps import ServerOptions, make_client_app, make_server_app, server_main
from .records import RecordError, record_to_tree, to_config, to_metrics, tree_to_record

__all__ = [
    "RecordError", "ServerOptions", "make_client_app", "make_server_app", "record_to_tree", "server_main",
    "to_config", "to_metrics", "tree_to_record",
]
