"""Cluster modes: the same integration tests against a cluster leader and through a follower.

Theory of operation: a defect that only a cluster shows (a leader wedged after an ack then a
queue delete, found first by a client suite through a follower) hides from tests that only ever
meet a single node. So modules whose tests touch durable state carry the ``cluster_modes``
marker, and ``conftest.py`` runs each of their tests three times: against a single node
(``single``), against the leader of a 3-node cluster (``leader``) and through one of its
followers (``follower``, every client byte proxied to the leader).

The cluster is one per test session (``SessionCluster``): a real etcd and three real broker
processes, booted on first use and shared by every module that asks, so the three modes cost one
boot. Tests in those modules may not stop, kill or restart their broker (the ``shared_broker``
contract), and ``ClusterTarget`` fails a test that tries. At the end of the session the cluster
must still serve a durable declare and a confirmed persistent publish through a follower and on
the leader, with no traceback in any node's log: that is what a wedge breaks.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any

import pika
import pytest

from ._support import assert_healthy

MODES = ("single", "leader", "follower")
# What a node's log may not hold after the cluster-mode tests ran: an unhandled exception, or a
# client told "internal error" (541: the operation may still have happened).
_BAD_LOG = re.compile(r"Traceback \(most recent call last\)|internal error|INTERNAL_ERROR")


class ClusterTarget:
    """One node of the session's cluster, shaped like ``_support``'s brokers for the tests."""

    external = True

    def __init__(self, node: Any, role: str, cluster: SessionCluster) -> None:
        self.node = node
        self.role = role
        self.cluster = cluster
        self.host: str = node.ip
        self.port: int = node.port
        self.mgmt_port: int = node.mgmt_port
        self.metrics_port: int = node.metrics_port
        self.stream_port: int = node.stream_port
        self.url: str = node.url
        self.data_dir: Path | None = None
        self.pid: int | None = None

    def _refuse(self) -> None:
        pytest.fail(f"a cluster-mode test may not stop or restart the shared cluster's {self.role}")

    start = stop = kill9 = restart = _refuse

    def log_text(self) -> str:
        return str(self.node.log_text())

    def close(self) -> None:
        pass


class SessionCluster:
    """A real etcd and three brokers, booted once; ``target(role)`` names the node to use."""

    def __init__(self, tmp: Path) -> None:
        from .test_cluster import Cluster, start_cluster  # skips the session's use without etcd

        self.cluster = Cluster(tmp)
        try:
            self.leader, self.followers = start_cluster(self.cluster)
        except BaseException:
            self.cluster.close()
            raise

    def target(self, role: str) -> ClusterTarget:
        node = self.leader if role == "leader" else self.followers[0]
        return ClusterTarget(node, role, self)

    def problems(self) -> list[str]:
        """What is wrong with the cluster after the tests: each node still serves a durable
        declare, a confirmed persistent publish and a consume, and no log shows an internal error."""
        out: list[str] = []
        if self.cluster.leader() is not self.leader:
            out.append("the leader changed during the cluster-mode tests")
        for role in ("leader", "follower"):
            t = self.target(role)
            try:
                assert_healthy(t)  # type: ignore[arg-type]
                _confirmed_durable_roundtrip(t)
            except Exception as exc:  # noqa: BLE001 - the failure is the finding, reported below
                out.append(f"{role} {t.node.name}: {type(exc).__name__}: {exc}")
        for n in self.cluster.nodes:
            bad = [line for line in n.log_text().splitlines() if _BAD_LOG.search(line)]
            if bad:
                out.append(f"{n.name}'s log: " + " | ".join(bad[:5]))
        return out

    def close(self) -> None:
        self.cluster.close()


def _confirmed_durable_roundtrip(t: ClusterTarget) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(t.url))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        q = f"skredtest.cluster-health.{uuid.uuid4().hex[:8]}"
        ch.queue_declare(q, durable=True)
        ch.basic_publish("", q, b"health", pika.BasicProperties(delivery_mode=2), mandatory=True)
        m, _, body = ch.basic_get(q, auto_ack=False)
        assert m is not None and body == b"health", "the confirmed message is not there"
        ch.basic_ack(m.delivery_tag)
        ch.queue_delete(q)
    finally:
        if conn.is_open:
            conn.close()
