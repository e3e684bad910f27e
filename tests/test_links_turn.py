"""The link layer's turn publisher (``broker/links/turn.py``) on a real node's model and store,
no sockets: a turn's messages go in through the batch operation with one group-commit wait, and
a queue that refuses one answers RETRY for it while the rest are OK."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from _amqp_session import close_node, make_node
from pamqp import commands

from broker import properties
from broker.links.message import Message, Verdict
from broker.links.turn import TurnPublisher

PERSISTENT = properties.encode(commands.Basic.Properties(delivery_mode=2))


Outcome = tuple[list[Verdict], int, int, list[str]]  # verdicts, commit waits, stored, failures


async def _turn(tmp_path: Path, n: int, queue_args: dict[str, Any]) -> Outcome:
    broker = make_node(tmp_path)
    try:
        vh = broker.vhosts["/"]
        q, _ = vh.declare_queue("q", durable=True, arguments=queue_args, owner=None)
        waits: list[int] = []

        def after_sync(callback: Any, deps: Any = None) -> None:
            waits.append(1)
            broker.syncer.after_sync(callback, deps)

        verdicts: list[Verdict] = []
        failures: list[str] = []
        turn = TurnPublisher(lambda: vh, after_sync, True, failures.append)
        for i in range(n):  # one event-loop turn, as a source hands over one socket read
            turn.add(Message("", "q", None, b"m%d" % i, False, i, raw=PERSISTENT), verdicts.append)
        async with asyncio.timeout(10):
            while len(verdicts) < n and not failures:
                await asyncio.sleep(0.01)
        return verdicts, len(waits), q.message_count, failures
    finally:
        close_node(broker)


def test_a_turn_is_one_batch_and_one_group_commit_wait(tmp_path: Path) -> None:
    verdicts, waits, stored, failures = asyncio.run(_turn(tmp_path, 200, {}))
    assert failures == []
    assert verdicts == [Verdict.OK] * 200 and stored == 200
    assert waits == 1, f"{waits} group-commit waits for one turn of 200 messages"


def test_a_full_reject_publish_queue_is_retry_for_what_it_refused(tmp_path: Path) -> None:
    verdicts, _, stored, failures = asyncio.run(
        _turn(tmp_path, 10, {"x-max-length": 4, "x-overflow": "reject-publish"}))
    assert failures == [] and stored == 4
    assert verdicts.count(Verdict.OK) == 4 and verdicts.count(Verdict.RETRY) == 6
