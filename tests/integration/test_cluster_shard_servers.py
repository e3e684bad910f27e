"""A node leading a shard serves it and replicates it itself (``[clustering] shard_servers``,
the hand-over of ``broker/cluster/handover.py``) on a real 3-node cluster (real etcd, three
real broker processes): the cluster leader closes each shard another node holds, releases it
once that node holds its last action, and the holder opens it from its own copy and says so in
its key; clients reach each shard through a follower's proxy (routed by vhost) with confirms
that waited for the shard's ISR; kill -9 of a node serving shards moves only its shards, to a
node their ISR key names, and nothing confirmed is lost (an MQTT retained message and a
persistent session's queued message included); the killed node returns, wins its
shards back (2/2/2 again) and serves them with every confirmed message; then, with the third
node killed, kill -9 of a shard's server leaves the cluster leader (which follows every shard
others serve, and is in their ISR) its only in-sync copy, and it takes the shard over with every
confirmed message; last, kill -9 of the cluster leader itself while the others serve shards: a
new cluster leader, its shards led again by an in-sync node with every confirmed message, the
others' shards kept (their client reconnecting at most), and its return wins them back. Before
those, on the
same cluster: MQTT, the stream protocol and the management API on the cluster leader's own ports
(and a follower's, which tunnel there) reach a vhost another node serves, that node checking the
login again. A trial of its own (chaos): it boots its own cluster, shared by its three tests, the last
the return (once an occasional hang, fixed by construction: docs/architecture.md, "Per-shard
leaders across nodes")."""

from __future__ import annotations

import asyncio
import base64
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pika
import pytest
from rstream import (
    AMQPMessage,
    Consumer,
    ConsumerOffsetSpecification,
    MessageContext,
    OffsetType,
    Producer,
    amqp_decoder,
)

from broker.mqtt import packets as P

from ._support import CALL_FAILED, free_port, run_async
from ._tls import PKI, Issued, issue, make_pki, tls_args
from .shard_faults import (
    BATCH,
    GAP_RUN,
    HANDBACK_WAIT,
    IDS,
    VHOSTS,
    GapPublisher,
    ReconnectingPublisher,
    ShardCluster,
    expected,
    publish,
    queue_depth,
)
from .test_cluster import ClusterNode, wait_for
from .test_mqtt import Paho, Raw

pytestmark = [pytest.mark.timeout(240), pytest.mark.chaos]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def amqps() -> int:
    """The AMQPS port of every node (each binds its own loopback address)."""
    return free_port()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, pki: PKI, amqps: int) -> Iterator[ShardCluster]:
    # AMQPS with client certificates on every node (EXTERNAL); the replication link stays in
    # clear as before, and no other TLS listener opens (none of them on a default port)
    tls = tls_args(pki, "--amqp-tls-port", str(amqps), "--mgmt-tls-port", "-1", "--mqtt-tls-port", "-1",
                   "--stream-tls-port", "-1", "--tls-verify-peer", "--no-clustering-tls")
    sc = ShardCluster(tmp_path_factory.mktemp("servers"), ("--clustering-shard-servers", *tls))
    try:
        yield sc
    except BaseException:
        print(sc.c.diag())
        raise
    finally:
        sc.close()


@pytest.fixture
def kept_on_failure(servers: ShardCluster, tmp_path_factory: pytest.TempPathFactory,
                    request: pytest.FixtureRequest) -> Iterator[None]:
    """A failed test keeps the nodes' logs: copied beside the base temp dir
    (``kept-logs/servers/<time>-<pid>``, which the next run neither clears nor reuses) and
    named in a warning, which the summary shows."""
    yield
    if request.node.stash.get(CALL_FAILED, False):
        kept = servers.keep_logs(_kept_root(tmp_path_factory), f"{request.node.name} failed")
        print(f"the nodes' logs of this failed run are kept in {kept}")
        warnings.warn(f"shard servers trial failed; the nodes' logs are kept in {kept}", stacklevel=1)


def _kept_root(factory: pytest.TempPathFactory) -> Path:
    return factory.getbasetemp().parent / "kept-logs" / "servers"


@pytest.fixture(scope="module")
def after_kill() -> dict[str, object]:
    """What the first test leaves for the second: the killed node, the survivor, the moved
    shards and every confirmed count (both run in this file's order on one worker)."""
    return {}


def test_the_cluster_leaders_mqtt_and_stream_ports_reach_a_vhost_served_elsewhere(
        servers: ShardCluster, kept_on_failure: None) -> None:
    # MQTT and the stream protocol on the cluster leader's own ports, for a vhost another node
    # serves: carried there as AMQP is (cluster/elsewhere.py), that node checking the login
    # again; before, the leader answered MQTT CONNACK 5 (not authorized: no such vhost here)
    # and the stream Open VHOST_ACCESS_FAILURE
    want, boss, vhost = _served_elsewhere(servers)
    wait_for(lambda: _mqtt_connack(boss, vhost, b"guest") == 0, 10,
             f"the cluster leader's MQTT port carrying {vhost} (its election learning the server)")
    follower = next(n for n in servers.c.nodes if n is not boss)  # its proxy tunnels to the leader's port
    topic = f"routed/{uuid.uuid4().hex[:8]}"
    sub = Paho(boss.ip, boss.mqtt_port, f"sub-{topic}", user=f"{vhost}:guest")
    pub = Paho(follower.ip, follower.mqtt_port, f"pub-{topic}", user=f"{vhost}:guest")
    try:
        assert sub.subscribe(topic, 1) == [1]
        for i in range(3):
            pub.publish(topic, f"m{i}".encode(), 1)
        # QoS 1 is at least once: a publisher whose proxied connection is closed (the cluster
        # leader changing while the cluster settles, as in a CI run) sends its unacknowledged
        # message again, so a repeat may come; each comes, in order
        got: list[bytes] = []
        while len(set(got)) < 3:
            got += [m.payload for m in sub.take(1)]
        assert list(dict.fromkeys(got)) == [b"m0", b"m1", b"m2"], got
    finally:
        pub.close()
        sub.close()
    for level, code in ((4, P.BAD_CREDENTIALS), (5, P.RC_BAD_CREDENTIALS)):  # refused, nothing done
        assert _mqtt_connack(boss, vhost, b"wrong", level) == code, level
    streams = {run_async(_stream_round(boss, vhost)), run_async(_stream_round(follower, vhost))}
    # the management API about that vhost: answered by the node serving it, through either port
    quoted = urllib.parse.quote(vhost, safe="")
    for node in (boss, follower):
        names = {q["name"] for q in servers.api(node, "GET", f"/api/queues/{quoted}")}
        assert streams <= names, (node.name, names)  # on main: 404, no vhost of that name there
        every = {(q["vhost"], q["name"]) for q in servers.api(node, "GET", "/api/queues")}
        assert {(vhost, s) for s in streams} <= every, (node.name, every)  # the whole cluster's list
    with pytest.raises(urllib.error.HTTPError) as refused:  # that node checks the login again
        urllib.request.urlopen(urllib.request.Request(
            f"http://{boss.ip}:{boss.mgmt_port}/api/queues/{quoted}",
            headers={"Authorization": "Basic " + base64.b64encode(b"guest:wrong").decode()}), timeout=10)
    assert refused.value.code == 401


def test_a_client_certificate_logs_in_by_external_to_a_vhost_served_elsewhere(
        servers: ShardCluster, pki: PKI, amqps: int, tmp_path: Path, kept_on_failure: None) -> None:
    # TLS ends at the node the client reached; the connection is carried to the node serving its
    # vhost, which checks the login again. The verified certificate's identity goes with it (in
    # the tunnel's hello, which only a member with the cluster secret opens): before, that node
    # saw no certificate and refused EXTERNAL (403).
    want, boss, vhost = _served_elsewhere(servers)
    serving = servers.by_id[want[vhost]]
    third = next(n for n in servers.c.nodes if n not in (boss, serving))
    quoted = urllib.parse.quote(vhost, safe="")
    servers.api(boss, "PUT", "/api/users/tls-user", {"password": "", "tags": ""})
    servers.api(boss, "PUT", f"/api/permissions/{quoted}/tls-user",
                {"configure": "^ext-", "write": ".*", "read": ".*"})
    external = pika.credentials.ExternalCredentials()

    def params(node: ClusterNode, cert: Issued, port: int = amqps) -> pika.ConnectionParameters:
        ctx = pki.client_context(cert=cert)
        return pika.ConnectionParameters(node.ip, port, vhost, external, socket_timeout=5,
                                         ssl_options=pika.SSLOptions(ctx, node.ip), connection_attempts=1,
                                         blocked_connection_timeout=10)

    def logs_in() -> bool:  # once the serving node has the new user and its permissions
        try:
            pika.BlockingConnection(params(boss, pki.client)).close()
        except (pika.exceptions.ProbableAccessDeniedError, pika.exceptions.ProbableAuthenticationError):
            # Not yet: the user (403, "unknown user") or its permissions (530) reach the serving
            # node by replication, which nothing acknowledges. Main's refusal (403: no
            # certificate there) never passes, so the wait below fails on it.
            return False
        return True

    wait_for(logs_in, 15, "tls-user's permissions on the node serving its vhost")
    queue = f"ext-{uuid.uuid4().hex[:8]}"
    # the cluster leader's AMQPS, and the third node's (its proxy passes TLS on to the leader's)
    for node in (boss, third):
        with pika.BlockingConnection(params(node, pki.client)) as conn:
            ch = conn.channel()
            ch.confirm_delivery()
            ch.queue_declare(queue, durable=True)
            ch.basic_publish("", queue, node.name.encode(), pika.BasicProperties(delivery_mode=2),
                             mandatory=True)
            seen = [(c.get("user"), c.get("auth_mechanism"), c.get("peer_cert_subject") or "")
                    for c in servers.api(serving, "GET", f"/api/vhosts/{quoted}/connections")]
            assert any(u == "tls-user" and m == "EXTERNAL" and "CN=tls-user" in s for u, m, s in seen), seen
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as denied:  # its permissions apply:
                ch.queue_declare("not-ext", durable=True)
            assert denied.value.reply_code == 403
    assert queue_depth(serving, vhost, queue) == 2  # on the serving node, confirmed
    # a certificate naming no user is refused there as here; so is EXTERNAL with no certificate
    stranger = issue(pki.ca, tmp_path, "nobody-known", client=True)
    with pytest.raises(pika.exceptions.ProbableAuthenticationError) as refused:
        pika.BlockingConnection(params(boss, stranger))
    assert "403" in str(refused.value)
    with pytest.raises((pika.exceptions.ProbableAuthenticationError, pika.exceptions.AMQPConnectionError)):
        pika.BlockingConnection(pika.ConnectionParameters(serving.ip, serving.port, vhost, external,
                                                          socket_timeout=5, connection_attempts=1))


def test_the_management_api_and_metrics_answer_for_every_shard_wherever_asked(
        servers: ShardCluster, amqps: int, kept_on_failure: None) -> None:
    # /api/overview, /metrics, a page of a list and the whole definitions through the cluster
    # leader's port and a follower's (which tunnels there) are the sum of what each vhost's server
    # says of its vhost (http/forward.py); on main they were the cluster leader's part only
    want = expected()
    wait_for(lambda: servers.leaders() == want, 20, f"shard leaders {want}")
    boss = servers.c.leader()
    assert boss is not None
    others = {v: n for v, n in want.items() if n != IDS[servers.c.nodes.index(boss)]}
    wait_for(lambda: {v: n for v, n in servers.served().items() if v in others} == others, 30,
             f"the shards of the nodes other than the cluster leader served by them: {others}")
    follower = next(n for n in servers.c.nodes if n is not boss)
    quoted = {v: urllib.parse.quote(v, safe="") for v in want}
    for v in others:  # the cluster leader's election learning each server (503 "moving" until then)
        wait_for(lambda: _answers(servers, boss, f"/api/queues/{quoted[v]}"), 20, f"{v} reached")  # noqa: B023
    for i, vhost in enumerate(VHOSTS):
        publish(boss, vhost, "agg", i + 1)
    queues = [q for v in want for q in servers.api(boss, "GET", f"/api/queues/{quoted[v]}")]  # each server's
    exchanges = sum(len(servers.api(boss, "GET", f"/api/exchanges/{quoted[v]}")) for v in want)
    messages = sum(int(q.get("messages", 0)) for q in queues)
    names = sorted((q["name"], q["vhost"]) for q in queues)
    def totals(node: ClusterNode) -> tuple[int, int, int, object]:
        doc = servers.api(node, "GET", "/api/overview")
        o, t = doc["object_totals"], doc["queue_totals"]
        return o["queues"], o["exchanges"], t.get("messages", 0), doc.get("partial")

    for node in (boss, follower):
        whole = (len(queues), exchanges, messages, None)
        try:
            wait_for(lambda: totals(node) == whole, 15, f"{node.name}'s overview: {whole}")  # noqa: B023
        except AssertionError:
            assert totals(node) == whole, node.name  # on main: the cluster leader's part
        metrics = _samples(servers, node, "/metrics")
        assert metrics["rabbitmq_queues"] == len(queues), node.name  # on main: the leader's part
        assert metrics["rabbitmq_queue_messages"] == messages, node.name
        shared = {k: metrics.get(k) for k in ("skred_users", "skred_vhosts")}  # the cluster's one copy
        assert shared == {"skred_users": len(servers.api(node, "GET", "/api/users")),
                          "skred_vhosts": len(want)}, (node.name, metrics)
        per = _samples(servers, node, "/metrics/per-object")
        for i, vhost in enumerate(VHOSTS):
            found = [v for k, v in per.items() if k.startswith("rabbitmq_queue_messages{")
                     and f'vhost="{vhost}"' in k and 'queue="agg"' in k]
            assert found == [i + 1], (node.name, vhost, found)
        page = servers.api(node, "GET", "/api/queues?page=2&page_size=3&sort=vhost&sort_reverse=true")
        assert page["total_count"] == len(queues), node.name  # joined, then sorted, then cut
        assert [q["vhost"] for q in page["items"]] == sorted((q["vhost"] for q in queues), reverse=True)[3:6]
        defs = servers.api(node, "GET", "/api/definitions")
        assert sorted((q["name"], q["vhost"]) for q in defs["queues"]) == names, node.name
        assert sorted(v["name"] for v in defs["vhosts"]) == sorted(want), node.name  # each once
        _every_member_listed(servers, node, amqps)
    # the cluster leader's metrics port (no login; bound to 127.0.0.1, its default): each
    # serving node's metrics port's part
    with urllib.request.urlopen(f"http://127.0.0.1:{boss.metrics_port}/metrics", timeout=10) as resp:
        open_metrics = resp.read().decode()
    assert re.search(r"^rabbitmq_queues (\d+)$", open_metrics, re.M)[1] == str(len(queues))  # type: ignore[index]
    # a whole import: to the node serving its vhosts when that is one node and the document
    # holds only their topology (that node's import is the all-or-nothing one); else refused
    # before anything happens (on main: 400 "vhost does not exist", for a vhost that does)
    boss_id = IDS[servers.c.nodes.index(boss)]
    one_node = sorted(v for v, n in VHOSTS.items() if n == min(set(IDS) - {boss_id}))
    spread = sorted({n: v for v, n in VHOSTS.items()}.values())  # a vhost of each node

    def queues_in(vhosts: list[str], name: str) -> dict[str, Any]:
        return {"queues": [{"name": name, "vhost": v, "durable": True, "auto_delete": False,
                            "arguments": {}} for v in vhosts]}

    def names_in(vhost: str) -> set[str]:  # each asked of its server
        return {q["name"] for q in servers.api(boss, "GET", f"/api/queues/{quoted[vhost]}")}

    assert servers.api(follower, "POST", "/api/definitions", queues_in(one_node, "imported")) is None  # 204
    assert all("imported" in names_in(v) for v in one_node)
    user = [{"name": "u", "password": "p", "tags": ""}]
    for doc in (queues_in(spread, "refused"), {**queues_in(one_node[:1], "refused"), "users": user}):
        with pytest.raises(urllib.error.HTTPError) as refused:
            servers.api(follower, "POST", "/api/definitions", doc)
        assert refused.value.code == 501, doc
        assert not any("refused" in names_in(v) for v in {*spread, *one_node}), doc
    assert "u" not in {u["name"] for u in servers.api(boss, "GET", "/api/users")}


def _name(node: ClusterNode) -> str:
    return f"skred-{node.port}@{socket.gethostname()}"  # broker.metrics.node_name


def _every_member_listed(servers: ShardCluster, node: ClusterNode, amqps: int) -> None:
    """``/api/nodes`` through ``node``: every member, each as it says it is (its own process),
    and the overview's listeners: every member's client ports (a follower's are its proxies'),
    never a shard broker's loopback ones (on main: the cluster leader alone, and loopback ones)."""
    listed = {n["name"]: n for n in servers.api(node, "GET", "/api/nodes")}
    assert set(listed) == {_name(n) for n in servers.c.nodes}, (node.name, sorted(listed))
    for member in servers.c.nodes:
        entry = listed[_name(member)]
        assert member.proc is not None and entry["os_pid"] == str(member.proc.pid), (member.name, entry)
        assert entry["running"] is True and entry["mem_used"] > 0 and entry["fd_used"] > 0, entry
    one = servers.c.nodes[-1]
    assert servers.api(node, "GET", f"/api/nodes/{_name(one)}")["os_pid"] == str(one.proc.pid)  # type: ignore[union-attr]
    ports = {(x["node"], x["protocol"], x["ip_address"], x["port"])
             for x in servers.api(node, "GET", "/api/overview")["listeners"]}
    for member in servers.c.nodes:
        for proto, port in (("amqp", member.port), ("http", member.mgmt_port), ("mqtt", member.mqtt_port),
                            ("stream", member.stream_port)):
            assert (_name(member), proto, member.ip, port) in ports, (node.name, member.name, proto, ports)
    known = {(_name(m), m.ip, p) for m in servers.c.nodes for p in (m.port, m.mgmt_port, m.mqtt_port,
                                                                   m.stream_port, amqps)}
    known |= {(_name(m), "127.0.0.1", m.metrics_port) for m in servers.c.nodes}  # its default bind
    assert {x for x in ports if (x[0], x[2], x[3]) not in known} == set(), ports  # no shard broker's port


def _served_elsewhere(servers: ShardCluster) -> tuple[dict[str, str], ClusterNode, str]:
    """Once the shards are placed: the placement, the cluster leader and the first vhost another
    node serves (its server's ``serves`` mark seen)."""
    want = expected()
    wait_for(lambda: servers.leaders() == want, 20, f"shard leaders {want}")
    boss = servers.c.leader()
    assert boss is not None
    boss_id = IDS[servers.c.nodes.index(boss)]
    vhost = min(v for v, n in VHOSTS.items() if n != boss_id)
    wait_for(lambda: servers.served().get(vhost) == want[vhost], 30, f"{vhost} served by {want[vhost]}")
    return want, boss, vhost


def _answers(servers: ShardCluster, node: ClusterNode, path: str) -> bool:
    try:
        servers.api(node, "GET", path)
    except urllib.error.HTTPError as exc:
        if exc.code != 503:
            raise
        return False
    return True


def _samples(servers: ShardCluster, node: ClusterNode, path: str) -> dict[str, float]:
    req = urllib.request.Request(f"http://{node.ip}:{node.mgmt_port}{path}", headers={
        "Authorization": "Basic " + base64.b64encode(b"guest:guest").decode()})
    with urllib.request.urlopen(req, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def _mqtt_connack(node: ClusterNode, vhost: str, password: bytes, level: int = 4) -> int:
    """The return code of the CONNACK ``node``'s MQTT port answers guest in ``vhost`` (which then
    closes a refused connection)."""
    mq = Raw(node.ip, node.mqtt_port, P.Connect("MQTT", level, True, 30, f"probe-{uuid.uuid4().hex[:6]}",
                                                None, f"{vhost}:guest", password))
    try:
        _flags, code = mq.connack()
        assert code == 0 or mq.closed_within(5), "a refused MQTT connection left open"
        return code
    finally:
        mq.close()


async def _stream_round(boss: ClusterNode, vhost: str) -> str:
    """Through ``boss``'s stream port: a stream declared, three messages confirmed and read back
    in ``vhost`` (served elsewhere); a wrong password refused. The stream's name."""
    kw = {"port": boss.stream_port, "username": "guest", "vhost": vhost, "load_balancer_mode": True}
    stream = f"routed-{uuid.uuid4().hex[:8]}"
    async with Producer(boss.ip, password="guest", **kw) as producer:
        await producer.create_stream(stream)
        for i in range(3):
            await producer.send_wait(stream, AMQPMessage(body=f"s{i}".encode()))
    got: list[bytes] = []

    async def on_message(msg: AMQPMessage, _ctx: MessageContext) -> None:
        got.append(bytes(msg.body))

    consumer = Consumer(boss.ip, password="guest", **kw)
    await consumer.start()
    try:
        await consumer.subscribe(stream, on_message, decoder=amqp_decoder,
                                 offset_specification=ConsumerOffsetSpecification(OffsetType.FIRST, None))
        deadline = asyncio.get_running_loop().time() + 15
        while len(got) < 3 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)  # poll, bounded by the deadline
        assert got == [b"s0", b"s1", b"s2"], got
    finally:
        await consumer.close()
    with pytest.raises(Exception) as refused:  # noqa: PT011 - rstream's own error classes
        async with Producer(boss.ip, password="wrong", **kw):
            pass
    assert "AUTHENTICATION" in repr(refused.value).upper() or "8" in repr(refused.value), refused.value
    return stream


def test_nodes_serve_their_shards_and_kill9_of_one_moves_only_those_losing_nothing(
        servers: ShardCluster, after_kill: dict[str, object], kept_on_failure: None) -> None:
    want = expected()
    wait_for(lambda: servers.leaders() == want, 20, f"shard leaders {want}")
    boss = servers.c.leader()
    assert boss is not None
    boss_id = IDS[servers.c.nodes.index(boss)]
    others = {v: n for v, n in want.items() if n != boss_id}
    wait_for(lambda: {v: n for v, n in servers.served().items() if v in others} == others, 30,
             f"the shards of the nodes other than the cluster leader served by them: {others}")
    followers = [n for n in servers.c.nodes if n is not boss]

    def isr_keys_written_by_their_servers() -> bool:
        # each served shard's ISR key is its server's, and names the third node and the cluster
        # leader, which follow it from there (on main the cluster leader followed nothing, and
        # was in no served shard's ISR: never a failover target)
        isrs = servers.isrs()
        return all(v in isrs and boss_id in isrs[v]
                   and next(n for n in IDS if n not in (boss_id, others[v])) in isrs[v] for v in others)

    wait_for(isr_keys_written_by_their_servers, 20, "the served shards' ISR keys written by their servers")
    confirmed: dict[str, int] = {}
    for i, vhost in enumerate(VHOSTS):  # through either follower's proxy, routed by vhost
        confirmed[vhost] = publish(followers[i % 2], vhost, "served", BATCH)
    for vhost in sorted(set(others) & set(VHOSTS)):  # and through the cluster leader's own port
        assert queue_depth(boss, vhost, "served") == confirmed[vhost], vhost  # on main: 530
    victim_id = next(n for n in IDS if n != boss_id)
    victim = servers.by_id[victim_id]
    moved = {v for v, n in VHOSTS.items() if n == victim_id}
    survivor = next(n for n in followers if n is not victim)
    mqtt_vhost = min(moved)
    kept = _mqtt_state_before(boss, mqtt_vhost)  # its MQTT state, written by the victim
    before = servers.leaders()
    victim.kill9()
    # its part of a whole answer is missing until its shards move: said, not under-counted
    partial = " ".join(servers.api(boss, "GET", "/api/overview").get("partial", []))
    assert any(repr(v) in partial for v in moved), partial
    down = {n["name"]: n["running"] for n in servers.api(boss, "GET", "/api/nodes")}  # listed, not dropped
    assert down == {_name(n): n is not victim for n in servers.c.nodes}, down
    with pytest.raises(urllib.error.HTTPError) as missing:
        servers.api(boss, "GET", "/api/queues")
    assert missing.value.code == 503 and "missing" in missing.value.read().decode()

    def only_its_shards_moved_and_served() -> bool:
        now, served = servers.leaders(), servers.served()
        return all(now.get(v) not in (None, victim_id) and served.get(v) == now[v] for v in moved) \
            and all(now.get(v) == before[v] for v in VHOSTS if v not in moved)

    wait_for(only_its_shards_moved_and_served, 30, f"{sorted(moved)} served again by another node")
    for vhost in VHOSTS:  # every confirmed message, through the surviving follower
        assert _depth(survivor, vhost) == confirmed[vhost], vhost
    for vhost in sorted(moved):  # and the moved shards take new confirmed publishes
        confirmed[vhost] += publish(survivor, vhost, "served", BATCH)
        assert queue_depth(survivor, vhost, "served") == confirmed[vhost], vhost
    _mqtt_state_after(survivor, mqtt_vhost, kept)  # failed over with its shard
    after_kill.update(want=want, others=others, victim=victim, survivor=survivor, moved=moved,
                      confirmed=confirmed, mqtt=(mqtt_vhost, kept))


def test_the_killed_node_returns_wins_its_shards_back_and_serves_every_confirmed_message(
        servers: ShardCluster, after_kill: dict[str, object], kept_on_failure: None) -> None:
    # the killed node returns: it follows its shards' current server, is in their ISR again,
    # wins them back and serves them from a copy holding every confirmed message, while a
    # publisher keeps confirming into one of them through the survivor across the hand-back
    if "confirmed" not in after_kill:
        pytest.fail("the first phase (placement, kill -9) did not complete")
    want = cast(dict[str, str], after_kill["want"])
    others = cast(dict[str, str], after_kill["others"])
    victim = cast(ClusterNode, after_kill["victim"])
    survivor = cast(ClusterNode, after_kill["survivor"])
    moved = cast(set[str], after_kill["moved"])
    confirmed = cast(dict[str, int], after_kill["confirmed"])
    trickle = GapPublisher(survivor, min(moved), "trickle")
    trickle.start()
    try:
        wait_for(lambda: trickle.confirmed > 0 or trickle.error is not None, 10, "the trickle confirming")
        victim.start()
        started = time.monotonic()
        wait_for(lambda: servers.leaders() == want, HANDBACK_WAIT, f"shard leaders back to {want}")
        wait_for(lambda: {v: n for v, n in servers.served().items() if v in others} == others, HANDBACK_WAIT,
                 f"the returned node serving its shards again: {others}")
        print(f"hand-back: its shards served again {time.monotonic() - started:.2f}s after the node started")
    finally:
        trickle.stop_at.set()
        trickle.join(GAP_RUN + 10)
    # its connection is closed as the shard moves (320); what it had confirmed is all there
    assert trickle.confirmed > 0, trickle.error
    assert _depth(survivor, min(moved), "trickle") >= trickle.confirmed
    for vhost in VHOSTS:  # through the returned node (the survivor read them all before, and
        assert _depth(victim, vhost) == confirmed[vhost], vhost  # reads the moved ones below)
    for vhost in sorted(moved):  # served again by the returned node, with new confirms
        confirmed[vhost] += publish(victim, vhost, "served", BATCH)
        assert _depth(survivor, vhost) == confirmed[vhost], vhost
    _retained_through(victim, *cast(tuple[str, str], after_kill["mqtt"]))  # and its MQTT state


def test_the_cluster_leader_follows_served_shards_and_takes_one_over_with_no_other_copy(
        servers: ShardCluster, kept_on_failure: None) -> None:
    # the cluster leader follows every shard another node serves, from that node, so it is in
    # the shard's ISR like any other node and its confirms wait for it; with the third node
    # down, kill -9 of the server leaves the cluster leader the shard's only in-sync copy, and
    # it takes the shard over with every confirmed message (on main it followed nothing, was in
    # no served shard's ISR, and the shard was never led again)
    want = expected()
    wait_for(lambda: servers.leaders() == want, HANDBACK_WAIT, f"shard leaders {want}")
    boss = servers.c.leader()
    assert boss is not None
    boss_id = IDS[servers.c.nodes.index(boss)]
    server_id, third_id = sorted(n for n in IDS if n != boss_id)
    theirs = sorted(v for v, n in VHOSTS.items() if n == server_id)
    wait_for(lambda: all(servers.served().get(v) == server_id for v in theirs), HANDBACK_WAIT,
             f"{theirs} served by {server_id}")
    wait_for(lambda: all(boss_id in servers.isrs().get(v, []) for v in theirs), 20,
             f"the cluster leader in the ISR keys of {theirs}")
    servers.by_id[third_id].kill9()
    confirmed = {v: publish(boss, v, "sole", BATCH) for v in theirs}  # waited for the leader's acks
    servers.by_id[server_id].kill9()
    wait_for(lambda: all(servers.leaders().get(v) == boss_id and servers.served().get(v) == boss_id
                         for v in theirs), 30, f"{theirs} led and served by the cluster leader")
    for vhost in theirs:
        assert _depth(boss, vhost, "sole") == confirmed[vhost], vhost
        confirmed[vhost] += publish(boss, vhost, "sole", BATCH)  # and it serves them on
        assert _depth(boss, vhost, "sole") == confirmed[vhost], vhost
    # the server returns: it follows its shards from the cluster leader (whose listing of them
    # is what its links wrote, read again as it opened them: a stale one would have the
    # returning node delete the queue its links created) and wins them back
    server = servers.by_id[server_id]
    server.start()
    wait_for(lambda: all(servers.served().get(v) == server_id for v in theirs), HANDBACK_WAIT,
             f"{theirs} served by {server_id} again")
    for vhost in theirs:
        assert _depth(server, vhost, "sole") == confirmed[vhost], vhost



def test_kill9_of_the_cluster_leader_moves_its_shards_others_serve_on_and_its_return_wins_them_back(
        servers: ShardCluster, kept_on_failure: None) -> None:
    # kill -9 of the cluster leader while the other nodes serve their shards: a new cluster
    # leader is elected, the killed node's shards fail over to a node in their ISR with every
    # confirmed message, the other nodes' shards are served on (a client of one, connected to
    # its server, confirms throughout, at most reconnecting), and the killed node returns and
    # wins its shards back without loss. Last in the module: it leaves a new cluster leader.
    want = expected()
    for node in servers.c.nodes:  # the previous test left the third node down
        if node.proc is None or node.proc.poll() is not None:
            node.start()
    wait_for(lambda: servers.leaders() == want, HANDBACK_WAIT, f"shard leaders {want}")
    boss = servers.c.leader()
    assert boss is not None
    boss_id = IDS[servers.c.nodes.index(boss)]
    others = {v: n for v, n in want.items() if n != boss_id}
    mine = sorted(v for v, n in VHOSTS.items() if n == boss_id)
    rest = [n for n in servers.c.nodes if n is not boss]
    rest_ids = {IDS[servers.c.nodes.index(n)] for n in rest}
    wait_for(lambda: {v: n for v, n in servers.served().items() if v in others} == others, HANDBACK_WAIT,
             f"the other nodes' shards served by them: {others}")
    wait_for(lambda: all(rest_ids <= set(servers.isrs().get(v, [])) for v in mine), 20,
             f"both other nodes in the ISR keys of the cluster leader's shards {mine}")
    confirmed = {v: publish(rest[i % 2], v, "boss", BATCH) for i, v in enumerate(sorted(VHOSTS))}
    live = next(v for v in sorted(others) if v in VHOSTS)
    server = servers.by_id[others[live]]
    client = ReconnectingPublisher([server, *(n for n in rest if n is not server)], live, "live")
    client.start()
    try:
        wait_for(lambda: client.confirmed > 0 or not client.is_alive(), 10, "the live client confirming")
        boss.kill9()
        killed, at_kill = time.monotonic(), client.confirmed

        def moved_and_others_kept() -> bool:
            # a shard the new cluster leader won is served by it unmarked (the cluster's own
            # data path, handover.py); one another node won, by that node's mark
            now, served, new = servers.leaders(), servers.served(), servers.c.leader()
            if new is None or new is boss:
                return False
            new_id = IDS[servers.c.nodes.index(new)]
            return all(now.get(v) in rest_ids and served.get(v, new_id) == now[v] for v in mine) \
                and all(now.get(v) == n and served.get(v) == n for v, n in others.items())

        wait_for(moved_and_others_kept, 30,
                 f"a new cluster leader, {mine} served by another node, {sorted(others)} kept")
        print(f"cluster leader kill -9: its shards served again {time.monotonic() - killed:.2f}s after")
        for vhost in VHOSTS:  # every confirmed message, wherever each shard is served now
            assert _depth(rest[0], vhost, "boss") == confirmed[vhost], vhost
        for vhost in mine:  # and the moved shards take new confirmed publishes
            confirmed[vhost] += publish(rest[1], vhost, "boss", BATCH)
        wait_for(lambda: client.confirmed > at_kill or not client.is_alive(), 10,
                 f"the live client confirming into {live} after the kill")
        assert client.confirmed > at_kill, (client.reconnects, client.error)
    finally:
        client.stop_at.set()
        client.join(GAP_RUN + 10)
    assert client.error is None, (client.reconnects, client.error)  # no refusal beyond a reconnect
    assert _depth(server, live, "live") >= client.confirmed
    print(f"the live client of {live}: {client.confirmed} confirmed, {client.reconnects} reconnects")
    boss.start()  # it returns as a follower of the new cluster leader and wins its shards back
    wait_for(lambda: servers.leaders() == want, HANDBACK_WAIT, f"shard leaders back to {want}")
    wait_for(lambda: all(servers.served().get(v) == boss_id for v in mine), HANDBACK_WAIT,
             f"{mine} served by the returned node again")
    for vhost in VHOSTS:
        assert _depth(boss, vhost, "boss") == confirmed[vhost], vhost


def _mqtt_state_before(boss: ClusterNode, vhost: str) -> str:
    """Through the cluster leader's MQTT port (carried to the node serving ``vhost``): a retained
    message confirmed (PUBACK), and a persistent session's subscription with a QoS 1 message
    queued for it while it is away. The topic."""
    wait_for(lambda: _mqtt_connack(boss, vhost, b"guest") == 0, 10, f"MQTT carried to {vhost}")
    topic = f"kept/{uuid.uuid4().hex[:8]}"
    away = Paho(boss.ip, boss.mqtt_port, f"away-{topic}", clean=False, user=f"{vhost}:guest")
    try:
        assert away.subscribe(topic + "/queued", 1) == [1]
    finally:
        away.close()
    pub = Paho(boss.ip, boss.mqtt_port, f"pub-{topic}", user=f"{vhost}:guest")
    try:
        info = pub.c.publish(topic, b"retained", 1, retain=True)
        info.wait_for_publish(10)
        assert info.is_published()
        pub.publish(topic + "/queued", b"queued", 1)
    finally:
        pub.close()
    return topic


def _mqtt_state_after(node: ClusterNode, vhost: str, topic: str) -> None:
    """The MQTT state ``_mqtt_state_before`` left, read through ``node`` from the shard's new
    server: the retained message, and the persistent session with its queued message."""
    _retained_through(node, vhost, topic)  # on main: queue.Empty, it stayed on the dead node
    away = Paho(node.ip, node.mqtt_port, f"away-{topic}", clean=False, user=f"{vhost}:guest")
    try:
        assert away.present
        assert [m.payload for m in away.take(1)] == [b"queued"]
    finally:
        away.close()


def _retained_through(node: ClusterNode, vhost: str, topic: str) -> None:
    """The retained message ``_mqtt_state_before`` left on ``topic``, read through ``node``."""
    wait_for(lambda: _mqtt_connack(node, vhost, b"guest") == 0, 20, f"MQTT carried to {vhost}")
    sub = Paho(node.ip, node.mqtt_port, f"late-{uuid.uuid4().hex[:8]}", user=f"{vhost}:guest")
    try:
        assert sub.subscribe(topic, 1) == [1]
        got = sub.take(1, 5)
        assert [(m.topic, m.payload, m.retain) for m in got] == [(topic, b"retained", True)]
    finally:
        sub.close()


def _depth(node: ClusterNode, vhost: str, queue: str = "served") -> int:
    """The depth of ``queue`` in ``vhost`` through ``node``, reconnecting while a pass of each
    node learns the shard's new server."""
    depth: list[int] = []

    def read() -> bool:
        try:
            depth.append(queue_depth(node, vhost, queue))
            return True
        except pika.exceptions.AMQPError:
            return False

    wait_for(read, 10, f"{vhost} readable through {node.name}")
    return depth[-1]
