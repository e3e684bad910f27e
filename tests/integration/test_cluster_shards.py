"""Per-shard leaders across a real 3-node cluster (``[clustering] shard_leaders``).

One cluster for the module (``shard_faults.ShardCluster``: real etcd, three real broker
processes, TTL 2 s): six vhosts get their shard leaders spread 2/2/2 (etcd,
``skred --cluster-status``, ``GET /api/cluster``); confirmed publishes reach every vhost through
every node; SIGTERM to the cluster leader drains its shards to other nodes, each resigned
(hooks per shard) while its client reconnects elsewhere, and it takes them back on return
(``shard_faults.drain_and_return``); kill -9 of a node moves only its shards, within TTL + 2 s,
while a publisher on each shard it did not lead keeps confirming with no gap of 1 s; the node's
return hands its shards back; nothing confirmed is lost (``shard_faults.kill_and_return``;
``benchmarks/chaos.py --shards N`` runs it N times). The cluster runs with per-shard ISRs
(``broker/cluster/shard_sink.py``): every confirm here waited for its shard's ISR; one shard's
ISR key is written alone and no mend puts a member back (on the module's etcd).
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import urllib.request
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pika
import pytest
from prometheus_client.parser import text_string_to_metric_families

from broker.cluster.etcd import (
    SHARDS,
    Etcd,
    shard_isr_key,
    shard_isrs,
    shard_key,
    shard_released,
    shard_server,
)

from ._support import REPO_ROOT
from .shard_faults import (
    BATCH,
    BOUND,
    HANDBACK_WAIT,
    IDS,
    PER_NODE,
    TTL,
    VHOSTS,
    ShardCluster,
    amqp_url,
    drain_and_return,
    expected,
    kill_and_return,
    publish,
    queue_depth,
)
from .test_cluster import ClusterNode, wait_for

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShardCluster]:
    sc = ShardCluster(tmp_path_factory.mktemp("shards"))
    try:
        yield sc
    except BaseException:
        print(sc.c.diag())
        raise
    finally:
        sc.close()


def cluster_status(sc: ShardCluster) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "broker", "--cluster-status", "--json", "--clustering",
         "--clustering-etcd-endpoints", sc.c.etcd.endpoint,
         "--clustering-etcd-prefix", sc.c.prefix],
        cwd=str(REPO_ROOT), capture_output=True, timeout=30, check=True)
    return dict(json.loads(out.stdout))


def test_six_vhosts_spread_two_per_node_everywhere_it_shows(shards: ShardCluster) -> None:
    want = expected()
    wait_for(lambda: shards.leaders() == want, 15, f"shard leaders {want}")
    assert Counter(VHOSTS.values()) == dict.fromkeys(IDS, PER_NODE)
    status = cluster_status(shards)
    assert {s["vhost"]: s["leader"] for s in status["shards"]} == want
    assert {m["node_id"]: m["shards_led"] for m in status["members"]} == dict(Counter(want.values()))
    follower = next(n for n in shards.c.nodes if n is not shards.leader)
    view = shards.api(follower, "GET", "/api/cluster")  # a follower's port: the leader's view
    assert {s["vhost"]: s["leader"] for s in view["shards"]} == want


def test_each_shard_has_its_isr_key_beside_its_leader_key(shards: ShardCluster) -> None:
    """Replication scoped by shard, step one: ``<prefix>/shards/<v>/isr`` beside each leader key,
    written with the cluster's ISR by the node replicating the data (which, while it replicates
    every shard, also gives a new vhost its key and mends a stray value within a pass); the
    election hands a shard only to a node its key names (tests/test_shard_isr.py; the kill -9
    trial below fails shards over with these keys in place); per-shard acks on the leader."""
    want = expected()
    wait_for(lambda: shards.leaders() == want, 15, "the initial placement")
    etcd, prefix = shards.c.etcd, shards.c.prefix

    def isr(name: str) -> Any:
        raw = etcd.get(f"{prefix}/{name}")
        return None if raw is None else json.loads(raw)

    def named() -> bool:
        cluster = isr("isr")
        return cluster is not None and all(isr(shard_isr_key(v)) == cluster for v in want)

    wait_for(lambda: sorted(isr("isr") or []) == IDS, 15, "all three nodes in sync")
    wait_for(named, 15, "every shard's ISR key naming the cluster's ISR")
    status = cluster_status(shards)  # skred --cluster-status, per shard
    assert {s["vhost"]: sorted(s["isr"]) for s in status["shards"]} == {v: IDS for v in want}
    x = next(iter(VHOSTS))
    cluster = isr("isr")
    etcd._ctl("put", f"{prefix}/{shard_isr_key(x)}", json.dumps([*cluster, cluster[0]]))  # same set
    wait_for(named, 30, f"{x}'s stray ISR value mended")
    assert shards.leaders() == want
    # the one stream is acked per shard: the leader lists who holds each shard's every action
    publish(shards.c.nodes[0], x, "isr", 1)

    def replicas() -> bool:
        leader = shards.c.leader()
        listed = {} if leader is None else {
            s["vhost"]: s.get("replicas") for s in shards.api(leader, "GET", "/api/cluster")["shards"]}
        return all(sorted(listed.get(v) or []) == IDS for v in want)

    wait_for(replicas, 30, "every shard held by all three nodes")


def test_hooks_name_the_shard_and_a_deleted_vhost_gives_its_shard_up(shards: ShardCluster) -> None:
    want = expected()
    wait_for(lambda: all(f"leader {n} {v}" in shards.hook_lines() for v, n in want.items()), 30,
             "an on_leader_elected hook per shard, naming it")
    shards.api(shards.leader, "PUT", "/api/vhosts/short-lived")
    wait_for(lambda: "short-lived" in shards.leaders(), 30, "the new vhost's shard led")
    holder = shards.leaders()["short-lived"]
    shards.api(shards.leader, "DELETE", "/api/vhosts/short-lived")
    wait_for(lambda: "short-lived" not in shards.leaders(), 30, "the deleted vhost's shard key gone")
    wait_for(lambda: f"follower {holder} short-lived" in shards.hook_lines(), 30, "its on_leader_lost hook")


def test_confirmed_publishes_reach_every_vhost_through_every_node(shards: ShardCluster) -> None:
    nodes = shards.c.nodes
    for i, vhost in enumerate(VHOSTS):  # every vhost through one node, every node for two vhosts
        publish(nodes[i % len(nodes)], vhost, "every-node", BATCH)
    for i, vhost in enumerate(VHOSTS):  # and read back through another
        assert queue_depth(nodes[(i + 1) % len(nodes)], vhost, "every-node") == BATCH


def shard_samples(node: ClusterNode) -> dict[str, dict[tuple[str, ...], float]]:
    """The ``skred_shard_*`` samples on ``node``'s metrics port (on the default metrics address,
    whatever the node's own): name -> label values -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, dict[tuple[str, ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("skred_shard_"):
                labels = tuple(sample.labels[k] for k in sorted(sample.labels))  # node, shard
                out.setdefault(sample.name, {})[labels] = sample.value
    return out


def test_per_shard_gauges_on_every_node_and_in_cluster_status(shards: ShardCluster) -> None:
    want = expected()
    for vhost in VHOSTS:
        publish(shards.leader, vhost, "gauged", BATCH)

    def gauges_true() -> bool:
        for nid, node in shards.by_id.items():
            led = shard_samples(node).get("skred_shard_leader", {})
            if led != {(leader, vhost): float(leader == nid) for vhost, leader in want.items()}:
                return False
        return True

    wait_for(gauges_true, 10, "skred_shard_leader on every node naming each shard's leader")
    served = shard_samples(shards.leader)  # the node serving the data (the cluster leader, today)
    for vhost in VHOSTS:
        assert served["skred_shard_messages"][(vhost,)] >= BATCH
        assert served["skred_shard_queues"][(vhost,)] >= 1
    status = shards.api(shards.leader, "GET", "/api/cluster")
    assert status["shards_led"] == Counter(want.values())[status["node_id"]]


def test_amqp_routed_by_vhost_through_a_third_node_survives_kill9_of_an_owner(shards: ShardCluster) -> None:
    """Two vhosts whose shards two different nodes lead, one of them the node serving the data
    (the cluster leader: a shard's leader does not serve it yet); a client on the third node,
    whose proxy reads each connection up to connection.open and carries it on by vhost, publishes
    with confirms into both; kill -9 of the serving owner; every confirmed message is there."""
    want = expected()
    wait_for(lambda: shards.leaders() == want, 15, "the initial placement")
    owner = shards.c.leader()
    assert owner is not None
    owner_id = IDS[shards.c.nodes.index(owner)]
    x = next(v for v, n in VHOSTS.items() if n == owner_id)
    y, other_id = next((v, n) for v, n in VHOSTS.items() if n != owner_id)
    third = next(shards.by_id[n] for n in IDS if n not in (owner_id, other_id))
    confirmed = {v: publish(third, v, "routed", BATCH) for v in (x, y)}
    # the owner authenticates (at start-ok, as a node reached directly does: pika names the 403
    # an authentication error) and judges the vhost; its answers reach the client
    with pytest.raises(pika.exceptions.ProbableAuthenticationError, match="403"):
        pika.BlockingConnection(pika.URLParameters(amqp_url(third, x).replace("guest@", "wrong@")))
    with pytest.raises(pika.exceptions.AMQPConnectionError, match="530"):
        pika.BlockingConnection(pika.URLParameters(amqp_url(third, "no-such-vhost")))
    owner.kill9()

    def publish_again() -> bool:
        try:
            confirmed[x] += publish(third, x, "routed", BATCH)
            return True
        except pika.exceptions.AMQPError:
            return False

    wait_for(publish_again, 20, f"confirmed publishes to {x} through {third.name} after the failover")
    owner.start()
    wait_for(lambda: shards.leaders() == want, HANDBACK_WAIT, "the shards back with the returning node")
    wait_for(owner.answers, 20, "the returned node's AMQP port")
    for v in (x, y):
        assert queue_depth(third, v, "routed") == confirmed[v]


def test_sigterm_drains_a_node_its_clients_reconnect_nothing_confirmed_lost(shards: ShardCluster) -> None:
    """The drained node resigns each of its shards (not left to its lease, nor to the runner's
    give-up after DRAIN_TIMEOUT: a cancel of the election loop lost in ``Etcd._call`` once
    did that, tests/test_cancel_kept.py); how long the move took is measured, not bounded."""
    trial = drain_and_return(shards, "drain", random.Random(2736))
    print(f"drained {trial.victim} (the cluster leader) moved {trial.moved} in {trial.moved_in}s "
          f"(resigned {trial.resigned}), exit {trial.exit_code}, client reconnects {trial.reconnects}, "
          f"hand-back {trial.handback}s, {trial.confirmed} confirmed, {trial.lost} lost")
    assert trial.notes == []
    assert trial.moved_in is not None and trial.resigned == trial.moved
    assert trial.exit_code == 0 and trial.reconnects >= 1
    assert trial.confirmed > 0 and trial.lost == 0
    # each shard moved once: the drained node's to another node, no other shard at all (the
    # new cluster leader's first ISR write left the other follower out of its own shards' ISR
    # keys until it synced; it resigned them, and took them back after its sync: twice)
    assert trial.moves == {v: int(v in trial.moved) for v in trial.moves}, trial.moves


def test_kill9_moves_only_its_shards_and_its_return_hands_them_back(shards: ShardCluster) -> None:
    """kill -9 of a node that does not hold ``<prefix>/leader``: its two shards, and only they,
    fail over within TTL + 2 s; on each of the four shards it did not lead a publisher (two on
    the cluster leader, two through the surviving follower's proxy, routed by vhost) waits less
    than 1 s between any two confirms from before the kill to 0.5 s past the failover (today
    the cluster leader serves every shard: the victim's own shards' clients are not timed); its
    return hands its shards back; nothing confirmed is lost."""
    trial = kill_and_return(shards, "t", random.Random(27))
    print(f"victim {trial.victim} moved {trial.moved}: failover {trial.failover}s, confirm gaps "
          f"{trial.gaps}, hand-back {trial.handback}s, {trial.confirmed} confirmed, {trial.lost} lost")
    assert trial.notes == []
    assert trial.failover is not None and trial.failover <= BOUND
    assert len(trial.gaps) == len(VHOSTS) - PER_NODE
    assert all(gap < 1.0 for gap in trial.gaps.values()), trial.gaps
    assert trial.confirmed > 0 and trial.lost == 0


def test_one_shards_isr_is_written_alone_and_a_mend_never_puts_a_member_back(shards: ShardCluster) -> None:
    """A member behind on one shard leaves that shard's ISR key alone (``write_shard_isr``,
    fenced on the leadership), and the leader's mending pass, which read the key before that
    write, does not put the member back (it compares the key's value as read), on the module's
    real etcd under a prefix of this test's own."""
    async def scenario() -> None:
        e = Etcd(shards.c.etcd.endpoint, f"{shards.c.prefix}-isr-alone", TTL)
        await e.connect()
        try:
            await e.grant_lease()
            assert await e.campaign("me", None)
            both = json.dumps(["a", "b"]).encode()
            assert await e.write_isr(["a", "b"], {"v": ["a", "b"], "w": ["a", "b"]})
            assert await e.write_shard_isr("v", ["a"])  # b behind on v only
            got = shard_isrs(await e.get_prefix(SHARDS))
            assert got == {"v": ["a"], "w": ["a", "b"]}
            # a mend that read v before the write above: refused, the key stays as written
            assert not await e.mend_shard_isrs({"v": (both, both)}, [], both)
            assert shard_isrs(await e.get_prefix(SHARDS))["v"] == ["a"]
            # one that read it as it is goes through (b holds v again)
            assert await e.mend_shard_isrs({"v": (json.dumps(["a"]).encode(), both)}, ["w"], both)
            assert shard_isrs(await e.get_prefix(SHARDS)) == {"v": ["a", "b"]}
            await e.resign()
            assert await e.write_shard_isr("v", ["a"]) is False  # not the leader: fenced
        finally:
            await e.revoke()
            await e.close()

    asyncio.run(scenario())


def test_a_shard_server_marks_its_key_and_writes_its_isr_fenced_on_its_own_term(
        shards: ShardCluster) -> None:
    """Step 2's keys: the node serving a shard says so on its leader key (``put_if``: only the
    key it created, kept on its lease) and writes the shard's ISR key itself, fenced on that
    shard's term, not on the cluster's leadership (``write_served_isr``); once the shard moved
    on (a successor's key) neither write of the old server goes through. Two etcd clients (two
    nodes' leases) on the module's real etcd, under a prefix of this test's own."""
    async def scenario() -> None:
        prefix = f"{shards.c.prefix}-served"
        old, new = Etcd(shards.c.etcd.endpoint, prefix, TTL), Etcd(shards.c.etcd.endpoint, prefix, TTL)
        for e in (old, new):
            await e.connect()
            await e.grant_lease()
        try:
            key = shard_key("v")
            term = await old.create_bound(key, b'{"node_id": "o", "uri": "tcp://o:1"}')
            assert term is not None
            assert shard_server((await old.get(key)) or b"") is None  # led, not served yet
            assert await old.put_if(key, term, b'{"node_id": "o", "serves": true, "uri": "tcp://o:1"}')
            assert shard_server((await old.get(key)) or b"") == "tcp://o:1"
            assert await old.write_served_isr("v", term, ["o", "n"])
            assert shard_isrs(await old.get_prefix(SHARDS)) == {"v": ["o", "n"]}
            # the shard moves: the old key goes (resigned or its lease expired), a successor wins
            assert await old.delete_if(key, term)
            won = await new.create_bound(key, b'{"node_id": "n", "uri": "tcp://n:1"}')
            assert won is not None and won != term
            assert not await old.put_if(key, term, b'{"node_id": "o", "serves": true, "uri": "tcp://o:1"}')
            assert await old.write_served_isr("v", term, ["o"]) is False  # fenced
            assert shard_isrs(await old.get_prefix(SHARDS)) == {"v": ["o", "n"]}
            assert shard_server((await new.get(key)) or b"") is None
            assert await new.write_served_isr("v", won, ["n"])
            assert shard_isrs(await new.get_prefix(SHARDS)) == {"v": ["n"]}
            # the hand-over's release names the holder's term, and only that holder's
            assert shard_released(await new.get_prefix(SHARDS), "v") is None
            assert not await old.release_shard("v", term)  # a term that no longer holds it
            assert await old.release_shard("v", won)
            assert shard_released(await new.get_prefix(SHARDS), "v") == won
        finally:
            for e in (old, new):
                await e.revoke()
                await e.close()

    asyncio.run(scenario())
