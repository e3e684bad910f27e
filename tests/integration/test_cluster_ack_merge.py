"""Acks only the followers had stay acked (issue 14, item 10): bulk sync merges ack files.

Theory of operation: three real ``skred --clustering`` nodes with a long ack sync window
(``--ack-sync-interval 30000``, 30 s), so the leader's acks live in its memory while its followers
have them on disk at once. Confirmed messages, half of them acked; then the followers are
killed (the leader drops them from the in-sync set, so it is the only node allowed to lead)
and then the leader, before it wrote its acks. After all three start again the leader leads
from its own files, which lack those acks; the followers, when they bulk-sync from it, offer
their ack files (``MERGE_ACKS``) and the leader acks the same messages. Goal: not one acked
message is delivered again, and no confirmed message is lost.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aio_pika
import pytest

from .cluster_faults import ack_bytes, consume_some, drain, in_sync
from .test_cluster import Cluster, ClusterNode, publish, wait_for

pytestmark = [pytest.mark.timeout(240), pytest.mark.chaos]


# A priority queue keeps one store per priority level (``prio.NNN`` directories), a quorum
# queue two: the acks of every level are merged, not only those of the queue's own directory.
KINDS: dict[str, tuple[dict[str, Any], int]] = {
    "merge-prio": ({"x-max-priority": 5}, 3),  # level 3: a store in prio.003
    "merge-quorum": ({"x-queue-type": "quorum"}, 7),  # quorum's high level
}


def _leader_loses_its_acks(c: Cluster, settle: Callable[[ClusterNode], int], merges: int) -> ClusterNode:
    """Start the cluster with a 30 s ack window; ``settle`` acks messages on the leader (returns
    how many); once the followers have them on disk they are killed, then the leader; all
    restart and the old leader leads again. Returns it once ``merges`` ack files were merged."""
    for n in c.nodes:
        n.argv += ["--ack-sync-interval", "30000"]
        n.start()
    leader = in_sync(c)
    followers = [n for n in c.nodes if n is not leader]
    before = [ack_bytes(f) for f in followers]
    total = settle(leader)
    pairs = list(zip(followers, before, strict=True))
    wait_for(lambda: all(ack_bytes(f) >= b + 4 * total for f, b in pairs), 20,
             "the acks on the followers' disks")
    for f in followers:
        f.kill9()
    lid = leader.node_id()
    wait_for(lambda: json.loads(c.etcd.get(f"{c.prefix}/isr") or b"[]") == [lid], 30,
             "the leader alone in the ISR")
    assert ack_bytes(leader) < 4 * total, "the leader wrote its acks: the case is not set up"
    leader.kill9()
    for n in c.nodes:
        n.start()
    new = in_sync(c)
    assert new is leader, "only the old leader was in sync"
    wait_for(lambda: leader.log_text().count("merged") >= merges, 30, "the followers' acks merged")
    return new


def test_acks_only_followers_had_stay_acked(tmp_path: Path) -> None:
    """A classic queue, a priority queue (acks in a level's own store) and a quorum queue, in one
    trial: one cluster and one kill-and-restart serve all three (each queue's ack files are merged
    on their own, a merge each). Every publish comes before the first ack: a confirm's fsync
    would write the acks made before it on the leader too, and the case would not be set up."""
    c = Cluster(tmp_path, ttl=2)
    try:
        confirmed: list[int] = []
        acked: list[int] = []
        confirmed_kinds: dict[str, list[int]] = {}
        acked_kinds: dict[str, list[int]] = {}

        def settle(leader: ClusterNode) -> int:
            asyncio.run(asyncio.wait_for(publish(leader.url, "merge-q", 0, 200, confirmed, batch=50), 60))
            confirmed_kinds.update(asyncio.run(asyncio.wait_for(_publish_kinds(leader.url, 100), 60)))
            acked.extend(asyncio.run(asyncio.wait_for(consume_some(leader.url, "merge-q", 100), 60)))
            for q, (args, _) in KINDS.items():
                acked_kinds[q] = asyncio.run(asyncio.wait_for(consume_some(leader.url, q, 50, args), 60))
            return len(acked) + sum(map(len, acked_kinds.values()))

        new = _leader_loses_its_acks(c, settle, 1 + len(KINDS))
        got: list[tuple[int, bool]] = []
        asyncio.run(asyncio.wait_for(drain(new.url, "merge-q", got), 120))
        numbers = {n for n, _ in got}
        assert not numbers & set(acked), f"{len(numbers & set(acked))} acked messages delivered again"
        assert numbers == set(confirmed) - set(acked)
        for q in KINDS:
            kind = asyncio.run(asyncio.wait_for(_drain(new.url, q), 90))
            assert not set(kind) & set(acked_kinds[q]), \
                f"{q}: {len(set(kind) & set(acked_kinds[q]))} acked delivered again"
            assert sorted(kind) == sorted(set(confirmed_kinds[q]) - set(acked_kinds[q])), q
    except BaseException:
        print(c.diag())
        raise
    finally:
        c.close()


async def _publish_kinds(url: str, n: int) -> dict[str, list[int]]:
    """``n`` confirmed persistent messages to each queue of ``KINDS``, at its priority."""
    confirmed: dict[str, list[int]] = {q: [] for q in KINDS}
    conn = await aio_pika.connect(url, timeout=5)
    try:
        ch = await conn.channel(publisher_confirms=True)
        for q, (args, prio) in KINDS.items():
            await ch.declare_queue(q, durable=True, arguments=args)

            async def one(i: int, q: str = q, prio: int = prio) -> None:
                await ch.default_exchange.publish(aio_pika.Message(
                    str(i).encode(), delivery_mode=aio_pika.DeliveryMode.PERSISTENT, priority=prio),
                    routing_key=q)
                confirmed[q].append(i)

            await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await conn.close()
    return confirmed


async def _drain(url: str, queue: str) -> list[int]:
    """basic.get with ack until the queue is empty."""
    conn = await aio_pika.connect(url, timeout=5)
    got: list[int] = []
    try:
        ch = await conn.channel()
        q = await ch.declare_queue(queue, passive=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            msg = await q.get(fail=False)
            if msg is None:
                return got
            got.append(int(msg.body))
            await msg.ack()
        raise AssertionError(f"{queue}: not drained in 60 s")
    finally:
        await conn.close()
