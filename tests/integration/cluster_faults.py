"""Fault injection for cluster chaos tests and ``benchmarks/chaos.py`` (not a test module).

Theory of operation: ``NetLab`` gives every cluster node a network namespace of its own,
joined by a veth pair to a bridge in our namespace; etcd and the test client stay here and
reach the nodes over the bridge (addresses from 198.18.0.0/15, reserved for network tests).
``cut(a, b)`` adds blackhole routes in both nodes' namespaces so the packets between them
are dropped (an established TCP connection sees silence, not a reset); ``isolate(a)`` takes
the node's link down, so nobody (etcd, peers, clients) hears from it. ``heal`` undoes both.

The scenario helpers run one fault against a running three-node ``Cluster`` and return a
``Trial``: what was confirmed and lost, which acked messages came back, which messages
delivered before the fault came back without the redelivered flag, and the failover time
(fault to a leader serving clients again, when the fault causes one).
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import aio_pika

from .test_cluster import Cluster, ClusterNode, Etcd, publish, start_cluster, wait_for


def ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


def netlab_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    if shutil.which("ip") is None:
        return "needs the ip command"
    return None


class NetLab:
    """A bridge here and one namespace per node; ``close`` removes all of it."""

    def __init__(self, count: int = 3) -> None:
        tag = uuid.uuid4().hex[:6]
        self.bridge = f"skb{tag}"
        used = ip("-4", "addr").stdout
        for _ in range(50):
            net = f"198.19.{random.randrange(256)}"
            if f"{net}." not in used:
                break
        else:
            raise RuntimeError("no free 198.19.x.0/24 test network")
        self.net = net
        self.namespaces = [f"skn{tag}{i}" for i in range(count)]
        self.links = [f"skv{tag}{i}" for i in range(count)]
        self.ips = [f"{net}.{11 + i}" for i in range(count)]
        self._routes: set[tuple[int, int]] = set()
        steps: list[tuple[str, ...]] = [
            ("link", "add", self.bridge, "type", "bridge"),
            ("addr", "add", f"{net}.1/24", "dev", self.bridge),
            ("link", "set", self.bridge, "up"),
        ]
        for ns, link, addr in zip(self.namespaces, self.links, self.ips, strict=True):
            steps += [
                ("netns", "add", ns),
                ("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns),
                ("link", "set", link, "master", self.bridge, "up"),
                ("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0"),
                ("-n", ns, "link", "set", "eth0", "up"),
                ("-n", ns, "link", "set", "lo", "up"),
            ]
        for step in steps:
            out = ip(*step)
            if out.returncode != 0:
                self.close()
                raise RuntimeError(f"cannot set up the test network ({' '.join(step)}): {out.stderr.strip()}")

    @property
    def host(self) -> str:
        return f"{self.net}.1"

    def wrapper(self, i: int) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.namespaces[i])

    def cut(self, a: int, b: int) -> None:
        """Drop every packet between nodes a and b (both directions)."""
        for x, y in ((a, b), (b, a)):
            out = ip("-n", self.namespaces[x], "route", "add", "blackhole", f"{self.ips[y]}/32")
            assert out.returncode == 0, out.stderr
            self._routes.add((x, y))

    def isolate(self, a: int) -> None:
        out = ip("link", "set", self.links[a], "down")
        assert out.returncode == 0, out.stderr

    def heal(self) -> None:
        for x, y in list(self._routes):
            ip("-n", self.namespaces[x], "route", "del", "blackhole", f"{self.ips[y]}/32")
            self._routes.discard((x, y))
        for link in self.links:
            ip("link", "set", link, "up")

    def close(self) -> None:
        for ns in self.namespaces:
            ip("netns", "del", ns)  # takes its veth pair with it
        ip("link", "del", self.bridge)


def lab_cluster(tmp: Path, lab: NetLab, ttl: int) -> Cluster:
    etcd = Etcd(tmp, host=lab.host)
    c = Cluster(tmp, etcd, ttl=ttl, ips=lab.ips, wrappers=[lab.wrapper(i) for i in range(3)])
    for n in c.nodes:  # clients reach these nodes from a non-loopback address
        n.user = "chaos"
        n.argv += ["--default-user", n.user, "--default-password", n.user]
    return c


# ------------------------------------------------------------------ measuring

@dataclass
class Trial:
    fault: str
    confirmed: int = 0
    lost: int = 0
    resurrected: int = 0
    missing_redelivered: int = 0
    failover: float | None = None
    notes: list[str] = field(default_factory=list)


def serving_leader(c: Cluster, exclude: ClusterNode | None = None) -> ClusterNode | None:
    n = c.leader()
    return n if n is not None and n is not exclude and n.answers() else None


async def consume_some(url: str, queue: str, count: int) -> list[int]:
    """Ack ``count`` messages (one by one, so every ack is its own ack-file entry)."""
    conn = await aio_pika.connect(url, timeout=5)
    got: list[int] = []
    try:
        ch = await conn.channel()
        await ch.set_qos(prefetch_count=100)
        q = await ch.declare_queue(queue, durable=True)
        async with q.iterator() as it:
            async for msg in it:
                got.append(int(msg.body))
                await msg.ack()
                if len(got) >= count:
                    break
    finally:
        await conn.close()
    return got


async def hold_unacked(url: str, queue: str, count: int) -> tuple[aio_pika.abc.AbstractConnection, list[int]]:
    """Take ``count`` deliveries and keep them unacked (the connection stays open)."""
    conn = await aio_pika.connect(url, timeout=5)
    ch = await conn.channel()
    await ch.set_qos(prefetch_count=count)
    q = await ch.declare_queue(queue, durable=True)
    got: list[int] = []
    done = asyncio.Event()

    async def on_message(msg: aio_pika.abc.AbstractIncomingMessage) -> None:
        got.append(int(msg.body))
        if len(got) >= count:
            done.set()

    await q.consume(on_message)
    await asyncio.wait_for(done.wait(), 20)
    return conn, got


async def drain(url: str, queue: str) -> list[tuple[int, bool]]:
    """Consume (ack) until the queue stays idle: [(number, redelivered)]."""
    conn = await aio_pika.connect(url, timeout=5)
    got: list[tuple[int, bool]] = []
    try:
        ch = await conn.channel()
        await ch.set_qos(prefetch_count=1000)
        q = await ch.declare_queue(queue, durable=True)

        async def on_message(msg: aio_pika.abc.AbstractIncomingMessage) -> None:
            got.append((int(msg.body), bool(msg.redelivered)))
            await msg.ack()

        await q.consume(on_message)
        seen, idle_since = -1, time.monotonic()
        while time.monotonic() - idle_since < 2.0:
            if len(got) != seen:
                seen, idle_since = len(got), time.monotonic()
            await asyncio.sleep(0.1)  # progress poll; ends after a bounded idle period
    finally:
        await conn.close()
    return got


def ack_bytes(node: ClusterNode) -> int:
    return sum(p.stat().st_size for p in node.data_dir.rglob("acks.*") if p.is_file())


def score(trial: Trial, confirmed: list[int], acked: list[int], delivered: list[int],
          got: list[tuple[int, bool]]) -> Trial:
    numbers = {n for n, _ in got}
    trial.confirmed = len(confirmed)
    trial.lost = len(set(confirmed) - set(acked) - numbers)
    trial.resurrected = len(set(acked) & numbers)
    redelivered = {n for n, r in got if r}
    trial.missing_redelivered = len((set(delivered) & numbers) - redelivered)
    return trial


# ------------------------------------------------------------------ scenarios

N_MSGS = 400
N_ACK = 150
N_HOLD = 50


def quick_restart_of_leader(c: Cluster, queue: str) -> Trial:
    """Publish, ack some (acks only in the leader's memory + followers' disks), hold some
    unacked, kill -9 the leader and restart it at once; then count what comes back."""
    trial = Trial("quick restart of the old leader")
    leader = wait_for(lambda: serving_leader(c), 30, "a serving leader")
    followers = [n for n in c.nodes if n is not leader]
    for f in followers:
        wait_for(f.answers, 30, f"{f.name} serving (synced)")
    confirmed: list[int] = []
    asyncio.run(asyncio.wait_for(publish(leader.url, queue, 0, N_MSGS, confirmed, batch=100), 60))
    before = [ack_bytes(f) for f in followers]
    acked = asyncio.run(asyncio.wait_for(consume_some(leader.url, queue, N_ACK), 60))

    async def hold_and_kill() -> list[int]:
        conn, held = await hold_unacked(leader.url, queue, N_HOLD)
        # Every ack is on the followers' disks (they fsync before acking the leader) ...
        deadline = time.monotonic() + 20
        while any(ack_bytes(f) < b + 4 * N_ACK for f, b in zip(followers, before, strict=True)):
            assert time.monotonic() < deadline, "followers never got the acks"
            await asyncio.sleep(0.05)
        # ... and the leader dies before a confirm or a timer writes them to its own.
        leader.kill9()
        leader.start()
        await asyncio.gather(conn.close(), return_exceptions=True)
        return held

    killed = time.monotonic()
    held = asyncio.run(asyncio.wait_for(hold_and_kill(), 60))
    new = wait_for(lambda: serving_leader(c), c.ttl + 30, "a leader after the quick restart")
    trial.failover = time.monotonic() - killed
    if new is leader:
        trial.notes.append("the restarted node won the election")
    got = asyncio.run(asyncio.wait_for(drain(new.url, queue), 60))
    return score(trial, confirmed, acked, held, got)


def etcd_pause(c: Cluster, queue: str, seconds: float) -> Trial:
    """SIGSTOP etcd for ``seconds`` while publishing to the leader; failover = time without confirms."""
    from .test_cluster_ops import Publisher

    trial = Trial(f"etcd paused {seconds:g}s")
    leader = wait_for(lambda: serving_leader(c), 30, "a serving leader")
    with Publisher(leader.url, queue, limit=seconds + 40) as pub:
        wait_for(lambda: pub.count() >= 100, 20, "publishing under way")
        os.kill(c.etcd.proc.pid, signal.SIGSTOP)
        paused = time.monotonic()
        try:
            wait_for(lambda: time.monotonic() - paused >= seconds, seconds + 5, "the pause")
        finally:
            os.kill(c.etcd.proc.pid, signal.SIGCONT)
        resumed = time.monotonic()
        at = pub.count()
        wait_for(lambda: pub.count() >= at + 100 or pub.error is not None, 30, "confirms after the pause")
    if "stepping down" in leader.log_text():
        trial.notes.append("the leader stepped down")
    if pub.error is not None:
        trial.notes.append(f"publisher: {pub.error!r}")
    times = sorted(pub.confirm_times)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False) if b > paused - 1 and a < resumed + 30]
    trial.failover = max(gaps, default=0.0)
    new = wait_for(lambda: serving_leader(c), 30, "a serving leader")
    got = asyncio.run(asyncio.wait_for(drain(new.url, queue), 60))
    return score(trial, pub.confirmed, [], [], got)
