"""A cancelled etcd call is cancelled (``Etcd._call``), even when etcd's answer lands in the
same turn of the event loop as the cancel.

Python 3.11's ``asyncio.wait_for`` returns the awaited result in that case and drops the cancel
(fixed in 3.12). The per-shard election's pass loop (``broker/shards/leaders.py``) is stopped by
a cancel at SIGTERM and the drain waits for it to end: with the cancel dropped, the loop went on
and the drain never ran, so the node's shards stayed with it until the runner gave up on the
drain (10 s) and revoked its lease (issue 27's drain trial).

No etcd is needed: the awaited call is an asyncio future answered by the test, the way grpc
answers an etcd call's future, in the same turn as the cancel.
"""

from __future__ import annotations

import asyncio

import pytest

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
