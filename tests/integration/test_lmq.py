"""LMQ's interfaces (HTTP on [lmq] http_port, MessagePack-RPC on rpc_port) on a real broker.

Theory of operation: each test talks to a real ``skred`` process over real sockets: aiohttp as
the HTTP client (keep-alive), ``aio-msgpack-rpc`` from PyPI as the MessagePack-RPC client, pika
for the AMQP side, and a UDP socket of the test as the StatsD server. The README session of the
LMQ seed is run literally first. Timeouts in these tests are LMQ's own (queue properties of a
fraction of a second), waited for by polling with a deadline. Most tests share the module's
broker (each names its own queues); those that kill it, read its node-wide default properties
or need options have their own.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp
import msgpack
import pika
import pytest

from ._support import Broker, connect, is_external, run_async

pytestmark = pytest.mark.skipif(is_external(), reason="LMQ's interfaces are Skred's own")


def base(b: Broker) -> str:
    return f"http://{b.host}:{b.lmq_http_port}"  # type: ignore[attr-defined]


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": aiohttp.encode_basic_auth(user, password)}


def session(user: str = "guest", password: str = "guest") -> aiohttp.ClientSession:
    """An HTTP client logged in as ``user`` (LMQ authenticates by default)."""
    return aiohttp.ClientSession(headers=basic(user, password))


async def rpc_client(b: Broker, user: str = "guest", password: str = "guest") -> Any:
    """A MessagePack-RPC client of ``b``'s LMQ, logged in."""
    import aio_msgpack_rpc

    reader, writer = await asyncio.open_connection(b.host, b.lmq_rpc_port)  # type: ignore[attr-defined]
    client = aio_msgpack_rpc.Client(reader, writer, response_timeout=10)
    assert await client.call("authenticate", user, password) == "ok"
    return client


def qname(prefix: str = "lmq") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def wait_until(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await pred()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_readme_session_put_get_ack_and_the_404_after_a_timeout(shared_broker: Broker) -> None:
    async def main() -> None:
        async with session() as http:
            # $ curl -i -XPOST localhost:9980/messages/myqueue -H 'content-type: text/plain' -d 'hello world!'
            r = await http.post(
                f"{base(shared_broker)}/messages/myqueue",
                data=b"hello world!",
                headers={"content-type": "text/plain"},
            )
            assert r.status == 200 and await r.json() == {"accum": "no"}
            assert r.headers["Content-Type"].startswith("application/json")
            # $ curl -i localhost:9980/messages/myqueue
            r = await http.get(f"{base(shared_broker)}/messages/myqueue")
            assert r.status == 200 and await r.read() == b"hello world!"
            assert r.headers["Content-Type"].startswith("text/plain")
            assert r.headers["x-lmq-queue-name"] == "myqueue"
            assert r.headers["x-lmq-message-type"] == "normal"
            msg_id = r.headers["x-lmq-message-id"]
            assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", msg_id)
            # $ curl -i -XPOST 'localhost:9980/messages/myqueue/<id>?reply=ack'
            r = await http.post(f"{base(shared_broker)}/messages/myqueue/{msg_id}?reply=ack")
            assert r.status == 204
            r = await http.post(f"{base(shared_broker)}/messages/myqueue/{msg_id}?reply=ack")
            assert r.status == 404  # settled: the id is gone
            r = await http.get(f"{base(shared_broker)}/messages/myqueue?t=0")
            assert r.status == 204  # empty

            # Timeout and retry: a message not acked in time comes back with a NEW id; the old id 404s;
            # after `retry` redeliveries it is discarded.
            q = qname()
            r = await http.patch(f"{base(shared_broker)}/properties/{q}", json={"timeout": 0.3, "retry": 1})
            assert r.status == 204
            await http.post(f"{base(shared_broker)}/messages/{q}", data=b"job")
            r = await http.get(f"{base(shared_broker)}/messages/{q}?t=5")
            first = r.headers["x-lmq-message-id"]
            assert r.headers["x-lmq-retry-remaining"] == "1"
            r = await http.get(f"{base(shared_broker)}/messages/{q}?t=5")  # redelivered after 0.3 s
            assert r.status == 200 and await r.read() == b"job"
            second = r.headers["x-lmq-message-id"]
            assert second != first
            assert r.headers["x-lmq-retry-remaining"] == "0"
            assert (await http.post(f"{base(shared_broker)}/messages/{q}/{first}?reply=ack")).status == 404
            r = await http.get(f"{base(shared_broker)}/messages/{q}?t=1")  # retry 1 used up: discarded
            assert r.status == 204

            # nack returns it at once (a retry); ext resets the timeout.
            q = qname()
            await http.patch(f"{base(shared_broker)}/properties/{q}", json={"timeout": 0.5, "retry": 3})
            await http.post(f"{base(shared_broker)}/messages/{q}", data=b"again")
            r = await http.get(f"{base(shared_broker)}/messages/{q}?t=5")
            mid = r.headers["x-lmq-message-id"]
            assert (await http.post(f"{base(shared_broker)}/messages/{q}/{mid}?reply=nack")).status == 204
            r = await http.get(f"{base(shared_broker)}/messages/{q}?t=0")
            assert r.status == 200 and r.headers["x-lmq-retry-remaining"] == "2"
            mid = r.headers["x-lmq-message-id"]
            for _ in range(4):  # keep extending past the 0.5 s timeout: it must not come back
                await asyncio.sleep(0.25)
                assert (await http.post(f"{base(shared_broker)}/messages/{q}/{mid}?reply=ext")).status == 204
            assert (await http.get(f"{base(shared_broker)}/messages/{q}?t=0")).status == 204
            assert (await http.post(f"{base(shared_broker)}/messages/{q}/{mid}?reply=ack")).status == 204
            assert (await http.post(f"{base(shared_broker)}/messages/{q}/{mid}?reply=bogus")).status == 400

    run_async(main())


def test_properties_precedence_and_defaults(broker: Broker) -> None:
    async def main() -> None:
        async with session() as http:
            u = base(broker)
            assert await (await http.get(f"{u}/properties")).json() == []
            assert (await http.patch(f"{u}/properties/foo", json={"accum": 15})).status == 204
            assert (await http.put(f"{u}/properties", json=[[".*", {"timeout": 60}]])).status == 204
            # The README's example: queue props > first matching default > system default.
            assert await (await http.get(f"{u}/properties/foo")).json() == {
                "accum": 15,
                "retry": 2,
                "timeout": 60,
            }
            assert await (await http.get(f"{u}/properties")).json() == [[".*", {"timeout": 60.0}]]
            await http.put(f"{u}/properties", json=[["^b", {"retry": 5}], [".*", {"retry": 9}]])
            assert (await (await http.get(f"{u}/properties/bar")).json())["retry"] == 5  # first match wins
            assert (await (await http.get(f"{u}/properties/zed")).json())["retry"] == 9
            assert (await http.delete(f"{u}/properties/foo")).status == 204
            assert await (await http.get(f"{u}/properties/foo")).json() == {
                "accum": 0,
                "retry": 9,
                "timeout": 30,
            }
            assert (await http.delete(f"{u}/properties")).status == 204
            assert await (await http.get(f"{u}/properties")).json() == []
            for bad in ({"accum": "x"}, {"nope": 1}, {"retry": -1}, [1]):
                r = await http.patch(f"{u}/properties/foo", json=bad)
                assert r.status == 400, bad
            r = await http.put(f"{u}/properties", json=[["(", {}]])
            assert r.status == 400
            r = await http.put(f"{u}/properties", data=b"{not json")
            assert r.status == 400

    run_async(main())


def test_changed_properties_apply_to_messages_put_after_the_change(shared_broker: Broker) -> None:
    async def main() -> None:
        async with session() as http:
            u, q = base(shared_broker), qname()
            await http.patch(f"{u}/properties/{q}", json={"retry": 0})
            await http.post(f"{u}/messages/{q}", data=b"old")
            await http.patch(f"{u}/properties/{q}", json={"retry": 4})
            await http.post(f"{u}/messages/{q}", data=b"new")
            r1 = await http.get(f"{u}/messages/{q}?t=0")
            r2 = await http.get(f"{u}/messages/{q}?t=0")
            assert await r1.read() == b"old" and r1.headers["x-lmq-retry-remaining"] == "0"
            assert await r2.read() == b"new" and r2.headers["x-lmq-retry-remaining"] == "4"

    run_async(main())


def test_long_poll_waits_for_a_put(shared_broker: Broker) -> None:
    async def main() -> None:
        async with session() as http:
            u, q = base(shared_broker), qname()
            getter = asyncio.ensure_future(http.get(f"{u}/messages/{q}?t=20"))
            await asyncio.sleep(0.3)
            assert not getter.done()
            await http.post(f"{u}/messages/{q}", data=b"late", headers={"content-type": "text/x-late"})
            r = await asyncio.wait_for(getter, 10)
            assert r.status == 200 and await r.read() == b"late"
            assert r.headers["Content-Type"].startswith("text/x-late")
            t0 = time.monotonic()
            r = await http.get(f"{u}/messages/{q}?t=0.5")
            assert r.status == 204 and time.monotonic() - t0 >= 0.45
            assert (await http.get(f"{u}/messages/{q}?t=abc")).status == 400
            assert (await http.get(f"{u}/messages/{q}?cf=xml&t=0")).status == 400

    run_async(main())


def test_compound_messages_in_both_formats(shared_broker: Broker) -> None:
    async def main() -> None:
        async with session() as http:
            u, q = base(shared_broker), qname()
            await http.patch(f"{u}/properties/{q}", json={"accum": 0.5})
            flags = []
            for i, ct in enumerate(["text/plain", "application/json", "text/plain"]):
                r = await http.post(
                    f"{u}/messages/{q}", data=f"part{i}".encode(), headers={"content-type": ct}
                )
                flags.append((await r.json())["accum"])
            assert flags == ["new", "yes", "yes"]
            assert (await http.get(f"{u}/messages/{q}?t=0")).status == 204  # not before the window ends
            r = await http.get(f"{u}/messages/{q}?t=5")
            assert r.status == 200 and r.headers["x-lmq-message-type"] == "compound"
            mid = r.headers["x-lmq-message-id"]
            assert r.headers["Content-Type"] == f"multipart/mixed; boundary={mid}"
            body = await r.read()
            assert (
                body
                == "".join(
                    f"\r\n--{mid}\r\ncontent-type: {ct}\r\ncontent-transfer-encoding: binary\r\n\r\n{part}"
                    for ct, part in [
                        ("text/plain", "part0"),
                        ("application/json", "part1"),
                        ("text/plain", "part2"),
                    ]
                ).encode()
                + f"\r\n--{mid}--\r\n".encode()
            )
            # nack it: the compound message comes back as one, now asked for as msgpack.
            assert (await http.post(f"{u}/messages/{q}/{mid}?reply=nack")).status == 204
            r = await http.get(f"{u}/messages/{q}?t=5&cf=msgpack")
            assert r.headers["Content-Type"] == "application/x-msgpack"
            assert msgpack.unpackb(await r.read(), raw=False) == [
                [{"content-type": "text/plain"}, b"part0"],
                [{"content-type": "application/json"}, b"part1"],
                [{"content-type": "text/plain"}, b"part2"],
            ]
            assert (
                await http.post(f"{u}/messages/{q}/{r.headers['x-lmq-message-id']}?reply=ack")
            ).status == 204
            assert (await http.get(f"{u}/messages/{q}?t=0")).status == 204

    run_async(main())


def test_regex_fan_out_and_pull_any(shared_broker: Broker) -> None:
    async def main() -> None:
        async with session() as http:
            u, tag = base(shared_broker), uuid.uuid4().hex[:6]
            names = [f"fan-{tag}-a", f"fan-{tag}-b", f"other-{tag}"]
            for n in names:
                await http.patch(f"{u}/properties/{n}", json={})  # creates the queue
            r = await http.post(f"{u}/messages?qre=^fan-{tag}-", data=b"everyone")
            assert r.status == 200 and await r.json() == {
                names[0]: {"accum": "no"},
                names[1]: {"accum": "no"},
            }
            got = set()
            for _ in range(2):
                r = await http.get(f"{u}/messages?qre=^fan-{tag}-&t=1")
                assert r.status == 200 and await r.read() == b"everyone"
                got.add(r.headers["x-lmq-queue-name"])
            assert got == {names[0], names[1]}
            assert (await http.get(f"{u}/messages?qre=^fan-{tag}-&t=0")).status == 204
            assert (await http.get(f"{u}/messages/{names[2]}?t=0")).status == 204  # not matched, not put
            assert (await http.post(f"{u}/messages?qre=(", data=b"x")).status == 400
            assert (await http.get(f"{u}/messages")).status == 400
            assert (await http.delete(f"{u}/queues/{names[2]}")).status == 204

    run_async(main())


def test_amqp_and_http_interoperate(shared_broker: Broker) -> None:
    q = qname()

    async def put_get() -> None:
        async with session() as http:
            r = await http.post(f"{base(shared_broker)}/messages/{q}", data=b"from http",
                                headers={"content-type": "text/plain"})
            assert r.status == 200

    run_async(put_get())
    conn = connect(shared_broker)
    try:
        ch = conn.channel()
        method, props, body = ch.basic_get(q, auto_ack=True)
        assert body == b"from http" and props.content_type == "text/plain" and props.delivery_mode == 2
        ch.basic_publish("", q, b"from amqp", pika.BasicProperties(content_type="application/x-amqp"))
    finally:
        conn.close()

    async def take() -> None:
        async with session() as http:
            r = await http.get(f"{base(shared_broker)}/messages/{q}?t=5")
            assert r.status == 200 and await r.read() == b"from amqp"
            assert r.headers["Content-Type"].startswith("application/x-amqp")
            ack = f"{base(shared_broker)}/messages/{q}/{r.headers['x-lmq-message-id']}?reply=ack"
            assert (await http.post(ack)).status == 204

    run_async(take())


def test_messagepack_rpc_client(shared_broker: Broker) -> None:
    aio_msgpack_rpc = pytest.importorskip("aio_msgpack_rpc")

    async def main() -> None:
        client = await rpc_client(shared_broker)
        try:
            q = qname("rpc")
            assert await client.call("update_props", q, {"timeout": 0.4, "retry": 1}) == "ok"
            assert await client.call("push", q, {"job": 1, "data": [1, 2, 3]}) == "ok"
            got = await client.call("pull", q, 2)
            assert (
                got["queue"] == q
                and got["type"] == "normal"
                and got["content"] == {"job": 1, "data": [1, 2, 3]}
            )
            assert await client.call("retain", q, got["id"]) == "ok"
            assert await client.call("release", q, got["id"]) == "ok"  # back at once, a retry
            again = await client.call("pull", q, 2)
            assert again["content"] == {"job": 1, "data": [1, 2, 3]} and again["id"] != got["id"]
            assert await client.call("done", q, again["id"]) == "ok"
            assert await client.call("pull", q, 0.2) == "empty"
            with pytest.raises(aio_msgpack_rpc.error.RPCResponseError):
                await client.call("done", q, again["id"])  # settled: gone
            with pytest.raises(aio_msgpack_rpc.error.RPCResponseError):
                await client.call("no_such_method")
            # push_all / pull_any, default props with LMQ-RPC's older name 'pack' for accum.
            tag = uuid.uuid4().hex[:6]
            assert await client.call("update_props", f"all-{tag}-1") == "ok"
            assert await client.call("update_props", f"all-{tag}-2") == "ok"
            assert await client.call("push_all", f"^all-{tag}-", "hi") == "ok"
            a = await client.call("pull_any", f"^all-{tag}-", 1)
            b = await client.call("pull_any", f"^all-{tag}-", 1)
            assert {a["queue"], b["queue"]} == {f"all-{tag}-1", f"all-{tag}-2"} and a["content"] == "hi"
            assert await client.call("set_default_props", [[f"^pk-{tag}", {"pack": 0.3}]]) == "ok"
            assert await client.call("get_default_props") == [[f"^pk-{tag}", {"pack": 0.3}]]
            pk = f"pk-{tag}"
            await client.call("push", pk, "one")
            await client.call("push", pk, "two")
            package = await client.call("pull", pk, 5)
            assert package["type"] == "package" and package["content"] == ["one", "two"]
            assert await client.call("delete", pk) == "ok"
        finally:
            client.close()

    run_async(main())


def test_statsd_receives_queue_lengths_and_counters(broker_factory: Callable[..., Broker]) -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    listener.bind(("127.0.0.1", 0))
    listener.settimeout(10)
    port = listener.getsockname()[1]
    b = broker_factory(
        ["--lmq-statsd-host", "127.0.0.1", "--lmq-statsd-port", str(port), "--lmq-stats-interval", "50"]
    )
    q = qname("stats")

    async def main() -> None:
        async with session() as http:
            for _ in range(3):
                await http.post(f"{base(b)}/messages/{q}", data=b"x")
            r = await http.get(f"{base(b)}/messages/{q}?t=1")
            await http.post(f"{base(b)}/messages/{q}/{r.headers['x-lmq-message-id']}?reply=ack")

    # Counters are per-interval increments: the three puts may fall into several intervals
    # (put:1, then put:2; a loaded machine did that at 1 s), so the counters are summed over
    # every packet; the gauge is the queue's length as last reported. The 50 ms interval makes
    # the split usual, not rare.
    want_counts = {f"lmq.{q}.put": 3, f"lmq.{q}.get": 1, f"lmq.{q}.ack": 1}
    counts = {name: 0 for name in want_counts}
    length: list[str] = []
    try:
        run_async(main())
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and (counts != want_counts or length[-1:] != ["2"]):
            for line in listener.recv(65536).decode().splitlines():
                name, _, rest = line.partition(":")
                value, _, kind = rest.partition("|")
                if kind == "c" and name in counts:
                    counts[name] += int(value)
                elif kind == "g" and name == f"lmq.{q}.length":
                    length.append(value)
        assert counts == want_counts and length[-1:] == ["2"], (counts, length)
    finally:
        listener.close()


def test_taken_but_not_acked_messages_survive_kill_9(broker: Broker) -> None:
    q = qname("durable")

    async def put_and_take() -> None:
        async with session() as http:
            for i in range(5):
                r = await http.post(f"{base(broker)}/messages/{q}", data=f"m{i}".encode())
                assert r.status == 200  # answered after the group commit
            for _ in range(3):
                assert (await http.get(f"{base(broker)}/messages/{q}?t=1")).status == 200  # taken, not acked

    run_async(put_and_take())
    broker.kill9()
    broker.start()

    async def drain() -> list[bytes]:
        out = []
        async with session() as http:
            while True:
                r = await http.get(f"{base(broker)}/messages/{q}?t=0")
                if r.status == 204:
                    return out
                out.append(await r.read())
                await http.post(f"{base(broker)}/messages/{q}/{r.headers['x-lmq-message-id']}?reply=ack")

    assert sorted(run_async(drain())) == [b"m0", b"m1", b"m2", b"m3", b"m4"]
    # ...and the queue is an ordinary durable queue: listed by the management API.
    conn = connect(broker)
    try:
        assert conn.channel().queue_declare(q, passive=True).method.message_count == 0
    finally:
        conn.close()


def test_bad_requests_get_clear_answers(shared_broker: Broker) -> None:
    async def main() -> None:
        async with session() as http:
            u = base(shared_broker)
            assert (await http.put(f"{u}/messages/x")).status == 405
            assert (await http.get(f"{u}/nope")).status == 404
            r = await http.post(f"{u}/messages/x/not-an-id?reply=ack")
            assert r.status == 404 and "error" in await r.json()
        # garbage on the RPC port: the connection closes, the broker stays up
        reader, writer = await asyncio.open_connection(shared_broker.host, shared_broker.lmq_rpc_port)  # type: ignore[attr-defined]
        writer.write(b"\xc1\xc1\xc1 not msgpack")
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        async with session() as http:
            assert (await http.get(f"{base(shared_broker)}/properties")).status == 200

    run_async(main())


def test_a_client_that_half_closes_gets_its_answer(shared_broker: Broker) -> None:
    """An HTTP/1.0 client that shuts down its sending side after the request (nc -N, some
    scripts) still gets the whole answer."""
    with socket.create_connection((shared_broker.host, shared_broker.lmq_http_port), timeout=10) as s:  # type: ignore[attr-defined]
        s.sendall(b"GET /properties HTTP/1.0\r\nHost: x\r\nAuthorization: Basic Z3Vlc3Q6Z3Vlc3Q=\r\n\r\n")
        s.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.") and b" 200 " in answer.split(b"\r\n", 1)[0], answer[:200]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1]) is not None  # the whole body


def test_authentication_is_on_by_default(broker_factory: Callable[..., Broker]) -> None:
    aio_msgpack_rpc = pytest.importorskip("aio_msgpack_rpc")
    b = broker_factory()

    async def main() -> None:
        async with aiohttp.ClientSession() as http:
            r = await http.post(f"{base(b)}/messages/secured", data=b"x")
            assert r.status == 401 and "WWW-Authenticate" in r.headers
            r = await http.post(
                f"{base(b)}/messages/secured", data=b"x", headers=basic("guest", "wrong")
            )
            assert r.status == 401
            r = await http.post(
                f"{base(b)}/messages/secured", data=b"x", headers=basic("guest", "guest")
            )
            assert r.status == 200
        reader, writer = await asyncio.open_connection(b.host, b.lmq_rpc_port)  # type: ignore[attr-defined]
        client = aio_msgpack_rpc.Client(reader, writer, response_timeout=10)
        try:
            with pytest.raises(aio_msgpack_rpc.error.RPCResponseError):
                await client.call("pull", "secured", 0)
            with pytest.raises(aio_msgpack_rpc.error.RPCResponseError):
                await client.call("authenticate", "guest", "wrong")
            assert await client.call("authenticate", "guest", "guest") == "ok"
            got = await client.call("pull", "secured", 1)
            assert got["content"] == b"x"
        finally:
            client.close()

    run_async(main())


def test_cluster_followers_proxy_lmq_to_the_leader(tmp_path: Any) -> None:
    from ._support import free_port
    from .test_cluster import Cluster, start_cluster

    cluster = Cluster(tmp_path)
    try:
        if len({n.ip for n in cluster.nodes}) < 3:
            pytest.skip("needs 127.0.0.2 and 127.0.0.3 (one LMQ port on three addresses)")
        http_port, rpc_port = free_port(), free_port()
        for n in cluster.nodes:
            n.argv += ["--lmq-bind", n.ip, "--lmq-http-port", str(http_port), "--lmq-rpc-port", str(rpc_port)]
        leader, followers = start_cluster(cluster)
        from .test_lmq_access import add_user

        add_user(leader, "nobody", "^$", "^$", "^$")  # through a follower, permissions apply too
        q = qname("clustered")

        async def main() -> None:
            async with aiohttp.ClientSession() as anon:
                r = await anon.post(f"http://{followers[0].ip}:{http_port}/messages/{q}", data=b"x")
                assert r.status == 401
            async with session("nobody", "pw") as http:
                r = await http.post(f"http://{followers[0].ip}:{http_port}/messages/{q}", data=b"x")
                assert r.status == 403
            async with session() as http:
                a, b = (f"http://{f.ip}:{http_port}" for f in followers)
                r = await http.post(f"{a}/messages/{q}", data=b"via a follower")
                assert r.status == 200 and await r.json() == {"accum": "no"}
                r = await http.get(f"{b}/messages/{q}?t=5")
                assert r.status == 200 and await r.read() == b"via a follower"
                r = await http.post(f"{a}/messages/{q}/{r.headers['x-lmq-message-id']}?reply=ack")
                assert r.status == 204

        run_async(main())
    finally:
        cluster.close()
