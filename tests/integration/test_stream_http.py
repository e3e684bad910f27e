"""Stream queues through the management API on a real broker: HTTP reads by offset,
retention set by an HTTP policy, and age retention on an idle stream."""

from __future__ import annotations

import base64
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pika
import pytest

from ._support import SkredProcess, connect, is_external, unique, wait_until
from .test_mgmt_api import Api, start_mgmt_broker

pytestmark = pytest.mark.skipif(is_external(), reason="needs Skred's management API on a known port")

SEG = {"x-queue-type": "stream", "x-stream-max-segment-size-bytes": 512}


def _call(b: SkredProcess, method: str, path: str, body: Any = None,
          auth: tuple[str, str] | None = ("guest", "guest")) -> tuple[int, Any]:
    api = Api(b.mgmt_port, *auth) if auth is not None else Api(b.mgmt_port)
    status, parsed, _headers = api.call(method, path, body, auth=auth is not None)
    return status, parsed


@pytest.fixture(scope="module")
def mb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SkredProcess]:
    b = start_mgmt_broker(tmp_path_factory.mktemp("stream-http"))
    try:
        yield b
    finally:
        b.close()


def _messages(b: SkredProcess, q: str, **params: Any) -> dict[str, Any]:
    status, body = _call(b, "GET", f"/api/streams/%2F/{urllib.parse.quote(q, safe='')}/messages?"
                         + urllib.parse.urlencode(params))
    assert status == 200, body
    assert isinstance(body, dict)
    return body


def _count(conn: pika.BlockingConnection, q: str) -> int:
    return int(conn.channel().queue_declare(q, passive=True).method.message_count)


def test_http_read_by_offset(mb: SkredProcess) -> None:
    q = unique("shttp")
    conn = connect(mb)
    try:
        ch = conn.channel()
        ch.queue_declare(q, durable=True, arguments=SEG)
        ch.confirm_delivery()
        for i in range(40):
            body = b"\xff\xfe%d" % i if i == 7 else b"msg-%d" % i
            ch.basic_publish("", q, body, pika.BasicProperties(
                content_type="text/plain", delivery_mode=2, headers={"n": i}, message_id=f"id{i}"))
        page = _messages(mb, q, offset=10, count=5)
        assert page["first_offset"] == 0 and page["next_offset"] == 40
        msgs = page["messages"]
        assert [m["offset"] for m in msgs] == [10, 11, 12, 13, 14]
        m = msgs[0]
        assert m["payload"] == "msg-10" and m["payload_encoding"] == "string"
        assert m["exchange"] == "" and m["routing_key"] == q
        assert m["properties"]["content_type"] == "text/plain"
        assert m["properties"]["headers"] == {"n": 10} and m["properties"]["message_id"] == "id10"
        assert isinstance(m["timestamp"], int) and m["timestamp"] > 1_600_000_000_000
        # paging continues from the last offset + 1, across segments
        nxt = _messages(mb, q, offset=msgs[-1]["offset"] + 1, count=100)["messages"]
        assert [x["offset"] for x in nxt] == list(range(15, 40))
        # binary payloads come back as base64; encoding=base64 forces it
        (bin_msg,) = _messages(mb, q, offset=7, count=1)["messages"]
        assert bin_msg["payload_encoding"] == "base64"
        assert base64.b64decode(bin_msg["payload"]) == b"\xff\xfe7"
        (b64,) = _messages(mb, q, offset=3, count=1, encoding="base64")["messages"]
        assert base64.b64decode(b64["payload"]) == b"msg-3"
        assert [x["offset"] for x in _messages(mb, q, offset="last")["messages"]] == [39]
        assert _messages(mb, q, offset="next")["messages"] == []
        ts = nxt[5]["timestamp"]
        assert _messages(mb, q, timestamp=ts, count=1)["messages"][0]["timestamp"] >= ts
        assert _messages(mb, q, offset=3, count=1, truncate=2)["messages"][0]["payload"] == "ms"
        # reading consumed nothing
        assert _count(conn, q) == 40
        # errors
        assert _call(mb, "GET", "/api/streams/%2F/no-such-queue/messages")[0] == 404
        assert _call(mb, "GET", f"/api/streams/%2F/{q}/messages?count=0")[0] == 400
        assert _call(mb, "GET", f"/api/streams/%2F/{q}/messages?offset=abc")[0] == 400
        assert _call(mb, "GET", f"/api/streams/%2F/{q}/messages", auth=None)[0] == 401
        classic = unique("classic")
        ch.queue_declare(classic, durable=False, auto_delete=True)
        assert _call(mb, "GET", f"/api/streams/%2F/{classic}/messages")[0] == 400
        # a management user without read permission on the queue is refused
        user = unique("u").replace(".", "-")
        made = _call(mb, "PUT", f"/api/users/{user}", {"password": "pw", "tags": "management"})
        assert made[0] in (201, 204)
        assert _call(mb, "PUT", f"/api/permissions/%2F/{user}",
                     {"configure": "", "write": "", "read": "^nothing$"})[0] in (201, 204)
        assert _call(mb, "GET", f"/api/streams/%2F/{q}/messages", auth=(user, "pw"))[0] == 401
        assert _call(mb, "PUT", f"/api/permissions/%2F/{user}",
                     {"configure": "", "write": "", "read": ".*"})[0] in (201, 204)
        assert _call(mb, "GET", f"/api/streams/%2F/{q}/messages?count=2",
                     auth=(user, "pw"))[0] == 200
        _call(mb, "DELETE", f"/api/users/{user}")
        ch.queue_delete(q)
    finally:
        conn.close()


def test_policy_retention_over_http(mb: SkredProcess) -> None:
    q = unique("spol")
    conn = connect(mb)
    try:
        ch = conn.channel()
        ch.queue_declare(q, durable=True, arguments=SEG)
        ch.confirm_delivery()
        for i in range(300):
            ch.basic_publish("", q, b"payload-%04d" % i, pika.BasicProperties(delivery_mode=2))
        assert _count(conn, q) == 300
        pattern = "^" + q.replace(".", r"\.") + "$"
        status, body = _call(mb, "PUT", f"/api/policies/%2F/{q}-cap",
                             {"pattern": pattern, "definition": {"max-length": 50}, "apply-to": "streams"})
        assert status in (201, 204), body
        left = _count(conn, q)
        assert 0 < left <= 50
        assert _messages(mb, q, count=1)["first_offset"] == 300 - left
        status, _ = _call(mb, "PUT", f"/api/policies/%2F/{q}-bad",
                          {"pattern": pattern, "definition": {"max-age": "soon"}})
        assert status == 400
        assert _call(mb, "DELETE", f"/api/policies/%2F/{q}-cap")[0] in (200, 204)
        for i in range(300):
            ch.basic_publish("", q, b"payload-%04d" % i, pika.BasicProperties(delivery_mode=2))
        assert _count(conn, q) == left + 300  # no limit any more
        ch.queue_delete(q)
    finally:
        conn.close()


def test_idle_stream_age_retention(mb: SkredProcess) -> None:
    q = unique("sage")
    conn = connect(mb)
    try:
        ch = conn.channel()
        ch.queue_declare(q, durable=True, arguments={**SEG, "x-max-age": "3s"})
        ch.confirm_delivery()
        for i in range(200):  # well under 3 s: nothing is old enough to go while publishing
            ch.basic_publish("", q, b"payload-%04d" % i, pika.BasicProperties(delivery_mode=2))
        assert _count(conn, q) == 200
        # No more publishes: only the retention timer can shrink the stream now.
        wait_until(lambda: _count(conn, q) < 50, 20, "age retention on an idle stream")
        assert _messages(mb, q, count=1)["first_offset"] > 150
        ch.queue_delete(q)
    finally:
        conn.close()
