"""The ``samples`` of RabbitMQ's range queries on the management API's object routes.

``GET /api/queues/{vhost}/{name}?lengths_age=600&lengths_incr=5&msg_rates_age=600&msg_rates_incr=5``
answers, besides the usual fields, ``samples`` (newest first) and averages inside each
``*_details`` of the range: message counts (``lengths``), message counters (``msg_rates``),
connection bytes (``data_rates``) and a node's gauges (``node_stats``), from the history the
statistics sampler keeps (``history.py``). A request without range parameters is answered as
before; a bad range is a 400 and nothing else is read.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from aiohttp import web

from broker.http.common import MGMT_KEY, bad_request
from broker.http.history import History, Span, Values, decorate, parse_spans, series
from broker.http.rates import (
    CHANNEL_FIELDS,
    GAUGE_FIELDS,
    GLOBAL_FIELDS,
    QUEUE_FIELDS,
    VHOST_FIELDS,
    channel_values,
    queue_values,
)
from broker.http.state import Mgmt
from broker.model.exchange import Exchange
from broker.model.queue import Queue
from broker.model.vhost import VHost
from broker.views import ChannelView, ConnectionView

Keys = Mapping[str, tuple[int, ...]]
_Q = {name: i for i, name in enumerate(QUEUE_FIELDS)}
QUEUE_LENGTHS: Keys = {"messages": (_Q["ready"], _Q["unacked"]), "messages_ready": (_Q["ready"],),
                       "messages_unacknowledged": (_Q["unacked"],)}
QUEUE_RATES: Keys = {k: (_Q[k],) for k in ("publish", "deliver_get", "ack", "redeliver")}
_V = len(VHOST_FIELDS)  # a vhost's history: its own fields, then its queues' sums
VHOST_LENGTHS: Keys = {k: tuple(_V + i for i in v) for k, v in QUEUE_LENGTHS.items()}
VHOST_RATES: Keys = {**{k: (_V + v[0],) for k, v in QUEUE_RATES.items()}, "confirm": (0,)}
_G = {name: i for i, name in enumerate(GLOBAL_FIELDS)}
GLOBAL_RATES: Keys = {"publish": (_G["published"],), "confirm": (_G["confirmed"],),
                      "deliver_get": (_G["delivered"],), "ack": (_G["acked"],),
                      "redeliver": (_G["redelivered"],)}
NODE_STATS: Keys = {name: (i,) for i, name in enumerate(GAUGE_FIELDS)}
DATA_RATES: Keys = {"recv_oct": (0,), "send_oct": (1,)}
EXCHANGE_RATES: Keys = {"publish_in": (0,), "publish_out": (1,)}
CHANNEL_RATES: Keys = {name: (i,) for i, name in enumerate(CHANNEL_FIELDS)}


def spans(request: web.Request) -> dict[str, Span]:
    try:
        return parse_spans(request.query)
    except ValueError as exc:
        raise bad_request(str(exc)) from None


class Ranges:
    """One request's ranges, applied to the JSON of the object it renders."""

    def __init__(self, request: web.Request) -> None:
        self.spans = spans(request)
        self.mgmt: Mgmt = request.app[MGMT_KEY]
        self.now = time.time()
        self.offset = self.mgmt.rates.wall_offset()

    def rows(self, name: str, history: History | None, current: Values | None) -> list[tuple[float, ...]]:
        return series(history, current, self.spans[name], self.now, self.offset)

    def apply(self, target: dict[str, Any], name: str, keys: Keys, rows: list[tuple[float, ...]]) -> None:
        if rows:
            decorate(target, keys, rows, self.spans[name].points(self.now), counter=name != "lengths"
                     and name != "node_stats")

    def one(self, target: dict[str, Any], name: str, keys: Keys, history: History | None,
            current: Values | None) -> None:
        if name in self.spans:
            self.apply(target, name, keys, self.rows(name, history, current))


def queue(request: web.Request, out: dict[str, Any], q: Queue) -> None:
    r = Ranges(request)
    history = r.mgmt.rates.queue_history(q)
    now = queue_values(q)
    r.one(out, "lengths", QUEUE_LENGTHS, history, now)
    r.one(out.setdefault("message_stats", {}), "msg_rates", QUEUE_RATES, history, now)


def exchange(request: web.Request, out: dict[str, Any], ex: Exchange) -> None:
    r = Ranges(request)
    r.one(out.setdefault("message_stats", {}), "msg_rates", EXCHANGE_RATES,
          r.mgmt.rates.exchange_history(ex), (ex.n_in, ex.n_out))


def connection(request: web.Request, out: dict[str, Any], s: ConnectionView) -> None:
    r = Ranges(request)
    r.one(out, "data_rates", DATA_RATES, r.mgmt.rates.connection_history(s), (s.recv_oct, s.send_oct))


def channel(request: web.Request, out: dict[str, Any], c: ChannelView) -> None:
    r = Ranges(request)
    r.one(out.setdefault("message_stats", {}), "msg_rates", CHANNEL_RATES, r.mgmt.rates.channel_history(c),
          channel_values(c))


def vhost(request: web.Request, out: dict[str, Any], vh: VHost) -> None:
    r = Ranges(request)
    history = r.mgmt.rates.vhost_history(vh)
    r.one(out, "lengths", VHOST_LENGTHS, history, None)
    r.one(out.setdefault("message_stats", {}), "msg_rates", VHOST_RATES, history, None)


def overview(request: web.Request, out: dict[str, Any], vhosts: Iterable[VHost]) -> None:
    """The broker's counters, and the queue totals of the vhosts the user sees (their
    histories' points summed: every vhost's points fall on the same aligned times)."""
    r = Ranges(request)
    rates = r.mgmt.rates
    r.one(out.setdefault("message_stats", {}), "msg_rates", GLOBAL_RATES, rates.global_history(), None)
    if "lengths" in r.spans:
        total: list[tuple[float, ...]] = []
        for vh in vhosts:
            rows = r.rows("lengths", rates.vhost_history(vh), None)
            total = rows if not total else [tuple(a + b for a, b in zip(x, y, strict=True))
                                            for x, y in zip(total, rows, strict=True)] if rows else total
        r.apply(out.setdefault("queue_totals", {}), "lengths", VHOST_LENGTHS, total)


def node(request: web.Request, out: dict[str, Any]) -> None:
    r = Ranges(request)
    r.one(out, "node_stats", NODE_STATS, r.mgmt.rates.node_history(), None)
