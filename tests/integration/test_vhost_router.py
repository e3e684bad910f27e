"""AMQP routed by its vhost to the node that serves it (``broker/cluster/vhost_router.py``): the
routing half of the per-shard data path, over real sockets to two real broker processes.

One entry port; vhost ``route-a`` lives on one broker, ``route-b`` on the other. pika publishes
with confirms into both through the entry port and every message is in its owner's queue; the
owner authenticates (a wrong password is its 403, heard by the client); a vhost no node serves
is a 320; kill -9 of one owner stops only its vhost, which is served again, with every
confirmed message, once the owner is back.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest

from broker.amqp.broker import server_properties
from broker.cluster.vhost_route import Limits
from broker.cluster.vhost_router import Streams, VhostRouter

from ._support import SkredProcess, wait_until
from .test_workers import api

BATCH = 50


class Entry:
    """A router on its own event loop thread, routing by a vhost -> broker table."""

    def __init__(self, owners: dict[str, SkredProcess]) -> None:
        self.owners = owners
        self.loop = asyncio.new_event_loop()
        self.router = VhostRouter(Limits(2047, 131072, 60), server_properties(), self.leg)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self.router.start("127.0.0.1", 0), self.loop).result(10)

    async def leg(self, vhost: str, client: tuple[str, int]) -> Streams | None:
        owner = self.owners.get(vhost)
        if owner is None:
            return None
        try:
            return await asyncio.wait_for(asyncio.open_connection(owner.host, owner.port), 5)
        except OSError:
            return None

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.router.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Entry, dict[str, SkredProcess]]]:
    tmp: Path = tmp_path_factory.mktemp("vhost-router")
    owners = {"route-a": SkredProcess(tmp / "a"), "route-b": SkredProcess(tmp / "b")}
    entry = None
    try:
        for vhost, b in owners.items():
            b.start()
            api(b, "PUT", f"/api/vhosts/{vhost}")
            api(b, "PUT", f"/api/permissions/{vhost}/guest", {"configure": ".*", "write": ".*", "read": ".*"})
        entry = Entry(owners)
        yield entry, owners
    finally:
        if entry is not None:
            entry.close()
        for b in owners.values():
            b.close()


def through(entry: Entry, vhost: str, password: str = "guest") -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.ConnectionParameters(
        "127.0.0.1", entry.port, vhost, pika.PlainCredentials("guest", password), socket_timeout=5,
        blocked_connection_timeout=10, connection_attempts=1))


def publish(entry: Entry, vhost: str, queue: str, count: int) -> int:
    with through(entry, vhost) as conn:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare(queue, durable=True)
        for i in range(count):
            ch.basic_publish("", queue, f"{vhost}-{i}".encode(), pika.BasicProperties(delivery_mode=2),
                             mandatory=True)
    return count


def depth_at(b: SkredProcess, vhost: str, queue: str) -> int:
    with pika.BlockingConnection(pika.ConnectionParameters(b.host, b.port, vhost,
                                                           pika.PlainCredentials("guest", "guest"))) as conn:
        return int(conn.channel().queue_declare(queue, passive=True).method.message_count)


def test_one_port_reaches_each_vhost_on_its_own_node(setup: tuple[Entry, dict[str, SkredProcess]]) -> None:
    entry, owners = setup
    for vhost in owners:
        publish(entry, vhost, "routed", BATCH)
    for vhost, b in owners.items():
        assert depth_at(b, vhost, "routed") == BATCH
        other = next(o for v, o in owners.items() if v != vhost)
        status, _body = api(other, "GET", f"/api/vhosts/{vhost}")
        assert status == 404  # the data is on the owner only
    assert entry.router.routed >= 2


def test_the_owner_authenticates_and_an_unserved_vhost_is_refused(
        setup: tuple[Entry, dict[str, SkredProcess]]) -> None:
    entry, _owners = setup
    # the owner's 403 comes after open (the client had our tune), so pika files it as access denied
    with pytest.raises(pika.exceptions.ProbableAccessDeniedError) as denied:
        through(entry, "route-a", password="wrong")
    assert "403" in repr(denied.value) and "Login was refused" in repr(denied.value)
    with pytest.raises(pika.exceptions.AMQPConnectionError) as err:
        through(entry, "nowhere")
    assert "320" in repr(err.value) or "no node serves" in repr(err.value)


def test_kill9_of_one_owner_stops_only_its_vhost_and_loses_nothing_confirmed(
        setup: tuple[Entry, dict[str, SkredProcess]]) -> None:
    entry, owners = setup
    confirmed = {v: publish(entry, v, "killed", BATCH) for v in owners}
    owners["route-a"].kill9()
    confirmed["route-b"] += publish(entry, "route-b", "killed", BATCH)  # the other vhost serves on
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        through(entry, "route-a")  # its owner is down: told so, not hung
    owners["route-a"].start()

    def back() -> bool:
        try:
            through(entry, "route-a").close()
            return True
        except pika.exceptions.AMQPError:
            return False

    wait_until(back, 20, "route-a served through the entry port again")
    for vhost, b in owners.items():
        with through(entry, vhost) as conn:
            routed = conn.channel().queue_declare("killed", passive=True).method.message_count
        assert routed == confirmed[vhost]
        assert depth_at(b, vhost, "killed") == confirmed[vhost]
