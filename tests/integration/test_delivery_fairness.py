"""A consumer draining a backlog does not keep other connections' frames waiting (issue 31).

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
"""

from __future__ import annotations

import socket
import threading
import time

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
