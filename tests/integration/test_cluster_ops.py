"""Cluster operations: metrics and status, a stalled follower, a stalled disk, a network partition.

Theory of operation: reuses ``test_cluster``'s real etcd + three real ``skred
--clustering`` processes. Load comes from ``Publisher``, a thread running its
own asyncio loop that publishes persistent messages with confirms to one node
and timestamps every confirm, so a test can say when confirms stopped and
whether they resumed. The partition test puts etcd in a network namespace of
its own, joined to ours by a veth pair, and gives every node its own etcd
address there; deleting one of those addresses inside the namespace cuts one
node off from etcd while everything else keeps talking. It runs only as root
with ``ip netns`` available, and skips with the reason otherwise.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ._support import REPO_ROOT
from .cluster_faults import Publisher, free_test_net
from .test_cluster import (
    TTL,
    Cluster,
    ClusterNode,
    Etcd,
    consume_all,
    publish,
    start_cluster,
    wait_for,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """The same three-node cluster as test_cluster's fixture (etcd + nodes stopped by PID)."""
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


# ------------------------------------------------------------------ helpers

def http_get(url: str, auth: bool = False) -> bytes:
    req = urllib.request.Request(url)
    if auth:
        req.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
    with urllib.request.urlopen(req, timeout=5) as resp:
        body: bytes = resp.read()
        return body


def scrape(node: ClusterNode) -> dict[str, float]:
    """``{series: value}`` from a node's open metrics port (``{}`` if it does not answer)."""
    try:
        text = http_get(f"http://127.0.0.1:{node.metrics_port}/metrics").decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def isr(c: Cluster) -> list[str]:
    raw = c.etcd.get(f"{c.prefix}/isr")
    return list(json.loads(raw)) if raw else []


# ------------------------------------------------------------------ tests

def test_metrics_api_and_cluster_status(cluster: Cluster) -> None:
    c = cluster
    leader, followers = start_cluster(c)
    ids = {n.name: n.node_id() for n in c.nodes}
    wait_for(lambda: len(isr(c)) == 3, 30, "all three nodes in the ISR")

    m = wait_for(lambda: (m := scrape(leader)) and m.get("skred_connected_followers") == 2 and m, 10,
                 "leader metrics with two followers")
    assert m["skred_is_leader"] == 1
    for f in followers:
        assert f'skred_follower_lag_in_bytes{{id="{ids[f.name]}"}}' in m, m
    for f in followers:
        fm = wait_for(lambda f=f: scrape(f), 10, f"{f.name}'s metrics port")
        assert fm["skred_is_leader"] == 0, fm
        assert fm["skred_connected_followers"] == 0
        # every node exports its own process, memory and disk, under the cluster's one name
        for series in ("skred_process_resident_memory_bytes", "rabbitmq_disk_space_available_bytes",
                       "rabbitmq_process_open_fds"):
            assert fm.get(series, 0) > 0, (series, fm)
        assert any(k.startswith("rabbitmq_identity_info{") and f'rabbitmq_cluster="{c.prefix}"' in k
                   for k in fm), fm
    assert any(k.startswith("rabbitmq_identity_info{") and f'rabbitmq_cluster="{c.prefix}"' in k for k in m)

    # GET /api/cluster: on the leader, and through a follower's HTTP proxy (the leader's view too).
    for node in (leader, followers[0]):
        st = json.loads(http_get(f"http://{node.ip}:{node.mgmt_port}/api/cluster", auth=True))
        assert st["enabled"] is True and st["role"] == "leader", st
        assert st["leader"] == {"node_id": ids[leader.name], "uri": leader.uri}
        assert st["isr"] == sorted(ids.values())
        assert sorted(f["node_id"] for f in st["followers"]) == sorted(ids[f.name] for f in followers)
        assert all(isinstance(f["lag_bytes"], int) and f["in_isr"] for f in st["followers"]), st

    # skred --cluster-status reads etcd only: leader, ISR, and the live members with their roles.
    base = [sys.executable, "-m", "broker", "--cluster-status", "--clustering-etcd-endpoints",
            c.etcd.endpoint, "--clustering-etcd-prefix", c.prefix]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))

    want_roles = {ids[n.name]: ("leader" if n is leader else "follower") for n in c.nodes}

    def status_json() -> dict[str, Any] | None:
        """The status once every member's record names its role: a node rewrites its record
        about once a second, so a follower's may still say 'candidate' just after it joined."""
        out = subprocess.run([*base, "--json"], capture_output=True, timeout=20, env=env, cwd=REPO_ROOT)
        assert out.returncode == 0, out.stderr.decode()
        doc: dict[str, Any] = json.loads(out.stdout)
        return doc if {m["node_id"]: m["role"] for m in doc["members"]} == want_roles else None

    doc = wait_for(status_json, 15, f"three live member records with their roles {want_roles}")
    assert doc["leader"] == {"node_id": ids[leader.name], "uri": leader.uri}
    assert doc["isr"] == sorted(ids.values())
    table = subprocess.run(base, capture_output=True, timeout=20, env=env, cwd=REPO_ROOT)
    assert table.returncode == 0, table.stderr.decode()
    text = table.stdout.decode()
    assert f"leader: {ids[leader.name]} {leader.uri}" in text, text
    assert "NODE" in text and "LAG BYTES" in text and text.count(" yes ") == 3, text

    # Unreachable etcd: one line on stderr, exit status 1.
    bad = subprocess.run([sys.executable, "-m", "broker", "--cluster-status", "--clustering-etcd-endpoints",
                          "127.0.0.1:1"], capture_output=True, timeout=30, env=env, cwd=REPO_ROOT)
    assert bad.returncode == 1 and b"cannot read cluster status" in bad.stderr, bad


def test_follower_that_stops_acking_is_dropped_then_resyncs(cluster: Cluster) -> None:
    c = cluster
    leader, followers = start_cluster(c)
    wait_for(lambda: len(isr(c)) == 3, 30, "all three nodes in the ISR")
    frozen = followers[0]
    fid = frozen.node_id()
    lag_key = f'skred_follower_lag_in_bytes{{id="{fid}"}}'
    assert frozen.proc is not None
    with Publisher(leader.url, "stall-q") as pub:
        wait_for(lambda: pub.count() >= 200, 10, "publishing under way")
        os.kill(frozen.proc.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            # The leader's lag for the frozen follower grows (visible in its metrics) ...
            wait_for(lambda: scrape(leader).get(lag_key, 0) > 0, 10, "the frozen follower's lag in metrics")
            # ... until, after 3 s without an ack, it is dropped from the ISR in etcd.
            wait_for(lambda: fid not in isr(c) and len(isr(c)) == 2, 10, "the frozen follower out of the ISR")
            dropped = time.monotonic() - stopped_at
            print(f"\nfollower dropped from the ISR {dropped:.2f}s after it stopped acking")
            assert dropped >= 2.5, dropped
            assert "no ack for" in leader.log_text()
            # Confirms continue without it.
            before = pub.count()
            wait_for(lambda: pub.count() >= before + 200, 10, "confirms after the drop")
            assert lag_key not in scrape(leader)
        finally:
            os.kill(frozen.proc.pid, signal.SIGCONT)
        # Thawed, it reconnects, bulk-syncs again and rejoins the ISR while publishing goes on.
        wait_for(lambda: fid in isr(c), 20, "the thawed follower back in the ISR")
        before = pub.count()
        wait_for(lambda: pub.count() >= before + 100, 10, "confirms with the follower back")
    assert pub.error is None, repr(pub.error)
    assert frozen.log_text().count("bulk sync complete") >= 2


def test_leader_with_stalled_disk_gives_up_lease(cluster: Cluster, tmp_path: Path) -> None:
    c = cluster
    stall_timeout = 2
    for n in c.nodes:
        # the test's own composition root: fsync blocks while stall-<name> exists
        assert n.argv[1:3] == ["-m", "broker"]
        n.argv[1:3] = [str(Path(__file__).with_name("_stalling_node.py")), str(tmp_path / f"stall-{n.name}")]
        n.argv += ["--clustering-disk-stall-timeout", str(stall_timeout)]
    leader, _followers = start_cluster(c)
    ok: list[int] = []
    asyncio.run(asyncio.wait_for(publish(leader.url, "disk-q", 0, 50, ok), 20))
    assert len(ok) == 50
    wait_for(lambda: len(isr(c)) == 3, 30, "all three nodes in the ISR")
    assert leader.proc is not None

    (tmp_path / f"stall-{leader.name}").touch()  # from now on the leader's fsync never returns
    stuck: list[int] = []

    async def publish_into_stall() -> float:
        task = asyncio.ensure_future(publish(leader.url, "disk-q", 1000, 1, stuck))
        t0 = time.monotonic()
        while leader.proc is not None and leader.proc.poll() is None and time.monotonic() - t0 < 15:
            await asyncio.sleep(0.05)  # poll for the process exit, bounded
        await asyncio.gather(task, return_exceptions=True)
        return time.monotonic() - t0

    gave_up = asyncio.run(asyncio.wait_for(publish_into_stall(), 30))
    print(f"\nleader with a stalled fsync exited {gave_up:.2f}s after the stall began "
          f"(disk_stall_timeout {stall_timeout}s)")
    assert leader.proc.poll() == 1, c.diag()
    assert stuck == [], "a message was confirmed although its fsync never returned"
    assert "fsync stalled" in leader.log_text()
    assert stall_timeout <= gave_up < stall_timeout + 3, gave_up

    new = wait_for(lambda: (n := c.leader()) is not None and n is not leader and n.answers() and n,
                   TTL + 10, "a new leader after the disk stall")
    got = asyncio.run(asyncio.wait_for(consume_all(new.url, "disk-q", 50), 30))
    assert set(range(50)) <= set(got), sorted(set(range(50)) - set(got))[:10]
    assert f"follower {leader.node_id()} {leader.uri}" in c.hook_file.read_text().splitlines()


# ------------------------------------------------------------------ partition

def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


class NetnsEtcd(Etcd):
    """etcd in its own network namespace, reached over a veth pair; node ``i`` uses address .1i.

    Addresses come from 198.18.0.0/15 (reserved for network tests); traffic goes only to
    addresses inside the namespace this creates. ``cut(i)`` deletes node i's address in the
    namespace: its packets are then silently dropped, the others are untouched.
    """

    def __init__(self, tmp: Path, ns: str, net: str) -> None:
        self.ns = ns
        self.net = net
        super().__init__(tmp, host=f"{net}.2", listen="0.0.0.0", wrapper=("ip", "netns", "exec", ns))

    def node_endpoint(self, index: int) -> str:
        return f"{self.net}.{11 + index}:{self.client_port}"

    def cut(self, index: int) -> None:
        out = _ip("-n", self.ns, "addr", "del", f"{self.net}.{11 + index}/32", "dev", "ve0")
        assert out.returncode == 0, out.stderr

    def heal(self, index: int) -> None:
        out = _ip("-n", self.ns, "addr", "add", f"{self.net}.{11 + index}/32", "dev", "ve0")
        assert out.returncode == 0, out.stderr


def _netns_setup() -> tuple[str, str]:
    """Create a namespace + veth pair; returns (namespace, /24 prefix); skips where impossible."""
    if os.geteuid() != 0:
        pytest.skip("partition test needs root (ip netns)")
    if shutil.which("ip") is None:
        pytest.skip("partition test needs the ip command")
    tag = uuid.uuid4().hex[:8]
    ns, host_if = f"skt{tag}", f"skh{tag}"
    net = free_test_net("198.18")
    if net is None:
        pytest.skip("no free 198.18.x.0/24 test network")
    made = _ip("netns", "add", ns)
    if made.returncode != 0:
        pytest.skip(f"ip netns add not permitted here: {made.stderr.strip()}")
    steps = [
        ("link", "add", host_if, "type", "veth", "peer", "name", "ve0", "netns", ns),
        ("addr", "add", f"{net}.1/24", "dev", host_if),
        ("link", "set", host_if, "up"),
        ("-n", ns, "link", "set", "lo", "up"),
        ("-n", ns, "addr", "add", f"{net}.2/24", "dev", "ve0"),
        *[("-n", ns, "addr", "add", f"{net}.{11 + i}/32", "dev", "ve0") for i in range(3)],
        ("-n", ns, "link", "set", "ve0", "up"),
    ]
    for step in steps:
        out = _ip(*step)
        if out.returncode != 0:
            _ip("netns", "del", ns)
            pytest.skip(f"cannot set up the test network ({' '.join(step)}): {out.stderr.strip()}")
    return ns, net


@pytest.fixture
def partition_cluster(tmp_path: Path) -> Iterator[tuple[Cluster, NetnsEtcd]]:
    ns, _net = _netns_setup()
    try:
        etcd = NetnsEtcd(tmp_path, ns, _net)
        c = Cluster(tmp_path, etcd)
        try:
            yield c, etcd
        finally:
            c.close()
    finally:
        _ip("netns", "del", ns)  # takes the veth pair with it


def test_leader_partitioned_from_etcd_stops_confirming_within_ttl(
        partition_cluster: tuple[Cluster, NetnsEtcd]) -> None:
    c, etcd = partition_cluster
    leader, _followers = start_cluster(c)
    wait_for(lambda: len(isr(c)) == 3, 30, "all three nodes in the ISR")
    index = c.nodes.index(leader)
    with Publisher(leader.url, "part-q", limit=30) as pub:
        wait_for(lambda: pub.count() >= 200, 10, "publishing under way")
        etcd.cut(index)
        cut_at = time.monotonic()
        try:
            new = wait_for(lambda: (n := c.leader()) is not None and n is not leader and n, TTL + 10,
                           "another node elected")
            new_seen = time.monotonic()
            wait_for(lambda: pub.error is not None or not leader.answers(), TTL + 5,
                     "the cut-off leader to stop serving")
        finally:
            etcd.heal(index)
    last = max(pub.confirm_times)
    print(f"\npartitioned leader: last confirm {last - cut_at:.2f}s after the cut (TTL {TTL}s); "
          f"new leader in etcd after {new_seen - cut_at:.2f}s")
    assert last - cut_at <= TTL + 0.3, last - cut_at
    assert last < new_seen, "the old leader confirmed after another node was elected"
    assert "stepping down: lease lost" in leader.log_text()

    # Every confirm the old leader sent is on the new one; the old leader rejoins as a follower.
    wait_for(new.answers, 20, "the new leader serving clients")
    got = asyncio.run(asyncio.wait_for(consume_all(new.url, "part-q", len(pub.confirmed)), 60))
    missing = set(pub.confirmed) - set(got)
    assert not missing, f"{len(missing)} confirmed messages lost, e.g. {sorted(missing)[:10]}"
    wait_for(lambda: leader.node_id() in isr(c), 30, "the healed old leader back in the ISR")
