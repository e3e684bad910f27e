"""Durability across restart, kill -9 and graceful shutdown (Skred processes only).

Theory of operation: each test owns a broker process (``broker`` fixture) and
its data dir. A restart reuses both data dir and ports. The kill -9 test runs
the publisher in a subprocess that prints every confirmed message id; the test
kills the broker once thousands are confirmed, restarts it and requires every
printed id to be in the queue (unconfirmed ones may or may not be there, and
duplicates of unconfirmed ones are tolerated).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pika
import pytest

from ._support import (
    Broker,
    SkredProcess,
    amqp_answers,
    assert_healthy,
    connect,
    exists_exchange,
    exists_queue,
    is_external,
    unique,
)

pytestmark = pytest.mark.skipif(
    is_external(),
    reason="restarts and kills the Skred process; SKRED_TEST_EXTERNAL_URL points at an external broker",
)


def _persistent(i: int | str) -> tuple[bytes, pika.BasicProperties]:
    return str(i).encode(), pika.BasicProperties(delivery_mode=2, message_id=str(i))


def _get_all(
    ch: pika.adapters.blocking_connection.BlockingChannel, q: str, limit: int = 100_000
) -> list[tuple[bytes, bool]]:
    out: list[tuple[bytes, bool]] = []
    for _ in range(limit):
        m, _, body = ch.basic_get(q, auto_ack=True)
        if m is None:
            return out
        out.append((bytes(body), bool(m.redelivered)))
    raise AssertionError("queue did not drain")


def test_restart_keeps_durable_definitions_and_persistent_messages(broker: Broker) -> None:
    dx, tx_ = unique("dx"), unique("tx")
    dq, tq = unique("dq"), unique("tq")
    e2e = unique("e2e")
    conn = connect(broker)
    ch = conn.channel()
    ch.confirm_delivery()
    ch.exchange_declare(dx, "topic", durable=True)
    ch.exchange_declare(e2e, "fanout", durable=True)
    ch.exchange_declare(tx_, "direct", durable=False)
    ch.queue_declare(dq, durable=True, arguments={"x-max-length": 1000})
    ch.queue_declare(tq, durable=False)
    ch.queue_bind(dq, dx, routing_key="orders.#")
    ch.exchange_bind(destination=e2e, source=dx, routing_key="audit.*")
    ch.queue_bind(dq, e2e)
    for i in range(10):
        body, props = _persistent(i)
        ch.basic_publish(dx, "orders.new", body, props)
    ch.basic_publish(dx, "orders.new", b"transient", pika.BasicProperties(delivery_mode=1))
    ch.basic_publish("", tq, b"in-transient-queue", pika.BasicProperties(delivery_mode=2))
    conn.close()

    broker.restart()

    conn = connect(broker)
    ch = conn.channel()
    ch.exchange_declare(dx, "topic", durable=True, passive=True)
    ch.exchange_declare(dx, "topic", durable=True)  # equivalent redeclare: type and flags kept
    ch.queue_declare(dq, durable=True, arguments={"x-max-length": 1000})  # args kept, no 406
    got = _get_all(ch, dq)
    assert [b for b, _ in got] == [str(i).encode() for i in range(10)], (
        "persistent messages not back in order"
    )
    assert not exists_exchange(conn, tx_), "non-durable exchange survived a restart"
    assert not exists_queue(conn, tq), "non-durable queue survived a restart"
    # bindings are back: queue binding and exchange-to-exchange binding
    ch.basic_publish(dx, "orders.x", b"via-binding")
    ch.basic_publish(dx, "audit.x", b"via-e2e")
    ch.basic_publish(dx, "other", b"unrouted")
    assert [b for b, _ in _get_all(ch, dq)] == [b"via-binding", b"via-e2e"]
    c = conn.channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as ei:
        c.exchange_declare(dx, "fanout", durable=True)
    assert ei.value.reply_code == 406, "exchange type not preserved across restart"
    conn.close()


def test_unacked_deliveries_are_redelivered_after_restart(broker: Broker) -> None:
    q = unique("dq")
    conn = connect(broker)
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(q, durable=True)
    for i in range(5):
        body, props = _persistent(i)
        ch.basic_publish("", q, body, props)
    c2 = conn.channel()
    tags = [c2.basic_get(q, auto_ack=False)[0].delivery_tag for _ in range(3)]  # 0,1,2 unacked
    c2.basic_ack(tags[0])  # message 0 is done
    # make sure the ack was processed before we stop: a synchronous call on the same channel
    c2.queue_declare(q, passive=True)

    broker.restart()  # the client connection is forced closed; 1 and 2 were never acked

    conn2 = connect(broker)
    got = _get_all(conn2.channel(), q)
    conn2.close()
    assert [b for b, _ in got] == [b"1", b"2", b"3", b"4"]
    assert got[0][1] and got[1][1], "unacked deliveries must come back with redelivered=True"
    # (3 and 4 were never delivered; the spec lets a broker set redelivered when unsure)


def test_sigterm_closes_clients_with_320_and_releases_lock(broker: Broker) -> None:
    assert isinstance(broker, SkredProcess) and broker.proc is not None
    conn = connect(broker)
    conn.channel().queue_declare(unique("q"))
    broker.proc.send_signal(signal.SIGTERM)
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as ei:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            conn.process_data_events(time_limit=0.05)
    assert ei.value.reply_code == 320, ei.value
    assert broker.proc.wait(15) == 0, "graceful shutdown must exit 0:\n" + broker.log_tail()
    broker.start()  # same data dir: the lock was released
    assert_healthy(broker)


def test_second_broker_on_locked_data_dir_exits_nonzero(broker: Broker, tmp_path: Path) -> None:
    assert isinstance(broker, SkredProcess)
    second = SkredProcess(broker.data_dir)  # same data dir, new ports
    second.log_path = tmp_path / "second.log"
    try:
        proc = second.spawn()
        rc = proc.wait(15)
        assert rc != 0, "a second broker started on a locked data dir"
        assert "lock" in second.log_text().lower(), "no clear message about the lock:\n" + second.log_tail()
        assert not amqp_answers(second.host, second.port)
    finally:
        second.close()
    assert_healthy(broker)


def test_kill9_idle_then_restart(broker: Broker) -> None:
    q = unique("dq")
    conn = connect(broker)
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(q, durable=True)
    for i in range(100):
        body, props = _persistent(i)
        ch.basic_publish("", q, body, props)
    broker.kill9()  # the lock must not outlive the process (e.g. flock, not a pid file alone)
    broker.start()
    conn = connect(broker)
    assert [b for b, _ in _get_all(conn.channel(), q)] == [str(i).encode() for i in range(100)]
    conn.close()


PUBLISHER = r"""
import asyncio, sys
import aio_pika

async def main(url, queue, total, window):
    conn = await aio_pika.connect(url, timeout=10)
    ch = await conn.channel(publisher_confirms=True)
    await ch.declare_queue(queue, durable=True)
    sem = asyncio.Semaphore(window)
    out = sys.stdout

    async def one(i):
        try:
            await ch.default_exchange.publish(
                aio_pika.Message(str(i).encode(), delivery_mode=2), routing_key=queue)
            out.write(f"{i}\n")
            out.flush()
        finally:
            sem.release()

    tasks = []
    for i in range(total):
        await sem.acquire()
        tasks.append(asyncio.ensure_future(one(i)))
    await asyncio.gather(*tasks, return_exceptions=True)
    try:
        await conn.close()
    except Exception:
        pass
    out.write("DONE\n")
    out.flush()

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
"""


@pytest.mark.timeout(180)
def test_kill9_while_publishing_loses_no_confirmed_message(broker: Broker) -> None:
    assert isinstance(broker, SkredProcess)
    q = unique("kill9")
    total, kill_after = 20_000, 10_000
    pub = subprocess.Popen(
        [sys.executable, "-c", PUBLISHER, broker.url, q, str(total), "256"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    confirmed: set[int] = set()
    try:
        assert pub.stdout is not None
        deadline = time.monotonic() + 120
        killed = False
        for line in pub.stdout:
            line = line.strip()
            if line.isdigit():
                confirmed.add(int(line))
            if not killed and len(confirmed) >= kill_after:
                broker.kill9()
                killed = True
            if time.monotonic() > deadline:
                break
        assert killed, f"publisher ended after {len(confirmed)} confirms, before the kill"
    finally:
        if pub.poll() is None:
            pub.kill()
        pub.wait(10)
    assert len(confirmed) >= kill_after

    broker.start()
    conn = connect(broker)
    ch = conn.channel()
    present = [int(b) for b, _ in _get_all(ch, q, limit=total * 2 + 10)]
    conn.close()
    missing = confirmed - set(present)
    assert not missing, f"{len(missing)} confirmed messages lost, e.g. {sorted(missing)[:10]}"
    assert set(present) <= set(range(total)), "unknown messages after recovery"
    # messages recovered in publish order (duplicates of unconfirmed ones tolerated)
    firsts = list(dict.fromkeys(present))
    assert firsts == sorted(firsts), "recovered messages out of order"


def test_torn_state_after_repeated_kill9_still_starts(broker: Broker) -> None:
    q = unique("dq")
    for round_ in range(3):
        conn = connect(broker)
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare(q, durable=True)
        body, props = _persistent(round_)
        ch.basic_publish("", q, body, props)
        broker.kill9()
        broker.start()
    conn = connect(broker)
    assert [b for b, _ in _get_all(conn.channel(), q)] == [b"0", b"1", b"2"]
    conn.close()
