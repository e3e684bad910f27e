"""The shovel parameter's validation (RabbitMQ's JSON shape) and where a message is published,
without sockets."""

from __future__ import annotations

from typing import Any

import pytest

from broker.shovel.definition import parse, parse_uri

BASE: dict[str, Any] = {"src-uri": "amqp://", "src-queue": "a", "dest-uri": "amqp://", "dest-queue": "b"}


def test_rabbitmq_defaults() -> None:
    d = parse("/", "s", BASE)
    assert (d.ack_mode, d.src_prefetch, d.delete_after) == ("on-confirm", 1000, "never")
    assert d.reconnect_delay == 5.0
    assert d.src_uris[0].local and d.src_uris[0].vhost == "/"
    assert d.destination("amq.topic", "k") == ("", "b")


def test_uris() -> None:
    assert parse_uri("amqp:///other", "k", False).vhost == "other"
    assert parse_uri("amqp://u:p@h:5672/%2F", "k", False).vhost == "/"
    assert not parse_uri("amqps://h/v", "k", False).local
    assert parse_uri("amqp://u:secret@h/v", "k", False).redacted() == "amqp://u:***@h/v"
    assert parse_uri("https://h/p", "k", True).http
    for bad in ("ftp://h", "amqp://h:x", "amqp://h/a/b", "", "http://h"):
        with pytest.raises(ValueError):
            parse_uri(bad, "k", False)


def test_destination_by_exchange_and_key() -> None:
    d = parse("/", "s", {**BASE, "dest-queue": None, "dest-exchange": "x"})
    assert d.destination("e", "orig") == ("x", "orig")
    d = parse("/", "s", {k: v for k, v in BASE.items() if k != "dest-queue"} | {"dest-exchange": "x",
                                                                               "dest-exchange-key": "k"})
    assert d.destination("e", "orig") == ("x", "k")
    d = parse("/", "s", {k: v for k, v in BASE.items() if k != "dest-queue"})
    assert d.destination("e", "orig") == ("e", "orig")


@pytest.mark.parametrize("change,reason", [
    ({"x": 1}, "unknown shovel parameter key(s): x"),
    ({"src-exchange": "e"}, "exactly one of"),
    ({"dest-exchange": "e"}, "at most one of"),
    ({"src-delete-after": "sometimes"}, "src-delete-after"),
    ({"src-delete-after": 0}, "src-delete-after"),
    ({"reconnect-delay": -1}, "reconnect-delay"),
    ({"reconnect-delay": True}, "reconnect-delay"),
    ({"src-protocol": "amqp10"}, "AMQP 1.0"),
    ({"dest-publish-properties": {"colour": "red"}}, "unknown properties colour"),
    ({"dest-uri": "http://h/"}, "HTTP destination takes no"),
    ({"src-uri": []}, "at least one URI"),
    ({"src-consumer-args": []}, "'src-consumer-args' must be an object"),
])
def test_refusals_name_the_key(change: dict[str, Any], reason: str) -> None:
    with pytest.raises(ValueError) as ei:
        parse("/", "s", {**BASE, **change})
    assert reason in str(ei.value)
