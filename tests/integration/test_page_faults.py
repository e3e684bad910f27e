"""The broker reuses memory for its large short-lived buffers (issue 13).

Every socket read (up to 256 KiB), joined delivery write and join of a frame cut between two
reads is a block that lives for one loop turn. With glibc's defaults each of them came as
fresh pages, one page fault per 4 KiB: about one fault per 1 KiB message under load, a third
of the broker's CPU (``node.keep_buffers_on_the_heap``). This counts the broker process's
minor page faults (a kernel counter, not a clock) while a producer streams varied messages
in large writes to a queue with an autoack consumer: about 100 with the fix, 15,000 without.
"""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest
from pamqp import commands

from ._raw import FRAME_BODY, FRAME_HEADER, RawConn, frame_bytes, header_payload, method_bytes
from ._support import Broker, is_external, unique

MESSAGES = 20_000


def _minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])  # field 10: minflt


def _varied(queue: str, n: int) -> bytes:
    rnd = random.Random(n)
    out = []
    for i in range(n):
        body = rnd.randbytes(rnd.randint(200, 2048))
        props = commands.Basic.Properties(message_id=f"m-{i}-{rnd.getrandbits(64):x}",
                                          content_type="application/json",
                                          headers={"task": f"t{i % 17}", "n": i})
        out.append(method_bytes(1, commands.Basic.Publish(routing_key=queue))
                   + frame_bytes(FRAME_HEADER, 1, header_payload(len(body), props))
                   + frame_bytes(FRAME_BODY, 1, body))
    return b"".join(out)


def test_streaming_varied_messages_costs_few_page_faults(broker: Broker) -> None:
    if is_external() or getattr(broker, "pid", None) is None:
        pytest.skip("needs the broker's process")
    queue = unique("faults")
    data = _varied(queue, MESSAGES)
    con = RawConn(broker.host, broker.port, timeout=10)
    con.handshake()
    con.open_channel()
    con.send_method(1, commands.Queue.Declare(queue=queue))
    con.expect(commands.Queue.DeclareOk, 1)
    con.send_method(1, commands.Basic.Consume(queue=queue, no_ack=True))
    con.expect(commands.Basic.ConsumeOk, 1)
    got = [0]
    stop = threading.Event()

    def read() -> None:  # the consumer: take everything as fast as it comes
        con.sock.settimeout(0.5)
        while not stop.is_set():
            try:
                chunk = con.sock.recv(1 << 20)
            except TimeoutError:
                continue
            if not chunk:
                return
            got[0] += len(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    pub = RawConn(broker.host, broker.port, timeout=10)
    pub.handshake()
    pub.open_channel()
    assert broker.pid is not None
    before = _minor_faults(broker.pid)
    for i in range(0, len(data), 1 << 20):  # large writes: the broker reads up to 256 KiB at once
        pub.sock.sendall(data[i : i + (1 << 20)])
    deadline = time.monotonic() + 60
    while got[0] < len(data) and time.monotonic() < deadline:  # deliveries are larger than publishes
        time.sleep(0.05)
    faults = _minor_faults(broker.pid) - before
    stop.set()
    reader.join(5)
    pub.close()
    try:
        con.sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    con.close()
    assert got[0] >= len(data), "the consumer did not get every message"
    assert faults < MESSAGES // 10, f"{faults} minor page faults for {MESSAGES} messages"
