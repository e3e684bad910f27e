"""A definitions import on a cluster leader killed mid-way comes back all or nothing on the
follower that takes over (marker ``chaos``).

Theory of operation: reuses ``test_cluster``'s real etcd + three ``skred --clustering``
processes and ``test_definitions_atomic``'s document and census. The document is posted through
a follower (its HTTP port proxies to the leader). Once the leader is applying it (more than 20
queue directories in its vhost, polled with a deadline) it is killed with SIGKILL after a
further random delay of up to half a second, so the kill lands while the import is being applied
(the whole import takes seconds). A follower wins the election and boots from its replicated
data dir: the intent file reached it before any write of the import did (the replication stream
keeps the leader's order), so it completes the import before it serves, or it never saw any of
it. Either way the new leader holds all of the document or none of it, never a prefix. (The
leader applies an import in slices and lets its loop run between them, so the replication
stream carries it while it is applied; the queue directories are all made before the first
declare, so the kill lands while they are made or the declares run.)
"""

from __future__ import annotations

import random
import time

import pytest

from broker.store.paths import vhost_dir

from .cluster_faults import api_leader
from .test_cluster import TTL, Cluster, cluster, start_cluster, wait_for  # noqa: F401 (fixture)
from .test_definitions_atomic import ALL, NONE, document, post_in_thread, what_exists

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240)]


def test_import_cut_off_by_the_leaders_kill9_is_all_or_nothing_on_the_new_leader(
        cluster: Cluster) -> None:  # noqa: F811 (the fixture imported above)
    c = cluster
    leader, followers = start_cluster(c)
    root = vhost_dir(leader.data_dir, "/")
    t = post_in_thread(followers[0].mgmt_port, document(), followers[0].ip)
    wait_for(lambda: sum(p.is_dir() for p in root.iterdir()) > 20, 60,
             "the leader applying the import (its first queue directories)")
    delay = random.uniform(0, 0.5)
    time.sleep(delay)  # the random moment of the kill, not a wait for a condition
    leader.kill9()
    t.join(30)
    try:
        successor = wait_for(lambda: api_leader(c, exclude=leader), TTL + 30,
                             "a new leader serving clients")
    except AssertionError:
        raise AssertionError(c.diag()) from None
    got = what_exists(successor.mgmt_port, successor.ip)
    assert got in (ALL, NONE), (f"killed {delay:.2f} s after the leader had 20 queues of it: {got}\n"
                                + successor.log_tail())
    print(f"killed {delay:.2f} s into applying the import: the new leader has "
          f"{'all' if got == ALL else 'none'} of it")
    assert not (successor.data_dir / "definitions-import.json").exists()
