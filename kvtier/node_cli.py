"""``kvtier node serve CONFIG``: the node daemon in the foreground, logging to stderr; SIGTERM or SIGINT
stop it cleanly (connections closed, their holds given back, the slab left for the next daemon)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from kvtier.core.errors import ConfigError
from kvtier.node_config import load_node_config
from kvtier.node_daemon import NodeDaemon


def add_node_parser(commands) -> None:
    node = commands.add_parser("node", help="the node daemon: one shared-memory cache for every engine on a machine")
    actions = node.add_subparsers(dest="node_command", required=True)
    serve = actions.add_parser(
        "serve",
        help="run the node daemon in the foreground (SIGTERM stops it)",
        description="Serve the machine's node slab to engines whose stacks list a `medium: node` tier.",
    )
    serve.add_argument("config", help="the daemon's YAML: a `node` section (socket, slab, users) and the slab's tier")
    serve.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (/metrics)")
    serve.add_argument(
        "--metrics-address", default="127.0.0.1", help="the address of --metrics-port (default 127.0.0.1)"
    )
    serve.add_argument("--node-id", help="the name engines are told this machine has (default: the host name)")
    serve.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def run_node(args: argparse.Namespace) -> int:
    """Serve until a signal; 2 for a config or a place to listen that does not work (one message)."""
    logging.basicConfig(
        stream=sys.stderr, level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        daemon = NodeDaemon(load_node_config(args.config), args.node_id)
    except (ConfigError, MemoryError) as exc:
        print(f"kvtier node serve: {exc}", file=sys.stderr)
        return 2
    try:
        if args.metrics_port is not None:
            from kvtier.node_metrics import serve_metrics

            serve_metrics(daemon, args.metrics_port, args.metrics_address)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: daemon.request_stop())
        daemon.serve()
    finally:
        daemon.stop()
    logging.getLogger("kvtier.node").info("node: stopped")
    return 0
