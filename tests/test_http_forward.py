"""The cluster leader's forwarded management request, sans-IO (``broker/http/forward.py``): the
request as it goes to the node serving the vhost, and that node's answer as the client gets it."""

from __future__ import annotations

import http.client
import warnings
from typing import Any

import pytest

from broker.http.forward import parse_answer, request_bytes


def test_the_request_goes_as_it_came_and_closes_its_connection() -> None:
    raw = request_bytes("PUT", "/api/queues/shard3/q?x=1", {"Authorization": "Basic Zzpn"},
                        b'{"durable":true}')
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "PUT /api/queues/shard3/q?x=1 HTTP/1.1"
    assert {"Connection: close", "Content-Length: 16", "Authorization: Basic Zzpn"} <= set(lines)
    assert body == b'{"durable":true}'


def test_an_answer_keeps_its_status_body_and_the_headers_a_client_needs() -> None:
    got = parse_answer(b"HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\n"
                       b"WWW-Authenticate: Basic realm=\"RabbitMQ Management\"\r\nServer: x\r\n"
                       b"Content-Length: 2\r\n\r\n{}")
    assert got.status == 401 and got.body == b"{}"
    assert got.headers["WWW-Authenticate"] == 'Basic realm="RabbitMQ Management"'
    assert "Server" not in got.headers


def test_a_busy_answer_keeps_its_retry_after_across_nodes_as_across_workers() -> None:
    """A 503 with Retry-After (the records budget is busy) reaches the client with its pause
    whether a worker (``shards/fanout.py``) or a node (``http/forward.py``) passed it on: one list
    of the answer's headers passed on, and the same list of the request's."""
    from broker.http import common, forward
    from broker.shards import fanout

    got = parse_answer(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                       b"retry-after: 1\r\nContent-Length: 2\r\n\r\n{}")
    assert got.status == 503 and got.headers["Retry-After"] == "1"
    answer = [("Content-Type", "application/json"), ("Retry-After", "1"), ("Location", "/x"),
              ("WWW-Authenticate", "Basic"), ("Server", "x"), ("Set-Cookie", "a=b")]
    assert common.passed_back(answer) == {"Content-Type": "application/json", "Retry-After": "1",
                                          "Location": "/x", "WWW-Authenticate": "Basic"}
    for hop in (forward, fanout):  # both hops use the one pair of lists, no copy of their own
        assert hop.PASSED_ON is common.PASSED_ON and hop.passed_back is common.passed_back
        assert not {"KEPT", "_KEPT", "PASSED", "_PASSED"} & set(vars(hop))


def test_a_chunked_answer_is_read_whole() -> None:
    got = parse_answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
                       b"Content-Type: application/json\r\n\r\n"
                       b"3\r\n[1,\r\n2\r\n2]\r\n0\r\n\r\n")
    assert got.status == 200 and got.body == b"[1,2]"


def test_a_cut_or_garbled_answer_raises_for_a_503() -> None:
    with pytest.raises(http.client.HTTPException):
        parse_answer(b"")
    with pytest.raises(http.client.HTTPException):
        parse_answer(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort")


def _cut_after_request(method: str) -> int:
    """A request forwarded over a real loopback connection to a "serving node" that reads the
    request and closes without answering: the status the client gets."""
    import asyncio

    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from broker.http.forward import Streams, VhostForward

    async def run() -> int:
        got: list[bytes] = []

        async def serving_node(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            got.append(await reader.read(64 * 1024))  # it has the request: it may have applied it
            writer.close()

        node = await asyncio.start_server(serving_node, "127.0.0.1", 0)
        port = node.sockets[0].getsockname()[1]

        async def open_to(vhost: str, peer: tuple[str, int]) -> Streams:
            return await asyncio.open_connection("127.0.0.1", port)

        async def here(request: web.Request) -> web.Response:
            return web.json_response({"served": "here"})

        app = web.Application(middlewares=[VhostForward(open_to, None).middleware])
        app.router.add_route("*", "/api/queues/{vhost}/{name}", here)
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            answer = await client.request(method, "/api/queues/shard1/q", json={"durable": True})
            status = answer.status
        node.close()
        await node.wait_closed()
        assert got and got[0].startswith(method.encode())
        return status

    return asyncio.run(run())


def test_a_change_passed_on_whose_answer_failed_is_504_not_an_error_that_claims_it_did_not_happen() -> None:
    # 503 says the request did not happen; a PUT the serving node received may have happened
    assert _cut_after_request("PUT") == 504
    assert _cut_after_request("DELETE") == 504
    assert _cut_after_request("GET") == 503  # a read changed nothing


def test_every_member_is_listed_and_one_that_does_not_answer_is_not_running() -> None:
    # GET /api/nodes: each member's own answer over a real loopback connection; a member that
    # closes unanswered, or is gone from the live members since it answered, is listed
    # running: false (as RabbitMQ lists a stopped node), not dropped and not an error
    import asyncio
    import json

    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from broker.auth.users import User
    from broker.http.common import USER_KEY
    from broker.http.forward import Streams, VhostForward

    async def run() -> list[list[tuple[str, bool]]]:
        async def member_a(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(64 * 1024)
            body = json.dumps([{"name": "a@h", "running": True}]).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))
            writer.close()

        async def member_b(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(64 * 1024)
            writer.close()  # no answer: down

        servers = {n: await asyncio.start_server(f, "127.0.0.1", 0)
                   for n, f in (("a", member_a), ("b", member_b))}
        live = {"a", "b"}

        async def open_members(peer: tuple[str, int]) -> list[tuple[str, Streams]]:
            return [(n, await asyncio.open_connection("127.0.0.1", servers[n].sockets[0].getsockname()[1]))
                    for n in sorted(live)]

        async def nodes(request: web.Request) -> web.Response:
            return web.json_response([{"name": "me@h", "running": True}])

        async def unused(vhost: str, peer: tuple[str, int]) -> None:
            return None

        @web.middleware
        async def logged_in(request: web.Request, handler: Any) -> web.StreamResponse:  # as auth does
            with warnings.catch_warnings():  # the key is the broker's (a str, as auth_middleware sets it)
                warnings.simplefilter("ignore")
                request[USER_KEY] = User("mon", "", ("monitoring",))
            answer: web.StreamResponse = await handler(request)
            return answer

        forward = VhostForward(unused, None, None, open_members)
        app = web.Application(middlewares=[logged_in, forward.middleware])
        app.router.add_get("/api/nodes", nodes)
        seen = []
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            for gone in ((), ("a",)):
                live.difference_update(gone)
                answer = await client.get("/api/nodes?sort=name")
                assert answer.status == 200
                seen.append([(n["name"], n["running"]) for n in await answer.json()])
        for s in servers.values():
            s.close()
            await s.wait_closed()
        return seen

    first, after = asyncio.run(run())
    # sorted by name once joined; b never said its name: listed by its node id
    assert first == [("a@h", True), ("b", False), ("me@h", True)]
    assert after == [("a@h", False), ("b", False), ("me@h", True)]  # a gone: by the name it gave
