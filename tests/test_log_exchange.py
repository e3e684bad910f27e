"""The log exchange's handler on a real vhost (temporary directory, no sockets): lines reach a
queue bound to ``amq.rabbitmq.log`` by level, the logger never waits for the loop, a full queue
drops and counts, and a line logged while a line is published is never queued again."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from broker import properties
from broker.amqp import log_exchange
from broker.model.vhost import VHost
from broker.store.sink import NullSink

LIMIT = 50  # the handler's bound on waiting lines (the broker's is log_exchange.LIMIT)


Setup = tuple[VHost, log_exchange.LogExchangeHandler, list[Callable[[], None]]]


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    vh = VHost("/", tmp_path / "data", segment_size=64 * 1024, sink=NullSink(), schedule=lambda cb: cb(),
               mark_dirty=lambda _obj: None, transient_root=tmp_path / "transient")
    pending: list[Callable[[], None]] = []  # the loop's ready callbacks (nothing runs them but us)
    handler = log_exchange.install({"/": vh}, "skred@test", pending.append, limit=LIMIT)
    assert handler is not None
    vh.declare_queue("warn", owner=None)
    vh.bind_queue("warn", log_exchange.LOG_EXCHANGE, "warning", {}, owner=None)
    vh.declare_queue("all", owner=None)
    vh.bind_queue("all", log_exchange.LOG_EXCHANGE, "#", {}, owner=None)
    logging.getLogger().setLevel(logging.INFO)
    try:
        yield vh, handler, pending
    finally:
        log_exchange.uninstall(handler)


def _run(pending: list[Callable[[], None]]) -> None:
    while pending:
        pending.pop(0)()


def test_lines_routed_by_level_after_the_loop_drains(setup: Setup) -> None:
    vh, handler, pending = setup
    assert vh.exchanges[log_exchange.LOG_EXCHANGE].internal
    logging.getLogger("broker.x").warning("disk %s", "low")
    logging.getLogger("broker.x").info("hello")
    assert vh.queues["all"].message_count == 0 and len(pending) == 1  # one drain asked for, none run
    _run(pending)
    got = vh.queues["warn"].get()
    assert got is not None and b"disk low" in got[4] and got[2] == b"warning"
    assert properties.headers(got[3])["node"] == "skred@test"
    assert vh.queues["all"].message_count == 2


def test_full_queue_drops_and_counts(setup: Setup) -> None:
    vh, handler, pending = setup
    for i in range(LIMIT + 7):
        logging.getLogger("broker.x").info("line %d", i)
    assert handler.dropped == 7
    _run(pending)
    assert vh.queues["all"].message_count == LIMIT
    first = vh.queues["all"].get()
    assert first is not None and properties.headers(first[3])["dropped"] == 7


def test_a_line_logged_while_publishing_is_not_requeued(setup: Setup,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    vh, handler, pending = setup
    real = vh.publish

    def noisy(req):  # type: ignore[no-untyped-def]
        logging.getLogger("broker.model").warning("publishing %s", req.routing_key)
        return real(req)

    monkeypatch.setattr(vh, "publish", noisy)
    logging.getLogger("broker.x").warning("once")
    _run(pending)
    assert pending == [] and handler.suppressed == 1 and handler.published == 1
    assert vh.queues["all"].message_count == 1
