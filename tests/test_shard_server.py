"""A node serves the shards it leads and replicates them itself (``cluster/shard_server.py``,
step 2 of the per-shard data path): a broker holding only its shards, booted from the node's
data dir, with a ``ShardedLeaderSink`` on the replication port. A real follower follows it
scoped to the shard over a real socket into real files; a real AMQP client's confirms come
only once the follower holds the message; the shard's ISR key is written per shard; closing
the shard closes its clients (no confirm after) and keeps its files."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aio_pika
import pytest
from aio_pika.exceptions import AMQPError, DeliveryError

from broker.cluster import codec, follower
from broker.cluster.files import Scope, shard_name
from broker.cluster.proxy import Routed, SpliceProxy, Target, Tunnelled
from broker.cluster.shard_server import ShardServer
from broker.cluster.status import ClusterView
from broker.cluster.vhost_route import Limits
from broker.config import Config, load_config
from broker.node import Node, NodeHost
from broker.store.paths import vhost_dir
from tests.integration._support import listener_ports_env

SECRET = b"s" * 32
DEADLINE = 20.0  # seconds: generous under load
N = 20


async def _until(what: str, ok: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {DEADLINE}s: {what}")
        await asyncio.sleep(0.02)


def _held(root: Path, vhost: str, body: bytes) -> bool:
    """True when some file of ``vhost``'s directory under ``root`` holds ``body``."""
    return any(body in p.read_bytes() for p in vhost_dir(root, vhost).rglob("*") if p.is_file())


def test_a_node_serves_its_shard_and_confirms_wait_for_the_shards_follower(tmp_path: Path) -> None:
    data, f_dir = tmp_path / "b", tmp_path / "f"
    env = listener_ports_env()
    config = load_config(["--data-dir", str(data), "--no-mgmt"], environ=env)

    async def main() -> None:
        # the node's data dir as replication left it: two vhosts, the users
        seed = Node(config)
        await seed.start()
        assert seed.mgmt is not None and seed.broker is not None
        for vhost in ("v", "w"):
            seed.mgmt.create_vhost(vhost)
            seed.broker.users.set_permissions("guest", vhost, ".*", ".*", ".*")
        await seed.shutdown()
        seed.release_lock()

        written: list[tuple[str, list[str]]] = []

        async def write_isr(vhost: str, members: list[str]) -> bool:
            written.append((vhost, sorted(members)))
            return True

        server = ShardServer(config, NodeHost(config), "B", SECRET, ClusterView("B", "tcp://127.0.0.1:1"),
                             write_isr, lambda: True)
        _, port = await server.start("127.0.0.1", 0)
        pool = ThreadPoolExecutor(1)
        synced: list[bool] = []
        assert await server.open("v")  # a follower is sent only the shards served (refused before)
        link = asyncio.ensure_future(follower.follow(
            "127.0.0.1", port, f_dir, SECRET, "F", lambda w: None, lambda: synced.append(True), pool,
            scope=Scope(shared=False, shards=frozenset({shard_name("v")}))))
        try:
            assert written and written[0][0] == "v", "its ISR key is the server's as it opens"
            assert not await server.open("v") and not await server.open("nope")
            assert server.node.client_addresses()["amqp"][0] == "127.0.0.1"  # loopback only
            await _until("the follower synced and in the ISR",
                         lambda: bool(synced) and server.sink.isr == {"F"} or link.done())
            assert not link.done(), link.exception()
            host, amqp_port = server.node.client_addresses()["amqp"]
            conn = await aio_pika.connect(f"amqp://guest:guest@{host}:{amqp_port}/v", timeout=5)
            ch = await conn.channel(publisher_confirms=True)
            await ch.declare_queue("q", durable=True)
            for i in range(N):
                body = b"served-%03d" % i
                await ch.default_exchange.publish(aio_pika.Message(body, delivery_mode=2), "q")
                assert _held(f_dir, "v", body)  # confirmed: the shard's follower holds it already
            with pytest.raises((AMQPError, ConnectionError)):
                await aio_pika.connect(f"amqp://guest:guest@{host}:{amqp_port}/w", timeout=5)  # not ours
            # a client of this node's routed AMQP port reaches the shard through a tunnel to our
            # own replication port (the router's target for a shard we serve: runner._routed)
            ours = Target("127.0.0.1", port)
            proxy = SpliceProxy("amqp", Target(), False, None,
                                tunnel=Tunnelled(codec.AMQP_PORT, lambda: SECRET, lambda: None),
                                routed=Routed(Limits(2047, 131072, 60), NodeHost().amqp_server_properties(),
                                              serving=lambda vhost: ours, login=lambda: ours))
            proxy_port = await proxy.start("127.0.0.1", 0)
            try:
                routed = await aio_pika.connect(f"amqp://guest:guest@127.0.0.1:{proxy_port}/v", timeout=5)
                rch = await routed.channel(publisher_confirms=True)
                for i in range(5):
                    body = b"routed-%03d" % i
                    await rch.default_exchange.publish(aio_pika.Message(body, delivery_mode=2), "q")
                    assert _held(f_dir, "v", body)
                await routed.close()
            finally:
                await proxy.stop()
            assert ("v", ["B", "F"]) in written or ("v", ["F"]) in written, written  # per shard
            assert all(vhost == "v" for vhost, _ in written)

            await server.close("v", "the shard moved to another node")
            with pytest.raises((AMQPError, ConnectionError, RuntimeError)):
                for _ in range(50):  # the close reaches the client (320): no confirm after it
                    await asyncio.wait_for(ch.default_exchange.publish(
                        aio_pika.Message(b"after", delivery_mode=2), "q"), 1)
                    await asyncio.sleep(0.05)
            assert vhost_dir(data, "v").is_dir() and not _held(f_dir, "v", b"after")
        finally:
            link.cancel()
            await asyncio.gather(link, return_exceptions=True)
            await server.stop()
            pool.shutdown(wait=True)

    asyncio.run(main())


def _files(root: Path, vhost: str) -> dict[str, bytes]:
    top = vhost_dir(root, vhost)
    return {str(p.relative_to(top)): p.read_bytes() for p in sorted(top.rglob("*")) if p.is_file()}


async def _publish(url: str, queue: str, bodies: list[bytes]) -> None:
    conn = await aio_pika.connect(url, timeout=5)
    try:
        ch = await conn.channel(publisher_confirms=True)
        await ch.declare_queue(queue, durable=True)
        for body in bodies:
            await ch.default_exchange.publish(aio_pika.Message(body, delivery_mode=2), queue)
    finally:
        await conn.close()


def test_a_shard_opened_after_the_server_started_is_sent_whole_and_only_served_shards_are_sent(
        tmp_path: Path) -> None:
    """The killed node's return (issue 27): a node serving shards opens one whose files
    replication wrote after its server started (its queue declared meanwhile, on another node).
    A follower's bulk sync must list that shard's files as they are on disk: on main the index
    read at the server's start listed neither the definitions log nor the queue's segment, and
    the follower deleted both (the confirmed queue was gone when it served the shard next). A
    follower asking for a shard not served here is refused: our copy of it may be stale."""
    data, f_dir = tmp_path / "b", tmp_path / "f"
    env = listener_ports_env()
    config = load_config(["--data-dir", str(data), "--no-mgmt"], environ=env)

    async def seeded(then: Callable[[Node], Awaitable[None]]) -> None:
        seed = Node(config)
        await seed.start()
        try:
            await then(seed)
        finally:
            await seed.shutdown()
            seed.release_lock()

    async def vhosts(seed: Node) -> None:
        assert seed.mgmt is not None and seed.broker is not None
        for vhost in ("v", "w"):
            seed.mgmt.create_vhost(vhost)
            seed.broker.users.set_permissions("guest", vhost, ".*", ".*", ".*")

    async def queue(seed: Node) -> None:  # as the shard's server at the time wrote it
        host, amqp_port = seed.client_addresses()["amqp"]
        await _publish(f"amqp://guest:guest@{host}:{amqp_port}/v", "q",
                       [b"before-%03d" % i for i in range(N)])

    async def main() -> None:
        await seeded(vhosts)
        server = ShardServer(config, NodeHost(config), "B", SECRET, ClusterView("B", "tcp://127.0.0.1:1"),
                             _accept_isr, lambda: True)
        _, port = await server.start("127.0.0.1", 0)
        pool = ThreadPoolExecutor(1)
        links: list[asyncio.Future[None]] = []

        def follow(shard: str, into: Path, synced: list[bool], me: str = "F") -> asyncio.Future[None]:
            link = asyncio.ensure_future(follower.follow(
                "127.0.0.1", port, into, SECRET, me, lambda w: None, lambda: synced.append(True), pool,
                scope=Scope(shared=False, shards=frozenset({shard_name(shard)}))))
            links.append(link)
            return link

        try:
            await seeded(queue)  # replication writes "v" while our server serves none of it
            assert await server.open("v")
            host, amqp_port = server.node.client_addresses()["amqp"]
            await _publish(f"amqp://guest:guest@{host}:{amqp_port}/v", "q",
                           [b"after-%03d" % i for i in range(5)])
            synced: list[bool] = []
            link = follow("v", f_dir, synced)
            await _until("the follower synced", lambda: bool(synced) or link.done())
            assert not link.done(), link.exception()
            server.node.flush_stores()
            def whole() -> bool:  # each file as served, up to its logical length (segments are preallocated)
                mine, served = _files(f_dir, "v"), _files(data, "v")
                return set(mine) == set(served) and all(served[n].startswith(mine[n]) for n in mine)

            await _until("the follower holds the shard as served, file for file", whole)
            assert all(_held(f_dir, "v", b"%s-%03d" % (w, i)) for w, n in ((b"before", N), (b"after", 5))
                       for i in range(n))
            assert any(name.endswith("definitions.amqp") for name in _files(f_dir, "v"))
            g_synced: list[bool] = []
            refused = follow("w", tmp_path / "g", g_synced, "G")
            await _until("a follower of a shard not served here refused", refused.done)
            assert not g_synced and server.sink.followers.keys() == {"F"}
            assert not (vhost_dir(tmp_path / "g", "w")).exists()
        finally:
            await _stop(links, server, pool)

    asyncio.run(main())


async def _accept_isr(vhost: str, members: list[str]) -> bool:
    return True


async def _seed(config: Config, vhosts: tuple[str, ...]) -> None:
    """The node's data dir as replication left it: ``vhosts``, guest allowed in each."""
    seed = Node(config)
    await seed.start()
    assert seed.mgmt is not None and seed.broker is not None
    for vhost in vhosts:
        seed.mgmt.create_vhost(vhost)
        seed.broker.users.set_permissions("guest", vhost, ".*", ".*", ".*")
    await seed.shutdown()
    seed.release_lock()


async def _stop(links: list[asyncio.Future[None]], server: ShardServer, pool: ThreadPoolExecutor) -> None:
    for link in links:
        link.cancel()
    await asyncio.gather(*links, return_exceptions=True)
    await server.stop()
    pool.shutdown(wait=True)


def test_a_shard_whose_term_is_lost_stops_confirming_alone_the_others_go_on(tmp_path: Path) -> None:
    """A server holding two shards loses its term of one (resigned to the returning node) and
    a follower leaves: the ISR write for the lost shard is refused. On main that fenced the
    whole sink: the other shard's confirms stopped and no follower could connect until the
    node restarted. Now the lost shard's publishes are nacked (never confirmed) and the other
    shard confirms on, after them (the syncer is not wedged)."""
    data, f_dir = tmp_path / "b", tmp_path / "f"
    config = load_config(["--data-dir", str(data), "--no-mgmt"], environ=listener_ports_env())
    lost: set[str] = set()

    async def write_isr(vhost: str, members: list[str]) -> bool:
        return vhost not in lost  # False: the key is fenced on a term we no longer hold

    async def main() -> None:
        await _seed(config, ("v", "w"))
        server = ShardServer(config, NodeHost(config), "B", SECRET, ClusterView("B", "tcp://127.0.0.1:1"),
                             write_isr, lambda: True)
        _, port = await server.start("127.0.0.1", 0)
        pool = ThreadPoolExecutor(1)
        links: list[asyncio.Future[None]] = []

        def follow(into: Path, me: str, shards: set[str], synced: list[bool]) -> asyncio.Future[None]:
            links.append(asyncio.ensure_future(follower.follow(
                "127.0.0.1", port, into, SECRET, me, lambda w: None, lambda: synced.append(True), pool,
                scope=Scope(shared=False, shards=frozenset(shard_name(s) for s in shards)))))
            return links[-1]

        try:
            assert await server.open("v") and await server.open("w")
            f_synced: list[bool] = []
            f_link = follow(f_dir, "F", {"v", "w"}, f_synced)
            await _until("F in the ISR", lambda: server.sink.isr == {"F"})
            host, amqp_port = server.node.client_addresses()["amqp"]
            conns = [await aio_pika.connect(f"amqp://guest:guest@{host}:{amqp_port}/{v}", timeout=5)
                     for v in ("v", "w")]
            chans = [await c.channel(publisher_confirms=True) for c in conns]
            for ch in chans:
                await ch.declare_queue("q", durable=True)
            lost.add("w")  # the election resigned it: the runner's next pass closes it
            f_link.cancel()  # F leaves: its removal from the ISR is written per shard
            await asyncio.gather(f_link, return_exceptions=True)
            await _until("F out of the ISR", lambda: not server.sink.isr)
            assert not server.sink.fenced
            with pytest.raises(DeliveryError):  # w is nacked, never confirmed (closed by the next pass)
                await asyncio.wait_for(chans[1].default_exchange.publish(
                    aio_pika.Message(b"w-after", delivery_mode=2), "q"), 5)
            await asyncio.wait_for(chans[0].default_exchange.publish(
                aio_pika.Message(b"v-after", delivery_mode=2), "q"), 5)  # v confirms on, after it
            g_synced: list[bool] = []
            follow(tmp_path / "g", "G", {"v"}, g_synced)  # a follower of v still connects
            await _until("G in the ISR", lambda: server.sink.isr == {"G"})
            for c in conns:
                await c.close()
        finally:
            await _stop(links, server, pool)

    asyncio.run(main())


def test_a_closed_shard_is_replicated_read_only_until_it_is_handed_over(tmp_path: Path) -> None:
    """Issue 27's hand-back: a server closes a shard its holder does not fully hold yet, and
    releases it only once the holder holds its last action. The holder must be able to follow
    it from here meanwhile: on main a follower naming a shard we closed was refused (its index
    entries forgotten at the close), so the holder never caught up and the release never came.
    Now the closed shard is sent, read-only, as it was at the close (every confirmed message),
    and takes no write, until the runner says it was handed over (``handed``); from then on a
    follower naming it is refused again."""
    data, f_dir = tmp_path / "b", tmp_path / "f"
    config = load_config(["--data-dir", str(data), "--no-mgmt"], environ=listener_ports_env())

    async def main() -> None:
        await _seed(config, ("v",))
        server = ShardServer(config, NodeHost(config), "B", SECRET, ClusterView("B", "tcp://127.0.0.1:1"),
                             _accept_isr, lambda: True)
        _, port = await server.start("127.0.0.1", 0)
        pool = ThreadPoolExecutor(1)
        links: list[asyncio.Future[None]] = []

        def follow(into: Path, me: str, synced: list[bool]) -> asyncio.Future[None]:
            links.append(asyncio.ensure_future(follower.follow(
                "127.0.0.1", port, into, SECRET, me, lambda w: None, lambda: synced.append(True), pool,
                scope=Scope(shared=False, shards=frozenset({shard_name("v")})))))
            return links[-1]

        try:
            assert await server.open("v")
            host, amqp_port = server.node.client_addresses()["amqp"]
            url = f"amqp://guest:guest@{host}:{amqp_port}/v"
            await _publish(url, "q", [b"confirmed-%03d" % i for i in range(N)])  # no follower: ISR is us
            await server.close("v", "the shard moved to another node")
            with pytest.raises((AMQPError, ConnectionError, TimeoutError)):  # the closed copy takes no write
                await _publish(url, "q", [b"after-close"])
            synced: list[bool] = []
            link = follow(f_dir, "F", synced)  # the holder, behind on it: follows it from here
            await _until("the holder synced the closed shard", lambda: bool(synced) or link.done())
            assert not link.done(), link.exception()
            await _until("the holder holds every confirmed message",
                         lambda: all(_held(f_dir, "v", b"confirmed-%03d" % i) for i in range(N)))
            assert not _held(data, "v", b"after-close")
            await _until("F acked the closed shard's last action: its release may go to F",
                         lambda: "F" in server.sink.shard_replicas(shard_name("v")))
            server.handed("v")  # released and marked elsewhere: its next server's stream writes it
            g_synced: list[bool] = []
            refused = follow(tmp_path / "g", "G", g_synced)
            await _until("a follower of a shard handed over refused", refused.done)
            assert not g_synced
        finally:
            await _stop(links, server, pool)

    asyncio.run(main())
