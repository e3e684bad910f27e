#!/usr/bin/env python3
"""The user workloads of issue 13 that ``skred-perf`` does not cover, for ``benchmarks/run.py``.

- ``varied`` (workload 1): every message different: body 200 B-2 KiB, a message-id, a
  timestamp and three headers; 1 producer + 1 autoack consumer, each its own process and raw
  AMQP connection (messages are encoded before the clock starts, so the client costs little);
  reports consumed msg/s.
- ``latency`` (workload 5): end-to-end latency at a fixed publish rate (``--rate``), autoack or
  manual ack (``--ack``); each body carries its send time; reports p50/p99/p99.9 in ms.
  ``--direct``: the same clients with no broker between them, the floor of the numbers above.
- ``sync`` (workload 6): a pika ``BlockingConnection`` with ``confirm_delivery`` publishing one
  message at a time into a queue with a backlog (50,000: it outlasts the run) and a consumer
  (pika, manual ack, prefetch 100, its own process); reports the publisher's msg/s.

Each prints one JSON line with ``server`` (product, version) like skred-perf does.

    python benchmarks/workloads.py varied --uri amqp://guest:guest@127.0.0.1:5672/ -z 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
from collections.abc import AsyncIterator, Callable, Iterator
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


async def first_bodies(r: asyncio.StreamReader, timeout: float | None = None
                       ) -> AsyncIterator[tuple[int, bytes, list[int]]]:
    """Per read: (its arrival time in ns, the buffer, the offsets of the first body frame of
    each delivery completed in it); ends at EOF."""
    buf = b""
    pending = False
    while True:
        data = await asyncio.wait_for(r.read(1 << 16), timeout)
        if not data:
            return
        now = time.time_ns()
        buf += data
        found, rest = frames(buf)
        ats = []
        for ftype, at in found:
            if is_deliver(buf, ftype, at):
                pending = True
            elif ftype == 3 and pending:
                pending = False
                ats.append(at)
        yield now, buf, ats
        buf = rest


def content(body: bytes, props: commands.Basic.Properties) -> bytes:
    """A message's header frame and body frame on channel 1 (what follows publish or deliver)."""
    return (pframe.marshal(header.ContentHeader(0, len(body), props), 1)
            + (pframe.marshal(pbody.ContentBody(body), 1) if body else b""))


def encode(rk: str, body: bytes, props: commands.Basic.Properties, exchange: str = "") -> bytes:
    return pframe.marshal(commands.Basic.Publish(exchange=exchange, routing_key=rk), 1) + content(body, props)


def varied_message(rk: str, rnd: random.Random, i: int, exchange: str = "",
                   persistent: bool = False) -> bytes:
    """Workload 1's message: body 200 B-2 KiB, a message-id, a timestamp, three headers."""
    body = rnd.randbytes(rnd.randint(200, 2048))
    props = commands.Basic.Properties(
        content_type="application/json", delivery_mode=2 if persistent else 1,
        message_id=str(uuid.UUID(int=rnd.getrandbits(128))), timestamp=_EPOCH + datetime.timedelta(seconds=i),
        headers={"task": f"tasks.t{i % 17}", "id": str(i), "retries": i % 3})
    return encode(rk, body, props, exchange)


# ----------------------------------------------------------------------------- varied
def broker_cpu(pid: int) -> float:
    """CPU seconds the broker process ``pid`` used so far (0.0 without a pid)."""
    if not pid:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _acks_seen(buf: bytes, found: list[tuple[int, int]]) -> int:
    """The highest basic.ack delivery tag among ``found`` frames (0 if none)."""
    top = 0
    for ftype, at in found:
        if ftype == 1 and buf[at : at + 4] == b"\x00\x3c\x00\x50":
            top = max(top, struct.unpack_from(">Q", buf, at + 4)[0])
    return top


def _producer(uri: str, exchange: str, keys: list[str], seconds: float, persistent: bool, window: int,
              out: Any) -> None:
    """Publish varied messages (``keys`` in turn as routing keys) for ``seconds`` + 2 s; with
    ``window``, in confirm mode with at most that many unconfirmed."""
    async def run() -> None:
        rnd = random.Random(hash(tuple(keys)) & 0xFFFF)
        msgs = [varied_message(keys[i % len(keys)], rnd, i, exchange, persistent) for i in range(20000)]
        chunks = [b"".join(msgs[i : i + 100]) for i in range(0, len(msgs), 100)]
        c = await Raw.connect(uri)
        confirmed = 0
        if window:
            await c.call(commands.Confirm.Select())

            async def read_acks() -> None:
                nonlocal confirmed
                buf = b""
                while True:
                    data = await c.r.read(1 << 16)
                    if not data:
                        return
                    buf += data
                    found, rest = frames(buf)
                    confirmed = max(confirmed, _acks_seen(buf, found))
                    buf = rest

            reader = asyncio.ensure_future(read_acks())
        sent = 0
        end = time.monotonic() + seconds + 2  # the consumers' windows start at their first delivery
        while time.monotonic() < end:
            for ch in chunks:
                while window and sent - confirmed >= window and time.monotonic() < end:
                    await asyncio.sleep(0.0005)
                c.w.write(ch)
                sent += 100
                await c.w.drain()
                if time.monotonic() >= end:
                    break
        out.put((sent, confirmed))
        if window:
            reader.cancel()
        c.w.close()

    asyncio.run(run())


def _consumer(uri: str, queues: list[str], seconds: float, prefetch: int, out: Any) -> None:
    """Consume from ``queues`` (one consumer each, one channel), autoack or, with ``prefetch``,
    manual ack (one multiple ack per read); count deliveries for ``seconds`` from the first."""
    async def run() -> None:
        c = await Raw.connect(uri)
        out.put(c.server)
        if prefetch:
            await c.call(commands.Basic.Qos(prefetch_count=prefetch))
        for i, q in enumerate(queues):
            await c.call(commands.Basic.Consume(queue=q, consumer_tag=f"v{i}", no_ack=not prefetch))
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
                out.put("started")
                end = time.monotonic() + seconds
            buf += data
            found, rest = frames(buf)
            got = sum(1 for ftype, at in found if is_deliver(buf, ftype, at))
            n += got
            buf = rest
            if prefetch and got:
                c.w.write(pframe.marshal(commands.Basic.Ack(delivery_tag=n, multiple=True), 1))
        out.put(n)
        c.w.close()

    asyncio.run(run())


def varied(uri: str, seconds: float, pairs: int = 1, topic: int = 0, persistent: bool = False,
           window: int = 0, prefetch: int = 0, pid: int = 0,
           cpu: Callable[[], float] | None = None) -> dict[str, Any]:
    """``pairs`` producers and consumers, each pair on its own queue (workloads 1, 2, 4); or,
    with ``topic``, one producer into a topic exchange with that many bound queues, routing
    keys in turn, all consumed by one consumer (workload 3). Reports consumed msg/s (all
    consumers) and, with ``pid``, the broker's CPU per consumed message over the window
    (``cpu``: CPU seconds so far read some other way, e.g. a node's and its workers')."""
    tag = uuid.uuid4().hex[:8]
    conn = pika.BlockingConnection(pika.URLParameters(uri))
    ch = conn.channel()
    if topic:
        exchange = "bench-topic-" + tag
        ch.exchange_declare(exchange, "topic", auto_delete=False)
        queues = [f"bench-t{j}-{tag}" for j in range(topic)]
        # queue j takes the keys of region j % 10 and kind j // 10: "*.r3.k2"
        keys = [f"orders.r{j % 10}.k{j // 10}" for j in range(topic)]
        for j, q in enumerate(queues):
            ch.queue_declare(q, durable=persistent)
            ch.queue_bind(q, exchange, f"*.r{j % 10}.k{j // 10}")
        plan = [(queues, [keys])]  # one consumer for all queues, one producer for all keys
    else:
        exchange = ""
        queues = [f"bench-varied{j}-{tag}" for j in range(pairs)]
        for q in queues:
            ch.queue_declare(q, durable=persistent)
        plan = [([q], [[q]]) for q in queues]
    cq: Any = mp.Queue()
    pq: Any = mp.Queue()
    cons = [mp.Process(target=_consumer, args=(uri, qs, seconds, prefetch, cq)) for qs, _ in plan]
    for p in cons:
        p.start()
    server = {}
    for _ in cons:
        server = cq.get(timeout=30)
    prods = [mp.Process(target=_producer, args=(uri, exchange, keys, seconds, persistent, window, pq))
             for _, ks in plan for keys in ks]
    for p in prods:
        p.start()
    assert cq.get(timeout=60) == "started"
    read_cpu = cpu or (lambda: broker_cpu(pid))
    cpu0 = read_cpu()
    time.sleep(seconds)
    cpu1 = read_cpu()
    counts = []
    while len(counts) < len(cons):
        v = cq.get(timeout=seconds + 180)
        if v != "started":
            counts.append(v)
    sent = [pq.get(timeout=seconds + 180) for _ in prods]
    for p in prods + cons:
        p.join(30)
    for q in queues:
        ch.queue_delete(q)
    if topic:
        ch.exchange_delete(exchange)
    conn.close()
    consumed = sum(counts)
    r: dict[str, Any] = {"server": server, "consume_rate": consumed / seconds,
                         "publish_rate": sum(s for s, _ in sent) / (seconds + 2)}
    if window:
        r["confirm_rate"] = sum(c for _, c in sent) / (seconds + 2)
    if (pid or cpu) and consumed:
        r["cpu_us_per_msg"] = (cpu1 - cpu0) / consumed * 1e6
    return r


# ----------------------------------------------------------------------------- latency
async def _drain_reader(r: asyncio.StreamReader) -> None:
    while await r.read(1 << 16):
        pass


def _latency_consumer(uri: str, queue: str, total: int, ack: bool, out: Any, direct: bool = False) -> None:
    async def run() -> None:
        if direct:  # the publisher connects to us and sends the deliveries itself: no broker
            accepted: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = \
                asyncio.get_running_loop().create_future()
            server = await asyncio.start_server(lambda r, w: accepted.set_result((r, w)), "127.0.0.1", 0)
            out.put(("ready", server.sockets[0].getsockname()[1]))
            r, w = await accepted
        else:
            con = await Raw.connect(uri)
            if ack:
                await con.call(commands.Basic.Qos(prefetch_count=100))
            await con.call(commands.Basic.Consume(queue=queue, consumer_tag="l", no_ack=not ack))
            out.put(("ready", 0))
            r, w = con.r, con.w
        lat: list[float] = []
        tag = 0
        async for now, buf, ats in first_bodies(r, 60):
            for at in ats:  # each body starts with its send time
                lat.append((now - struct.unpack_from(">q", buf, at)[0]) / 1e6)
            tag += len(ats)
            if ack and ats:
                w.write(pframe.marshal(commands.Basic.Ack(delivery_tag=tag, multiple=True), 1))
            if len(lat) >= total:
                break
        out.put(lat)
        w.close()

    asyncio.run(run())


def latency(uri: str, seconds: float, rate: int, ack: bool, direct: bool = False) -> dict[str, Any]:
    """The producer (this process) publishes at ``rate`` msg/s, each body starting with its send
    time; the consumer (another process) records receive time minus send time.

    ``direct``: no broker. The producer connects to the consumer and writes it the deliveries a
    broker would (the consumer's acks are read and dropped): the same two processes, the same
    reads and writes, so what is left is the floor that this machine and these clients set
    (a client process that the machine stalls for some milliseconds delays every message due
    meanwhile; at 5,000 msg/s the 25 slowest of 25,000 are such a stall)."""
    total = int(rate * seconds)
    queue = "bench-lat-" + uuid.uuid4().hex[:8]
    q: Any = mp.Queue()

    async def run() -> dict[str, Any]:
        cons = mp.Process(target=_latency_consumer, args=(uri, queue, total, ack, q, direct))
        pub = None
        # one encoding; per message only the send time (the body's first 8 bytes) changes
        frames = content(b"\x00" * 64, commands.Basic.Properties(content_type="text/plain"))
        if direct:
            cons.start()
            ready, port = q.get(timeout=30)
            r, w = await asyncio.open_connection("127.0.0.1", port)
            drop = asyncio.create_task(_drain_reader(r))
            server = {"product": "none (the clients connected directly)", "version": ""}
            one = pframe.marshal(commands.Basic.Deliver("l", 1, False, "", queue), 1) + frames
        else:
            pub = await Raw.connect(uri)
            await pub.call(commands.Queue.Declare(queue=queue))
            cons.start()
            ready, _ = q.get(timeout=30)
            w = pub.w
            server = pub.server
            one = pframe.marshal(commands.Basic.Publish(exchange="", routing_key=queue), 1) + frames
        assert ready == "ready"
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
                w.write(b"".join(batch))
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
        sent_rate = total / (time.monotonic() - start)  # below ``rate``: the client could not keep up
        lat: list[float] = await asyncio.get_running_loop().run_in_executor(None, q.get, True, seconds + 120)
        cons.join(30)
        if pub is not None:
            await pub.call(commands.Queue.Delete(queue=queue))
        else:
            drop.cancel()
            w.close()
        lat.sort()
        pick = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))]  # noqa: E731
        return {"server": server, "p50_ms": pick(0.5), "p99_ms": pick(0.99), "p999_ms": pick(0.999),
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


def _prefill(ch: Any, queue: str, backlog: int) -> None:
    """``backlog`` messages into ``queue``, all of them in it before the clock starts (a
    broker still taking in the backlog would be measured doing that too)."""
    for i in range(backlog):
        ch.basic_publish("", queue, b"backlog-%d" % i)
    end = time.monotonic() + 300
    while ch.queue_declare(queue, passive=True).method.message_count < backlog and time.monotonic() < end:
        time.sleep(0.05)


Publisher = tuple[Callable[[int], None], Callable[[], None]]  # publish message n, close


@contextlib.contextmanager
def backlog_with_consumer(uri: str, backlog: int) -> Iterator[tuple[str, dict[str, str]]]:
    """A durable queue holding ``backlog`` messages with a consumer (pika, manual ack, prefetch
    100, its own process: in a thread it would take the publisher's GIL, and the faster a broker
    delivered, the slower its publisher would look); yields (queue, the server's product and
    version), then stops the consumer and deletes the queue."""
    queue = "bench-sync-" + uuid.uuid4().hex[:8]
    setup = pika.BlockingConnection(pika.URLParameters(uri))
    sch = setup.channel()
    sch.queue_declare(queue, durable=True)
    _prefill(sch, queue, backlog)
    server = {k: (v.decode() if isinstance(v, bytes) else str(v)) for k, v in
              setup._impl.server_properties.items() if k in ("product", "version")}
    stop = mp.Event()
    t = mp.Process(target=_sync_consumer, args=(uri, queue, stop), daemon=True)
    t.start()
    try:
        yield queue, server
    finally:
        stop.set()
        t.join(10)
        sch.queue_delete(queue)
        setup.close()


def _against_backlog(uri: str, seconds: float, backlog: int, publisher: Callable[[str], Publisher]
                     ) -> dict[str, Any]:
    """Time a synchronous publisher into ``backlog_with_consumer``'s queue. ``publisher(queue)``
    returns (publish message n, close); reports publishes per second."""
    with backlog_with_consumer(uri, backlog) as (queue, server):
        publish, close = publisher(queue)
        n = 0
        t0 = time.monotonic()
        end = t0 + seconds
        while time.monotonic() < end:
            publish(n)
            n += 1
        elapsed = time.monotonic() - t0
        close()
    return {"server": server, "publish_rate": n / elapsed}


def sync(uri: str, seconds: float, persistent: bool = True, backlog: int = 50_000) -> dict[str, Any]:
    """Workload 6: a pika ``BlockingConnection`` with ``confirm_delivery``."""
    def publisher(queue: str) -> Publisher:
        pub = pika.BlockingConnection(pika.URLParameters(uri))
        pch = pub.channel()
        pch.confirm_delivery()
        props = pika.BasicProperties(delivery_mode=2 if persistent else 1, content_type="application/json")
        return (lambda n: pch.basic_publish("", queue, b'{"task": "x", "n": %d}' % n, props)), pub.close

    return _against_backlog(uri, seconds, backlog, publisher)


# ----------------------------------------------------------------------------- celery
def celery_delay(uri: str, seconds: float, backlog: int = 50_000) -> dict[str, Any]:
    """Workload 6 as Celery users meet it: ``task.delay()`` with publisher confirms
    (``confirm_publish``) into a backlogged queue with a consumer; reports delay() calls/s."""
    from celery import Celery

    def publisher(queue: str) -> Publisher:
        app = Celery("bench", broker=uri.replace("amqp://", "pyamqp://", 1))
        app.conf.broker_transport_options = {"confirm_publish": True}
        app.conf.task_default_queue = queue

        @app.task(name="bench.add")  # type: ignore[untyped-decorator]
        def add(x: int, y: int) -> int:
            return x + y

        add.delay(0, 0)  # connect and declare before the clock starts
        return (lambda n: add.delay(n, 1)), app.close

    return _against_backlog(uri, seconds, backlog, publisher)


# ----------------------------------------------------------------------------- many queues
def _pairs(uri: str, names: list[str], warm: int, go: Any, out: Any, durable: bool = False) -> None:
    """A producer and a consumer connection per queue. Cold: every queue is declared and
    consumed, then (on ``go``) every producer sends its first message; each consumer notes
    its latency. Warm: then every producer sends ``warm`` more; time until all arrived.
    ``durable``: durable queues, persistent messages and manual-ack consumers (which leave
    them unacked until the queue goes), so that every message is stored, as an MQTT QoS 1
    subscription's is; else autoack, where a message for a waiting consumer is not stored."""
    props = commands.Basic.Properties(delivery_mode=2 if durable else None)
    async def run() -> None:
        prods = []
        lat: list[float] = []
        got = [0]
        done = asyncio.Event()
        need = len(names) * (1 + warm)

        async def consume(c: Raw) -> None:
            async for now, buf, ats in first_bodies(c.r):
                for at in ats:
                    got[0] += 1
                    sent, first = struct.unpack_from(">qB", buf, at)
                    if first:
                        lat.append((now - sent) / 1e9)
                if got[0] >= need:
                    done.set()
                    return

        tasks = []
        for name in names:
            c = await Raw.connect(uri)
            await c.call(commands.Queue.Declare(queue=name, auto_delete=False, durable=durable))
            await c.call(commands.Basic.Consume(queue=name, consumer_tag="p", no_ack=not durable))
            tasks.append(asyncio.ensure_future(consume(c)))
            prods.append(await Raw.connect(uri))
        out.put("ready")
        await asyncio.get_running_loop().run_in_executor(None, go.wait)
        for name, p in zip(names, prods, strict=True):
            p.w.write(encode(name, struct.pack(">qB", time.time_ns(), 1) + b"x" * 55, props))
        while len(lat) < len(names):
            await asyncio.sleep(0.005)
        t0 = time.monotonic()
        for name, p in zip(names, prods, strict=True):
            p.w.write(b"".join(encode(name, struct.pack(">qB", time.time_ns(), 0) + b"x" * 55, props)
                               for _ in range(warm)))
        try:
            await asyncio.wait_for(done.wait(), 300)
        except TimeoutError:
            pass
        out.put((lat, time.monotonic() - t0, got[0] - len(names)))
        for name, p in zip(names, prods, strict=True):
            p.w.write(pframe.marshal(commands.Queue.Delete(queue=name), 1))
            await p.method()
        for t in tasks:
            t.cancel()

    asyncio.run(run())


def many_queues(uri: str, queues: int = 1000, warm: int = 100, procs: int = 4,
                durable: bool = False) -> dict[str, Any]:
    """Workload 7: ``queues`` new queues, each with its own producer and consumer connection
    (``procs`` client processes). Reports the time until the first message into every new
    queue was delivered (cold, s), its median, a bystander's worst latency meanwhile (a
    producer/consumer pair on a warm queue publishing every millisecond: does a cold queue
    stall other connections?), and the warm rate (``warm`` more per queue, msg/s).
    ``durable``: every message stored (``_pairs``)."""
    tag = uuid.uuid4().hex[:8]
    names = [f"bench-mq{i}-{tag}" for i in range(queues)]
    go = mp.Event()
    out: Any = mp.Queue()
    ps = [mp.Process(target=_pairs, args=(uri, names[i::procs], warm, go, out, durable))
          for i in range(procs)]
    for p in ps:
        p.start()
    for _ in ps:
        assert out.get(timeout=300) == "ready"
    bystander, stop, by, server = _start_bystander(uri, tag)
    go.set()
    results = [out.get(timeout=600) for _ in ps]
    stop.set()
    worst, sent = by.get(timeout=60)
    for p in [*ps, bystander]:
        p.join(30)
    lat = sorted(x for r in results for x in r[0])
    warm_n = sum(r[2] for r in results)
    return {"server": server, "cold_s": lat[-1], "cold_p50_ms": lat[len(lat) // 2] * 1e3,
            "bystander_max_ms": worst, "bystander_sent": sent,
            "warm_rate": warm_n / max(r[1] for r in results)}


def delete_queues(uri: str, queues: int = 1000, messages: int = 20) -> dict[str, Any]:
    """Issue 31's delete burst: ``queues`` durable queues, each holding ``messages`` persistent
    messages (stored: a write segment, a meta), are deleted at once, pipelined on one channel,
    while a bystander pair publishes every millisecond. Reports the time until every delete-ok
    (s) and the bystander's worst latency meanwhile (does a delete stall other connections?)."""
    tag = uuid.uuid4().hex[:8]
    names = [f"bench-del{i}-{tag}" for i in range(queues)]
    props = commands.Basic.Properties(delivery_mode=2)

    async def fill() -> None:
        c = await Raw.connect(uri)
        for name in names:
            await c.call(commands.Queue.Declare(queue=name, durable=True))
        for name in names:
            c.w.write(b"".join(encode(name, b"x" * 200, props) for _ in range(messages)))
        await c.call(commands.Queue.Declare(queue=names[-1], durable=True, passive=True))
        c.w.close()

    async def delete() -> float:
        c = await Raw.connect(uri)
        t0 = time.monotonic()
        c.w.write(b"".join(pframe.marshal(commands.Queue.Delete(queue=name), 1) for name in names))
        for _ in names:
            await c.method()
        took = time.monotonic() - t0
        c.w.close()
        return took

    asyncio.run(fill())
    time.sleep(1.0)  # the syncer wrote and fsynced them; the segment worker is idle
    bystander, stop, by, server = _start_bystander(uri, tag)
    took = asyncio.run(delete())
    time.sleep(0.5)  # the worker's removals, which must not stall the bystander either
    stop.set()
    worst, sent = by.get(timeout=60)
    bystander.join(30)
    return {"server": server, "delete_s": took, "bystander_max_ms": worst, "bystander_sent": sent}


def _start_bystander(uri: str, tag: str) -> tuple[Any, Any, Any, Any]:
    """A bystander pair (``_bystander``) in its own process, its queue warm: (process, stop
    event, result queue, the server's identity)."""
    by: Any = mp.Queue()
    stop = mp.Event()
    bystander = mp.Process(target=_bystander, args=(uri, "bench-by-" + tag, stop, by))
    bystander.start()
    server = by.get(timeout=60)
    time.sleep(0.5)  # the bystander's queue is warm
    return bystander, stop, by, server


def _bystander(uri: str, queue: str, stop: Any, out: Any) -> None:
    async def run() -> None:
        pub = await Raw.connect(uri)
        con = await Raw.connect(uri)
        await con.call(commands.Queue.Declare(queue=queue))
        await con.call(commands.Basic.Consume(queue=queue, consumer_tag="b", no_ack=True))
        out.put(pub.server)
        worst = 0.0
        sent = 0

        async def consume() -> None:
            nonlocal worst
            async for now, buf, ats in first_bodies(con.r):
                for at in ats:
                    worst = max(worst, (now - struct.unpack_from(">q", buf, at)[0]) / 1e6)

        task = asyncio.ensure_future(consume())
        while not stop.is_set():
            body = struct.pack(">q", time.time_ns()) + b"y" * 56
            pub.w.write(encode(queue, body, commands.Basic.Properties()))
            sent += 1
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.5)
        task.cancel()
        await pub.call(commands.Queue.Delete(queue=queue))
        out.put((worst, sent))

    asyncio.run(run())


# ----------------------------------------------------------------------------- rss
def memory_mib(pid: int) -> dict[str, float]:
    """The broker's VmRSS, RssAnon and RssFile in MiB (empty without a pid)."""
    mem: dict[str, float] = {}
    if pid:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":")[0]
                if key in ("VmRSS", "RssAnon", "RssFile"):
                    mem[key] = int(line.split()[1]) / 1024
    return mem


def rss(uri: str, count: int, pid: int, size: int = 1024, cap: float = 1200.0, stall: float = 120.0,
        keep: bool = False) -> dict[str, Any]:
    """Workload 8: ``count`` persistent ``size``-byte messages into a durable queue with
    confirms (window 1000); reports the fill rate and, with ``pid``, the broker's RSS (MiB)
    once all are confirmed. The fill stops after ``cap`` seconds, or when no confirm came for
    ``stall`` seconds (a broker blocking publishers, e.g. on a memory alarm): ``messages`` is
    then the confirmed count and ``capped``/``blocked`` say why. With ``keep`` the queue stays
    (for ``drain``), else it is deleted."""
    queue = "bench-rss-" + uuid.uuid4().hex[:8]

    async def run() -> dict[str, Any]:
        c = await Raw.connect(uri)
        await c.call(commands.Queue.Declare(queue=queue, durable=True))
        await c.call(commands.Confirm.Select())
        one = encode(queue, b"r" * size, commands.Basic.Properties(delivery_mode=2))
        chunk = one * 100
        confirmed = 0
        sent = 0
        buf = b""
        capped = blocked = False
        t0 = time.monotonic()
        deadline = t0 + cap
        while confirmed < count:
            while sent < count and sent - confirmed < 1000 and time.monotonic() < deadline:
                c.w.write(chunk)
                sent += 100
            wait = min(stall, max(1.0, deadline - time.monotonic()))
            try:
                data = await asyncio.wait_for(c.r.read(1 << 16), wait)
            except TimeoutError:
                data = None
            now = time.monotonic()
            if data == b"":
                raise ConnectionError(f"broker closed the connection after {confirmed:,} confirms")
            if data:
                buf += data
                found, rest = frames(buf)
                confirmed = max(confirmed, _acks_seen(buf, found))
                buf = rest
            elif wait >= stall:
                blocked = True
                break
            if now >= deadline and (sent == confirmed or now >= deadline + stall):
                capped = True
                break
        elapsed = time.monotonic() - t0
        if pid:
            time.sleep(2)  # let the broker settle (write-back, GC)
        mem = memory_mib(pid)
        if not keep:
            c.w.write(pframe.marshal(commands.Queue.Delete(queue=queue), 1))
            await asyncio.wait_for(c.method(), 600)
        c.w.close()
        # RssAnon: the broker's own memory; RssFile: mapped file pages (segments the kernel
        # may drop at any time, clean once written back)
        return {"server": c.server, "fill_rate": confirmed / elapsed, "rss_mib": mem.get("VmRSS", 0.0),
                "rss_anon_mib": mem.get("RssAnon", 0.0), "rss_file_mib": mem.get("RssFile", 0.0),
                "messages": confirmed, "sent": sent, "fill_s": elapsed, "capped": capped,
                "blocked": blocked, "queue": queue}

    return asyncio.run(run())


def passive_depth(uri: str, queue: str, timeout: float = 10.0) -> int:
    """The queue's message count, from a passive declare on a new connection (raises OSError
    while the broker does not listen yet)."""
    async def ask() -> int:
        c = await Raw.connect(uri)
        try:
            ok = await c.call(commands.Queue.Declare(queue=queue, passive=True))
        finally:
            c.w.close()
        return int(ok.message_count)

    return asyncio.run(asyncio.wait_for(ask(), timeout))


def drain(uri: str, queue: str, count: int, pid: int, cap: float = 600.0, delete: bool = True
          ) -> dict[str, Any]:
    """Consume ``count`` messages of ``queue`` (manual ack, prefetch 1000, one multiple ack per
    read) and report the drain rate overall and per tenth of ``count`` (slowest and fastest
    tenth: a steady drain has them close), the queue depth before, and the broker's highest
    RSS meanwhile (sampled each second). Stops after ``cap`` seconds; then deletes the queue."""
    async def run() -> dict[str, Any]:
        c = await Raw.connect(uri)
        ok = await c.call(commands.Queue.Declare(queue=queue, passive=True))
        depth = int(ok.message_count)
        await c.call(commands.Basic.Qos(prefetch_count=1000))
        await c.call(commands.Basic.Consume(queue=queue, consumer_tag="drain"))
        n = 0
        buf = b""
        tenth = max(1, count // 10)
        marks: list[float] = []
        peak: dict[str, float] = {}
        t0 = time.monotonic()
        sample = t0
        while n < count and time.monotonic() - t0 < cap:
            try:
                data = await asyncio.wait_for(c.r.read(1 << 20), 5.0)
            except TimeoutError:
                continue
            if not data:
                raise ConnectionError(f"broker closed the connection after {n:,} deliveries")
            buf += data
            found, rest = frames(buf)
            got = sum(1 for ftype, at in found if is_deliver(buf, ftype, at))
            buf = rest
            if got:
                n += got
                c.w.write(pframe.marshal(commands.Basic.Ack(delivery_tag=n, multiple=True), 1))
                now = time.monotonic()
                while len(marks) < 10 and n >= tenth * (len(marks) + 1):
                    marks.append(now)
            if time.monotonic() >= sample:
                sample += 1.0
                for k, v in memory_mib(pid).items():
                    peak[k] = max(peak.get(k, 0.0), v)
        elapsed = time.monotonic() - t0
        rates = [tenth / (b - a) for a, b in zip([t0, *marks], marks, strict=False) if b > a]
        c.w.close()  # deliveries still in flight: delete from a fresh connection
        if delete:
            d = await Raw.connect(uri)
            await asyncio.wait_for(d.call(commands.Queue.Delete(queue=queue)), 900)
            d.w.close()
        return {"server": c.server, "drained": n, "depth_before": depth, "drain_rate": n / elapsed,
                "drain_tenth_min": min(rates, default=0.0), "drain_tenth_max": max(rates, default=0.0),
                "drain_rss_anon_mib": peak.get("RssAnon", 0.0), "drain_rss_mib": peak.get("VmRSS", 0.0)}

    return asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", choices=("varied", "latency", "sync", "celery", "queues", "rss", "drain"))
    ap.add_argument("--uri", default="amqp://guest:guest@127.0.0.1:5672/")
    ap.add_argument("-z", "--seconds", type=float, default=5.0)
    ap.add_argument("--pid", type=int, default=0, help="the broker's pid: its CPU per message, its RSS")
    ap.add_argument("--rate", type=int, default=5000, help="latency: messages per second")
    ap.add_argument("--ack", action="store_true", help="latency: manual ack (prefetch 100)")
    ap.add_argument("--direct", action="store_true",
                    help="latency: no broker, the producer writes deliveries to the consumer (the floor)")
    ap.add_argument("--transient", action="store_true", help="sync: delivery mode 1 (default: persistent)")
    ap.add_argument("--pairs", type=int, default=1, help="varied: producer/consumer pairs, a queue each")
    ap.add_argument("--topic", type=int, default=0, help="varied: a topic exchange with this many queues")
    ap.add_argument("--persistent", action="store_true", help="varied: persistent, durable queues")
    ap.add_argument("--confirm", type=int, default=0, help="varied: confirms, at most N unconfirmed")
    ap.add_argument("--prefetch", type=int, default=0, help="varied: manual ack with this prefetch")
    ap.add_argument("--queues", type=int, default=1000, help="queues: how many new queues")
    ap.add_argument("--count", type=int, default=1_000_000, help="rss: messages to queue; drain: to consume")
    ap.add_argument("--cap", type=float, default=1200.0, help="rss, drain: stop after this many seconds")
    ap.add_argument("--keep", action="store_true", help="rss: keep the queue (for drain)")
    ap.add_argument("--queue", default="", help="drain: the queue")
    a = ap.parse_args(argv)
    if a.workload == "varied":
        r = varied(a.uri, a.seconds, a.pairs, a.topic, a.persistent, a.confirm, a.prefetch, a.pid)
    elif a.workload == "latency":
        r = latency(a.uri, a.seconds, a.rate, a.ack, a.direct)
    elif a.workload == "celery":
        r = celery_delay(a.uri, a.seconds)
    elif a.workload == "queues":
        r = many_queues(a.uri, a.queues)
    elif a.workload == "rss":
        r = rss(a.uri, a.count, a.pid, cap=a.cap, keep=a.keep)
    elif a.workload == "drain":
        r = drain(a.uri, a.queue, a.count, a.pid, a.cap)
    else:
        r = sync(a.uri, a.seconds, not a.transient)
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
