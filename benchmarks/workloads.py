#!/usr/bin/env python3
"""The user workloads of issue 13 that ``skred-perf`` does not cover, for ``benchmarks/run.py``.

- ``varied`` (workload 1): every message different: body 200 B-2 KiB, a message-id, a
  timestamp and three headers; 1 producer + 1 autoack consumer, each its own process and raw
  AMQP connection (messages are encoded before the clock starts, so the client costs little);
  reports consumed msg/s.
- ``latency`` (workload 5): end-to-end latency at a fixed publish rate (``--rate``), autoack or
  manual ack (``--ack``); each body carries its send time; reports p50/p99/p99.9 in ms.
- ``sync`` (workload 6): a pika ``BlockingConnection`` with ``confirm_delivery`` publishing one
  message at a time into a queue with a backlog (50,000: it outlasts the run) and a consumer
  (pika, manual ack, prefetch 100, its own process); reports the publisher's msg/s.

Each prints one JSON line with ``server`` (product, version) like skred-perf does.

    python benchmarks/workloads.py varied --uri amqp://guest:guest@127.0.0.1:5672/ -z 5
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing as mp
import os
import random
import statistics
import struct
import sys
import time
import uuid
from typing import Any
from urllib.parse import urlparse

import pika
from pamqp import body as pbody
from pamqp import commands, header
from pamqp import frame as pframe

_FRAME = struct.Struct(">BHI")
_DELIVER = b"\x00\x3c\x00\x3c"
_EPOCH = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


class Raw:
    """A minimal asyncio AMQP client: handshake with pamqp, then raw frames."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.r = reader
        self.w = writer
        self.server: dict[str, str] = {}

    @classmethod
    async def connect(cls, uri: str) -> Raw:
        u = urlparse(uri)
        reader, writer = await asyncio.open_connection(u.hostname or "127.0.0.1", u.port or 5672)
        c = cls(reader, writer)
        writer.write(b"AMQP\x00\x00\x09\x01")
        start = await c.method()
        props = getattr(start, "server_properties", {}) or {}
        c.server = {"product": str(props.get("product", "?")), "version": str(props.get("version", "?"))}
        writer.write(pframe.marshal(commands.Connection.StartOk(
            client_properties={}, mechanism="PLAIN",
            response=f"\x00{u.username or 'guest'}\x00{u.password or 'guest'}"), 0))
        await c.method()  # tune
        writer.write(pframe.marshal(commands.Connection.TuneOk(2047, 131072, 0), 0))
        writer.write(pframe.marshal(commands.Connection.Open((u.path or "/")[1:] or "/"), 0))
        await c.method()  # open-ok
        writer.write(pframe.marshal(commands.Channel.Open(), 1))
        await c.method()
        return c

    async def method(self) -> Any:
        hdr = await self.r.readexactly(7)
        _, _, size = _FRAME.unpack(hdr)
        payload = await self.r.readexactly(size + 1)
        return pframe.unmarshal(hdr + payload)[2]

    async def call(self, m: Any) -> Any:
        self.w.write(pframe.marshal(m, 1))
        return await self.method()


def frames(buf: bytes) -> tuple[list[tuple[int, int]], bytes]:
    """The complete frames at the start of ``buf`` as (type, payload offset), and the rest."""
    found = []
    pos = 0
    ln = len(buf)
    while ln - pos >= 7:
        ftype, _, size = _FRAME.unpack_from(buf, pos)
        if ln - pos < size + 8:
            break
        found.append((ftype, pos + 7))
        pos += size + 8
    return found, buf[pos:]


def is_deliver(buf: bytes, ftype: int, at: int) -> bool:
    return ftype == 1 and buf[at : at + 4] == _DELIVER


def encode(rk: str, body: bytes, props: commands.Basic.Properties) -> bytes:
    return (pframe.marshal(commands.Basic.Publish(exchange="", routing_key=rk), 1)
            + pframe.marshal(header.ContentHeader(0, len(body), props), 1)
            + (pframe.marshal(pbody.ContentBody(body), 1) if body else b""))


def varied_message(rk: str, rnd: random.Random, i: int) -> bytes:
    body = rnd.randbytes(rnd.randint(200, 2048))
    props = commands.Basic.Properties(
        content_type="application/json", delivery_mode=1, message_id=str(uuid.UUID(int=rnd.getrandbits(128))),
        timestamp=_EPOCH + datetime.timedelta(seconds=i),
        headers={"task": f"tasks.t{i % 17}", "id": str(i), "retries": i % 3})
    return encode(rk, body, props)


# ----------------------------------------------------------------------------- varied
def _varied_producer(uri: str, queue: str, seconds: float, out: Any) -> None:
    async def run() -> None:
        rnd = random.Random(7)
        msgs = [varied_message(queue, rnd, i) for i in range(20000)]
        chunks = [b"".join(msgs[i : i + 100]) for i in range(0, len(msgs), 100)]
        c = await Raw.connect(uri)
        sent = 0
        end = time.monotonic() + seconds + 2  # the consumer's window starts at its first delivery
        while time.monotonic() < end:
            for ch in chunks:
                c.w.write(ch)
                sent += 100
                await c.w.drain()
                if time.monotonic() >= end:
                    break
        out.put(sent)
        c.w.close()

    asyncio.run(run())


def _varied_consumer(uri: str, queue: str, seconds: float, out: Any) -> None:
    async def run() -> None:
        c = await Raw.connect(uri)
        out.put(c.server)
        await c.call(commands.Basic.Consume(queue=queue, consumer_tag="v", no_ack=True))
        n = 0
        buf = b""
        started = False
        end = time.monotonic() + 120  # until the first delivery; then ``seconds`` from it
        while time.monotonic() < end:
            try:
                data = await asyncio.wait_for(c.r.read(1 << 20), 1.0)
            except TimeoutError:
                continue
            if not data:
                break
            if not started:
                started = True
                end = time.monotonic() + seconds
            buf += data
            found, rest = frames(buf)
            n += sum(1 for ftype, at in found if is_deliver(buf, ftype, at))
            buf = rest
        out.put(n)
        c.w.close()

    asyncio.run(run())


def varied(uri: str, seconds: float) -> dict[str, Any]:
    queue = "bench-varied-" + uuid.uuid4().hex[:8]
    params = pika.URLParameters(uri)
    conn = pika.BlockingConnection(params)
    ch = conn.channel()
    ch.queue_declare(queue)
    cq: Any = mp.Queue()
    pq: Any = mp.Queue()
    cons = mp.Process(target=_varied_consumer, args=(uri, queue, seconds, cq))
    cons.start()
    server = cq.get(timeout=30)
    prod = mp.Process(target=_varied_producer, args=(uri, queue, seconds, pq))
    prod.start()
    consumed = cq.get(timeout=seconds + 180)
    published = pq.get(timeout=seconds + 180)
    prod.join(30)
    cons.join(30)
    ch.queue_delete(queue)
    conn.close()
    return {"server": server, "consume_rate": consumed / seconds, "publish_rate": published / (seconds + 2)}


# ----------------------------------------------------------------------------- latency
def _latency_consumer(uri: str, queue: str, total: int, ack: bool, out: Any) -> None:
    async def run() -> None:
        con = await Raw.connect(uri)
        if ack:
            await con.call(commands.Basic.Qos(prefetch_count=100))
        await con.call(commands.Basic.Consume(queue=queue, consumer_tag="l", no_ack=not ack))
        out.put("ready")
        lat: list[float] = []
        buf = b""
        tag = 0
        pending = False
        while len(lat) < total:
            data = await asyncio.wait_for(con.r.read(1 << 16), 60)
            if not data:
                break
            now = time.time_ns()
            buf += data
            found, rest = frames(buf)
            for ftype, at in found:
                if is_deliver(buf, ftype, at):
                    tag += 1
                    pending = True
                elif ftype == 3 and pending:  # the first body frame starts with the send time
                    lat.append((now - struct.unpack_from(">q", buf, at)[0]) / 1e6)
                    pending = False
            buf = rest
            if ack and tag:
                con.w.write(pframe.marshal(commands.Basic.Ack(delivery_tag=tag, multiple=True), 1))
        out.put(lat)
        con.w.close()

    asyncio.run(run())


def latency(uri: str, seconds: float, rate: int, ack: bool) -> dict[str, Any]:
    """The producer (this process) publishes at ``rate`` msg/s, each body starting with its send
    time; the consumer (another process) records receive time minus send time."""
    total = int(rate * seconds)
    queue = "bench-lat-" + uuid.uuid4().hex[:8]
    q: Any = mp.Queue()

    async def run() -> dict[str, Any]:
        pub = await Raw.connect(uri)
        await pub.call(commands.Queue.Declare(queue=queue))
        cons = mp.Process(target=_latency_consumer, args=(uri, queue, total, ack, q))
        cons.start()
        assert q.get(timeout=30) == "ready"
        # one encoding; per message only the send time (the body's first 8 bytes) changes
        one = encode(queue, b"\x00" * 64, commands.Basic.Properties(content_type="text/plain"))
        head, tail = one[:-65], one[-57:]  # body frame: 7-byte header, 64 bytes, frame end
        start = time.monotonic()
        i = 0
        while i < total:
            # every due message goes out now (one write), then sleep until the next is due
            due = int((time.monotonic() - start) * rate) + 1
            batch = []
            while i < min(due, total):
                batch.append(head + struct.pack(">q", time.time_ns()) + tail)
                i += 1
            if batch:
                pub.w.write(b"".join(batch))
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
        sent_rate = total / (time.monotonic() - start)  # below ``rate``: the client could not keep up
        lat: list[float] = await asyncio.get_running_loop().run_in_executor(None, q.get, True, seconds + 120)
        cons.join(30)
        await pub.call(commands.Queue.Delete(queue=queue))
        lat.sort()
        pick = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))]  # noqa: E731
        return {"server": pub.server, "p50_ms": pick(0.5), "p99_ms": pick(0.99), "p999_ms": pick(0.999),
                "mean_ms": statistics.fmean(lat), "messages": len(lat), "sent_rate": sent_rate}

    return asyncio.run(run())


# ----------------------------------------------------------------------------- sync
def _sync_consumer(uri: str, queue: str, stop: Any) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(uri))
    ch = conn.channel()
    ch.basic_qos(prefetch_count=100)

    def on(chx: Any, method: Any, _p: Any, _b: bytes) -> None:
        chx.basic_ack(method.delivery_tag)

    ch.basic_consume(queue, on)
    while not stop.is_set():
        conn.process_data_events(time_limit=0.05)
    conn.close()


def sync(uri: str, seconds: float, persistent: bool = True, backlog: int = 50_000) -> dict[str, Any]:
    params = pika.URLParameters(uri)
    queue = "bench-sync-" + uuid.uuid4().hex[:8]
    setup = pika.BlockingConnection(params)
    sch = setup.channel()
    sch.queue_declare(queue, durable=True)
    for i in range(backlog):
        sch.basic_publish("", queue, b"backlog-%d" % i)
    product = setup._impl.server_properties.get("product", b"?")
    version = setup._impl.server_properties.get("version", b"?")
    # the consumer is another process: in a thread it would take the publisher's GIL, and
    # the faster a broker delivers, the slower its publisher would look
    stop = mp.Event()
    t = mp.Process(target=_sync_consumer, args=(uri, queue, stop), daemon=True)
    t.start()
    pub = pika.BlockingConnection(params)
    pch = pub.channel()
    pch.confirm_delivery()
    n = 0
    t0 = time.monotonic()
    end = t0 + seconds
    props = pika.BasicProperties(delivery_mode=2 if persistent else 1, content_type="application/json")
    while time.monotonic() < end:
        pch.basic_publish("", queue, b'{"task": "x", "n": %d}' % n, props)
        n += 1
    elapsed = time.monotonic() - t0
    stop.set()
    t.join(10)
    pub.close()
    sch.queue_delete(queue)
    setup.close()
    as_text = lambda v: v.decode() if isinstance(v, bytes) else str(v)  # noqa: E731
    return {"server": {"product": as_text(product), "version": as_text(version)}, "publish_rate": n / elapsed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", choices=("varied", "latency", "sync"))
    ap.add_argument("--uri", default="amqp://guest:guest@127.0.0.1:5672/")
    ap.add_argument("-z", "--seconds", type=float, default=5.0)
    ap.add_argument("--rate", type=int, default=5000, help="latency: messages per second")
    ap.add_argument("--ack", action="store_true", help="latency: manual ack (prefetch 100)")
    ap.add_argument("--transient", action="store_true", help="sync: delivery mode 1 (default: persistent)")
    a = ap.parse_args(argv)
    if a.workload == "varied":
        r = varied(a.uri, a.seconds)
    elif a.workload == "latency":
        r = latency(a.uri, a.seconds, a.rate, a.ack)
    else:
        r = sync(a.uri, a.seconds, not a.transient)
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
