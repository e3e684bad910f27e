"""Access refusals as RabbitMQ words them, and its rule for passive declares (real broker, pika).

RabbitMQ checks no permission on a passive ``queue.declare`` or ``exchange.declare``: any user
with access to the vhost learns whether the entity exists (and a queue's counts); only a queue
exclusive to another connection is refused (405). A refusal (403) names the kind of the entity
refused: a binding needs write on its destination (a queue for queue.bind, an exchange for
exchange.bind) and read on its source exchange.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

import pika
import pytest

from ._support import Broker, connect, is_external, unique
from .test_features_extra import http, wait_http

pytestmark = pytest.mark.skipif(is_external(), reason="needs Skred's management API")


def _refused(conn: pika.BlockingConnection, op: Any) -> tuple[int, str]:
    ch = conn.channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as ei:
        op(ch)
    return ei.value.reply_code, ei.value.reply_text


def test_refusal_texts_and_passive_declares(broker: Broker) -> None:
    wait_http(broker)
    user = unique("u")
    uq = urllib.parse.quote(user, safe="")
    assert http(broker, "PUT", f"/api/users/{uq}", {"password": "pw", "tags": ""})[0] in (201, 204)
    assert http(broker, "PUT", f"/api/permissions/%2F/{uq}",
                {"configure": "^mine\\.", "write": "^mine\\.", "read": "^mine\\."})[0] in (201, 204)
    other_q, other_x = "other.q." + user, "other.x." + user
    mine_q, mine_x = "mine.q." + user, "mine.x." + user

    admin = connect(broker)
    ach = admin.channel()
    ach.queue_declare(other_q)
    ach.exchange_declare(other_x, "direct")
    ach.basic_publish("", other_q, b"x")
    locked = ach.queue_declare("", exclusive=True).method.queue

    params = pika.ConnectionParameters("127.0.0.1", broker.port, "/", pika.PlainCredentials(user, "pw"),
                                       socket_timeout=5, connection_attempts=1)
    conn = pika.BlockingConnection(params)
    ch = conn.channel()
    ch.queue_declare(mine_q)
    ch.exchange_declare(mine_x, "direct")

    # RabbitMQ's rule: a passive declare checks existence (and exclusivity), not permissions.
    ok = ch.queue_declare(other_q, passive=True).method
    assert (ok.queue, ok.message_count, ok.consumer_count) == (other_q, 1, 0)
    ch.exchange_declare(other_x, passive=True)
    assert _refused(conn, lambda c: c.queue_declare("missing." + user, passive=True))[0] == 404
    assert _refused(conn, lambda c: c.queue_declare(locked, passive=True))[0] == 405

    expected = {
        "queue.declare": (lambda c: c.queue_declare("other.q2." + user), "queue", "other.q2." + user),
        "queue.delete": (lambda c: c.queue_delete(other_q), "queue", other_q),
        "queue.purge": (lambda c: c.queue_purge(other_q), "queue", other_q),
        "basic.get": (lambda c: c.basic_get(other_q), "queue", other_q),
        "exchange.declare": (lambda c: c.exchange_declare("other.x2." + user, "direct"), "exchange",
                             "other.x2." + user),
        "exchange.delete": (lambda c: c.exchange_delete(other_x), "exchange", other_x),
        # queue.bind: write on the destination queue, read on the source exchange
        "queue.bind to a foreign queue": (lambda c: c.queue_bind(other_q, mine_x, "k"), "queue", other_q),
        "queue.bind from a foreign exchange": (lambda c: c.queue_bind(mine_q, other_x, "k"), "exchange",
                                               other_x),
        "queue.unbind from a foreign exchange": (lambda c: c.queue_unbind(mine_q, other_x, "k"), "exchange",
                                                 other_x),
        # exchange.bind: write on the destination exchange, read on the source exchange
        "exchange.bind to a foreign exchange": (lambda c: c.exchange_bind(other_x, mine_x, "k"), "exchange",
                                                other_x),
        "exchange.bind from a foreign exchange": (lambda c: c.exchange_bind(mine_x, other_x, "k"),
                                                  "exchange", other_x),
    }
    for what, (op, kind, name) in expected.items():
        code, text = _refused(conn, op)
        assert code == 403, (what, code, text)
        assert text == f"ACCESS_REFUSED - access to {kind} '{name}' in vhost '/' refused for user '{user}'", \
            (what, text)

    # basic.publish: the refusal arrives as a channel.close after the publish
    pch = conn.channel()
    pch.basic_publish(other_x, "k", b"no")
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as ei:
        pch.queue_declare(mine_q, passive=True)
    assert ei.value.reply_code == 403
    assert f"access to exchange '{other_x}'" in ei.value.reply_text
    conn.close()
    admin.close()
