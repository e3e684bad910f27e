"""Hard names and a definitions import on a cluster: through the leader and through a follower,
replicated, and back whole on the follower that takes over after the leader's kill -9.

Theory of operation: reuses ``test_cluster``'s real etcd + three ``skred --clustering``
processes and ``test_names``' doors and check. Names RabbitMQ accepts (``<``, quotes, ``/``,
``%``, emoji, NUL, 255 bytes) and reserved ones go in over AMQP and the management API of the
leader and of a follower (whose ports proxy to the leader), and in one definitions import
through the follower; the import's intent file (``definitions-import.json``) must be gone from
every node once the import answered. Then the leader is killed with SIGKILL; a follower wins the
election and boots from its replicated data dir, and must hold exactly what the leader
confirmed: the same queues, messages, exchanges and bindings, nothing refused.
"""

from __future__ import annotations

import pytest

from .cluster_faults import api_leader
from .test_cluster import TTL, Cluster, cluster, start_cluster, wait_for  # noqa: F401 (fixture)
from .test_names import Doors, Expect, check

pytestmark = pytest.mark.timeout(180)

NAMES = ["ü", "a<b>&c", "q'\"`", "a/b", "%2F", "50%", "\U0001F600 party", "x" * 255, "é" * 127,
         "nul\x00in", "tab\tand\nnewline", "Amq.y", "amq.x", "y" * 256, "日本語のキュー"]
IMPORTED = ["imported ü", "imported <\"'>", "imported /%2F%", "é" * 120 + "!"]


def test_names_and_an_import_through_leader_and_follower_survive_leader_kill9(
        cluster: Cluster) -> None:  # noqa: F811 (the fixture imported above)
    c = cluster
    leader, followers = start_cluster(c)
    expect = Expect()
    via_follower = Doors(followers[0].url, followers[0].mgmt_port, None, expect, followers[0].ip)
    via_leader = Doors(leader.url, leader.mgmt_port, None, expect, leader.ip)
    try:
        for i, name in enumerate(NAMES):
            (via_follower if i % 2 else via_leader).amqp(name)
            (via_leader if i % 2 else via_follower).api(name + " (api)")
        via_follower.definitions(IMPORTED)
    finally:
        via_follower.close()
        via_leader.close()
    assert expect.refused and len(expect.queues) > len(NAMES)
    for n in c.nodes:
        wait_for(lambda n=n: not (n.data_dir / "definitions-import.json").exists(), 10,
                 f"the import's intent file gone on {n.name}")

    leader.kill9()

    try:
        successor = wait_for(lambda: api_leader(c, exclude=leader), TTL + 15,
                             "a new leader serving clients")
    except AssertionError:
        raise AssertionError(c.diag()) from None
    check(successor.mgmt_port, successor.url, expect, successor.ip)
