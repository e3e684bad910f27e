"""Cluster chaos: one trial of every fault in ``cluster_faults.FAULTS``, each asserting its goal.

Theory of operation: real etcd, three real ``skred --clustering`` processes, real faults
(kill -9 and quick restart of the leader, SIGSTOP and SIGKILL of etcd, a follower killed
while etcd is too slow to record it, the leader partitioned from everyone and one
replication link cut, the last two with network namespaces). A trial builds confirmed,
acked and delivered-but-unacked messages, keeps publishing with confirms through the
fault, then drains the queue from whichever node leads. Goals: no confirmed message lost,
no acked message back, every message delivered before the fault back flagged
redelivered, the fault's own bound on the failover figure, and no note (a
stepped-down leader, a stale node elected, a proxied client left hanging, a cut link
unnoticed). ``benchmarks/chaos.py`` runs the same trials many times and prints a table.

Sharing: the module keeps one etcd per network (loopback; the lab's bridge) and one cluster
at a time, which serves every fault with the same lease TTL and network in turn (the trials
run grouped by that key; each uses a queue of its own). Every fault leaves the cluster whole
again (a killed node is restarted, a cut healed, etcd restarted or resumed), and a trial
passes only once it is whole: a leader serving, every node answering (synced), all three in
the ISR, waited for while the nodes progress. A trial that fails for any reason drops its
cluster (kill -9 of its nodes) and the next one builds a new one, on an etcd that is
restarted first if it no longer answers: one trial's failure never becomes the next one's.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator

import pytest

from .cluster_faults import FAULTS, NetLab, make_cluster, open_lab, run_trial, serving_leader
from .test_cluster import Cluster, Etcd, wait_while_starting

pytestmark = [pytest.mark.timeout(240), pytest.mark.chaos]

# Trials grouped by the cluster they can share (network, lease TTL), in FAULTS order within a group.
ORDER = sorted(FAULTS, key=lambda n: (FAULTS[n].lab, FAULTS[n].ttl))


def wait_whole(c: Cluster) -> None:
    """A leader serving, every node answering and in the ISR; the deadline runs while nodes
    progress (``wait_while_starting``), so a restarted node's slow start-up under load is no
    failure, a hung one is."""
    def isr_full() -> bool:
        return len(json.loads(c.etcd.get(f"{c.prefix}/isr") or b"[]")) == len(c.nodes)

    try:
        wait_while_starting(lambda: serving_leader(c), c.nodes, "serving leader")
        for n in c.nodes:
            wait_while_starting(n.answers, c.nodes, f"answer from {n.name} (synced)")
        wait_while_starting(isr_full, c.nodes, "full ISR")
    except AssertionError as exc:
        raise AssertionError(f"cluster not whole again: {exc}\n{c.diag()}") from None


class ClusterPool:
    """The module's etcds (one per network) and its one live cluster, keyed (network, TTL)."""

    def __init__(self, tmp: pytest.TempPathFactory) -> None:
        self.tmp = tmp
        self.etcds: dict[bool, Etcd] = {}
        self.key: tuple[bool, int] | None = None
        self.cluster: Cluster | None = None

    def _etcd(self, lab: NetLab | None) -> Etcd:
        etcd = self.etcds.get(lab is not None)
        if etcd is None:
            tmp = self.tmp.mktemp("etcd-lab" if lab else "etcd")
            etcd = self.etcds[lab is not None] = Etcd(tmp, host=lab.host) if lab else Etcd(tmp)
        elif not etcd._healthy():  # a failed trial left it paused or dead: same data, same ports
            etcd.kill9()
            etcd.start()
        return etcd

    def get(self, name: str, lab: NetLab | None) -> Cluster:
        """The live cluster if it suits fault ``name``, else a new one, started and whole."""
        fault = FAULTS[name]
        key = (fault.lab, fault.ttl)
        if self.cluster is not None and self.key == key:
            return self.cluster
        self.drop()
        c = make_cluster(self.tmp.mktemp("cluster"), name, lab, self._etcd(lab))
        self.cluster, self.key = c, key
        for n in c.nodes:  # deprecated, accepted with a warning (LavinMQ: no effect)
            n.argv += ["--clustering-max-unsynced-actions", "4096"]
            n.start()
        wait_whole(c)
        return c

    def drop(self) -> None:
        """Kill the live cluster's nodes (its etcd stays for the next cluster)."""
        if self.cluster is not None:
            for n in self.cluster.nodes:
                n.kill9()
        self.cluster, self.key = None, None

    def release_lab(self) -> None:
        """Stop everything inside or on the lab (before the lab goes)."""
        if self.key is not None and self.key[0]:
            self.drop()
        etcd = self.etcds.pop(True, None)
        if etcd is not None:
            etcd.stop()

    def close(self) -> None:
        self.drop()
        for etcd in self.etcds.values():
            etcd.stop()


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterPool]:
    p = ClusterPool(tmp_path_factory)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(scope="module")
def netlab(pool: ClusterPool) -> Iterator[NetLab]:
    try:
        yield from open_lab()
    finally:
        pool.release_lab()


@pytest.fixture
def lab(request: pytest.FixtureRequest) -> NetLab | None:
    """The module's lab for a fault that needs one (skips where it cannot exist), else None."""
    return request.getfixturevalue("netlab") if FAULTS[request.param].lab else None


@pytest.mark.parametrize(("name", "lab"), [(n, n) for n in ORDER], indirect=["lab"])
def test_fault(pool: ClusterPool, name: str, lab: NetLab | None) -> None:
    fault = FAULTS[name]
    t0 = time.monotonic()
    try:
        c = pool.get(name, lab)
        trial = run_trial(c, name, f"chaos-{uuid.uuid4().hex[:8]}", lab)
        print(f"\n{trial} (TTL {fault.ttl}s, bound {fault.bound}s: {fault.what}; "
              f"{time.monotonic() - t0:.0f} s with the cluster's start)")
        assert "max_unsynced_actions is deprecated" in c.nodes[0].log_text()
        assert not trial.notes, f"{trial}\n{c.diag()}"
        assert trial.lost == 0, trial
        assert trial.resurrected == 0, trial
        assert trial.missing_redelivered == 0, trial
        assert trial.failover is not None and trial.failover <= fault.bound, trial
        wait_whole(c)  # ready for the next fault of its group
    except BaseException:
        pool.drop()  # never hand a cluster a failed trial left behind to the next one
        raise
    finally:
        if lab is not None:
            lab.heal()
