"""A cluster member without a leader to serve: what its clients, its log and its leader see.

Theory of operation: real etcd and real ``skred --clustering`` processes on loopback
(``test_cluster``'s helpers). A follower whose leader was killed -9 keeps the leader's key
in etcd until its lease expires (a long TTL here holds that window open): the follower's
proxy cannot reach anyone, and a client must hear so in its own protocol (pika reads an
AMQP ``connection.close`` 320, HTTP a 503 with a JSON reason), not be dropped. With etcd
killed, the nodes' retry loops (every 0.2 s) must not log a warning each time. A follower
whose own disk (a small tmpfs in a private mount namespace) cannot take the leader's files
must back off its bulk-sync retries instead of asking for one every 0.4 s.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import aio_pika
import pika
import pytest

from broker.mqtt import packets as P

from ._tmpfs import NEEDS, mount_tmpfs
from .test_cluster import Cluster, ClusterNode, wait_for
from .test_mqtt import Raw

pytestmark = pytest.mark.timeout(180)


def start_two(c: Cluster) -> tuple[ClusterNode, ClusterNode]:
    """Start two of the three nodes; the leader and its (synced) follower."""
    pair = c.nodes[:2]
    for n in pair:
        n.start()
    leader = wait_for(c.leader, 30, "a leader in etcd")
    wait_for(leader.answers, 30, "the leader's AMQP port")
    follower = next(n for n in pair if n is not leader)
    wait_for(follower.answers, 30, f"{follower.name}'s proxy (first sync done)")
    return leader, follower


def test_a_follower_without_a_leader_says_so_over_amqp_and_http(tmp_path: Path) -> None:
    c = Cluster(tmp_path, ttl=30)  # the dead leader's key lives on for up to 30 s
    try:
        leader, follower = start_two(c)
        leader.kill9()
        # The follower finds the leader gone (its link reset) while etcd still names it.
        wait_for(lambda: "replication from" in follower.log_text(), 20, "the follower losing its link")
        params = pika.URLParameters(follower.url + "?connection_attempts=1&socket_timeout=5")
        with pytest.raises(pika.exceptions.AMQPConnectionError) as refused:
            pika.BlockingConnection(params)
        text = repr(refused.value)
        print(f"\npika: {text}")
        assert "320" in text and "no cluster leader" in text, text

        req = urllib.request.Request(f"http://{follower.ip}:{follower.mgmt_port}/api/overview",
                                     headers={"Authorization": "Basic Z3Vlc3Q6Z3Vlc3Q="})
        with pytest.raises(urllib.error.HTTPError) as http:
            urllib.request.urlopen(req, timeout=10)
        assert http.value.code == 503
        body = json.loads(http.value.read())
        assert body["error"] == "service_unavailable" and "no cluster leader" in body["reason"], body
        # MQTT: a CONNACK "server unavailable" of the client's version (3; MQTT 5: 0x88)
        for level, code in ((4, P.SERVER_UNAVAILABLE), (5, P.RC_SERVER_UNAVAILABLE)):
            hello = P.Connect("MQTT", level, True, 30, "c", None, "u", b"p")
            mq = Raw(follower.ip, follower.mqtt_port, hello)
            try:
                assert mq.connack() == (0, code)
                assert mq.closed_within(5)
            finally:
                mq.close()
        assert c.leader() is leader, "the window closed before the checks: raise the TTL"
    finally:
        c.close()


def test_etcd_down_is_one_warning_not_one_per_retry(tmp_path: Path) -> None:
    c = Cluster(tmp_path)
    try:
        leader, follower = start_two(c)
        before_logs = [n.log_text() for n in (leader, follower)]
        c.etcd.kill9()
        down = 4.0  # the nodes retry every 0.2 s to 1 s: four or more warnings before the fix
        t0 = time.monotonic()
        wait_for(lambda: time.monotonic() - t0 >= down, down + 5, "the outage")  # its length
        c.etcd.start()
        for n, before in zip((leader, follower), before_logs, strict=True):
            new = n.log_text()[len(before):]
            warnings = [line for line in new.splitlines()
                        if re.search(r"WARNING broker[.\w]*: etcd(:| still failing)", line)]
            print(f"\n{n.name}: {len(warnings)} etcd warnings in {down:.0f}s of outage")
            assert 1 <= len(warnings) <= 3, f"{n.name}: {len(warnings)} etcd warnings in {down}s:\n" + \
                "\n".join(warnings[:10])
        wait_for(lambda: all("etcd answers again" in n.log_text() for n in (leader, follower)), 30,
                 "both nodes noticing etcd is back")
    finally:
        c.close()


async def publish_big(url: str, queue: str, count: int, size: int) -> None:
    conn = await aio_pika.connect(url, timeout=5)
    try:
        ch = await conn.channel(publisher_confirms=True)
        await ch.declare_queue(queue, durable=True)
        for _ in range(count):
            msg = aio_pika.Message(b"x" * size, delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
            await ch.default_exchange.publish(msg, routing_key=queue)
    finally:
        await conn.close()


@pytest.fixture
def tmpfs(tmp_path: Path):  # type: ignore[no-untyped-def]
    yield from mount_tmpfs(tmp_path, size=2 * 1024 * 1024)


@NEEDS
def test_a_follower_whose_disk_is_full_backs_off_its_bulk_sync(tmp_path: Path,
                                                                tmpfs: tuple[Path, int]) -> None:
    """The leader holds 4 MiB of messages; the follower's data dir is a 2 MiB tmpfs, so every
    bulk sync fails on its disk. Retries must back off (1 s, 2 s, 4 s ...), not come every
    0.4 s: over 6 s the leader sees at most three bulk syncs (2 backing off; 10 retrying every
    0.4 s, on a loaded machine; it was at most five in 10 s, which left the grown disk 5 s from
    the next retry). Once the disk has room, the next retry syncs."""
    mnt, holder = tmpfs
    c = Cluster(tmp_path)
    try:
        leader, spare = c.nodes[0], c.nodes[1]
        leader.start()
        wait_for(c.leader, 30, "a leader in etcd")
        wait_for(leader.answers, 30, "the leader's AMQP port")
        asyncio.run(asyncio.wait_for(publish_big(leader.url, "big", 40, 100 * 1024), 60))
        data_dir = mnt / "data"
        spare.argv = ["nsenter", "-t", str(holder), "-m", "--",
                      *[str(data_dir) if a == str(spare.data_dir) else a for a in spare.argv]]
        spare.start()
        wait_for(lambda: "No space left on device" in spare.log_text(), 30,
                 "the follower's disk refusing the sync")
        t0 = time.monotonic()
        before = leader.log_text().count("starting bulk sync")
        wait_for(lambda: time.monotonic() - t0 >= 6, 11, "six seconds of retries")  # the window measured
        syncs = leader.log_text().count("starting bulk sync") - before
        print(f"\n{syncs} bulk syncs in 6 s for a follower on a full disk")
        assert 1 <= syncs <= 3, f"{syncs} bulk syncs in 6 s: not backing off\n{spare.log_tail()}"
        assert spare.log_text().count("No space left on device") == 1  # said once, not per retry
        # Space freed (the tmpfs grown): the next retry, at most one back-off step away, syncs.
        grown = subprocess.run(["nsenter", "-t", str(holder), "-m", "--", "mount", "-o", "remount,size=32m",
                                str(mnt)], capture_output=True, timeout=30)
        assert grown.returncode == 0, grown.stderr
        wait_for(spare.answers, 45, "the follower synced once its disk had room")
    finally:
        c.close()
