"""In-process CPU cost of the hot path, without sockets or a load generator.

Feeds pre-encoded frames straight into a ``Session`` (the sans-IO connection
wired to a real vhost and real segment files in a temp dir) and reports CPU
microseconds per message for: publish to a queue without consumers, deliver
to an autoack consumer, deliver + manual ack. CPU time (``process_time``) is
used so other load on a shared machine disturbs the numbers less than wall
time would. Usage: ``python benchmarks/hotpath.py [-n 200000] [-s 16]``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import random
import shutil
import tempfile
import time
from pathlib import Path

from pamqp import body as pbody
from pamqp import commands, header
from pamqp import frame as pframe

from broker.amqp.session import Session
from broker.config import load_config
from broker.node import Node


def publish_frames(n: int, size: int, queue: str, varied: bool = False,
                   keys: list[str] | None = None, per_key_channel: bool = False) -> bytes:
    """``n`` publishes to ``queue`` (varied: to ``keys`` in turn, if given) through the default
    exchange, on channel 1 (``per_key_channel``: key j's on channel j + 2)."""
    if varied:  # every message different: 200 B-2 KiB, message-id, timestamp, three headers
        rnd = random.Random(7)
        out = []
        for i in range(n):
            body = rnd.randbytes(rnd.randint(200, 2048))
            props = commands.Basic.Properties(
                content_type="application/json", message_id=f"{rnd.getrandbits(128):032x}",
                timestamp=datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC) + datetime.timedelta(seconds=i),
                headers={"task": f"tasks.t{i % 17}", "id": str(i), "retries": i % 3})
            key = keys[i % len(keys)] if keys else queue
            ch = i % len(keys) + 2 if keys and per_key_channel else 1
            out.append(pframe.marshal(commands.Basic.Publish(exchange="", routing_key=key), ch)
                       + pframe.marshal(header.ContentHeader(0, len(body), props), ch)
                       + pframe.marshal(pbody.ContentBody(body), ch))
        return b"".join(out)
    one = (
        pframe.marshal(commands.Basic.Publish(exchange="", routing_key=queue), 1)
        + pframe.marshal(header.ContentHeader(0, size, commands.Basic.Properties()), 1)
        + pframe.marshal(pbody.ContentBody(b"x" * size), 1)
    )
    return one * n


def handshake(s: Session) -> None:
    s.receive_data(b"AMQP\x00\x00\x09\x01")
    s.receive_data(pframe.marshal(commands.Connection.StartOk(
        client_properties={"capabilities": {}}, mechanism="PLAIN", response="\x00guest\x00guest"), 0))
    s.receive_data(pframe.marshal(commands.Connection.TuneOk(2047, 131072, 0), 0))
    s.receive_data(pframe.marshal(commands.Connection.Open("/"), 0))
    s.receive_data(pframe.marshal(commands.Channel.Open(), 1))


def report(what: str, seconds: float, n: int) -> None:
    print(f"{what + ':':34s}{seconds / n * 1e6:6.2f} us/msg  ({n / seconds:,.0f} msg/s)")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=200_000, help="messages per scenario")
    ap.add_argument("-s", type=int, default=16, help="body size")
    ap.add_argument("--varied", action="store_true", help="every message different (-s ignored)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="skred-hotpath-"))
    try:
        cfg = load_config(["--data-dir", str(tmp), "--no-sync", "--no-mgmt"], environ={})
        node = Node(cfg)
        loop = asyncio.get_running_loop()
        broker = node.load(loop)
        pub = Session(broker, ("127.0.0.1", 1), lambda: None)
        handshake(pub)
        pub.receive_data(pframe.marshal(commands.Queue.Declare(queue="hp"), 1))
        pub.out.clear()
        data = publish_frames(args.n, args.s, "hp", args.varied)
        chunk = 65536
        t0 = time.process_time()
        for i in range(0, len(data), chunk):
            pub.receive_data(data[i:i + chunk])
            pub.after_batch()
        t1 = time.process_time()
        report("publish", t1 - t0, args.n)

        q = broker.vhosts["/"].queues["hp"]

        def deliver_all(out: bytearray, ack: Session | None = None) -> None:
            tag = 0
            while q.message_count:
                q._deliver()
                out.clear()
                if ack is not None:
                    tag += 500
                    ack.receive_data(pframe.marshal(commands.Basic.Ack(delivery_tag=tag, multiple=True), 1))

        cons = Session(broker, ("127.0.0.1", 2), lambda: None)
        handshake(cons)
        consume = commands.Basic.Consume(queue="hp", consumer_tag="c1", no_ack=True)
        cons.receive_data(pframe.marshal(consume, 1))
        t0 = time.process_time()
        deliver_all(cons.out)
        t1 = time.process_time()
        report("deliver autoack", t1 - t0, args.n)

        # publish while an autoack consumer waits: the direct hand-over, publish + deliver
        t0 = time.process_time()
        for i in range(0, len(data), chunk):
            pub.receive_data(data[i:i + chunk])
            pub.after_batch()
            cons.out.clear()
        t1 = time.process_time()
        report("publish+deliver autoack (direct)", t1 - t0, args.n)
        cons.receive_data(pframe.marshal(commands.Basic.Cancel(consumer_tag="c1"), 1))

        for i in range(0, len(data), chunk):
            pub.receive_data(data[i:i + chunk])
        cons2 = Session(broker, ("127.0.0.1", 3), lambda: None)
        handshake(cons2)
        cons2.receive_data(pframe.marshal(commands.Basic.Qos(prefetch_count=1000), 1))
        cons2.receive_data(pframe.marshal(commands.Basic.Consume(queue="hp", consumer_tag="c2"), 1))
        t0 = time.process_time()
        deliver_all(cons2.out, cons2)
        t1 = time.process_time()
        report("deliver + ack", t1 - t0, args.n)

        # publish while a manual-ack consumer has room, acking every 500
        t0 = time.process_time()
        tag = 0
        for i in range(0, len(data), chunk):
            pub.receive_data(data[i:i + chunk])
            pub.after_batch()
            cons2.out.clear()
            while cons2.chs[1].next_tag - 1 > tag:
                tag = cons2.chs[1].next_tag - 1
                cons2.receive_data(pframe.marshal(commands.Basic.Ack(delivery_tag=tag, multiple=True), 1))
                if q.message_count:
                    q._deliver()
                    cons2.out.clear()
        t1 = time.process_time()
        report("publish+deliver+ack (direct)", t1 - t0, args.n)
        for vh in broker.vhosts.values():
            vh.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
