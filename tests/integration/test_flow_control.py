"""Flow control against real brokers and pika: a full disk, heartbeats while blocked, memory.

Theory of operation: the full-disk tests run the broker in a private mount namespace
(``unshare -m``) whose data dir is a small tmpfs, so the disk really fills and nothing
outside the test sees the mount. The test reaches into that namespace through
``/proc/<pid>/root`` to read the free space and to write the "other process" filler file.
Goal checked: publishers are blocked (connection.blocked) or nacked, never disconnected;
the broker stays up and consumers drain everything that was confirmed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pika
import pytest

from ._support import SkredProcess, connect, is_external, unique, wait_until
from .test_features_extra import http, wait_http

pytestmark = pytest.mark.skipif(is_external(), reason="needs Skred's process control")

MiB = 1024 * 1024
PERSISTENT = pika.BasicProperties(delivery_mode=2)


def _can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=10)
    return probe.returncode == 0


needs_mount_ns = pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare -m (mount namespace)")


class TmpfsSkred(SkredProcess):
    """A broker whose data dir is a tmpfs of ``size`` bytes in its own mount namespace."""

    def __init__(self, data_dir: Path, size: int, extra_args: list[str]) -> None:
        super().__init__(data_dir, extra_args)
        self.size = size

    def argv(self) -> list[str]:
        # unshare and sh exec in place: the broker keeps the PID the harness knows
        script = 'mount -t tmpfs -o size="$1" skredtest "$2" && shift 2 && exec "$@"'
        return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh",
                str(self.size), str(self.data_dir), *super().argv()]

    def inside(self, name: str = "") -> Path:
        """A path in the broker's data dir as the broker sees it."""
        return Path(f"/proc/{self.pid}/root") / str(self.data_dir).lstrip("/") / name

    def free(self) -> int:
        st = os.statvfs(self.inside())
        return st.f_bavail * st.f_frsize

    def fill_until_free(self, target: int) -> None:
        """Another process's file takes the disk until about ``target`` bytes are free."""
        chunk = b"\0" * MiB
        with open(self.inside("filler"), "wb") as fh:
            for _ in range(4096):
                room = self.free() - target
                if room <= 0:
                    return
                try:
                    fh.write(chunk[:min(room, MiB)])
                    fh.flush()
                except OSError:
                    return
        raise AssertionError("filler did not fill the disk")


@pytest.fixture
def tmpfs_broker(tmp_path: Path) -> Any:
    made: list[TmpfsSkred] = []

    def make(size: int, extra_args: list[str]) -> TmpfsSkred:
        b = TmpfsSkred(tmp_path / f"data-{uuid.uuid4().hex[:6]}", size, extra_args)
        made.append(b)
        b.start()
        return b

    yield make
    for b in made:
        b.close()


def _pump(conn: pika.BlockingConnection, flag: list[Any]) -> bool:
    conn.process_data_events(0.05)
    return bool(flag)


@needs_mount_ns
def test_full_disk_nacks_and_blocks_never_disconnects(tmpfs_broker: Any) -> None:
    """Another process fills the disk to just above the alarm threshold, so the one-second
    check never fires; a large publish then finds no space. It is nacked, the publisher is
    blocked (not closed), consumers drain, and once space is back publishing resumes."""
    b = tmpfs_broker(64 * MiB, ["--free-disk-min", "2MiB", "--segment-size", "1MiB"])
    pub = connect(b, blocked_connection_timeout=None)
    blocked: list[Any] = []
    unblocked: list[Any] = []
    pub.add_on_connection_blocked_callback(lambda c, m: blocked.append(m))
    pub.add_on_connection_unblocked_callback(lambda c, m: unblocked.append(m))
    ch = pub.channel()
    ch.confirm_delivery()
    q = unique("full")
    ch.queue_declare(q, durable=True)
    small = [f"small-{i}".encode() for i in range(10)]
    for body in small:
        ch.basic_publish("", q, body, PERSISTENT)  # confirmed (raises on nack)

    b.fill_until_free(4 * MiB)
    assert b.free() > 2 * MiB  # above the threshold: the alarm has no reason to fire
    big = os.urandom(6 * MiB)
    with pytest.raises(pika.exceptions.NackError):
        ch.basic_publish("", q, big, PERSISTENT)
    assert pub.is_open and ch.is_open
    wait_until(lambda: _pump(pub, blocked), 10, "connection.blocked after a write found no space")
    assert b.alive()
    assert http(b, "GET", "/api/health/checks/alarms")[0] == 503
    # The HTTP publish API refuses what it cannot store, with a clear answer.
    status, answer = http(b, "POST", "/api/exchanges/%2F/amq.default/publish",
                          {"properties": {"delivery_mode": 2}, "routing_key": q, "payload": "x" * (6 * MiB),
                           "payload_encoding": "string"})
    assert (status, answer["error"]) == (503, "disk_full"), (status, answer)
    lmq_put = urllib.request.Request(f"http://127.0.0.1:{b.lmq_http_port}/messages/{q}", data=big,
                                     method="POST",
                                     headers={"Authorization": "Basic Z3Vlc3Q6Z3Vlc3Q="})  # guest:guest
    with pytest.raises(urllib.error.HTTPError) as he:
        urllib.request.urlopen(lmq_put, timeout=10)
    assert he.value.code == 503

    # The broker stays readable: a consumer on another connection drains what was confirmed.
    cons = connect(b)
    cch = cons.channel()
    got = []
    for _ in range(len(small) + 5):
        m, _, body = cch.basic_get(q, auto_ack=True)
        if m is None:
            break
        got.append(bytes(body))
    assert got == small

    # Space comes back: the alarm clears, the publisher is unblocked and may publish again.
    b.inside("filler").unlink()
    wait_until(lambda: _pump(pub, unblocked), 15, "connection.unblocked once space is back")
    ch.basic_publish("", q, big, PERSISTENT)
    m, _, body = cch.basic_get(q, auto_ack=True)
    assert m is not None and bytes(body) == big
    assert b.alive() and pub.is_open
    cons.close()
    pub.close()


@needs_mount_ns
def test_full_disk_without_confirms_closes_the_channel_not_the_connection(tmpfs_broker: Any) -> None:
    """A publisher without confirms cannot be nacked: the message it was told nothing about is
    refused with a channel error (406), the connection stays and is blocked."""
    b = tmpfs_broker(32 * MiB, ["--free-disk-min", "1MiB", "--segment-size", "1MiB"])
    pub = connect(b, blocked_connection_timeout=None)
    blocked: list[Any] = []
    pub.add_on_connection_blocked_callback(lambda c, m: blocked.append(m))
    ch = pub.channel()
    q = unique("full")
    ch.queue_declare(q, durable=True)
    b.fill_until_free(3 * MiB)
    ch.basic_publish("", q, os.urandom(5 * MiB), PERSISTENT)
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as ei:
        ch.queue_declare(q, passive=True)
    assert ei.value.reply_code == 406 and "disk full" in ei.value.reply_text
    wait_until(lambda: _pump(pub, blocked), 10, "connection.blocked")
    assert pub.is_open and b.alive()
    other = connect(b)  # the blocked publisher is not read now; a consumer's connection is
    assert other.channel().queue_declare(q, passive=True).method.message_count == 0
    other.close()
    unblocked: list[Any] = []
    pub.add_on_connection_unblocked_callback(lambda c, m: unblocked.append(m))
    b.inside("filler").unlink()
    wait_until(lambda: _pump(pub, unblocked), 15, "connection.unblocked once space is back")
    pub.close()  # a blocked connection is not read, so it can close only now


class _Publisher(threading.Thread):
    """Publishes 2 MiB persistent messages with confirms until blocked, nacked or done."""

    def __init__(self, b: SkredProcess, queue: str, n: int) -> None:
        super().__init__(daemon=True)
        self.b = b
        self.queue = queue
        self.n = n
        self.acked: list[bytes] = []
        self.nacked = 0
        self.blocked = threading.Event()
        self.error: BaseException | None = None
        self.ready = threading.Event()

    def run(self) -> None:
        try:
            conn = connect(self.b, blocked_connection_timeout=None)
            conn.add_on_connection_blocked_callback(lambda c, m: self.blocked.set())
            ch = conn.channel()
            ch.confirm_delivery()
            ch.queue_declare(self.queue, durable=True)
            self.ready.set()
            pad = os.urandom(2 * MiB)
            for i in range(self.n):
                if self.blocked.is_set():
                    break
                body = uuid.uuid4().bytes + pad
                try:
                    ch.basic_publish("", self.queue, body, PERSISTENT)
                    self.acked.append(body[:16])
                except pika.exceptions.NackError:
                    self.nacked += 1
                conn.process_data_events(0)
                del i
            conn.close()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
            self.ready.set()


@needs_mount_ns
def test_publishers_filling_the_disk_are_blocked_or_nacked(tmpfs_broker: Any) -> None:
    """Three publishers write faster than the one-second alarm check: whatever reaches the
    end of the disk is nacked or waits blocked; no connection is closed, the broker stays up,
    a consumer drains every confirmed message and the waiting publishers then finish."""
    b = tmpfs_broker(40 * MiB, ["--free-disk-min", "8MiB", "--segment-size", "1MiB"])
    q = unique("fill")
    pubs = [_Publisher(b, q, 30) for _ in range(3)]  # 180 MiB offered to a 40 MiB disk
    for p in pubs:
        p.start()
        assert p.ready.wait(20), "publisher did not connect"
    wait_until(lambda: all(not p.is_alive() or p.blocked.is_set() for p in pubs), 60,
               "every publisher done or blocked")
    assert b.alive(), b.log_tail()
    assert all(p.error is None for p in pubs), [p.error for p in pubs]
    assert any(p.blocked.is_set() or p.nacked for p in pubs), "the disk never filled"

    # Drain: acks free segments, the alarm clears, blocked publishers get their confirms.
    cons = connect(b)
    cch = cons.channel()
    seen: set[bytes] = set()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        m, _, body = cch.basic_get(q, auto_ack=True)
        if m is not None:
            seen.add(bytes(body[:16]))
            continue
        if not any(p.is_alive() for p in pubs):
            break
        cons.process_data_events(0.05)
    for p in pubs:
        p.join(10)
        assert not p.is_alive(), "a publisher never got its confirm"
        assert p.error is None, p.error
    while True:  # what the last confirms added
        m, _, body = cch.basic_get(q, auto_ack=True)
        if m is None:
            break
        seen.add(bytes(body[:16]))
    acked = [a for p in pubs for a in p.acked]
    assert acked and set(acked) <= seen, f"{len(set(acked) - seen)} confirmed messages lost"
    assert b.alive()
    assert "Traceback" not in b.log_text()
    cons.close()


def test_blocked_connection_is_not_dropped_for_missed_heartbeats(broker_factory: Any) -> None:
    """A blocked publisher's heartbeats sit unread in the socket (the broker does not read
    a blocked publisher); that must not count as a dead peer."""
    b = broker_factory(["--free-disk-min", str(10**18)])  # more than any disk: alarm on
    wait_http(b)
    conn = connect(b, heartbeat=1, blocked_connection_timeout=None)
    assert conn._impl.params.heartbeat == 1  # noqa: SLF001 - negotiated value
    blocked: list[Any] = []
    unblocked: list[Any] = []
    conn.add_on_connection_blocked_callback(lambda c, m: blocked.append(m))
    conn.add_on_connection_unblocked_callback(lambda c, m: unblocked.append(m))
    wait_until(lambda: _pump(conn, blocked), 5, "connection.blocked")
    ch = conn.channel()
    q = unique("hb")
    ch.queue_declare(q)
    ch.basic_publish("", q, b"1")
    ch.basic_publish("", q, b"2")  # from here on the broker does not read this connection
    until = time.monotonic() + 5.0  # five heartbeat intervals, over twice the timeout
    while time.monotonic() < until:
        conn.process_data_events(0.1)
    assert conn.is_open, "blocked connection was dropped"
    assert "missed heartbeats" not in b.log_text()
    assert http(b, "PUT", "/api/disk-free-limit", {"limit": 0})[0] == 204
    wait_until(lambda: _pump(conn, unblocked), 10, "connection.unblocked")
    other = connect(b)
    wait_until(lambda: other.channel().queue_declare(q, passive=True).method.message_count == 2, 10,
               "parked publishes stored")
    other.close()
    conn.close()


def _anon_bytes(pid: int) -> int:
    """Anonymous resident memory of a process (what message bodies held in memory take)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


class _PeakMemory(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.peak = max(self.peak, _anon_bytes(self.pid))
            except (OSError, AssertionError):
                return
            time.sleep(0.005)  # sampling interval of a bounded monitor, not synchronisation


def test_memory_watermark_blocks_large_publishes_then_unblocks(broker_factory: Any) -> None:
    """Six 48 MiB publishes at once against a 128 MiB watermark: the broker takes them in as
    memory allows (blocking publishers meanwhile, connection.blocked), never holds all six at
    once, then unblocks and has stored every one."""
    body_size, n, watermark = 48 * MiB, 6, 128 * MiB
    b = broker_factory(["--vm-memory-high-watermark-absolute", str(watermark)])
    wait_http(b)
    assert b.pid is not None
    q = unique("mem")
    observer = connect(b, blocked_connection_timeout=None)
    events: list[str] = []
    observer.add_on_connection_blocked_callback(lambda c, m: events.append("blocked:" + m.method.reason))
    observer.add_on_connection_unblocked_callback(lambda c, m: events.append("unblocked"))
    observer.channel().queue_declare(q)
    monitor = _PeakMemory(b.pid)
    monitor.start()
    start = threading.Barrier(n)
    done: list[bool] = []
    errors: list[BaseException] = []

    def publish() -> None:
        try:
            conn = connect(b, blocked_connection_timeout=None)
            ch = conn.channel()
            ch.confirm_delivery()
            body = os.urandom(body_size)
            start.wait(30)
            ch.basic_publish("", q, body)  # returns once confirmed
            done.append(True)
            conn.close()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=publish, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        observer.process_data_events(0.05)
    monitor.stop.set()
    assert not errors, errors
    assert len(done) == n, "publishers still waiting"
    wait_until(lambda: (observer.process_data_events(0.05), "unblocked" in events)[1], 15,
               "connection.unblocked")
    assert "blocked:low on memory" in events
    assert events.index("blocked:low on memory") < len(events) - 1 - events[::-1].index("unblocked")
    assert observer.channel().queue_declare(q, passive=True).method.message_count == n
    # Not all six bodies were in memory at once (unbounded: about 2 x 6 x 48 MiB).
    assert monitor.peak < watermark + 2 * body_size, f"peak anonymous memory {monitor.peak >> 20} MiB"
    node = http(b, "GET", "/api/nodes")[1][0]
    assert node["mem_limit"] == watermark and node["mem_alarm"] is False
    assert http(b, "GET", "/api/health/checks/alarms")[0] == 200
    observer.close()


def test_memory_alarm_shows_in_api_health_and_metrics(broker_factory: Any) -> None:
    """A watermark below what the broker already uses: the alarm is on, publishers are
    blocked, and the API, the health check and the metrics say so."""
    b = broker_factory(["--vm-memory-high-watermark-absolute", "1MiB"])
    wait_http(b)
    conn = connect(b, blocked_connection_timeout=None)
    blocked: list[Any] = []
    conn.add_on_connection_blocked_callback(lambda c, m: blocked.append(m.method.reason))
    wait_until(lambda: _pump(conn, blocked), 10, "connection.blocked")
    assert blocked == ["low on memory"]
    node = http(b, "GET", "/api/nodes")[1][0]
    assert node["mem_alarm"] is True and node["mem_limit"] == MiB and node["disk_free_alarm"] is False
    status, body = http(b, "GET", "/api/health/checks/alarms")
    assert status == 503 and [a["resource"] for a in body["alarms"]] == ["memory"]
    with urllib.request.urlopen(f"http://127.0.0.1:{b.metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["skred_alarms_memory_used_watermark"] == 1
    assert values["skred_alarms_free_disk_space_watermark"] == 0
    assert values["skred_resident_memory_limit_bytes"] == MiB
    conn.close()


def test_bytes_in_flight_per_connection_are_bounded(broker_factory: Any) -> None:
    """Bodies a connection has announced but not completed count against
    max_bytes_in_flight across its channels: a second interleaved large body past the
    limit closes its channel with 406; the first completes and the connection stays."""
    from pamqp import commands

    from ._raw import FRAME_BODY, FRAME_HEADER, RawConn, frame_bytes, header_payload, method_bytes

    b = broker_factory(["--amqp-max-bytes-in-flight", "1MiB"])
    q = unique("inflight")
    admin = connect(b)
    admin.channel().queue_declare(q)
    size = 700 * 1024
    with RawConn(b.host, b.port) as c:
        c.handshake()
        c.open_channel(1)
        c.open_channel(2)

        def start(ch: int) -> bytes:
            return (method_bytes(ch, commands.Basic.Publish(exchange="", routing_key=q))
                    + frame_bytes(FRAME_HEADER, ch, header_payload(size, commands.Basic.Properties())))

        def body(ch: int, data: bytes) -> bytes:
            step = 128 * 1024 - 8  # frame_max less the frame's own bytes
            return b"".join(frame_bytes(FRAME_BODY, ch, data[i:i + step]) for i in range(0, len(data), step))

        half = b"a" * (size // 2)
        c.send(start(1) + body(1, half) + start(2))
        ch, close = c.read_method()
        assert ch == 2 and isinstance(close, commands.Channel.Close), (close.reply_code, close.reply_text)
        assert close.reply_code == 406 and "max_bytes_in_flight" in close.reply_text
        c.send_method(2, commands.Channel.CloseOk())
        c.send(body(1, half))
        c.send_method(1, commands.Basic.Get(queue=q, no_ack=True))
        c.expect(commands.Basic.GetOk, 1)
        _, body, _ = c.read_content()
        assert body == half + half
        # one body up to the limit is fine on its own
        c.publish(1, "", q, b"b" * (1024 * 1024))
        wait_until(lambda: admin.channel().queue_declare(q, passive=True).method.message_count == 1, 10,
                   "a body of exactly the limit stored")
    admin.close()


def test_a_client_that_does_not_read_is_not_read_either(broker_factory: Any) -> None:
    """Replies count as bytes in flight too: a client that publishes mandatory messages to
    nowhere and never reads its socket gets its basic.returns buffered only up to
    max_bytes_in_flight; then the broker stops reading it (its sends stall) instead of
    buffering everything. Once it reads, it gets every return."""
    import select
    import socket

    from pamqp import commands

    from ._raw import FRAME_BODY, FRAME_HEADER, RawConn, frame_bytes, header_payload, method_bytes

    b = broker_factory(["--amqp-max-bytes-in-flight", "4MiB"])
    assert b.pid is not None
    size, offered = MiB, 256
    step = 128 * 1024 - 8
    one = (method_bytes(1, commands.Basic.Publish(exchange="", routing_key=unique("nowhere"), mandatory=True))
           + frame_bytes(FRAME_HEADER, 1, header_payload(size, commands.Basic.Properties()))
           + b"".join(frame_bytes(FRAME_BODY, 1, b"r" * min(step, size - i)) for i in range(0, size, step)))
    with RawConn(b.host, b.port) as c:
        c.handshake()
        c.open_channel(1)
        base = _anon_bytes(b.pid)
        sock: socket.socket = c.sock
        sock.setblocking(False)
        sent = 0
        stalled_since = time.monotonic()
        deadline = time.monotonic() + 60
        while sent < offered * len(one) and time.monotonic() < deadline:
            if not select.select([], [sock], [], 0.2)[1]:
                if time.monotonic() - stalled_since > 3.0:
                    break  # the broker stopped reading us
                continue
            try:
                sent += sock.send(memoryview(one)[sent % len(one):])
                stalled_since = time.monotonic()
            except BlockingIOError:
                continue
        unit = len(one)
        assert sent < 64 * unit, f"broker read {sent >> 20} MiB from a client that reads nothing"
        assert _anon_bytes(b.pid) - base < 64 * MiB
        # Now read: every publish comes back as a basic.return (a thread finishes the last,
        # partly sent one while we read).
        sock.setblocking(True)
        rest = (len(one) - sent % len(one)) % len(one)
        finisher = threading.Thread(target=sock.sendall, args=(one[len(one) - rest:],), daemon=True)
        finisher.start()
        expected = (sent + rest) // len(one)
        returns = 0
        while returns < expected:
            _ch, m = c.read_method()
            if isinstance(m, commands.Basic.Return):
                assert m.reply_code == 312
                _, body, _ = c.read_content()
                assert len(body) == size
                returns += 1
        finisher.join(10)
        assert returns == expected
