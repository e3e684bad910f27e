#!/usr/bin/env python3
"""Latency as an outside load generator sees it (issue 31), Skred and RabbitMQ in one run.

Why a second latency benchmark: ``workloads.py latency`` (run.py's 5-* rows) reported every
percentile below RabbitMQ's while an independent generator saw Skred's 20k msg/s manual-ack p99 at
1.9x RabbitMQ's. It differs from such a generator in four ways, each of which hides tail latency:

- it stamps each message with the time it was *written*, so when the producer falls behind (a
  broker that pushes back on the socket, or a stall in the producer) the wait before the write is
  not counted: coordinated omission;
- its messages are one 64-byte body with one property, where users send 200 B-2 KiB with
  Celery's properties (message-id, timestamp, headers), which the broker must parse and re-encode;
- its consumer acknowledges once per socket read with ``multiple`` set, where clients ack each
  message with a frame (and a write) of its own, so the broker handles one ack per message;
- it publishes from an asyncio loop, and the producer and the broker compete for the same cores.

Theory of operation: open-loop generation. The producer (its own process, blocking sockets, no
event loop) fixes message k's *intended* send time as ``start + k / rate`` before the run; at each
wake it writes every message already due, each stamped with its intended time (CLOCK_MONOTONIC,
one clock for every process on the machine), then sleeps until the next is due. A message that
goes out late carries the lateness in its latency, as it would for a user whose publish waited.
The consumer (another process) reads with ``recv``, takes the clock once per read, and for each
delivery completed in it records ``now - stamp``; with ``--ack`` (prefetch 100) it sends a
``basic.ack`` for each delivery as its own write, as pika or aio-pika do. ``--conns N`` spreads
the same rate over N queues, each with a producer connection and a consumer connection. All
samples are kept (no histogram buckets): p50, p90, p99, p99.9 and max are exact.

``sync``: a pika ``BlockingConnection`` with ``confirm_delivery`` publishing Celery-like
persistent messages one at a time into a durable queue with a backlog (``--backlog``, 2,000 as in
the issue; 0 for none) and a live consumer in its own process; each ``basic_publish`` call is
timed (it returns when the confirm arrives).

Every load loop is bounded in count (``rate * seconds`` messages) and time (a deadline). With
``--private DIR`` it starts a Skred and a RabbitMQ of its own (benchmarks/tls_brokers.py), runs
every cell ``--runs`` times alternating the brokers, and prints a table: the median of the runs
and their range, with the 1-minute load average at each run.

    python benchmarks/latency.py --private /tmp/lat --runs 5 --cells ack-20k,auto-5k,sync-2000
    python benchmarks/latency.py --uri amqp://guest:guest@127.0.0.1:5672/ --cell ack-20k -z 5
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import random
import selectors
import socket
import statistics
import struct
import sys
import time
import uuid
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from pamqp import commands
from pamqp import frame as pframe

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import content  # noqa: E402  (benchmarks/ is not a package)

_FRAME = struct.Struct(">BHI")
_STAMP = struct.Struct(">q")
_TAG = struct.Struct(">Q")
_DELIVER = b"\x00\x3c\x00\x3c"
_EPOCH = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
POOL = 512  # distinct messages, sent in turn (the broker sees no two consecutive alike)
PREFETCH = 100
DRAIN_GRACE = 30.0  # seconds the consumer waits for the last messages after the producer ends


# ----------------------------------------------------------------------------- wire
class Conn:
    """A blocking AMQP 0-9-1 connection with channel 1 open (pamqp for the handshake)."""

    def __init__(self, uri: str) -> None:
        u = urlparse(uri)
        self.sock = socket.create_connection((u.hostname or "127.0.0.1", u.port or 5672), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""
        self.tag = 0  # the consumer: the delivery tag of the delivery being read
        self.sock.sendall(b"AMQP\x00\x00\x09\x01")
        start = self.method()
        props = getattr(start, "server_properties", {}) or {}
        self.server = {"product": str(props.get("product", "?")), "version": str(props.get("version", "?"))}
        user, pw = unquote(u.username or "guest"), unquote(u.password or "guest")
        self.send(commands.Connection.StartOk(client_properties={}, mechanism="PLAIN",
                                              response=f"\x00{user}\x00{pw}"), 0)
        self.method()  # tune
        self.send(commands.Connection.TuneOk(2047, 131072, 0), 0)
        self.send(commands.Connection.Open(unquote(u.path[1:]) if len(u.path) > 1 else "/"), 0)
        self.method()  # open-ok
        self.call(commands.Channel.Open())

    def send(self, m: Any, channel: int = 1) -> None:
        self.sock.sendall(pframe.marshal(m, channel))

    def method(self) -> Any:
        while True:
            if len(self.buf) >= 7:
                _, _, size = _FRAME.unpack_from(self.buf)
                if len(self.buf) >= size + 8:
                    one, self.buf = self.buf[: size + 8], self.buf[size + 8 :]
                    return pframe.unmarshal(one)[2]
            data = self.sock.recv(1 << 16)
            if not data:
                raise EOFError("broker closed the connection")
            self.buf += data

    def call(self, m: Any) -> Any:
        self.send(m)
        return self.method()

    def close(self) -> None:
        self.sock.close()


def celery_message(queue: str, rnd: random.Random, i: int, persistent: bool) -> tuple[bytes, bytes]:
    """A Celery-like message for ``queue`` as (the frames up to the body's first 8 bytes, the
    frames after them): body 200 B-2 KiB, message-id, timestamp, three headers. The 8 bytes
    between the two halves are the intended send time."""
    body = rnd.randbytes(rnd.randint(200, 2048))
    props = commands.Basic.Properties(
        content_type="application/json", content_encoding="utf-8", delivery_mode=2 if persistent else 1,
        priority=0, correlation_id=str(uuid.UUID(int=rnd.getrandbits(128))),
        message_id=str(uuid.UUID(int=rnd.getrandbits(128))), timestamp=_EPOCH + datetime.timedelta(seconds=i),
        headers={"lang": "py", "task": f"tasks.t{i % 17}", "id": str(i), "retries": i % 3})
    frames = pframe.marshal(commands.Basic.Publish(exchange="", routing_key=queue), 1) + content(body, props)
    at = len(frames) - 1 - len(body)  # the body frame ends with its body and the frame-end octet
    return frames[:at], frames[at + 8 :]


# ----------------------------------------------------------------------------- open loop
@dataclass(frozen=True)
class Plan:
    uri: str
    queues: tuple[str, ...]
    rate: int
    total: int
    ack: bool
    persistent: bool
    start_ns: int  # CLOCK_MONOTONIC time of message 0's intended send


def _producer(plan: Plan, out: Any) -> None:
    conns = [Conn(plan.uri) for _ in plan.queues]
    rnd = random.Random(31)
    n = len(plan.queues)
    pool = [celery_message(plan.queues[i % n], rnd, i, plan.persistent) for i in range(max(POOL, n))]
    pool = pool[: len(pool) - len(pool) % n]  # message k always goes to queue k % n
    interval = 1e9 / plan.rate
    i, lag = 0, 0
    out.send("ready")
    while time.monotonic_ns() < plan.start_ns:
        time.sleep(max(0.0, (plan.start_ns - time.monotonic_ns()) / 1e9))
    while i < plan.total:
        now = time.monotonic_ns()
        due = min(plan.total, int((now - plan.start_ns) / interval) + 1)
        if due > i:
            lag = max(lag, now - plan.start_ns - int(i * interval))
            parts: list[list[bytes]] = [[] for _ in range(n)]
            for k in range(i, due):
                head, tail = pool[k % len(pool)]
                parts[k % n] += (head, _STAMP.pack(plan.start_ns + int(k * interval)), tail)
            for c, p in zip(conns, parts, strict=True):
                if p:
                    c.sock.sendall(b"".join(p))
            i = due
        time.sleep(max(0.0, (plan.start_ns + i * interval - time.monotonic_ns()) / 1e9))
    out.send(("done", lag / 1e6))
    out.recv()  # the consumer is finished: only now close (a close could drop unrouted messages)
    for c in conns:
        c.close()


def _consumer(plan: Plan, seconds: float, out: Any) -> None:
    sel = selectors.DefaultSelector()
    acks = pframe.marshal(commands.Basic.Ack(delivery_tag=1), 1)
    ack_head, ack_tail = acks[:11], acks[19:]  # the tag is the 8 bytes after class/method ids
    conns = []
    for q in plan.queues:
        c = Conn(plan.uri)
        if plan.ack:
            c.call(commands.Basic.Qos(prefetch_count=PREFETCH))
        c.call(commands.Basic.Consume(queue=q, consumer_tag="l", no_ack=not plan.ack))
        c.sock.setblocking(False)
        sel.register(c.sock, selectors.EVENT_READ, c)
        conns.append(c)
    out.send("ready")
    lat = array("q")
    deadline = plan.start_ns / 1e9 + seconds + DRAIN_GRACE
    while len(lat) < plan.total and time.monotonic() < deadline:
        for key, _ in sel.select(1.0):
            c = key.data
            data = c.sock.recv(1 << 18)
            now = time.monotonic_ns()
            if not data:
                raise EOFError("broker closed the consumer's connection")
            buf = c.buf + data
            pos, ln = 0, len(buf)
            while ln - pos >= 7:
                ftype, _, size = _FRAME.unpack_from(buf, pos)
                if ln - pos < size + 8:
                    break
                at = pos + 7
                if ftype == 1 and buf[at : at + 4] == _DELIVER:
                    c.tag = _TAG.unpack_from(buf, at + 5 + buf[at + 4])[0]
                elif ftype == 3:  # the first (only: bodies < frame_max) body frame of a delivery
                    lat.append(now - _STAMP.unpack_from(buf, at)[0])
                    if plan.ack:  # one ack frame and one write per message, as clients do
                        c.sock.setblocking(True)
                        c.sock.sendall(ack_head + _TAG.pack(c.tag) + ack_tail)
                        c.sock.setblocking(False)
                pos += size + 8
            c.buf = buf[pos:]
    out.send(lat.tobytes())
    for c in conns:
        c.close()


def _pcts(lat_ns: array[int]) -> dict[str, float]:
    s = sorted(lat_ns)
    if not s:
        return {}
    pick = lambda p: s[min(len(s) - 1, int(p * len(s)))] / 1e6  # noqa: E731
    return {"p50_ms": pick(0.5), "p90_ms": pick(0.9), "p99_ms": pick(0.99), "p999_ms": pick(0.999),
            "max_ms": s[-1] / 1e6, "mean_ms": statistics.fmean(s) / 1e6}


def open_loop(uri: str, seconds: float, rate: int, ack: bool, conns: int = 1,
              persistent: bool = False) -> dict[str, Any]:
    """One open-loop run; the queues are declared (exclusive to nobody, deleted after)."""
    setup = Conn(uri)
    tag = uuid.uuid4().hex[:8]
    queues = tuple(f"bench-ol-{tag}-{i}" for i in range(conns))
    for q in queues:
        setup.call(commands.Queue.Declare(queue=q, durable=persistent))
    plan = Plan(uri, queues, rate, int(rate * seconds), ack, persistent, 0)
    ctx = mp.get_context("fork")
    c_end, c_child = ctx.Pipe()
    p_end, p_child = ctx.Pipe()
    load = os.getloadavg()[0]
    try:
        plan = Plan(**{**plan.__dict__, "start_ns": time.monotonic_ns() + int(2e9) + conns * int(2e7)})
        cons = ctx.Process(target=_consumer, args=(plan, seconds, c_child), daemon=True)
        prod = ctx.Process(target=_producer, args=(plan, p_child), daemon=True)
        cons.start()
        prod.start()
        for end in (c_end, p_end):
            if not end.poll(60) or end.recv() != "ready":
                raise RuntimeError("a client process did not get ready")
        budget = seconds + DRAIN_GRACE + 30
        if not c_end.poll(budget + 2e-9 * max(0, plan.start_ns - time.monotonic_ns())):
            raise RuntimeError("the consumer did not finish")
        lat = array("q")
        lat.frombytes(c_end.recv())
        _, lag = p_end.recv() if p_end.poll(10) else (None, float("nan"))
        p_end.send("close")
        cons.join(10)
        prod.join(10)
    finally:
        for q in queues:
            setup.call(commands.Queue.Delete(queue=q))
        setup.close()
    return {"server": setup.server, **_pcts(lat), "messages": len(lat), "expected": plan.total,
            "producer_lag_max_ms": lag, "load1": load}


# ----------------------------------------------------------------------------- sync publisher
def sync_calls(uri: str, seconds: float, backlog: int) -> dict[str, Any]:
    """Call times of a synchronous pika publisher with confirms (see the module comment)."""
    import pika
    from workloads import backlog_with_consumer

    with backlog_with_consumer(uri, backlog) as (queue, server):
        pub = pika.BlockingConnection(pika.URLParameters(uri))
        pch = pub.channel()
        pch.confirm_delivery()
        rnd = random.Random(6)
        bodies = [rnd.randbytes(rnd.randint(200, 2048)) for _ in range(64)]
        load = os.getloadavg()[0]
        calls = array("q")
        end = time.monotonic() + seconds
        n = 0
        while time.monotonic() < end and n < 1_000_000:
            props = pika.BasicProperties(
                content_type="application/json", content_encoding="utf-8", delivery_mode=2,
                message_id=str(uuid.UUID(int=rnd.getrandbits(128))), correlation_id=str(n),
                headers={"lang": "py", "task": f"tasks.t{n % 17}", "id": str(n), "retries": n % 3})
            t0 = time.perf_counter_ns()
            pch.basic_publish("", queue, bodies[n % len(bodies)], props)
            calls.append(time.perf_counter_ns() - t0)
            n += 1
        pub.close()
    return {"server": server, **_pcts(calls), "messages": n, "publish_rate": n / seconds, "load1": load}


# ----------------------------------------------------------------------------- cells, table
CELLS: dict[str, tuple[str, dict[str, Any]]] = {
    "auto-5k": ("1p1c, autoack, 5,000 msg/s", {"rate": 5000, "ack": False}),
    "auto-20k": ("1p1c, autoack, 20,000 msg/s", {"rate": 20000, "ack": False}),
    "ack-5k": ("1p1c, manual ack of each message, prefetch 100, 5,000 msg/s", {"rate": 5000, "ack": True}),
    "ack-20k": ("1p1c, manual ack of each message, prefetch 100, 20,000 msg/s", {"rate": 20000, "ack": True}),
    "conns-100": ("100 queues, a producer and a consumer connection each, 5,000 msg/s in all, manual ack",
                  {"rate": 5000, "ack": True, "conns": 100}),
    "sync-0": ("synchronous pika publisher, confirms, persistent, live consumer, no backlog: call time",
               {"backlog": 0}),
    "sync-2000": ("(sync-0) into a 2,000-message backlog: call time", {"backlog": 2000}),
}
METRICS = ("p50_ms", "p90_ms", "p99_ms", "p999_ms", "max_ms")


def tree_cpu(pid: int) -> float:
    """CPU seconds used so far by process ``pid`` and its descendants (Skred's node process
    runs its vhosts in worker processes; RabbitMQ's ``pid`` is its Erlang VM)."""
    from workloads import broker_cpu

    if not pid:
        return 0.0
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += broker_cpu(p)
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue  # it exited meanwhile
    return total


def run_cell(uri: str, cell: str, seconds: float, pid: int = 0) -> dict[str, Any]:
    """One run of ``cell``; with the broker's ``pid``, also its CPU time per message."""
    kw = CELLS[cell][1]
    cpu0 = tree_cpu(pid)
    if "backlog" in kw:
        r = sync_calls(uri, seconds, kw["backlog"])
    else:
        r = open_loop(uri, seconds, kw["rate"], kw["ack"], kw.get("conns", 1))
    if pid and r.get("messages"):
        r["broker_cpu_us_per_msg"] = (tree_cpu(pid) - cpu0) * 1e6 / r["messages"]
    return r


def _cell_in_child(uri: str, cell: str, seconds: float, pid: int = 0) -> dict[str, Any]:
    """``run_cell`` in a fresh interpreter: no state (sockets, pools) carries between runs."""
    import subprocess

    cmd = [sys.executable, __file__, "--uri", uri, "--cell", cell, "-z", f"{seconds:g}", "--pid", str(pid)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds * 4 + 180)
    except subprocess.TimeoutExpired:
        return {"error": "timed out"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return {"error": " | ".join(proc.stderr.strip().splitlines()[-3:])}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def table(results: dict[tuple[str, str], list[dict[str, Any]]], cells: list[str], names: list[str]) -> str:
    """Markdown: per cell and broker, each percentile's median over the runs and [min-max]."""
    head = ["cell", "broker", "runs",
            *(m.removesuffix("_ms").replace("p999", "p99.9") + " ms" for m in METRICS), "not received",
            "broker CPU µs/msg", "load 1-min"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cell in cells:
        for name in names:
            rs = [r for r in results.get((cell, name), []) if "error" not in r]
            if not rs:
                rows.append(f"| {cell} | {name} | 0 | " + " | ".join("—" for _ in METRICS) + " | — | — | — |")
                continue
            vals = []
            for m in METRICS:
                xs = [float(r[m]) for r in rs]
                vals.append(f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]")
            lost = sum(int(r.get("expected", r["messages"])) - int(r["messages"]) for r in rs)
            loads = [float(r["load1"]) for r in rs]
            cpus = [float(r["broker_cpu_us_per_msg"]) for r in rs if "broker_cpu_us_per_msg" in r]
            cpu = f"{statistics.median(cpus):.1f}" if cpus else "—"
            rows.append(f"| {cell} | {name} | {len(rs)} | " + " | ".join(vals)
                        + f" | {lost} | {cpu} | {min(loads):.1f}-{max(loads):.1f} |")
    return "\n".join(rows)


def alternate(targets: list[tuple[str, str, int]], cells: list[str], runs: int, seconds: float) -> int:
    """Every cell ``runs`` times on each (name, uri, pid) target, the targets in turn (so load
    on the machine hits them alike); prints the table."""
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for cell in cells:
        for run in range(runs):
            for name, uri, pid in targets:
                r = _cell_in_child(uri, cell, seconds, pid)
                results.setdefault((cell, name), []).append(r)
                print(f"  {cell} {name} run {run + 1}: {json.dumps(r)}", file=sys.stderr, flush=True)
    print(table(results, cells, [t[0] for t in targets]))
    return 1 if any("error" in r for rs in results.values() for r in rs) else 0


def private(work: Path, cells: list[str], runs: int, seconds: float, skred_only: bool,
            more: list[tuple[str, str, int]]) -> int:
    from tls_brokers import make_certs, start_rabbitmq, start_skred

    certs = make_certs(work / "certs")
    brokers = [start_skred(work, *certs)]
    try:
        if not skred_only:
            brokers.append(start_rabbitmq(work, *certs))
        for b in brokers:
            b.wait_ready(300)
        return alternate([(b.name, b.plain_uri, b.pid) for b in brokers] + more, cells, runs, seconds)
    finally:
        for b in brokers:
            b.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--uri", default="", help="one broker: run --cell once and print its JSON")
    ap.add_argument("--cell", choices=sorted(CELLS), default="ack-20k")
    ap.add_argument("--private", default="", metavar="DIR",
                    help="start a Skred and a RabbitMQ with data in DIR")
    ap.add_argument("--cells", default="auto-5k,auto-20k,ack-5k,ack-20k,conns-100,sync-0,sync-2000")
    ap.add_argument("--runs", type=int, default=5, help="runs per cell and broker (default 5)")
    ap.add_argument("--skred-only", action="store_true", help="with --private: no RabbitMQ")
    ap.add_argument("--target", action="append", default=[], metavar="NAME=URI[,PID]",
                    help="one more broker to measure in turn (e.g. Skred at another commit); repeatable")
    ap.add_argument("--pid", type=int, default=0, help="with --uri: the broker's PID (its CPU per message)")
    ap.add_argument("-z", "--seconds", type=float, default=5.0)
    a = ap.parse_args(argv)
    if a.uri:
        print(json.dumps(run_cell(a.uri, a.cell, a.seconds, a.pid)))
        return 0
    more = []
    for t in a.target:
        name, _, rest = t.partition("=")
        uri, _, pid = rest.partition(",")
        more.append((name, uri, int(pid or 0)))
    if not a.private and not more:
        ap.error("--uri, --private or --target is required")
    cells = [c for c in a.cells.split(",") if c]
    unknown = [c for c in cells if c not in CELLS]
    if unknown:
        ap.error(f"unknown cells {unknown}; choose from {','.join(CELLS)}")
    if not a.private:
        return alternate(more, cells, a.runs, a.seconds)
    return private(Path(a.private), cells, a.runs, a.seconds, a.skred_only, more)


if __name__ == "__main__":
    sys.exit(main())
