"""Cluster chaos: etcd pauses and outages, a lost ISR write, a quick leader restart, partitions.

Theory of operation: real etcd, three real ``skred --clustering`` processes, real faults
(SIGSTOP/SIGKILL of etcd, kill -9 of nodes, network namespaces with blackhole routes or a
downed link, see ``cluster_faults``). One trial per fault here (``benchmarks/chaos.py`` runs
many); each asserts the goal -- no confirmed message lost, no acked message back, no
stall, failover within the lease TTL + 2 s -- not merely that the broker is up.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .cluster_faults import NetLab, etcd_pause, lab_cluster, netlab_unavailable, quick_restart_of_leader
from .test_cluster import Cluster, consume_all, publish, start_cluster, wait_for
from .test_cluster_ops import Publisher, isr

pytestmark = [pytest.mark.timeout(180), pytest.mark.chaos]


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[[int], Cluster]]:
    made: list[Cluster] = []

    def factory(ttl: int) -> Cluster:
        c = Cluster(tmp_path, ttl=ttl)
        made.append(c)
        return c

    yield factory
    for c in made:
        c.close()


@pytest.fixture
def lab() -> Iterator[NetLab]:
    why = netlab_unavailable()
    if why:
        pytest.skip(why)
    try:
        net = NetLab()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    try:
        yield net
    finally:
        net.close()


def test_etcd_pause_shorter_than_ttl_keeps_the_leader(make_cluster: Callable[[int], Cluster]) -> None:
    c = make_cluster(8)
    for n in c.nodes:  # deprecated, accepted with a warning (LavinMQ: no effect)
        n.argv += ["--clustering-max-unsynced-actions", "4096"]
    leader, _ = start_cluster(c)
    assert "max_unsynced_actions is deprecated" in leader.log_text()
    trial = etcd_pause(c, "pause-q", 6.0)
    print(f"\n{trial}")
    assert "stepping down" not in leader.log_text(), leader.log_tail()
    assert c.leader() is leader
    assert trial.lost == 0 and not trial.notes, trial
    assert trial.failover is not None and trial.failover < 6.0 + 2, trial  # confirms resume with etcd


def test_etcd_down_longer_than_ttl_revokes_the_old_leader_key(make_cluster: Callable[[int], Cluster]) -> None:
    c = make_cluster(8)
    leader, _ = start_cluster(c)
    ok: list[int] = []
    asyncio.run(asyncio.wait_for(publish(leader.url, "down-q", 0, 100, ok), 30))
    c.etcd.kill9()
    wait_for(lambda: "stepping down: lease lost" in leader.log_text(), c.ttl + 10, "the leader to step down")
    c.etcd.start()
    back = time.monotonic()
    new = wait_for(lambda: (n := c.leader()) is not None and n.answers() and n, c.ttl + 20,
                   "a serving leader after etcd came back")
    took = time.monotonic() - back
    print(f"\nserving {took:.2f}s after etcd came back (lease TTL {c.ttl}s)")
    assert took < c.ttl, f"the old leader key outlived the outage: {took:.2f}s\n{c.diag()}"
    got = asyncio.run(asyncio.wait_for(consume_all(new.url, "down-q", 100), 30))
    assert set(range(100)) <= set(got)


def test_failed_isr_removal_is_retried(make_cluster: Callable[[int], Cluster]) -> None:
    c = make_cluster(10)
    leader, followers = start_cluster(c)
    wait_for(lambda: len(isr(c)) == 3, 10, "all three nodes in the ISR")
    dead = followers[0]
    dead_id = dead.node_id()
    with Publisher(leader.url, "isr-q", limit=60) as pub:
        wait_for(lambda: pub.count() >= 200, 20, "publishing under way")
        os.kill(c.etcd.proc.pid, signal.SIGSTOP)  # etcd slow ...
        try:
            dead.kill9()  # ... while a follower drops: the ISR write times out
            wait_for(lambda: "ISR write failed" in leader.log_text(), 15, "the failed ISR write")
        finally:
            os.kill(c.etcd.proc.pid, signal.SIGCONT)
        resumed = time.monotonic()
        at = pub.count()
        wait_for(lambda: pub.count() >= at + 200 or pub.error is not None, 15,
                 f"confirms after etcd resumed\n{leader.log_tail()}")
        print(f"\nconfirms resumed {time.monotonic() - resumed:.2f}s after etcd did")
    assert pub.error is None, repr(pub.error)
    assert dead_id not in isr(c) and len(isr(c)) == 2, isr(c)
    got = asyncio.run(asyncio.wait_for(consume_all(leader.url, "isr-q", pub.count()), 60))
    assert not set(pub.confirmed) - set(got)


def test_quick_restart_of_the_old_leader_resurrects_no_ack(make_cluster: Callable[[int], Cluster]) -> None:
    c = make_cluster(2)
    start_cluster(c)
    for round_ in range(3):  # the old code lost this race in about 2 of 3 elections
        trial = quick_restart_of_leader(c, f"restart-q{round_}")
        print(f"\n{trial}")
        assert trial.lost == 0 and trial.resurrected == 0, f"{trial}\n{c.diag()}"
        assert trial.failover is not None and trial.failover <= c.ttl + 2 + 3, trial  # + broker boot


def test_follower_proxy_closes_clients_when_the_leader_is_lost(tmp_path: Path, lab: NetLab) -> None:
    c = lab_cluster(tmp_path, lab, ttl=2)
    try:
        leader, followers = start_cluster(c)
        f = followers[0]
        with socket.create_connection((f.ip, f.port), timeout=5) as s:
            s.sendall(b"AMQP\x00\x00\x09\x01")
            assert s.recv(7)[:1] == b"\x01", "no connection.start through the proxy"
            lab.isolate(c.nodes.index(leader))  # the leader is partitioned from everyone
            cut = time.monotonic()
            s.settimeout(c.ttl + 10)
            try:
                data = s.recv(4096)
                while data:
                    data = s.recv(4096)
            except TimeoutError:
                raise AssertionError("the proxied client was never disconnected") from None
            except ConnectionError:
                pass
            closed = time.monotonic() - cut
        print(f"\nproxied client disconnected {closed:.2f}s after the leader was partitioned")
        assert closed <= c.ttl + 3, closed
        new = wait_for(lambda: (n := c.leader()) is not None and n is not leader and n, c.ttl + 10,
                       "a new leader")
        wait_for(lambda: f.answers(), 20, "the follower's proxy reaching the new leader")
        assert new is not leader
    finally:
        lab.heal()
        c.close()


def test_replication_link_cut_is_detected_within_seconds(tmp_path: Path, lab: NetLab) -> None:
    c = lab_cluster(tmp_path, lab, ttl=10)
    try:
        leader, followers = start_cluster(c)
        wait_for(lambda: len(isr(c)) == 3, 15, "all three nodes in the ISR")
        f = followers[0]
        fid = f.node_id()
        lab.cut(c.nodes.index(leader), c.nodes.index(f))  # etcd still reaches both: only the link dies
        cut = time.monotonic()
        try:
            wait_for(lambda: fid not in isr(c), 10, "the cut-off follower out of the ISR (leader side)")
            wait_for(lambda: "replication link silent" in f.log_text(), 10, "the follower noticing")
            print(f"\nlink cut detected on both sides within {time.monotonic() - cut:.2f}s (TTL {c.ttl}s)")
            ok: list[int] = []
            asyncio.run(asyncio.wait_for(publish(leader.url, "cut-q", 0, 100, ok), 30))  # no stall
            assert len(ok) == 100
        finally:
            lab.heal()
        healed = time.monotonic()
        wait_for(lambda: fid in isr(c), 20, "the follower back in the ISR after healing")
        print(f"back in the ISR {time.monotonic() - healed:.2f}s after healing")
    finally:
        c.close()
