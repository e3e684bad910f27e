"""What a cluster member's operator reads: one line when the leader cannot start, a follower's
"following leader" and replication failures logged on change (not every retry), and SIGHUP on a
follower reloading what can change at runtime (the log level at once); and a quorum queue's
delivery count surviving the leader's kill -9.

Reuses ``test_cluster``'s real etcd and ``skred --clustering`` processes (skips without etcd).
"""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path
from typing import Any

import pika
import pytest

from .test_cluster import Cluster, cluster, start_cluster, wait_for
from .test_cluster_ops import scrape

__all__ = ["cluster"]  # test_cluster's fixture: etcd and three nodes, stopped by PID

pytestmark = pytest.mark.timeout(120)


def test_leader_that_cannot_start_says_why_in_one_line(cluster: Cluster) -> None:
    n1 = cluster.nodes[0]
    with socket.socket() as taken:  # its AMQP port is in use: the broker cannot listen
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind((n1.ip, n1.port))
        taken.listen()
        n1.start()
        assert n1.proc is not None
        assert n1.proc.wait(60) == 1, n1.log_tail()
    text = n1.log_text()
    lines = [x for x in text.splitlines() if "broker failed to start as leader" in x]
    assert len(lines) == 1 and str(n1.port) in lines[0], text
    assert "Traceback" not in text, text


def test_follower_logs_on_change_and_reloads_on_sighup(cluster: Cluster, tmp_path: Path) -> None:
    inis = []
    for n in cluster.nodes[:2]:
        ini = tmp_path / f"{n.name}.ini"
        ini.write_text("[main]\nlog_level = info\n")
        n.argv += ["-c", str(ini)]
        inis.append(ini)
        n.start()
    leader = wait_for(cluster.leader, 30, "a leader in etcd")
    wait_for(leader.answers, 30, "the leader's AMQP port")
    i = 1 if leader is cluster.nodes[0] else 0
    follower = cluster.nodes[i]
    wait_for(follower.answers, 30, "the follower's proxy (first sync done)")
    # the follower's own metrics carry its own node name (unique on this host: its AMQP port)
    label = f'rabbitmq_node="skred-{follower.port}@{socket.gethostname()}"'
    wait_for(lambda: any(k.startswith("rabbitmq_identity_info{") and label in k for k in scrape(follower)),
             20, "the follower's identity series with its own node name")
    # SIGHUP on the follower: the log level applies at once (it went to the runner only before)
    inis[i].write_text("[main]\nlog_level = debug\n")
    assert follower.proc is not None
    os.kill(follower.proc.pid, signal.SIGHUP)
    wait_for(lambda: "SIGHUP: reloaded log level info -> debug" in follower.log_text(), 20,
             "the follower's SIGHUP reload line")
    # the leader dies: its key lives on for the lease TTL while the follower retries
    assert follower.log_text().count(f"following leader {leader.uri}") == 1
    before = len(follower.log_text())
    leader.kill9()
    wait_for(lambda: cluster.leader() is follower, 30, "the follower to take over")
    wait_for(follower.answers, 30, "the new leader's AMQP port")
    since = follower.log_text()[before:]  # retried every 0.2 s until the lease expired: said once
    assert f"following leader {leader.uri}" not in since, since
    assert since.count(f"replication from {leader.uri} ended") <= 1, since


def test_quorum_delivery_count_survives_failover(cluster: Cluster) -> None:
    """The delivery count is replicated with the queue (RabbitMQ: in the Raft log): after the
    leader's kill -9 the new leader delivers the message with the count it had."""
    leader, _followers = start_cluster(cluster)
    conn = pika.BlockingConnection(pika.URLParameters(leader.url))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("qq", durable=True, arguments={"x-queue-type": "quorum"})
    ch.basic_publish("", "qq", b"m", pika.BasicProperties(delivery_mode=2))
    for _ in range(3):
        method, _props, _body = ch.basic_get("qq")
        assert method is not None
        ch.basic_nack(method.delivery_tag, requeue=True)
    ch.queue_declare("marker", durable=True)
    # confirmed, so the ISR acked every byte before it, the counts included
    ch.basic_publish("", "marker", b"x", pika.BasicProperties(delivery_mode=2))
    conn.close()
    leader.kill9()

    def successor() -> Any:
        n = cluster.leader()
        return n if n is not None and n is not leader and n.answers() else None
    new = wait_for(successor, 30, "a new leader serving clients")
    conn = pika.BlockingConnection(pika.URLParameters(new.url))
    try:
        ch = conn.channel()
        method, props, body = ch.basic_get("qq")
        assert method is not None and body == b"m"
        assert (props.headers or {}).get("x-delivery-count") == 3, props.headers
    finally:
        conn.close()
