"""MQTT side by side: Skred, mosquitto 2.0, RabbitMQ 3.10's MQTT plugin and amqtt, in one run.

Usage: ``python benchmarks/mqtt.py [--brokers skred,mosquitto,rabbitmq,amqtt] [--write]``
(``--write`` replaces the MQTT section of docs/benchmarks.md; ``--help`` lists the sizes).

Theory of operation: each broker is a private process of ours on free loopback ports (Skred as
the integration tests start it, mosquitto and RabbitMQ as the conformance harness does, amqtt from
its console script, found on PATH or named by ``--amqtt``: install it with the ``[bench]`` extra,
in a virtualenv of its own if its pins clash), started, measured and stopped one after the other.
The load generator is this file: raw MQTT 3.1.1 over asyncio protocols (uvloop when present), with
pre-encoded packets written in batches and received packets counted by scanning fixed headers, so
a message costs the client about a microsecond and the broker is the bottleneck (the client's CPU
share is printed per row). Every loop is bounded in count and time.

Scenarios, per broker:
- fan-in: N publishers -> 1 subscriber on ``bench/#``; fan-out: 1 publisher -> N subscribers; each
  at QoS 0 (publishers paced by what the subscribers have received: at most ``--window``
  deliveries in flight, a stall of 3 s counts the rest as dropped) and at QoS 1 (each publisher keeps
  ``--inflight`` PUBLISHes waiting for PUBACK; subscribers PUBACK every delivery). The rate is
  deliveries per second at the subscribers over ``--seconds`` after a warm-up.
- latency: one QoS 1 publisher at ``--rate`` msg/s, one QoS 1 subscriber; p50/p99 of the time from
  write to receipt (the publisher's clock in the payload).
- idle memory: ``--idle`` clients connect (clean session, keepalive 600, no subscription); the
  broker's resident memory (VmRSS of its process tree) before and after, per connection.
- restore: ``--sessions`` persistent sessions (clean session 0, one QoS 1 subscription each) are
  made, the broker is stopped cleanly and started again; the time from the start until it
  accepts MQTT, and until every session has reconnected with session-present 1 (200 at a time).
"""

from __future__ import annotations

import argparse
import asyncio
import compileall
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tests.integration._support import SkredProcess, free_port, stop_group  # noqa: E402  (needs the repo root)
from tests.integration.conformance._mosquitto import MosquittoProcess  # noqa: E402
from tests.integration.conformance._mqtt_wire import packet, s  # noqa: E402
from tests.integration.conformance._rabbit import RabbitProcess  # noqa: E402

PUBLISH, PUBACK, CONNACK, SUBACK = 3, 4, 2, 9
DOC = REPO_ROOT / "docs" / "benchmarks.md"
SECTION = "MQTT (benchmarks/mqtt.py)"


# ------------------------------------------------------------------ brokers

class Broker:
    name = ""
    host = "127.0.0.1"
    port = 0

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def pids(self) -> list[int]:
        return []
    def close(self) -> None:
        self.stop()


class Skred(Broker):
    name = "Skred"

    def __init__(self, root: Path) -> None:
        self.p = SkredProcess(root / "skred")

    def start(self) -> None:
        self.p.start()
        self.port = self.p.mqtt_port
        wait_accepts(self.port)

    def stop(self) -> None:
        self.p.stop()

    def pids(self) -> list[int]:
        return [self.p.pid] if self.p.pid else []


class Mosquitto(Broker):
    name = "mosquitto"

    def __init__(self, root: Path) -> None:
        self.p = MosquittoProcess(root / "mosquitto", persistence=True)
        self.port = self.p.port

    def start(self) -> None:
        self.p.start()

    def stop(self) -> None:
        self.p.close()

    def pids(self) -> list[int]:
        return [self.p.proc.pid] if self.p.proc else []


class Rabbit(Broker):
    name = "RabbitMQ"

    def __init__(self, root: Path) -> None:
        self.p = RabbitProcess(root / "rabbitmq", management=False, mqtt=True, name="mqttbench")
        self.port = self.p.mqtt_port or 0

    def start(self) -> None:
        self.p.spawn()
        problem = self.p.wait_ready(180)
        if problem:
            raise RuntimeError(problem)

    def stop(self) -> None:
        self.p.close(60)

    def pids(self) -> list[int]:
        return [self.p.beam_pid()] if self.p.proc and self.p.proc.poll() is None else []


class Amqtt(Broker):
    name = "amqtt"

    def __init__(self, root: Path, exe: str) -> None:
        self.root, self.exe = root / "amqtt", exe
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        conf = self.root / "amqtt.yaml"
        conf.write_text(f"listeners:\n  default:\n    type: tcp\n    bind: {self.host}:{self.port}\n"
                        "plugins:\n  amqtt.plugins.authentication.AnonymousAuthPlugin:\n"
                        "    allow_anonymous: true\n")
        log = open(self.root / "amqtt.log", "ab")
        self.proc = subprocess.Popen([self.exe, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        wait_accepts(self.port, self.proc)

    def stop(self) -> None:
        stop_group(self.proc, 30)

    def pids(self) -> list[int]:
        return [self.proc.pid] if self.proc else []


def wait_accepts(port: int, proc: subprocess.Popen[bytes] | None = None, timeout: float = 60) -> None:
    import socket
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the broker exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)  # poll interval of a readiness loop with a deadline
    raise RuntimeError(f"nothing accepts on port {port} after {timeout} s")


def tree(pids: list[int]) -> list[int]:
    """The processes and all their descendants."""
    seen: list[int] = []
    todo = list(pids)
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.append(pid)
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return seen


def vmrss_kib(pid: int) -> int:
    """VmRSS of one process, KiB (0 once it is gone)."""
    try:
        m = re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())
    except OSError:
        return 0
    return int(m.group(1)) if m else 0


def rss_kib(pids: list[int]) -> int:
    """VmRSS of the processes and all their descendants, KiB."""
    return sum(vmrss_kib(pid) for pid in tree(pids))


def cpu_of(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes and their descendants used so far: what a
    start costs whatever the machine's load (its wall time is not)."""
    total = 0
    for pid in tree(pids):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------ the load generator

def connect_packet(client_id: str, clean: bool = True, keepalive: int = 600,
                   user: str = "guest", password: str = "guest") -> bytes:
    flags = (2 if clean else 0) | 128 | 64
    body = (s("MQTT") + bytes((4, flags)) + struct.pack("!H", keepalive) + s(client_id)
            + s(user) + s(password))
    return packet(0x10, body)


def subscribe_packet(topic: str, qos: int) -> bytes:
    return packet(0x82, struct.pack("!H", 1) + s(topic) + bytes((qos,)))


class Conn(asyncio.Protocol):
    """One raw MQTT connection: counts deliveries (acknowledging QoS 1 ones), PUBACKs, and takes
    CONNACK and SUBACK; ``on_puback`` lets a publisher refill its window from the callback."""

    def __init__(self, stamp: list[float] | None = None) -> None:
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.connack: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()
        self.suback: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.received = 0
        self.acked = 0
        self.on_puback: Callable[[], None] | None = None
        self.stamps = stamp  # latencies (s) of deliveries whose payload starts with a send time
        self.closed = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.connack.done():
            self.connack.set_exception(ConnectionError("closed before CONNACK"))

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        n, i, acks = len(buf), 0, []
        while i + 2 <= n:
            first = buf[i]
            length, shift, j = 0, 0, i + 1
            while j < n:
                b = buf[j]
                j += 1
                length |= (b & 127) << shift
                shift += 7
                if not b & 128:
                    break
            else:
                break
            if j + length > n:
                break
            kind = first >> 4
            if kind == PUBLISH:
                self.received += 1
                tlen = (buf[j] << 8) | buf[j + 1]
                pos = j + 2 + tlen
                if first & 6:
                    acks.append(b"\x40\x02" + buf[pos:pos + 2])
                    pos += 2
                if self.stamps is not None and j + length - pos >= 8:
                    self.stamps.append(time.perf_counter() - struct.unpack_from("!d", buf, pos)[0])
            elif kind == PUBACK:
                self.acked += 1
                if self.on_puback is not None:
                    self.on_puback()
            elif kind == CONNACK:
                if not self.connack.done():
                    self.connack.set_result((buf[j] & 1, buf[j + 1]))
            elif kind == SUBACK:
                if not self.suback.done():
                    self.suback.set_result(buf[j + 2])
            i = j + length
        self.buf = buf[i:]
        if acks and self.transport is not None:
            self.transport.write(b"".join(acks))


async def open_conn(b: Broker, client_id: str, clean: bool = True, stamps: list[float] | None = None) -> Conn:
    loop = asyncio.get_running_loop()
    _, c = await loop.create_connection(lambda: Conn(stamps), b.host, b.port)
    assert c.transport is not None
    c.transport.write(connect_packet(client_id, clean))
    sp, rc = await asyncio.wait_for(c.connack, 120)
    if rc != 0:
        raise ConnectionError(f"CONNACK {rc}")
    c.session_present = sp  # type: ignore[attr-defined]
    return c


async def subscribe(c: Conn, topic: str, qos: int) -> None:
    assert c.transport is not None
    c.transport.write(subscribe_packet(topic, qos))
    await asyncio.wait_for(c.suback, 120)


async def open_many(b: Broker, n: int, prefix: str, clean: bool = True, at_once: int = 200) -> list[Conn]:
    out: list[Conn] = []
    for first in range(0, n, at_once):
        out += await asyncio.gather(*(open_conn(b, f"{prefix}{i}", clean)
                                      for i in range(first, min(n, first + at_once))))
    return out


def close_all(conns: list[Conn]) -> None:
    for c in conns:
        if c.transport is not None:
            c.transport.write(b"\xe0\x00")
            c.transport.close()


def publish_packets(topic: str, qos: int, count: int, payload: bytes = b"x" * 16) -> list[bytes]:
    """``count`` pre-encoded PUBLISHes (QoS 1 ones with packet ids 1..count)."""
    t = s(topic)
    if not qos:
        return [packet(0x30, t + payload)] * count
    return [packet(0x32, t + struct.pack("!H", pid) + payload) for pid in range(1, count + 1)]


FIRST_WAIT = 30.0  # seconds a scenario waits for its first delivery before its warm-up


async def measure(seconds: float, delivered: Callable[[], int], warmup: float = 1.0,
                  pids: list[int] | None = None) -> tuple[float, float]:
    """Deliveries per second over ``seconds`` after ``warmup``, and the CPU the broker's
    processes (``pids``) spent per delivery meanwhile, in microseconds (NaN without pids): the
    figure a loaded machine does not bend, as the rate is bent by the CPU other work takes.
    The warm-up starts at the first delivery (at most ``FIRST_WAIT`` seconds on): Skred's first
    message to 1,000 fresh subscription queues creates their 1,000 segment files on the event
    loop (0.2 to 3 s seen on a loaded machine), a one-off the rate must not include; it is the
    likeliest cause of the runs that measured 200 deliveries/s (one message in the window) or 0."""
    first = time.perf_counter()
    while not delivered() and time.perf_counter() - first < FIRST_WAIT:
        await asyncio.sleep(0.01)
    await asyncio.sleep(warmup)
    n0, t0, c0 = delivered(), time.perf_counter(), cpu_of(pids or [])
    await asyncio.sleep(seconds)
    n = delivered() - n0
    cpu = cpu_of(pids or []) - c0
    return n / (time.perf_counter() - t0), (cpu * 1e6 / n if pids and n else float("nan"))


async def flow(b: Broker, pubs: int, subs: int, qos: int, args: argparse.Namespace) -> dict[str, float]:
    """Deliveries per second with ``pubs`` publishers and ``subs`` subscribers on one topic tree."""
    tag = f"{os.getpid()}{int(time.time() * 1000) % 100000}"
    topic = f"bench/{tag}"
    sub_conns = await open_many(b, subs, f"bs{tag}-")
    await asyncio.gather(*(subscribe(c, f"{topic}/#", qos) for c in sub_conns))
    pub_conns = await open_many(b, pubs, f"bp{tag}-")
    got = lambda: sum(c.received for c in sub_conns)  # noqa: E731
    sent = [0]
    running = [True]
    if qos == 1:
        window = max(1, args.inflight)
        pkts = publish_packets(f"{topic}/t", 1, 60000)

        def refill(c: Conn) -> Callable[[], None]:
            k = [0]

            def more() -> None:
                if running[0] and c.transport is not None and not c.transport.is_closing():
                    c.transport.write(pkts[k[0] % 60000])
                    k[0] += 1
                    sent[0] += 1
            return more

        for c in pub_conns:
            c.on_puback = refill(c)
            for _ in range(window):
                c.on_puback()
        rate, us = await measure(args.seconds, got, pids=b.pids())
        running[0] = False
        dropped = 0.0
    else:
        pkt = publish_packets(f"{topic}/t", 0, 1)[0]
        batch = max(1, min(50, args.window // (subs * 4)))  # fan-out: a message is subs deliveries
        chunk = pkt * batch
        dropped_n = [0]

        async def pump() -> None:
            last, last_change = got(), time.monotonic()
            i = 0
            while running[0]:
                now_got = got()
                if now_got != last:
                    last, last_change = now_got, time.monotonic()
                outstanding = sent[0] * subs - now_got - dropped_n[0]
                if outstanding > args.window:
                    if time.monotonic() - last_change > 3.0:  # the broker dropped them
                        dropped_n[0] += outstanding
                        last_change = time.monotonic()
                    await asyncio.sleep(0.001)
                    continue
                c = pub_conns[i % len(pub_conns)]
                i += 1
                if c.transport is not None and c.transport.get_write_buffer_size() < 1 << 20:
                    c.transport.write(chunk)
                    sent[0] += batch
                if i % len(pub_conns) == 0:
                    await asyncio.sleep(0)

        task = asyncio.ensure_future(pump())
        rate, us = await measure(args.seconds, got, pids=b.pids())
        running[0] = False
        await task
        dropped = 100.0 * dropped_n[0] / max(1, sent[0] * subs)
    close_all(pub_conns + sub_conns)
    await asyncio.sleep(0.5)  # let the broker see the closes before the next scenario
    return {"rate": rate, "dropped": dropped, "broker_us": us}


async def latency(b: Broker, args: argparse.Namespace) -> dict[str, float]:
    tag = f"{os.getpid()}{int(time.time() * 1000) % 100000}"
    stamps: list[float] = []
    sub = await open_conn(b, f"lat-s{tag}", stamps=stamps)
    await subscribe(sub, f"lat/{tag}", 1)
    pub = await open_conn(b, f"lat-p{tag}")
    assert pub.transport is not None
    t = s(f"lat/{tag}")
    n = int(args.rate * args.seconds)
    start = time.perf_counter() + 0.2
    for i in range(n):
        due = start + i / args.rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        pid = i % 65535 + 1
        pub.transport.write(packet(0x32, t + struct.pack("!H", pid) + struct.pack("!d", time.perf_counter())))
    deadline = time.monotonic() + 10
    while len(stamps) < n and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    close_all([sub, pub])
    stamps.sort()
    if not stamps:
        return {"p50": float("nan"), "p99": float("nan"), "lost": n}
    return {"p50": stamps[len(stamps) // 2] * 1000, "p99": stamps[int(len(stamps) * 0.99)] * 1000,
            "max": stamps[-1] * 1000, "lost": n - len(stamps)}


async def settled_rss(b: Broker) -> int:
    """RSS once three samples 0.5 s apart agree within 1 % (at most 10 s)."""
    samples = [rss_kib(b.pids())]
    for _ in range(20):
        await asyncio.sleep(0.5)
        samples.append(rss_kib(b.pids()))
        last = samples[-3:]
        if len(last) == 3 and max(last) - min(last) <= max(last) * 0.01:
            break
    return samples[-1]


async def idle_memory(b: Broker, args: argparse.Namespace) -> dict[str, float]:
    warm = await open_many(b, 10, "idle-warm-")
    before = await settled_rss(b)
    conns = await open_many(b, args.idle, f"idle-{os.getpid()}-")
    after = await settled_rss(b)
    close_all(conns + warm)
    await asyncio.sleep(1)
    return {"before_mib": before / 1024, "after_mib": after / 1024,
            "per_conn_kib": (after - before) / max(1, args.idle)}


async def make_sessions(b: Broker, n: int, budget: float) -> int:
    """Up to ``n`` persistent sessions with one QoS 1 subscription each, within ``budget`` s."""
    made, deadline = 0, time.monotonic() + budget
    for first in range(0, n, 100):
        if time.monotonic() > deadline:
            break
        ids = range(first, min(n, first + 100))
        conns = await asyncio.gather(*(open_conn(b, f"sess-{i}", clean=False) for i in ids))
        await asyncio.gather(*(subscribe(c, f"sess/{i}", 1) for c, i in zip(conns, ids, strict=True)))
        close_all(list(conns))
        made += len(conns)
    await asyncio.sleep(1)
    return made


async def resume_sessions(b: Broker, n: int) -> tuple[int, float]:
    present, t0 = 0, time.perf_counter()
    for first in range(0, n, 200):
        conns = await asyncio.gather(*(open_conn(b, f"sess-{i}", clean=False)
                                       for i in range(first, min(n, first + 200))))
        present += sum(getattr(c, "session_present", 0) for c in conns)
        close_all(list(conns))
    return present, time.perf_counter() - t0


def restore(b: Broker, args: argparse.Namespace) -> dict[str, float]:
    made = asyncio.run(make_sessions(b, args.sessions, args.session_budget))
    b.stop()
    t0 = time.perf_counter()
    b.start()
    ready = time.perf_counter() - t0
    cpu = cpu_of(b.pids())
    present, took = asyncio.run(resume_sessions(b, made))
    return {"sessions": made, "ready_s": ready, "ready_cpu_s": cpu, "all_s": ready + took, "present": present}


# ------------------------------------------------------------------ the run

def use_uvloop() -> None:
    """uvloop for the load generator's loops, when it is installed (the broker runs on it)."""
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def run_broker(b: Broker, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    want = set(args.only.split(","))
    b.start()
    try:
        for qos in (0, 1) if "flows" in want else ():
            for shape, pubs, subs in (("fan-in", args.publishers, 1), ("fan-out", 1, args.subscribers)):
                if f"{shape}-qos{qos}" not in args.flows.split(","):
                    continue
                c0, w0 = cpu_seconds(), time.perf_counter()
                try:
                    r = asyncio.run(flow(b, pubs, subs, qos, args))
                    r["client_cpu"] = 100 * (cpu_seconds() - c0) / (time.perf_counter() - w0)
                except Exception as exc:  # noqa: BLE001 - a broker that fails a scenario is a result
                    r = {"error": f"{type(exc).__name__}: {exc}"}
                out[f"{shape}-qos{qos}"] = r
                print(b.name, shape, qos, r, flush=True)
        for key, fn in (("latency", latency), ("idle", idle_memory)):
            if key not in want:
                continue
            try:
                out[key] = asyncio.run(fn(b, args))
            except Exception as exc:  # noqa: BLE001
                out[key] = {"error": f"{type(exc).__name__}: {exc}"}
            print(b.name, key, out[key], flush=True)
        if args.sessions and "restore" in want:
            try:
                out["restore"] = restore(b, args)
            except Exception as exc:  # noqa: BLE001
                out["restore"] = {"error": f"{type(exc).__name__}: {exc}"}
            print(b.name, "restore", out["restore"], flush=True)
    finally:
        b.close()
    return out


def fmt(v: Any, digits: int = 0) -> str:
    if isinstance(v, str):
        return v
    if v != v:  # NaN
        return "-"
    return f"{v:,.{digits}f}"


def table(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> list[str]:
    names = list(results)
    rows: list[tuple[str, str, Callable[[dict[str, Any]], str]]] = []

    def cell(key: str, field: str, digits: int = 0, extra: str = "") -> Callable[[dict[str, Any]], str]:
        def get(r: dict[str, Any]) -> str:
            d = r.get(key, {})
            if "error" in d:
                return "failed"
            if field not in d:
                return "-"
            text = fmt(d[field], digits)
            if extra and d.get(extra):
                text += f" ({fmt(d[extra], 1)} % dropped)"
            return text
        return get

    for qos in (0, 1):
        rows.append((f"QoS {qos} fan-in: {args.publishers:,} publishers -> 1 subscriber", "msg/s",
                     cell(f"fan-in-qos{qos}", "rate", extra="dropped")))
        rows.append((f"QoS {qos} fan-out: 1 publisher -> {args.subscribers:,} subscribers", "deliveries/s",
                     cell(f"fan-out-qos{qos}", "rate", extra="dropped")))
    for qos in (0, 1):
        for shape in ("fan-in", "fan-out"):
            rows.append((f"QoS {qos} {shape}: the broker's CPU per delivery", "us",
                         cell(f"{shape}-qos{qos}", "broker_us", 1)))
    rows += [
        (f"latency p50 at {args.rate:,} msg/s (QoS 1, 1 -> 1)", "ms", cell("latency", "p50", 2)),
        (f"latency p99 at {args.rate:,} msg/s (QoS 1, 1 -> 1)", "ms", cell("latency", "p99", 2)),
        (f"latency maximum at {args.rate:,} msg/s (QoS 1, 1 -> 1)", "ms", cell("latency", "max", 2)),
        (f"memory per idle connection ({args.idle:,} clients)", "KiB", cell("idle", "per_conn_kib", 1)),
        (f"memory with {args.idle:,} idle clients", "MiB", cell("idle", "after_mib", 0)),
        (f"persistent sessions made (of {args.sessions:,}, {args.session_budget:.0f} s budget)",
         "sessions", cell("restore", "sessions")),
        ("restart: until the MQTT port accepts", "s", cell("restore", "ready_s", 2)),
        ("restart: CPU of the broker's processes until then", "s", cell("restore", "ready_cpu_s", 2)),
        ("restart: until every session resumed (session present)", "s", cell("restore", "all_s", 2)),
        ("sessions resumed with session present = 1", "sessions", cell("restore", "present")),
    ]
    out = ["| measure | unit | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for label, unit, get in rows:
        out.append(f"| {label} | {unit} | " + " | ".join(get(results[n]) for n in names) + " |")
    return out


def write_doc(lines: list[str]) -> None:
    text = DOC.read_text()
    block = f"## {SECTION}\n\n" + "\n".join(lines) + "\n\n"
    pattern = re.compile(rf"## {re.escape(SECTION)}\n.*?(?=\n## |\Z)", re.S)
    if pattern.search(text):
        text = pattern.sub(block.rstrip("\n") + "\n", text)
    else:
        text = text.replace("\n## Results\n", f"\n{block}## Results\n", 1)
    DOC.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--brokers", default="skred,mosquitto,rabbitmq,amqtt")
    ap.add_argument("--seconds", type=float, default=5.0, help="measurement window per rate scenario")
    ap.add_argument("--publishers", type=int, default=1000, help="fan-in publishers")
    ap.add_argument("--subscribers", type=int, default=1000, help="fan-out subscribers")
    ap.add_argument("--window", type=int, default=20000, help="QoS 0 deliveries in flight, at most")
    ap.add_argument("--inflight", type=int, default=10, help="QoS 1 PUBLISHes in flight per publisher")
    ap.add_argument("--rate", type=int, default=200, help="msg/s of the latency scenario")
    ap.add_argument("--idle", type=int, default=5000, help="idle connections for the memory scenario")
    ap.add_argument("--sessions", type=int, default=10000, help="persistent sessions to restore (0: skip)")
    ap.add_argument("--session-budget", type=float, default=120.0, help="seconds to make them at most")
    ap.add_argument("--amqtt", default=shutil.which("amqtt") or "", help="amqtt's console script")
    ap.add_argument("--only", default="flows,latency,idle,restore", help="the scenarios to run")
    ap.add_argument("--flows", default="fan-in-qos0,fan-out-qos0,fan-in-qos1,fan-out-qos1",
                    help="which of the rate scenarios 'flows' runs")
    ap.add_argument("--write", action="store_true", help="replace the MQTT section of docs/benchmarks.md")
    ap.add_argument("--note", default="", help="a paragraph for docs/benchmarks.md (the machine's load)")
    args = ap.parse_args()
    use_uvloop()
    # the broker's modules byte-compiled first, as pip installs them: with PYTHONDONTWRITEBYTECODE
    # set (as on the development machines) every start compiled them again, a quarter of the
    # CPU of a restart with 10,000 sessions
    compileall.compile_dir(str(REPO_ROOT / "broker"), quiet=1)
    root = Path(tempfile.mkdtemp(prefix="mqtt-bench-"))
    makers: dict[str, Callable[[], Broker]] = {
        "skred": lambda: Skred(root), "mosquitto": lambda: Mosquitto(root),
        "rabbitmq": lambda: Rabbit(root), "amqtt": lambda: Amqtt(root, args.amqtt)}
    results: dict[str, dict[str, Any]] = {}
    load0 = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    for key in args.brokers.split(","):
        if key == "amqtt" and not args.amqtt:
            print("amqtt: not installed (pip install '.[bench]' or --amqtt PATH); skipped", flush=True)
            continue
        b = makers[key]()
        results[b.name] = run_broker(b, args)
    lines = table(results, args)
    print("\n".join(lines))
    load1 = os.getloadavg()
    head = [f"Run: {started}; {args.seconds:.0f} s per rate scenario, brokers one after the other; "
            f"load average (1/5/15 min) at the start {load0[0]:.1f}/{load0[1]:.1f}/{load0[2]:.1f}, "
            f"at the end {load1[0]:.1f}/{load1[1]:.1f}/{load1[2]:.1f}. Load generator: "
            "benchmarks/mqtt.py (raw MQTT 3.1.1 on asyncio, one process). " + args.note, ""]
    if args.write:
        write_doc(head + lines)


if __name__ == "__main__":
    main()
