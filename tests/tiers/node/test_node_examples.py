"""examples/node/ works as written: the daemon's YAML and the engine's validate, the Kubernetes ConfigMap's
daemon YAML too, and the systemd unit's and the DaemonSet's command lines are kvtier's own."""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

from kvtier.cli import build_parser
from kvtier.core.config import load_config
from kvtier.node_config import load_node_config

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "node"


def test_the_daemon_and_engine_yaml_validate():
    daemon = load_node_config(EXAMPLES / "node.yaml")
    assert daemon.node.socket == "/run/kvtier/node.sock" and daemon.block_bytes == 2 << 20
    engine = load_config(EXAMPLES / "engine.yaml")
    assert engine.tiers[0].medium == "node" and engine.tiers[0].socket == daemon.node.socket


def test_the_systemd_unit_and_the_daemonset_run_kvtier_node_serve():
    unit = (EXAMPLES / "kvtier-node.service").read_text()
    start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    args = build_parser().parse_args(shlex.split(start.removeprefix("ExecStart="))[1:])
    assert (args.command, args.node_command, args.metrics_port) == ("node", "serve", 9464)
    documents = list(yaml.safe_load_all((EXAMPLES / "daemonset.yaml").read_text()))
    config_map, daemon_set = documents
    assert load_node_config(yaml.safe_load(config_map["data"]["node.yaml"])).node.allow_users == [1000]
    command = daemon_set["spec"]["template"]["spec"]["containers"][0]["command"]
    args = build_parser().parse_args(command[1:])
    assert (args.node_command, args.config) == ("serve", "/etc/kvtier/node.yaml")
