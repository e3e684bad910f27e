"""A consumer draining a backlog, or a burst of queue deletes in one read, does not keep other
connections' frames waiting (issue 31).

Theory of operation: a queue's delivery pass runs in one loop turn, and no other connection's
frame is read until it ends; the pass is bounded in deliveries and bytes, and the next one runs on
a later turn, after the loop has polled the sockets. The test watches that bound without a clock:
while an autoack consumer (a raw socket read in a thread) drains a backlog of small messages,
another connection asks ``queue.declare(passive)`` again and again (and the test needs one of
its answers to come within a few passes of the one before). Every answer is made between
two passes, so between consecutive answers the queue shrinks by whole passes; the smallest
non-zero step is (a multiple of) one pass. With passes of thousands of deliveries, every frame
that arrives meanwhile waits thousands of deliveries for its answer (a synchronous publisher's
confirm among them), however fast the machine; with bounded passes some step is small. Counting
deliveries instead of timing them makes the test indifferent to load.

The burst of deletes: one write of many ``queue.delete`` frames arrives in one read, and a
session used to handle a read to its end before the loop looked at another socket, so a
bystander waited for the whole burst. The test needs no clock either: once the bystander sees
the burst's first queue gone, it asks for the last one, and that one must still be there (the
session gave the loop back between deletes); before, the first was never seen gone before the
last.
"""

from __future__ import annotations

import socket
import threading
import time

import pika.exceptions
from pamqp import commands

from ._raw import FRAME_BODY, FRAME_HEADER, RawConn, frame_bytes, header_payload, method_bytes
from ._support import Broker, Cleanup, connect, unique, wait_until

# Small messages: the per-pass count is the bound that holds. Many passes, so that even a probe
# slowed by a loaded machine gets some answers a few passes apart (the assertion needs one).
BACKLOG = 24 * 4096
STEP_BOUND = 2048  # four passes of 512; every step was a multiple of 4,096 before


def _sink(sock: socket.socket, stop: threading.Event) -> None:
    """Read and drop whatever the consumer is sent (autoack: nothing to answer)."""
    sock.settimeout(0.2)
    while not stop.is_set():
        try:
            if not sock.recv(1 << 20):
                return
        except TimeoutError:
            continue
        except OSError:
            return


def test_backlog_drain_leaves_turns_to_other_connections(shared_broker: Broker, cleanup: Cleanup) -> None:
    q = unique("fair")
    cleanup.queue(q)
    conn = connect(shared_broker)
    try:
        ch = conn.channel()
        ch.queue_declare(q)
        raw = RawConn("127.0.0.1", shared_broker.port)
        stop = threading.Event()
        reader: threading.Thread | None = None
        try:
            raw.handshake()
            raw.open_channel(1)
            one = (method_bytes(1, commands.Basic.Publish(exchange="", routing_key=q))
                   + frame_bytes(FRAME_HEADER, 1, header_payload(8, commands.Basic.Properties()))
                   + frame_bytes(FRAME_BODY, 1, b"backlog!"))
            raw.send(one * BACKLOG)  # the backlog in one write, then consumed on the same connection
            wait_until(lambda: ch.queue_declare(q, passive=True).method.message_count == BACKLOG,
                       timeout=30, what="the backlog stored")
            raw.send_method(1, commands.Basic.Consume(queue=q, consumer_tag="drain", no_ack=True))
            raw.expect(commands.Basic.ConsumeOk, 1)
            reader = threading.Thread(target=_sink, args=(raw.sock, stop), daemon=True)
            reader.start()
            seen = [BACKLOG]
            deadline = time.monotonic() + 30
            while seen[-1] and time.monotonic() < deadline:
                seen.append(ch.queue_declare(q, passive=True).method.message_count)
        finally:
            stop.set()
            if reader is not None:
                reader.join(5)
            raw.close()
    finally:
        conn.close()
    assert seen[-1] == 0, f"the backlog was not drained: {seen[-1]} left"
    steps = [a - b for a, b in zip(seen, seen[1:], strict=False) if a != b]
    assert min(steps) <= STEP_BOUND, (
        f"every answer to another connection waited {min(steps)}+ deliveries "
        f"(queue counts seen: {sorted(set(seen), reverse=True)[:12]}...)")


BURST = 300  # durable queues deleted in one write (about 12 KB: one read)


def test_a_burst_of_deletes_leaves_turns_to_other_connections(
        shared_broker: Broker, cleanup: Cleanup) -> None:
    names = [cleanup.queue(unique("burst")) for _ in range(BURST)]
    conn = connect(shared_broker)
    try:
        ch = conn.channel()
        for name in names:
            ch.queue_declare(name, durable=True)
        raw = RawConn("127.0.0.1", shared_broker.port)
        try:
            raw.handshake()
            raw.open_channel(1)
            raw.send(b"".join(method_bytes(1, commands.Queue.Delete(queue=name)) for name in names))
            deadline = time.monotonic() + 30
            first_gone = False
            while not first_gone and time.monotonic() < deadline:
                try:
                    ch.queue_declare(names[0], passive=True)
                except pika.exceptions.ChannelClosedByBroker:  # 404: the burst has begun
                    first_gone = True
                    ch = conn.channel()
            assert first_gone, "the burst of deletes never began"
            try:
                ch.queue_declare(names[-1], passive=True)
                last_there = True
            except pika.exceptions.ChannelClosedByBroker:
                last_there = False
            wait_until(lambda: _gone(conn, names[-1]), timeout=30, what="the burst done")
        finally:
            raw.close()
    finally:
        conn.close()
    assert last_there, "another connection waited for the whole burst of deletes"


def _gone(conn: object, name: str) -> bool:
    ch = conn.channel()  # type: ignore[attr-defined]
    try:
        ch.queue_declare(name, passive=True)
    except pika.exceptions.ChannelClosedByBroker:
        return True
    ch.close()
    return False
