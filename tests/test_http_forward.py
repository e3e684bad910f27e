"""The cluster leader's forwarded management request, sans-IO (``broker/http/forward.py``): the
request as it goes to the node serving the vhost, and that node's answer as the client gets it."""

from __future__ import annotations

import http.client

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
