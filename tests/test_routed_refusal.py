"""A follower's routed AMQP port (``[clustering] shard_leaders``, ``cluster/proxy.py`` ``Routed``)
with no node to check logins: the client hears 320 after its ``connection.open``, as from a node
with no leader (``cluster/unavailable.py``), never right after ``start-ok``, where a close reads
as a failed login (pika: ``ProbableAuthenticationError``). A real proxy on a real socket, a real
client; no cluster is needed for "no leader yet"."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pika
import pytest

from broker.cluster import codec
from broker.cluster.proxy import Routed, SpliceProxy, Target, Tunnelled
from broker.cluster.vhost_route import Limits


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    nobody = Target()  # no leader known yet
    proxy = SpliceProxy("amqp", nobody, False, None,
                        tunnel=Tunnelled(codec.AMQP_PORT, lambda: b"s", lambda: None),
                        routed=Routed(Limits(2047, 131072, 60), {"product": "Skred"},
                                      serving=lambda vhost: nobody, login=lambda: nobody))
    try:
        yield asyncio.run_coroutine_threadsafe(proxy.start("127.0.0.1", 0), loop).result(10)
    finally:
        asyncio.run_coroutine_threadsafe(proxy.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_no_node_to_check_the_login_is_a_320_after_open_not_a_failed_login(port: int) -> None:
    params = pika.ConnectionParameters("127.0.0.1", port, connection_attempts=1, socket_timeout=5)
    with pytest.raises(pika.exceptions.AMQPConnectionError) as err:
        pika.BlockingConnection(params)
    assert not isinstance(err.value, pika.exceptions.ProbableAuthenticationError), repr(err.value)
    assert "320" in repr(err.value)
