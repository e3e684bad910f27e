"""Shared steps of the AMQP scenarios (scenarios_connection/_topology/_basic.py) and their registry.

Each scenario is a small function of a ``Run``; it speaks raw frames through ``Conn`` and states
how many frames it expects back, so the transcript holds exactly what a client sees, in order.
The harness runs every scenario against RabbitMQ and against Skred and diffs the transcripts.
Scenarios close their connections at the end, so a broker that stays up but would not accept an
orderly close after an error shows up too.
"""

from __future__ import annotations

from collections.abc import Callable

from pamqp import commands as C

from .._raw import RawConn
from ._wire import READ_TIMEOUT, Conn, Run

Scenario = Callable[[Run], None]
SCENARIOS: dict[str, Scenario] = {}


def scenario(fn: Scenario) -> Scenario:
    SCENARIOS[fn.__name__] = fn
    return fn


def declare_q(c: Conn, name: str, ch: int = 1, **kw: object) -> None:
    c.call(ch, C.Queue.Declare(queue=name, **kw))  # type: ignore[arg-type]


def declare_x(c: Conn, name: str, kind: str = "direct", ch: int = 1, **kw: object) -> None:
    c.call(ch, C.Exchange.Declare(exchange=name, exchange_type=kind, **kw))  # type: ignore[arg-type]


def get(c: Conn, q: str, ch: int = 1, no_ack: bool = True) -> None:
    """basic.get and its answer: get-empty, or get-ok + header (+ body frames)."""
    rec = c.call(ch, C.Basic.Get(queue=q, no_ack=no_ack))[0]
    if rec[2] == "Basic.GetOk":
        recv_content(c)


def recv_content(c: Conn) -> None:
    hdr = c.recv(1)[0]
    if hdr[2] == "header":
        size, got = hdr[3], 0
        while got < size:
            got += len(c.recv(1)[0][3])


def deliveries(c: Conn, n: int) -> None:
    for _ in range(n):
        rec = c.recv(1)[0]
        if rec[2] in ("Basic.Deliver", "Basic.GetOk", "Basic.Return"):
            recv_content(c)


def fill(c: Conn, q: str, n: int) -> None:
    """Put messages b'm0'.. b'm{n-1}' into queue q, confirmed, through a connection of its own
    that is not recorded: a broker may route a channel's publishes asynchronously (RabbitMQ
    does), so only a confirm says they are in the queue, and acks may be coalesced."""
    p = RawConn(c.run.host, c.run.port, timeout=READ_TIMEOUT)
    try:
        p.handshake()
        p.open_channel(1)
        p.send_method(1, C.Confirm.Select())
        p.expect(C.Confirm.SelectOk, 1)
        for i in range(n):
            p.publish(1, "", q, f"m{i}".encode())
        acked = 0
        while acked < n:
            ack = p.expect(C.Basic.Ack, 1)
            acked = int(ack.delivery_tag)
    finally:
        p.close()


