"""A node serves the shards it leads (docs/architecture.md, "The per-shard data path", step 2):
its broker boots a shard's vhost from the directory replication wrote and closes one, fenced,
without deleting anything (``Node.open_shard`` / ``close_shard``), and a broker told which
shards it serves (``Node.serves``) loads only those. A real broker on real sockets and files,
real AMQP clients with publisher confirms; a real MQTT client (paho) and a real stream protocol
client (rstream) of a closed shard are disconnected too, and so is a MessagePack-RPC client of
LMQ (aio-msgpack-rpc); nothing they publish after is acknowledged."""

from __future__ import annotations

import asyncio
import contextlib
import queue
from pathlib import Path
from typing import Any

import aio_msgpack_rpc
import aio_pika
import aiohttp
import paho.mqtt.client as mqtt
import pytest
from aio_pika.exceptions import AMQPError
from rstream import AMQPMessage, Producer

from broker.config import load_config
from broker.node import Node
from broker.store.paths import vhost_dir
from tests.integration._support import listener_ports_env

N = 20
_GUEST = {"Authorization": aiohttp.BasicAuth("guest", "guest").encode()}


def _node(data: Path, env: dict[str, str]) -> Node:
    return Node(load_config(["--data-dir", str(data), "--no-mgmt"], environ=env))


async def _lmq_status(http: aiohttp.ClientSession, url: str) -> int:
    """LMQ's answer to guest's put at ``url``; 0: no answer (its port is closed)."""
    try:
        async with http.post(url, data=b"m", headers=_GUEST) as r:
            return r.status
    except aiohttp.ClientError:
        return 0


async def _connect(port: int, vhost: str) -> aio_pika.abc.AbstractRobustConnection:
    return await aio_pika.connect(f"amqp://guest:guest@127.0.0.1:{port}/{vhost}", timeout=5)


async def _publish(conn: aio_pika.abc.AbstractConnection, n: int) -> None:
    ch = await conn.channel(publisher_confirms=True)
    await ch.declare_queue("q", durable=True)
    for i in range(n):
        await ch.default_exchange.publish(aio_pika.Message(b"m%d" % i, delivery_mode=2), "q")
    await ch.close()


async def _count(port: int, vhost: str) -> int:
    conn = await _connect(port, vhost)
    try:
        ch = await conn.channel()
        q = await ch.declare_queue("q", durable=True, passive=True)
        count = q.declaration_result.message_count
        assert count is not None
        return count
    finally:
        await conn.close()


async def _closed(conn: aio_pika.abc.AbstractConnection) -> bool:
    """True once the broker closed ``conn`` (a channel no longer opens on it), within 5 s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while loop.time() < deadline:
        try:
            ch = await asyncio.wait_for(conn.channel(), 1)
        except (AMQPError, ConnectionError, RuntimeError):
            return True
        await ch.close()
        await asyncio.sleep(0.02)
    return False


def test_a_shard_closes_fenced_and_boots_again_from_its_files(tmp_path: Path) -> None:
    data = tmp_path / "data"
    env = listener_ports_env()
    port = int(env["SKRED_AMQP_PORT"])

    async def main() -> None:
        node = _node(data, env)
        await node.start()
        try:
            assert node.mgmt is not None
            assert node.broker is not None
            for vhost in ("a", "b"):
                node.mgmt.create_vhost(vhost)
                node.broker.users.set_permissions("guest", vhost, ".*", ".*", ".*")
            on_a, on_b = await _connect(port, "a"), await _connect(port, "b")
            await _publish(on_a, N)
            await _publish(on_b, N)

            assert await node.close_shard("a")
            assert not await node.close_shard("a")  # not served any more
            assert await _closed(on_a)  # its clients are told (320): nothing of it is confirmed after
            with pytest.raises((AMQPError, ConnectionError)):
                await _connect(port, "a")  # not served here
            assert vhost_dir(data, "a").is_dir()  # closed, not deleted
            await _publish(on_b, N)  # the other shard never noticed

            assert await node.open_shard("a")
            assert not await node.open_shard("a")  # served already
            assert not await node.open_shard("nope")  # not in the replicated list
            assert await _count(port, "a") == N  # booted from its files
            await on_b.close()
        finally:
            await node.shutdown()
            node.release_lock()

        # A broker told which shards it serves loads only those, and boots the others on demand.
        node = _node(data, env)
        node.serves = lambda vhost: vhost != "a"
        await node.start()
        try:
            assert node.broker is not None
            assert "a" not in node.broker.vhosts and "b" in node.broker.vhosts
            with pytest.raises(ValueError):
                node.make_vhost("a")  # another node serves it
            assert await _count(port, "b") == 2 * N
            node.serves = None
            assert await node.open_shard("a")
            assert await _count(port, "a") == N
        finally:
            await node.shutdown()
            node.release_lock()

    asyncio.run(main())


async def _within(what: str, ok: Any, seconds: float = 10) -> None:
    """Poll ``ok()`` until true, bounded by ``seconds``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not ok():
        if loop.time() > deadline:
            raise AssertionError(f"not within {seconds}s: {what}")
        await asyncio.sleep(0.02)


def test_a_closed_shard_disconnects_its_mqtt_and_stream_clients_and_acknowledges_nothing_after(
        tmp_path: Path) -> None:
    env = listener_ports_env()
    env["SKRED_LMQ_VHOST"] = "a"  # LMQ's listeners serve the shard too
    mqtt_port, stream_port = int(env["SKRED_MQTT_PORT"]), int(env["SKRED_STREAM_PORT"])
    lmq_put = f"http://127.0.0.1:{env['SKRED_LMQ_HTTP_PORT']}/messages/lq"
    rpc_port = int(env["SKRED_LMQ_RPC_PORT"])

    async def main() -> None:
        node = _node(tmp_path / "data", env)
        await node.start()
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="closeshard", protocol=mqtt.MQTTv5)
        closes: list[str] = []  # what the stream client heard of its connection's close
        producer = Producer("127.0.0.1", port=stream_port, vhost="a", username="guest", password="guest",
                            on_close_handler=lambda info: closes.append(info.reason))
        stack = contextlib.AsyncExitStack()
        try:
            assert node.mgmt is not None and node.broker is not None
            node.mgmt.create_vhost("b")  # LMQ made "a"
            for vhost in ("a", "b"):
                node.broker.users.set_permissions("guest", vhost, ".*", ".*", ".*")
            # MQTT 5 into vhost "a" (paho's own network thread)
            connected: queue.Queue[Any] = queue.Queue()
            gone: queue.Queue[Any] = queue.Queue()
            acked: queue.Queue[int] = queue.Queue()
            client.username_pw_set("a:guest", "guest")
            client.on_connect = lambda _c, _u, _f, rc, _p: connected.put(rc)
            client.on_disconnect = lambda _c, _u, _f, rc, _p: gone.put(rc)
            client.on_publish = lambda _c, _u, mid, _rc, _p: acked.put(mid)
            client.reconnect_delay_set(60, 60)  # no retry within the test: the next server is elsewhere
            client.connect("127.0.0.1", mqtt_port, keepalive=30)
            client.loop_start()
            await _within("MQTT CONNACK", lambda: not connected.empty())
            assert connected.get().value == 0
            before = client.publish("t", b"before", qos=1)
            await _within("PUBACK before the close", lambda: not acked.empty())
            assert acked.get() == before.mid
            # the stream protocol into vhost "a"
            await producer.start()
            await producer.create_stream("s")
            await producer.send_wait("s", AMQPMessage(body=b"before"))
            mqtt_front, stream_front = node.mqtt, node.stream
            assert mqtt_front is not None and stream_front is not None
            assert [c.vhost for c in mqtt_front.open_connections()] == ["a"]
            assert [c.vhost for c in stream_front.open_connections()] == ["a"]
            http = await stack.enter_async_context(
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)))
            assert await _lmq_status(http, lmq_put) == 200
            # LMQ's MessagePack-RPC into vhost "a", a connection open before the close
            rpc_reader, rpc_writer = await asyncio.open_connection("127.0.0.1", rpc_port)
            stack.callback(rpc_writer.close)
            rpc = aio_msgpack_rpc.Client(rpc_reader, rpc_writer, response_timeout=5)
            assert await rpc.call("authenticate", "guest", "guest") == "ok"
            assert await rpc.call("push", "rq", "before") == "ok"

            assert await node.close_shard("a")
            # both are closed by the broker (MQTT 5: DISCONNECT "use another server")
            await _within("the MQTT client of the closed shard disconnected", lambda: not gone.empty())
            assert gone.get().value == 0x9C
            await _within("the stream client told of its connection's close", lambda: bool(closes))
            assert not stream_front.open_connections()
            assert not mqtt_front.open_connections()
            # nothing published after the close is acknowledged
            after = client.publish("t", b"after", qos=1)
            with pytest.raises(Exception):  # noqa: PT011,B017 - rstream's own error classes, or no confirm
                await asyncio.wait_for(producer.send_wait("s", AMQPMessage(body=b"after")), 3)
            await asyncio.sleep(0.3)  # a late PUBACK would be on its way by now
            assert acked.empty() and after.rc == mqtt.MQTT_ERR_NO_CONN  # kept for its next server
            assert await _lmq_status(http, lmq_put) == 0  # LMQ's port closed with its vhost
            # the RPC connection open before the close is closed too: no answer backed by no store
            await _within("the LMQ RPC connection of the closed shard closed", rpc_reader.at_eof, 5)
            with pytest.raises((ConnectionError, TimeoutError, aio_msgpack_rpc.error.RPCResponseError)):
                await rpc.call("push", "rq", "after", timeout=2)
            assert await node.open_shard("a")
            assert await _lmq_status(http, lmq_put) == 200  # and open again where the shard is served
        finally:
            client.loop_stop()
            client.disconnect()
            try:
                await asyncio.wait_for(producer.close(), 5)
            except Exception:  # noqa: BLE001 - the broker closed it already
                pass
            await stack.aclose()
            await node.shutdown()
            node.release_lock()

    asyncio.run(main())


def test_a_broker_not_serving_lmqs_vhost_starts_and_opens_lmq_with_the_shard(tmp_path: Path) -> None:
    # a cluster leader elected while another node serves LMQ's vhost: its broker starts without
    # LMQ (on main LMQ's start took the vhost for a missing one and created it: "vhost 'a'
    # already exists", the broker failed to start, and the cluster stayed leaderless), and LMQ's
    # listeners open with the shard
    env = listener_ports_env()
    env["SKRED_LMQ_VHOST"] = "a"
    lmq_put = f"http://127.0.0.1:{env['SKRED_LMQ_HTTP_PORT']}/messages/lq"

    async def main() -> None:
        data = tmp_path / "data"
        node = _node(data, env)
        await node.start()  # creates "a" for LMQ
        await node.shutdown()
        node.release_lock()
        node = _node(data, env)
        node.serves = lambda vhost: vhost != "a"
        await node.start()
        try:
            assert node.broker is not None and "a" not in node.broker.vhosts
            async with aiohttp.ClientSession() as http:
                assert await _lmq_status(http, lmq_put) == 0  # not served here: LMQ's port closed
                node.serves = None
                assert await node.open_shard("a")
                assert await _lmq_status(http, lmq_put) != 0  # its port open with its shard (an HTTP answer)
        finally:
            await node.shutdown()
            node.release_lock()

    asyncio.run(main())
