"""A follower cut off from its leader: its proxied clients must not keep deliveries locked.

Theory of operation: two real ``skred --clustering`` nodes, each in a network namespace of its
own (``cluster_faults.NetLab``), etcd and the test's clients in ours. A consumer connected
through the follower's proxy (a tunnel to the leader) holds unacked deliveries; then only
the follower<->leader path is cut (blackhole routes: silence, no reset), while both nodes
still reach etcd and the clients. The leader drops the follower (no acks for 3 s) and must
close that follower's tunnels with it, so the consumer's connection on the leader closes and
its deliveries go back to the queue: a consumer on the leader gets all of them, flagged
redelivered, within a bound (before the fix they stayed locked for as long as the cut
lasted). The follower closes its side too (the client's socket ends).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import aio_pika
import pytest

from .cluster_faults import NetLab, hold_unacked, lab_cluster, open_lab
from .test_cluster import publish, wait_for

pytestmark = [pytest.mark.timeout(180), pytest.mark.chaos]

HELD = 20
BOUND = 15.0  # seconds from the cut to every held delivery redelivered on the leader


@pytest.fixture
def lab() -> Iterator[NetLab]:
    yield from open_lab(count=2)


async def redelivered(url: str, queue: str, count: int, deadline: float) -> list[tuple[int, bool]]:
    """Consume (ack) until ``count`` messages came or ``deadline`` (monotonic) passed."""
    conn = await aio_pika.connect(url, timeout=5)
    got: list[tuple[int, bool]] = []
    try:
        ch = await conn.channel()
        await ch.set_qos(prefetch_count=count)
        q = await ch.declare_queue(queue, durable=True)
        all_in = asyncio.Event()

        async def on_message(msg: aio_pika.abc.AbstractIncomingMessage) -> None:
            got.append((int(msg.body), bool(msg.redelivered)))
            await msg.ack()
            if len(got) >= count:
                all_in.set()

        await q.consume(on_message)
        try:
            await asyncio.wait_for(all_in.wait(), max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            pass
    finally:
        await asyncio.gather(conn.close(), return_exceptions=True)
    return got


async def quiet_close(conn: aio_pika.abc.AbstractConnection) -> None:
    await asyncio.gather(asyncio.wait_for(conn.close(), 5), return_exceptions=True)


async def closed_within(conn: aio_pika.Connection, seconds: float) -> bool:
    """Whether the broker side closed ``conn`` (aio-pika clears ``connected``) within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not conn.connected.is_set():
            return True
        await asyncio.sleep(0.1)  # poll with a deadline (the loop runs the connection meanwhile)
    return not conn.connected.is_set()


def test_cutting_a_follower_off_closes_its_proxied_clients_on_the_leader(tmp_path: Path,
                                                                         lab: NetLab) -> None:
    c = lab_cluster(tmp_path, lab, ttl=10)  # no election: both nodes keep reaching etcd
    try:
        for n in c.nodes:
            n.start()
        leader = wait_for(c.leader, 60, "a leader in etcd")
        wait_for(leader.answers, 60, "the leader serving")
        follower = next(n for n in c.nodes if n is not leader)
        wait_for(follower.answers, 60, "the follower's proxy (first sync done)")

        confirmed: list[int] = []
        asyncio.run(asyncio.wait_for(publish(leader.url, "held", 0, HELD, confirmed, batch=HELD), 30))
        assert len(confirmed) == HELD
        loop = asyncio.new_event_loop()
        holder, held = loop.run_until_complete(asyncio.wait_for(hold_unacked(follower.url, "held", HELD), 30))
        try:
            assert sorted(held) == list(range(HELD))

            lab.cut(c.nodes.index(leader), c.nodes.index(follower))
            cut = time.monotonic()
            got = asyncio.run(redelivered(leader.url, "held", HELD, cut + BOUND))
            took = time.monotonic() - cut
            assert sorted(n for n, _ in got) == list(range(HELD)), \
                f"{len(got)} of {HELD} held deliveries back within {BOUND}s\n{c.diag()}"
            assert all(r for _, r in got), "a held delivery came back without the redelivered flag"
            print(f"\nheld deliveries back on the leader {took:.1f}s after the cut")
            assert "closed 1 client tunnels of follower" in leader.log_text()
            # The follower's side ends too: its client is disconnected (to reconnect elsewhere).
            assert loop.run_until_complete(closed_within(holder, BOUND)), "the proxied client was left open"
        finally:
            loop.run_until_complete(quiet_close(holder))
            loop.close()
        assert "cluster status:" not in leader.log_text()  # every 10 s, at debug level only
    finally:
        lab.heal()
        c.close()
