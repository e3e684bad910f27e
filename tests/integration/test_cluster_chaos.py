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
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .cluster_faults import FAULTS, NetLab, make_cluster, open_lab, run_trial

pytestmark = [pytest.mark.timeout(240), pytest.mark.chaos]


@pytest.fixture
def lab(request: pytest.FixtureRequest) -> Iterator[NetLab | None]:
    if not FAULTS[request.param].lab:
        yield None
        return
    yield from open_lab()


@pytest.mark.parametrize(("name", "lab"), [(n, n) for n in FAULTS], indirect=["lab"])
def test_fault(tmp_path: Path, name: str, lab: NetLab | None) -> None:
    fault = FAULTS[name]
    c = make_cluster(tmp_path, name, lab)
    try:
        for n in c.nodes:  # deprecated, accepted with a warning (LavinMQ: no effect)
            n.argv += ["--clustering-max-unsynced-actions", "4096"]
            n.start()
        trial = run_trial(c, name, "chaos-q", lab)
        print(f"\n{trial} (TTL {fault.ttl}s, bound {fault.bound}s: {fault.what})")
        assert "max_unsynced_actions is deprecated" in c.nodes[0].log_text()
        assert not trial.notes, f"{trial}\n{c.diag()}"
        assert trial.lost == 0, trial
        assert trial.resurrected == 0, trial
        assert trial.missing_redelivered == 0, trial
        assert trial.failover is not None and trial.failover <= fault.bound, trial
    finally:
        if lab is not None:
            lab.heal()
        c.close()
