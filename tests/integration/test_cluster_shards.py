"""Per-shard leaders across a real 3-node cluster (``[clustering] shard_leaders``).

One cluster for the module (real etcd, three real broker processes, TTL 2 s): six vhosts get
their shard leaders spread 2/2/2 (etcd, ``skred --cluster-status``, ``GET /api/cluster``);
confirmed publishes reach every vhost through every node; kill -9 of a node moves only its
shards, within TTL + 2 s, while a publisher on another shard keeps confirming; the node's
return hands its shards back; nothing confirmed is lost.

Node ids are fixed (``.node_id`` written before the first start) and the vhost names chosen
by the placement function so that each node is preferred for two of them: with random ids
rendezvous hashing spreads shards only about evenly.

Scope (broker/shards/leaders.py): the election is per shard; clients are still served by the
cluster leader, so the node killed here is one that does not hold ``<prefix>/leader``.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pytest

from broker.shards.placement import node_of, vhost_shard

from ._support import REPO_ROOT
from .test_cluster import Cluster, ClusterNode, start_cluster, wait_for

pytestmark = pytest.mark.timeout(180)

TTL = 2
IDS = ["node-a", "node-b", "node-c"]
PER_NODE = 2
BATCH = 10  # confirmed messages per (vhost, node) in the publish round
GAP_RUN = 12.0  # longest the background publisher runs (seconds), bounded in count too
GAP_MAX = 5000


def pick_vhosts() -> dict[str, str]:
    """Six vhost names, two preferred by each node: vhost -> node id."""
    nodes = dict.fromkeys(IDS, 1)
    chosen: dict[str, str] = {}
    for i in range(1000):
        name = f"shard{i}"
        owner = node_of(vhost_shard(name), nodes)
        if sum(1 for o in chosen.values() if o == owner) < PER_NODE:
            chosen[name] = owner
        if len(chosen) == PER_NODE * len(IDS):
            return chosen
    raise AssertionError("placement never reached two vhosts per node")


VHOSTS = pick_vhosts()


class ShardCluster:
    def __init__(self, tmp: Path) -> None:
        self.c = Cluster(tmp, ttl=TTL)
        self.by_id: dict[str, ClusterNode] = {}
        for node, nid in zip(self.c.nodes, IDS, strict=True):
            node.argv.append("--clustering-shard-leaders")
            node.data_dir.mkdir(parents=True, exist_ok=True)
            (node.data_dir / ".node_id").write_text(nid + "\n")
            self.by_id[nid] = node
        self.leader, _followers = start_cluster(self.c)

    def leaders(self) -> dict[str, str]:
        """vhost -> node id, from etcd's shard keys."""
        out = self.c.etcd._ctl("get", f"{self.c.prefix}/shards/", "--prefix")
        lines = out.stdout.decode().splitlines()
        found = {}
        for key, value in zip(lines[0::2], lines[1::2], strict=False):
            vhost = urllib.parse.unquote(key.split("/")[-2])
            found[vhost] = json.loads(value)["node_id"]
        return found

    def api(self, node: ClusterNode, method: str, path: str, body: Any = None) -> Any:
        req = urllib.request.Request(f"http://{node.ip}:{node.mgmt_port}{path}", method=method,
                                     data=None if body is None else json.dumps(body).encode())
        req.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=10) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def close(self) -> None:
        self.c.close()


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShardCluster]:
    sc = ShardCluster(tmp_path_factory.mktemp("shards"))
    try:
        for vhost in VHOSTS:
            sc.api(sc.leader, "PUT", f"/api/vhosts/{vhost}")
            sc.api(sc.leader, "PUT", f"/api/permissions/{vhost}/guest",
                   {"configure": ".*", "write": ".*", "read": ".*"})
        yield sc
    except BaseException:
        print(sc.c.diag())
        raise
    finally:
        sc.close()


def expected() -> dict[str, str]:
    return {**VHOSTS, "/": node_of(vhost_shard("/"), dict.fromkeys(IDS, 1))}


def publish(node: ClusterNode, vhost: str, queue: str, count: int) -> int:
    params = pika.URLParameters(f"amqp://guest:guest@{node.ip}:{node.port}/{urllib.parse.quote(vhost, safe='')}")
    with pika.BlockingConnection(params) as conn:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare(queue, durable=True)
        for i in range(count):
            ch.basic_publish("", queue, f"{vhost}-{i}".encode(), pika.BasicProperties(delivery_mode=2),
                             mandatory=True)
    return count


def queue_depth(node: ClusterNode, vhost: str, queue: str) -> int:
    params = pika.URLParameters(f"amqp://guest:guest@{node.ip}:{node.port}/{urllib.parse.quote(vhost, safe='')}")
    with pika.BlockingConnection(params) as conn:
        return int(conn.channel().queue_declare(queue, passive=True).method.message_count)


class GapPublisher(threading.Thread):
    """Confirmed publishes to one vhost through one node, one at a time; records the largest
    gap between confirms. Bounded: GAP_MAX messages or GAP_RUN seconds, or until stopped."""

    def __init__(self, node: ClusterNode, vhost: str) -> None:
        super().__init__(daemon=True)
        self.node, self.vhost = node, vhost
        self.stop_at = threading.Event()
        self.confirmed = 0
        self.largest_gap = 0.0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            params = pika.URLParameters(
                f"amqp://guest:guest@{self.node.ip}:{self.node.port}/{urllib.parse.quote(self.vhost, safe='')}")
            with pika.BlockingConnection(params) as conn:
                ch = conn.channel()
                ch.confirm_delivery()
                ch.queue_declare("gap", durable=True)
                last = started = time.monotonic()
                while (not self.stop_at.is_set() and self.confirmed < GAP_MAX
                       and time.monotonic() - started < GAP_RUN):
                    ch.basic_publish("", "gap", b"x", pika.BasicProperties(delivery_mode=2))
                    now = time.monotonic()
                    self.largest_gap = max(self.largest_gap, now - last)
                    last = now
                    self.confirmed += 1
                    time.sleep(0.01)  # a steady trickle, not a flood, on a shared machine
        except BaseException as exc:  # reported by the test
            self.error = exc


def cluster_status(sc: ShardCluster) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "broker", "--cluster-status", "--json", "--clustering",
         "--clustering-shard-leaders", "--clustering-etcd-endpoints", sc.c.etcd.endpoint,
         "--clustering-etcd-prefix", sc.c.prefix],
        cwd=str(REPO_ROOT), capture_output=True, timeout=30, check=True)
    return dict(json.loads(out.stdout))


def test_six_vhosts_spread_two_per_node_everywhere_it_shows(shards: ShardCluster) -> None:
    want = expected()
    wait_for(lambda: shards.leaders() == want, 15, f"shard leaders {want} (have {shards.leaders()})")
    assert Counter(VHOSTS.values()) == dict.fromkeys(IDS, PER_NODE)
    status = cluster_status(shards)
    assert {s["vhost"]: s["leader"] for s in status["shards"]} == want
    led = {m["node_id"]: m["shards_led"] for m in status["members"]}
    assert led == dict(Counter(want.values()))
    follower = next(n for n in shards.c.nodes if n is not shards.leader)
    view = shards.api(follower, "GET", "/api/cluster")  # a follower's port: the leader's view
    assert {s["vhost"]: s["leader"] for s in view["shards"]} == want


def test_confirmed_publishes_reach_every_vhost_through_every_node(shards: ShardCluster) -> None:
    for vhost in VHOSTS:
        for node in shards.c.nodes:
            publish(node, vhost, "q", BATCH)
    for vhost in VHOSTS:
        assert queue_depth(shards.c.nodes[0], vhost, "q") == BATCH * len(shards.c.nodes)


def test_kill9_moves_only_its_shards_and_its_return_hands_them_back(shards: ShardCluster) -> None:
    want = expected()
    wait_for(lambda: shards.leaders() == want, 15, "the initial placement")
    data_leader = shards.c.leader()
    assert data_leader is not None
    leader_id = IDS[shards.c.nodes.index(data_leader)]
    victim_id = next(n for n in IDS if n != leader_id)
    victim = shards.by_id[victim_id]
    moved = {v for v, n in want.items() if n == victim_id}
    # a shard the victim does not lead, published to through the cluster leader meanwhile
    other = next(v for v, n in VHOSTS.items() if n != victim_id)
    gap = GapPublisher(data_leader, other)
    gap.start()
    wait_for(lambda: gap.confirmed >= 20 or gap.error, 10, "the gap publisher under way")
    killed = time.monotonic()
    victim.kill9()

    def failed_over() -> bool:
        now = shards.leaders()
        return all(now.get(v) not in (None, victim_id) for v in moved)

    wait_for(failed_over, TTL + 2 + 1, "the victim's shards on other nodes")
    failover = time.monotonic() - killed
    after = shards.leaders()
    assert {v: n for v, n in after.items() if v not in moved} == {v: n for v, n in want.items() if v not in moved}
    time.sleep(0.5)  # the publisher keeps running past the failover (the thread measures)
    gap.stop_at.set()
    gap.join(30)
    assert gap.error is None, gap.error
    print(f"failover {failover:.2f}s, largest confirm gap on {other!r}: {gap.largest_gap * 1000:.0f} ms "
          f"over {gap.confirmed} confirms")
    assert failover <= TTL + 2
    assert gap.largest_gap < 1.0
    for vhost in moved:  # the moved shards take confirmed publishes through a surviving node
        publish(data_leader, vhost, "q", BATCH)

    victim.start()
    wait_for(lambda: shards.leaders() == want, 30, "the shards handed back to the returning node")
    wait_for(victim.answers, 10, "the returned node's proxy")
    for vhost in VHOSTS:
        extra = BATCH if vhost in moved else 0
        assert queue_depth(victim, vhost, "q") == BATCH * len(shards.c.nodes) + extra
    assert queue_depth(victim, other, "gap") == gap.confirmed
