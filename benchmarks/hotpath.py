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
import shutil
import tempfile
import time
from pathlib import Path

from pamqp import body as pbody
from pamqp import commands, header
from pamqp import frame as pframe

from broker.config import load_config
from broker.net.session import Session
from broker.node import Node


def publish_frames(n: int, size: int, queue: str) -> bytes:
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


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=200_000, help="messages per scenario")
    ap.add_argument("-s", type=int, default=16, help="body size")
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
        data = publish_frames(args.n, args.s, "hp")
        chunk = 65536
        t0 = time.process_time()
        for i in range(0, len(data), chunk):
            pub.receive_data(data[i:i + chunk])
            pub.after_batch()
        t1 = time.process_time()
        print(f"publish:         {(t1 - t0) / args.n * 1e6:6.2f} us/msg  ({args.n / (t1 - t0):,.0f} msg/s)")

        cons = Session(broker, ("127.0.0.1", 2), lambda: None)
        handshake(cons)
        cons.receive_data(pframe.marshal(commands.Basic.Consume(queue="hp", no_ack=True), 1))
        q = broker.vhosts["/"].queues["hp"]
        t0 = time.process_time()
        while q.message_count:
            q._deliver()
            cons.out.clear()
        t1 = time.process_time()
        print(f"deliver autoack: {(t1 - t0) / args.n * 1e6:6.2f} us/msg  ({args.n / (t1 - t0):,.0f} msg/s)")

        for i in range(0, len(data), chunk):
            pub.receive_data(data[i:i + chunk])
        cons2 = Session(broker, ("127.0.0.1", 3), lambda: None)
        handshake(cons2)
        cons2.receive_data(pframe.marshal(commands.Basic.Qos(prefetch_count=1000), 1))
        cons2.receive_data(pframe.marshal(commands.Basic.Consume(queue="hp", consumer_tag="c2"), 1))
        cons.receive_data(pframe.marshal(commands.Basic.Cancel(consumer_tag=cons.chs[1].consumers and
                                                               next(iter(cons.chs[1].consumers)) or ""), 1))
        tag = 0
        t0 = time.process_time()
        while q.message_count:
            q._deliver()
            cons2.out.clear()
            tag += 500
            cons2.receive_data(pframe.marshal(commands.Basic.Ack(delivery_tag=tag, multiple=True), 1))
            q._deliver()
            cons2.out.clear()
            tag += 500
            cons2.receive_data(pframe.marshal(commands.Basic.Ack(delivery_tag=tag, multiple=True), 1))
        t1 = time.process_time()
        print(f"deliver + ack:   {(t1 - t0) / args.n * 1e6:6.2f} us/msg  ({args.n / (t1 - t0):,.0f} msg/s)")
        for vh in broker.vhosts.values():
            vh.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
