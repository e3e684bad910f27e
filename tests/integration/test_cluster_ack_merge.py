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
from pathlib import Path

import pytest

from .cluster_faults import ack_bytes, consume_some, drain, in_sync
from .test_cluster import Cluster, publish, wait_for

pytestmark = [pytest.mark.timeout(240), pytest.mark.chaos]


def test_acks_only_followers_had_stay_acked(tmp_path: Path) -> None:
    c = Cluster(tmp_path, ttl=2)
    try:
        for n in c.nodes:
            n.argv += ["--ack-sync-interval", "30000"]
            n.start()
        leader = in_sync(c)
        followers = [n for n in c.nodes if n is not leader]
        confirmed: list[int] = []
        asyncio.run(asyncio.wait_for(publish(leader.url, "merge-q", 0, 200, confirmed, batch=50), 60))
        before = [ack_bytes(f) for f in followers]
        acked = asyncio.run(asyncio.wait_for(consume_some(leader.url, "merge-q", 100), 60))
        pairs = list(zip(followers, before, strict=True))
        wait_for(lambda: all(ack_bytes(f) >= b + 4 * len(acked) for f, b in pairs), 20,
                 "the acks on the followers' disks")
        for f in followers:
            f.kill9()
        lid = leader.node_id()
        wait_for(lambda: json.loads(c.etcd.get(f"{c.prefix}/isr") or b"[]") == [lid], 30,
                 "the leader alone in the ISR")
        assert ack_bytes(leader) < 4 * len(acked), "the leader wrote its acks: the case is not set up"
        leader.kill9()
        for n in c.nodes:
            n.start()
        new = in_sync(c)
        assert new is leader, "only the old leader was in sync"
        wait_for(lambda: "merged" in leader.log_text(), 30, "the followers' acks merged")
        got: list[tuple[int, bool]] = []
        asyncio.run(asyncio.wait_for(drain(new.url, "merge-q", got), 120))
        numbers = {n for n, _ in got}
        assert not numbers & set(acked), f"{len(numbers & set(acked))} acked messages delivered again"
        assert numbers == set(confirmed) - set(acked)
    except BaseException:
        print(c.diag())
        raise
    finally:
        c.close()
