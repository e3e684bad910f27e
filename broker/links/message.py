"""A message in flight between two brokers, and how a link end answers for it.

A **destination** (a remote broker, this broker, an HTTP endpoint) says ``OK``, ``RETRY``
(refused for now: flow control, a ``reject-publish`` queue at its limit, an HTTP 5xx, a nack)
or ``REFUSED`` (refused for good: an HTTP 4xx other than 408/429); an end raises ``EndLost``
when its connection is gone, and its ``lost`` future is set with the reason when it breaks on
its own.
"""

from __future__ import annotations

import asyncio
import enum

from pamqp import commands

from broker import properties

CONNECT_TIMEOUT = 15.0  # seconds for the TCP, TLS and AMQP handshakes of one URI (a remote end)
OP_TIMEOUT = 30.0  # seconds for one declare, qos, consume (a remote end)
EMPTY_PROPERTIES = b"\x00\x00"  # a content header's property flags with no property set


class Verdict(enum.Enum):
    OK = "ok"
    RETRY = "retry"
    REFUSED = "refused"


class EndLost(Exception):
    """An end's connection or channel is gone; the text says why."""


class Message:
    """One message in flight. Its content properties are kept as they came: the raw property
    bytes from this broker's store or off the wire (decoded only if an end or the definition
    needs the fields), or the pamqp object a client library decoded (encoded only for this
    broker's store)."""

    __slots__ = ("exchange", "routing_key", "body", "redelivered", "tag", "_props", "_raw")

    def __init__(self, exchange: str, routing_key: str, props: commands.Basic.Properties | None, body: bytes,
                 redelivered: bool, tag: int, raw: bytes | None = None) -> None:
        self.exchange = exchange
        self.routing_key = routing_key
        self.body = body
        self.redelivered = redelivered
        self.tag = tag  # the source's handle to settle it
        self._props = props
        self._raw = raw

    @property
    def props(self) -> commands.Basic.Properties:
        """The fields (decoded on first use); a change to them is published (``raw`` is dropped)."""
        if self._props is None:
            try:
                self._props = properties.decode(self._raw or EMPTY_PROPERTIES)
            except Exception:  # noqa: BLE001 - stored by another protocol oddly: sent without properties
                self._props = commands.Basic.Properties()
        self._raw = None
        return self._props

    @property
    def raw(self) -> bytes:
        """The property bytes of this broker's store format."""
        if self._raw is None:
            self._raw = properties.encode(self.props)
        return self._raw


def new_lost() -> asyncio.Future[str]:
    fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    return fut


def set_lost(fut: asyncio.Future[str], reason: str) -> None:
    if not fut.done():
        fut.set_result(reason)
