"""A cancelled wait is cancelled, even when its answer lands in the same turn of the event loop
as the cancel: an etcd call (``Etcd._call``) and a follower's replication read
(``follower.follow``).

Python 3.11's ``asyncio.wait_for`` returns the awaited result in that case and drops the cancel
(fixed in 3.12). The per-shard election's pass loop (``broker/shards/leaders.py``) is stopped by
a cancel at SIGTERM and the drain waits for it to end: with the cancel dropped, the loop went on
and the drain never ran, so the node's shards stayed with it until the runner gave up on the
drain (10 s) and revoked its lease (issue 27's drain trial).

No etcd is needed: the awaited call is an asyncio future answered by the test, the way grpc
answers an etcd call's future, in the same turn as the cancel. The follower's link reads a
real loopback socket whose peer closes it.
"""

from __future__ import annotations

import asyncio
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from broker.cluster import codec, follower
from broker.cluster.etcd import Etcd, EtcdError


def test_a_cancel_that_lands_with_the_answer_is_not_dropped() -> None:
    async def main() -> None:
        etcd = Etcd("127.0.0.1:2379", "p", 2)
        answer: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        call = asyncio.ensure_future(etcd._call(answer))
        for _ in range(3):  # the call is now waiting for its answer
            await asyncio.sleep(0)
        answer.set_result("value")  # etcd answers ...
        call.cancel()  # ... in the same turn as SIGTERM's cancel
        with pytest.raises(asyncio.CancelledError):
            await call

    asyncio.run(main())


def test_an_answer_in_time_is_returned_and_a_late_one_is_an_etcd_error() -> None:
    async def main() -> None:
        etcd = Etcd("127.0.0.1:2379", "p", 2)
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[str] = loop.create_future()
        loop.call_soon(answer.set_result, "value")
        assert await etcd._call(answer, 1.0) == "value"
        never: asyncio.Future[str] = loop.create_future()
        with pytest.raises(EtcdError, match="TimeoutError"):
            await etcd._call(never, 0.05)
        assert never.cancelled()  # the timed-out call is not left running

    asyncio.run(main())


def test_a_follower_link_cancelled_as_its_leader_closes_ends_cancelled(tmp_path: Path) -> None:
    """``follower.follow`` on a real loopback socket: the leader closes the link (it is being
    drained) and, in the same turn, the follower's owner cancels the link (the runner saw the
    leader key go). The link must end cancelled: with ``wait_for`` the read's EOF won, ``follow``
    returned as after any close, and ``FollowSet`` retried the dead leader for ever while the
    runner waited for the link to end: the node never followed the new leader (seen at load 18
    in issue 27's drain trial, the node out of the ISR for good)."""
    leader = socket.socket()
    leader.bind(("127.0.0.1", 0))  # our own listener, kept open: no port handed to anyone else
    leader.listen(1)
    port = leader.getsockname()[1]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        welcomed = asyncio.Event()
        with ThreadPoolExecutor(max_workers=1) as executor:
            link = asyncio.ensure_future(follower.follow(
                "127.0.0.1", port, tmp_path, b"secret", "node-f", lambda _w: welcomed.set(),
                lambda: None, executor))
            conn, _addr = await loop.run_in_executor(None, leader.accept)
            with conn:
                conn.sendall(codec.encode_welcome(codec.OK))
                await asyncio.wait_for(welcomed.wait(), 10)
                for _ in range(5):  # the link now waits in its read
                    await asyncio.sleep(0)
                conn.shutdown(socket.SHUT_WR)  # the leader closes ...
                time.sleep(0.2)  # noqa: ASYNC251 - the loop must not look before the EOF is in
                await asyncio.sleep(0)  # ... the loop reads the EOF (the transport's callback) ...
                await asyncio.sleep(0)  # ... the read's waiter is answered in this turn ...
                assert link.cancel()  # ... and the owner cancels in it
                with pytest.raises(asyncio.CancelledError):
                    await link

    try:
        asyncio.run(main())
    finally:
        leader.close()
