"""Many non-empty queues under a small descriptor limit (issue 14, item 6).

Theory of operation: the broker runs under ``prlimit --nofile=LIMIT`` (soft and hard, so
its own attempt to raise the soft limit cannot help). The test declares QUEUES durable
queues, publishes one confirmed persistent message to each (more queues than the limit
allows descriptors, so a store that keeps a descriptor per queue runs out), acks a slice of
them, and checks the broker still accepts connections and publishes, stops gracefully within
5 s (SIGTERM), and after a restart holds exactly the unacked messages. CI runs 3,000 queues
under 1,024 descriptors; ``SKRED_MANY_QUEUES`` / ``SKRED_MANY_QUEUES_NOFILE`` scale it up
(the issue's figure: 100,000 under 20,000).
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pika
import pytest

from ._support import SkredProcess, amqp_answers, connect, is_external

pytestmark = pytest.mark.skipif(
    is_external() or not shutil.which("prlimit"),
    reason="needs util-linux prlimit and a Skred process of its own",
)

QUEUES = int(os.environ.get("SKRED_MANY_QUEUES", "3000"))
NOFILE = int(os.environ.get("SKRED_MANY_QUEUES_NOFILE", "1024"))
ACKED = QUEUES // 10
STOP_WITHIN = 5.0
FILLERS = 8


class LimitedBroker(SkredProcess):
    def argv(self) -> list[str]:
        return ["prlimit", f"--nofile={NOFILE}:{NOFILE}", "--", *super().argv()]


def _name(i: int) -> str:
    return f"many.{i:06d}"


def _fill(b: SkredProcess, numbers: range) -> None:
    """Declare the queues ``numbers`` and publish one confirmed persistent message to each."""
    conn = connect(b)
    ch = conn.channel()
    ch.confirm_delivery()
    for i in numbers:
        ch.queue_declare(_name(i), durable=True)
        ch.basic_publish("", _name(i), str(i).encode(), pika.BasicProperties(delivery_mode=2))
    conn.close()


def _count(ch: pika.adapters.blocking_connection.BlockingChannel, i: int) -> int:
    return int(ch.queue_declare(_name(i), passive=True).method.message_count)


@pytest.mark.timeout(600 + QUEUES // 100)
def test_non_empty_queues_beyond_the_descriptor_limit(tmp_path: Path) -> None:
    b = LimitedBroker(tmp_path / "data")
    try:
        b.start()
        t0 = time.monotonic()
        # Several clients at once: durable declares and confirms share group commits.
        with ThreadPoolExecutor(FILLERS) as pool:
            list(pool.map(lambda k: _fill(b, range(k, QUEUES, FILLERS)), range(FILLERS)))
        filled = time.monotonic() - t0
        conn = connect(b)
        ch = conn.channel()
        # Settle a slice: basic.get + ack on queues spread over the whole range.
        for i in range(0, QUEUES, QUEUES // ACKED):
            m, _, body = ch.basic_get(_name(i))
            assert m is not None and body == str(i).encode()
            ch.basic_ack(m.delivery_tag)
        acked = set(range(0, QUEUES, QUEUES // ACKED))
        assert amqp_answers(b.host, b.port), "no new connections"
        extra = connect(b)  # a second client still gets in and can publish
        xch = extra.channel()
        xch.confirm_delivery()
        xch.basic_publish("", _name(1), b"late", pika.BasicProperties(delivery_mode=2))
        extra.close()
        conn.close()
        assert b.proc is not None
        t0 = time.monotonic()
        b.proc.send_signal(signal.SIGTERM)
        code = b.proc.wait(60)
        stopped = time.monotonic() - t0
        assert code == 0, b.log_tail()
        assert stopped < STOP_WITHIN, f"shutdown took {stopped:.1f}s"
        assert "Too many open files" not in b.log_text(), b.log_tail()
        b.start()
        conn = connect(b)
        ch = conn.channel()
        wrong = {i: n for i in range(QUEUES)
                 if (n := _count(ch, i)) != (0 if i in acked else 1) + (i == 1)}
        assert not wrong, f"{len(wrong)} queues hold the wrong count after restart: {list(wrong.items())[:5]}"
        conn.close()
        print(f"\n{QUEUES} queues under nofile={NOFILE}: filled in {filled:.1f}s, stopped in {stopped:.2f}s")
    finally:
        b.close()
