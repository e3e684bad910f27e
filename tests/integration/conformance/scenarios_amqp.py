"""AMQP 0-9-1 scenarios: the method catalogue, its reply-code paths and corner cases.

Each scenario is a small function of a ``Run``; it speaks raw frames through ``Conn`` and states
how many frames it expects back, so the transcript holds exactly what a client sees, in order.
The harness runs every scenario against RabbitMQ and against Skred and diffs the transcripts.
Scenarios close their connections at the end, so a broker that stays up but would not accept an
orderly close after an error shows up too.
"""

from __future__ import annotations

from collections.abc import Callable

from pamqp import commands as C

from .._raw import FRAME_BODY, FRAME_HEADER, FRAME_HEARTBEAT, FRAME_METHOD, RawConn, frame_bytes, method_bytes
from .._raw import header_payload as hp
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


# -- connection ----------------------------------------------------------------------------------
@scenario
def conn_negotiate_and_close(r: Run) -> None:
    r.conn().close()


@scenario
def conn_bad_protocol_header(r: Run) -> None:
    c = r.conn(handshake=False)
    c.send_bytes(b"AMQP\x00\x00\x09\x00")
    r.note("answer", c.raw.read_exact(8), c.raw.wait_eof(10))


@scenario
def conn_wrong_password(r: Run) -> None:
    c = r.conn(password="wrong")
    c.until("Connection.Close")


@scenario
def conn_unknown_vhost(r: Run) -> None:
    c = r.conn(vhost="conf-no-such-vhost")
    if not c.closed:
        c.until("Connection.Close")


@scenario
def conn_channel_above_channel_max(r: Run) -> None:
    c = r.conn(channel_max=5)
    c.call(5, C.Channel.Open())
    c.call(6, C.Channel.Open())  # RabbitMQ counts open channels; the spec limits the number
    if not c.closed:
        c.close()


@scenario
def conn_frame_max_below_minimum(r: Run) -> None:
    c = r.conn(frame_max=1024, open_channel=None)
    if not c.closed:
        c.until("Connection.Close")


@scenario
def conn_frame_max_above_server(r: Run) -> None:
    c = r.conn(frame_max=1 << 24, open_channel=None)
    if not c.closed:
        c.until("Connection.Close")


@scenario
def conn_heartbeat_is_sent(r: Run) -> None:
    c = r.conn(heartbeat=1)
    rec = c.recv(1, heartbeats=True)[0]
    r.note("first frame after open", rec[2])
    c.close()


@scenario
def conn_frame_over_frame_max(r: Run) -> None:
    c = r.conn(frame_max=4096)
    c.send(1, C.Basic.Publish(exchange="", routing_key="x"))
    c.send_bytes(frame_bytes(FRAME_HEADER, 1, hp(5000, C.Basic.Properties())))
    c.send_bytes(frame_bytes(FRAME_BODY, 1, b"x" * 4097))
    c.until("Connection.Close")


@scenario
def conn_bad_frame_end(r: Run) -> None:
    c = r.conn()
    c.send_bytes(method_bytes(1, C.Basic.Qos(prefetch_count=1))[:-1] + b"\x00")
    c.until("Connection.Close")


@scenario
def conn_unknown_frame_type(r: Run) -> None:
    c = r.conn()
    c.send_bytes(frame_bytes(9, 1, b"abc"))
    c.until("Connection.Close")


@scenario
def conn_heartbeat_on_channel(r: Run) -> None:
    c = r.conn()
    c.send_bytes(frame_bytes(FRAME_HEARTBEAT, 1, b""))
    c.until("Connection.Close")


@scenario
def conn_unknown_method(r: Run) -> None:
    c = r.conn()
    c.send_bytes(frame_bytes(FRAME_METHOD, 1, b"\x00\x3c\x00\x63"))  # basic (60), method 99
    c.until("Connection.Close")


@scenario
def conn_unknown_class(r: Run) -> None:
    c = r.conn()
    c.send_bytes(frame_bytes(FRAME_METHOD, 1, b"\x00\x63\x00\x0a"))  # class 99
    c.until("Connection.Close")


@scenario
def conn_truncated_method(r: Run) -> None:
    c = r.conn()
    c.send_bytes(frame_bytes(FRAME_METHOD, 1, b"\x00\x32\x00\x0a\x00\x00\x05ab"))  # queue.declare
    c.until("Connection.Close")


@scenario
def conn_update_secret(r: Run) -> None:
    c = r.conn()
    c.call(0, C.Connection.UpdateSecret(new_secret="guest", reason="refresh"))
    c.close()


@scenario
def conn_method_before_channel_open(r: Run) -> None:
    c = r.conn(open_channel=None)
    c.send(3, C.Basic.Qos(prefetch_count=1))
    c.until("Connection.Close")


@scenario
def conn_channel_opened_twice(r: Run) -> None:
    c = r.conn()
    c.send(1, C.Channel.Open())
    c.until("Connection.Close")


@scenario
def conn_channel_method_on_channel_zero(r: Run) -> None:
    c = r.conn()
    c.send(0, C.Queue.Declare(queue="x"))
    c.until("Connection.Close")


@scenario
def conn_header_without_publish(r: Run) -> None:
    c = r.conn()
    c.send_bytes(frame_bytes(FRAME_HEADER, 1, hp(3, C.Basic.Properties())))
    c.until("Connection.Close")


@scenario
def conn_body_without_header(r: Run) -> None:
    c = r.conn()
    c.send(1, C.Basic.Publish(exchange="", routing_key="x"))
    c.send_bytes(frame_bytes(FRAME_BODY, 1, b"abc"))
    c.until("Connection.Close")


@scenario
def conn_method_inside_content(r: Run) -> None:
    c = r.conn()
    c.send(1, C.Basic.Publish(exchange="", routing_key="x"))
    c.send_bytes(frame_bytes(FRAME_HEADER, 1, hp(3, C.Basic.Properties())))
    c.send(1, C.Basic.Qos(prefetch_count=1))
    c.until("Connection.Close")


@scenario
def channel_close_and_reopen(r: Run) -> None:
    c = r.conn()
    c.call(1, C.Channel.Close(200, "ok", 0, 0))
    c.call(1, C.Channel.Open())
    c.call(2, C.Channel.Open())
    c.close()


@scenario
def channel_flow(r: Run) -> None:
    c = r.conn()
    c.call(1, C.Channel.Flow(active=True))
    c.send(1, C.Channel.Flow(active=False))
    c.recv(1)
    c.close()


@scenario
def access_request(r: Run) -> None:
    c = r.conn()
    c.send_bytes(frame_bytes(FRAME_METHOD, 1, b"\x00\x1e\x00\x0a\x05/data\x00"))  # access.request
    c.recv(1)
    c.close()


# -- exchanges -----------------------------------------------------------------------------------
@scenario
def exchange_declare_every_type_and_redeclare(r: Run) -> None:
    c = r.conn()
    for kind in ("direct", "fanout", "topic", "headers"):
        declare_x(c, r.name(kind), kind, auto_delete=True)
        declare_x(c, r.name(kind), kind, auto_delete=True)
        c.call(1, C.Exchange.Declare(exchange=r.name(kind), passive=True))
        c.call(1, C.Exchange.Delete(exchange=r.name(kind)))
    c.close()


@scenario
def exchange_redeclare_other_type(r: Run) -> None:
    c = r.conn()
    declare_x(c, r.name("x"), "direct", auto_delete=True)
    declare_x(c, r.name("x"), "fanout", auto_delete=True)
    c.close()


@scenario
def exchange_redeclare_other_durable(r: Run) -> None:
    c = r.conn()
    declare_x(c, r.name("x"), "direct", durable=False)
    declare_x(c, r.name("x"), "direct", durable=True)
    c.call(2, C.Channel.Open())
    c.call(2, C.Exchange.Delete(exchange=r.name("x")))
    c.close()


@scenario
def exchange_redeclare_other_args(r: Run) -> None:
    c = r.conn()
    declare_x(c, r.name("x"), "direct", auto_delete=True, arguments={"alternate-exchange": "a"})
    declare_x(c, r.name("x"), "direct", auto_delete=True, arguments={"alternate-exchange": "b"})
    c.close()


@scenario
def exchange_unknown_type(r: Run) -> None:
    c = r.conn()
    declare_x(c, r.name("x"), "no-such-type")
    c.close()


@scenario
def exchange_passive_missing(r: Run) -> None:
    c = r.conn()
    c.call(1, C.Exchange.Declare(exchange=r.name("x"), passive=True))
    c.close()


@scenario
def exchange_passive_with_other_type_ok(r: Run) -> None:
    c = r.conn()
    c.call(1, C.Exchange.Declare(exchange="amq.topic", exchange_type="fanout", passive=True))
    c.close()


@scenario
def exchange_reserved_prefix(r: Run) -> None:
    c = r.conn()
    declare_x(c, "amq.conf-" + r.tag)
    c.call(1, C.Channel.Open())
    declare_x(c, "amq.direct", "direct", durable=True)
    c.close()


@scenario
def exchange_default_is_untouchable(r: Run) -> None:
    c = r.conn()
    c.call(1, C.Exchange.Declare(exchange="", passive=True))
    c.call(1, C.Channel.Open())
    c.call(1, C.Exchange.Declare(exchange="", exchange_type="direct", durable=True))
    c.call(1, C.Channel.Open())
    c.call(1, C.Exchange.Delete(exchange=""))
    c.call(1, C.Channel.Open())
    c.call(1, C.Exchange.Delete(exchange="amq.default"))
    c.call(1, C.Channel.Open())
    c.call(1, C.Exchange.Delete(exchange="amq.direct"))
    c.close()


@scenario
def exchange_delete_missing(r: Run) -> None:
    c = r.conn()
    c.call(1, C.Exchange.Delete(exchange=r.name("x")))
    c.close()


@scenario
def exchange_delete_if_unused(r: Run) -> None:
    c = r.conn()
    declare_x(c, r.name("x"))
    declare_q(c, r.name("q"), exclusive=True)
    c.call(1, C.Queue.Bind(queue=r.name("q"), exchange=r.name("x"), routing_key="k"))
    c.call(1, C.Exchange.Delete(exchange=r.name("x"), if_unused=True))
    c.call(1, C.Channel.Open())
    c.call(1, C.Exchange.Delete(exchange=r.name("x")))
    c.call(1, C.Exchange.Delete(exchange=r.name("x"), if_unused=True))
    c.close()


@scenario
def exchange_to_exchange_bindings(r: Run) -> None:
    c = r.conn()
    declare_x(c, r.name("src"), "topic")
    declare_x(c, r.name("dst"), "fanout", auto_delete=True)
    declare_q(c, r.name("q"), exclusive=True)
    c.call(1, C.Queue.Bind(queue=r.name("q"), exchange=r.name("dst")))
    c.call(1, C.Exchange.Bind(destination=r.name("dst"), source=r.name("src"), routing_key="a.*"))
    c.publish(1, r.name("src"), "a.b", b"via-e2e")
    c.publish(1, r.name("src"), "b.b", b"dropped")
    get(c, r.name("q"))
    get(c, r.name("q"))
    c.call(1, C.Exchange.Unbind(destination=r.name("dst"), source=r.name("src"), routing_key="a.*"))
    c.publish(1, r.name("src"), "a.b", b"after-unbind")
    get(c, r.name("q"))
    c.call(1, C.Exchange.Bind(destination=r.name("dst"), source=r.name("missing")))
    c.call(1, C.Channel.Open())
    c.call(1, C.Exchange.Bind(destination=r.name("missing"), source=r.name("src")))
    c.call(1, C.Channel.Open())
    c.call(1, C.Exchange.Delete(exchange=r.name("src")))
    c.close()


@scenario
def exchange_auto_delete_after_last_unbind(r: Run) -> None:
    c = r.conn()
    declare_x(c, r.name("x"), auto_delete=True)
    declare_q(c, r.name("q"), exclusive=True)
    c.call(1, C.Exchange.Declare(exchange=r.name("x"), passive=True))
    c.call(1, C.Queue.Bind(queue=r.name("q"), exchange=r.name("x"), routing_key="k"))
    c.call(1, C.Queue.Unbind(queue=r.name("q"), exchange=r.name("x"), routing_key="k"))
    c.call(1, C.Exchange.Declare(exchange=r.name("x"), passive=True))
    c.close()


@scenario
def exchange_internal_refuses_publish(r: Run) -> None:
    c = r.conn()
    declare_x(c, r.name("x"), "fanout", auto_delete=True, internal=True)
    c.publish(1, r.name("x"), "", b"x")
    c.until("Channel.Close")
    c.close()


@scenario
def exchange_nowait(r: Run) -> None:
    c = r.conn()
    c.send(1, C.Exchange.Declare(exchange=r.name("x"), exchange_type="fanout", auto_delete=True,
                                 nowait=True))
    c.call(1, C.Exchange.Declare(exchange=r.name("x"), passive=True))
    c.send(1, C.Exchange.Delete(exchange=r.name("x"), nowait=True))
    c.call(1, C.Exchange.Declare(exchange=r.name("x"), passive=True))
    c.close()


# -- queues --------------------------------------------------------------------------------------
@scenario
def queue_server_named(r: Run) -> None:
    c = r.conn()
    c.call(1, C.Queue.Declare(queue="", exclusive=True))
    c.call(1, C.Queue.Declare(queue="", passive=True))  # '' means the last declared queue
    c.close()


@scenario
def queue_empty_name_means_last_declared(r: Run) -> None:
    c = r.conn()
    declare_q(c, r.name("q"), exclusive=True)
    c.call(1, C.Queue.Bind(queue="", exchange="amq.fanout"))
    c.publish(1, "amq.fanout", "", b"to-last")
    get(c, "")
    c.call(1, C.Queue.Purge(queue=""))
    c.call(1, C.Queue.Delete(queue=""))
    c.close()


@scenario
def queue_empty_name_without_declare(r: Run) -> None:
    c = r.conn()
    c.call(1, C.Queue.Bind(queue="", exchange="amq.fanout"))
    c.close()


@scenario
def queue_declare_counts(r: Run) -> None:
    c = r.conn()
    declare_q(c, r.name("q"), exclusive=True)
    fill(c, r.name("q"), 3)
    c.call(1, C.Basic.Consume(queue=r.name("q"), consumer_tag="t"))
    deliveries(c, 3)
    declare_q(c, r.name("q"), exclusive=True)
    c.close()


@scenario
def queue_redeclare_inequivalent(r: Run) -> None:
    c = r.conn()
    q = r.name("q")
    declare_q(c, q, auto_delete=True, arguments={"x-max-length": 10})
    for ch, kw in enumerate(({"durable": True}, {"exclusive": True}, {"auto_delete": False},
                             {"arguments": {"x-max-length": 11}}, {"arguments": {}},
                             {"arguments": {"x-message-ttl": 5}}), start=2):
        c.call(ch, C.Channel.Open())
        args = {"auto_delete": True, "arguments": {"x-max-length": 10}, **kw}
        declare_q(c, q, ch=ch, **args)
    c.call(9, C.Channel.Open())
    c.call(9, C.Queue.Delete(queue=q))
    c.close()


@scenario
def queue_passive(r: Run) -> None:
    c = r.conn()
    c.call(1, C.Queue.Declare(queue=r.name("q"), passive=True))
    c.call(1, C.Channel.Open())
    declare_q(c, r.name("q"), exclusive=True)
    fill(c, r.name("q"), 2)
    c.call(1, C.Queue.Declare(queue=r.name("q"), passive=True, durable=True,
                              arguments={"x-max-length": 1}))  # passive ignores the rest
    c.close()


@scenario
def queue_exclusive_from_other_connection(r: Run) -> None:
    owner, other = r.conn(), r.conn()
    q = r.name("q")
    declare_q(owner, q, exclusive=True)
    ops = [C.Queue.Declare(queue=q, exclusive=True), C.Queue.Declare(queue=q, passive=True),
           C.Queue.Declare(queue=q), C.Basic.Consume(queue=q), C.Basic.Get(queue=q),
           C.Queue.Purge(queue=q), C.Queue.Delete(queue=q),
           C.Queue.Bind(queue=q, exchange="amq.direct", routing_key="k"),
           C.Queue.Unbind(queue=q, exchange="amq.direct", routing_key="k")]
    for ch, op in enumerate(ops, start=2):
        other.call(ch, C.Channel.Open())
        other.call(ch, op)
    fill(owner, q, 1)  # publishing to another's exclusive queue is fine
    get(owner, q)
    other.close()
    owner.close()


@scenario
def queue_exclusive_gone_with_owner(r: Run) -> None:
    owner = r.conn()
    declare_q(owner, r.name("q"), exclusive=True)
    owner.close()
    c = r.conn()
    c.call(1, C.Queue.Declare(queue=r.name("q"), passive=True))
    c.close()


@scenario
def queue_reserved_prefix(r: Run) -> None:
    c = r.conn()
    declare_q(c, "amq.conf-" + r.tag)
    c.close()


@scenario
def queue_bind_errors(r: Run) -> None:
    c = r.conn()
    declare_q(c, r.name("q"), exclusive=True)
    c.call(1, C.Queue.Bind(queue=r.name("q"), exchange=r.name("missing")))
    c.call(1, C.Channel.Open())
    c.call(1, C.Queue.Bind(queue=r.name("missing"), exchange="amq.direct"))
    c.call(1, C.Channel.Open())
    c.call(1, C.Queue.Bind(queue=r.name("q"), exchange="", routing_key="k"))
    c.call(1, C.Channel.Open())
    c.call(1, C.Queue.Unbind(queue=r.name("q"), exchange="", routing_key="k"))
    c.call(1, C.Channel.Open())
    c.call(1, C.Queue.Bind(queue=r.name("q"), exchange="amq.default", routing_key="k"))
    c.close()


@scenario
def queue_unbind_missing(r: Run) -> None:
    c = r.conn()
    declare_q(c, r.name("q"), exclusive=True)
    c.call(1, C.Queue.Unbind(queue=r.name("q"), exchange="amq.direct", routing_key="never-bound"))
    c.call(1, C.Queue.Unbind(queue=r.name("missing"), exchange="amq.direct", routing_key="k"))
    c.call(1, C.Queue.Unbind(queue=r.name("q"), exchange=r.name("missing"), routing_key="k"))
    c.close()


@scenario
def queue_bind_headers_and_topic(r: Run) -> None:
    c = r.conn()
    declare_q(c, r.name("q"), exclusive=True)
    c.call(1, C.Queue.Bind(queue=r.name("q"), exchange="amq.match",
                           arguments={"x-match": "all", "a": 1, "b": "x"}))
    c.call(1, C.Queue.Bind(queue=r.name("q"), exchange="amq.topic", routing_key="*.b.#"))
    c.publish(1, "amq.match", "", b"h-all", C.Basic.Properties(headers={"a": 1, "b": "x"}))
    c.publish(1, "amq.match", "", b"h-part", C.Basic.Properties(headers={"a": 1}))
    c.publish(1, "amq.topic", "a.b", b"t1")
    c.publish(1, "amq.topic", "a.b.c.d", b"t2")
    c.publish(1, "amq.topic", "b.a", b"t3")
    for _ in range(4):
        get(c, r.name("q"))
    c.call(1, C.Queue.Bind(queue=r.name("q"), exchange="amq.match", arguments={"x-match": "bogus"}))
    c.close()


@scenario
def queue_purge(r: Run) -> None:
    c = r.conn()
    declare_q(c, r.name("q"), exclusive=True)
    fill(c, r.name("q"), 3)
    get(c, r.name("q"), no_ack=False)
    c.call(1, C.Queue.Purge(queue=r.name("q")))
    c.call(1, C.Queue.Purge(queue=r.name("missing")))
    c.close()


@scenario
def queue_delete_if_unused_if_empty(r: Run) -> None:
    c = r.conn()
    q = r.name("q")
    declare_q(c, q, exclusive=True)
    c.call(1, C.Basic.Consume(queue=q, consumer_tag="t"))
    c.call(1, C.Queue.Delete(queue=q, if_unused=True))
    c.call(1, C.Channel.Open())
    fill(c, q, 2)
    c.call(1, C.Queue.Delete(queue=q, if_empty=True))
    c.call(1, C.Channel.Open())
    c.call(1, C.Queue.Delete(queue=q))
    c.call(1, C.Queue.Delete(queue=q))  # gone: delete-ok with 0
    c.close()


@scenario
def queue_delete_consumed_order(r: Run) -> None:
    c = r.conn()
    declare_q(c, r.name("q"))
    c.call(1, C.Basic.Consume(queue=r.name("q"), consumer_tag="t"))
    c.call(1, C.Queue.Delete(queue=r.name("q")), frames=2)
    c.close()


@scenario
def queue_bad_arguments(r: Run) -> None:
    c = r.conn()
    bad = [{"x-max-length": "ten"}, {"x-message-ttl": -1}, {"x-queue-type": "bogus"},
           {"x-overflow": "sideways"}, {"x-max-priority": 300}, {"x-expires": 0},
           {"x-dead-letter-routing-key": "k"}, {"x-queue-mode": "fast"}]
    for ch, args in enumerate(bad, start=2):
        c.call(ch, C.Channel.Open())
        c.call(ch, C.Queue.Declare(queue=r.name(f"q{ch}"), auto_delete=True, arguments=args))
    c.close()


@scenario
def queue_quorum_restrictions(r: Run) -> None:
    c = r.conn()
    cases = [{"durable": False}, {"durable": True, "exclusive": True},
             {"durable": True, "auto_delete": True}, {"durable": True}]
    for ch, kw in enumerate(cases, start=2):
        c.call(ch, C.Channel.Open())
        c.call(ch, C.Queue.Declare(queue=r.name("qq"), arguments={"x-queue-type": "quorum"},
                                   **kw))  # type: ignore[arg-type]
    c.call(ch, C.Queue.Delete(queue=r.name("qq")))
    c.close()


@scenario
def queue_nowait(r: Run) -> None:
    c = r.conn()
    c.send(1, C.Queue.Declare(queue=r.name("q"), exclusive=True, nowait=True))
    c.call(1, C.Queue.Declare(queue=r.name("q"), passive=True))
    c.send(1, C.Queue.Bind(queue=r.name("q"), exchange="amq.direct", routing_key="k", nowait=True))
    c.publish(1, "amq.direct", "k", b"bound")
    c.send(1, C.Queue.Purge(queue=r.name("q"), nowait=True))
    c.call(1, C.Queue.Declare(queue=r.name("q"), passive=True))
    c.send(1, C.Queue.Delete(queue=r.name("q"), nowait=True))
    c.call(1, C.Queue.Declare(queue=r.name("q"), passive=True))
    c.close()


# -- basic ---------------------------------------------------------------------------------------
@scenario
def basic_publish_get_roundtrip(r: Run) -> None:
    c = r.conn()
    q = r.name("q")
    declare_q(c, q, exclusive=True)
    props = C.Basic.Properties(
        content_type="text/plain", content_encoding="utf-8", headers={"h": "v", "n": 1, "t": True},
        delivery_mode=2, priority=3, correlation_id="cid", reply_to="rt", expiration="60000",
        message_id="mid", timestamp=None, message_type="type", user_id="guest", app_id="app")
    c.publish(1, "", q, b"all properties", props)
    c.publish(1, "", q, b"")
    get(c, q)
    get(c, q)
    get(c, q)
    c.close()


@scenario
def basic_large_body_frames(r: Run) -> None:
    c = r.conn(frame_max=4096)
    q = r.name("q")
    declare_q(c, q, exclusive=True)
    c.publish(1, "", q, bytes(range(256)) * 40)  # 10240 bytes: 3 body frames each way
    get(c, q)
    c.close()


@scenario
def basic_publish_wrong_user_id(r: Run) -> None:
    c = r.conn()
    c.publish(1, "", "x", b"x", C.Basic.Properties(user_id="someone-else"))
    c.until("Channel.Close")
    c.close()


@scenario
def basic_publish_missing_exchange(r: Run) -> None:
    c = r.conn()
    c.publish(1, r.name("missing"), "k", b"x")
    c.until("Channel.Close")
    c.close()


@scenario
def basic_mandatory_return_and_confirm(r: Run) -> None:
    c = r.conn()
    c.call(1, C.Confirm.Select())
    c.publish(1, "amq.direct", "nobody", b"returned", mandatory=True)
    deliveries(c, 2)  # basic.return (+content), then basic.ack
    c.publish(1, "amq.direct", "nobody", b"dropped")
    c.recv(1)
    c.close()


@scenario
def basic_immediate(r: Run) -> None:
    c = r.conn()
    c.send(1, C.Basic.Publish(exchange="", routing_key="x", immediate=True))
    c.send_bytes(frame_bytes(FRAME_HEADER, 1, hp(0, C.Basic.Properties())))
    c.until("Connection.Close")


@scenario
def basic_get_empty_and_missing(r: Run) -> None:
    c = r.conn()
    declare_q(c, r.name("q"), exclusive=True)
    get(c, r.name("q"))
    get(c, r.name("missing"))
    c.close()


@scenario
def basic_consume_cancel(r: Run) -> None:
    c = r.conn()
    q = r.name("q")
    declare_q(c, q, exclusive=True)
    fill(c, q, 2)
    c.call(1, C.Basic.Consume(queue=q, consumer_tag="t1", no_ack=True))
    deliveries(c, 2)
    c.call(1, C.Basic.Cancel(consumer_tag="t1"))
    c.call(1, C.Basic.Cancel(consumer_tag="never"))
    c.call(1, C.Basic.Consume(queue=q, consumer_tag=""))  # server-named tag
    c.close()


@scenario
def basic_consume_errors(r: Run) -> None:
    c = r.conn()
    q = r.name("q")
    declare_q(c, q, exclusive=True)
    c.call(1, C.Basic.Consume(queue=r.name("missing")))
    c.call(1, C.Channel.Open())
    c.call(1, C.Basic.Consume(queue=q, consumer_tag="t", exclusive=True))
    c.call(2, C.Channel.Open())
    c.call(2, C.Basic.Consume(queue=q, consumer_tag="t2"))
    c.call(1, C.Basic.Consume(queue=q, consumer_tag="t"))
    c.until("Connection.Close")


@scenario
def basic_consume_exclusive_after_other(r: Run) -> None:
    c = r.conn()
    q = r.name("q")
    declare_q(c, q, exclusive=True)
    c.call(1, C.Basic.Consume(queue=q, consumer_tag="t"))
    c.call(2, C.Channel.Open())
    c.call(2, C.Basic.Consume(queue=q, consumer_tag="t2", exclusive=True))
    c.close()


@scenario
def basic_ack_errors(r: Run) -> None:
    c = r.conn()
    q = r.name("q")
    declare_q(c, q, exclusive=True)
    fill(c, q, 2)
    get(c, q, no_ack=False)
    c.send(1, C.Basic.Ack(delivery_tag=1))
    c.send(1, C.Basic.Ack(delivery_tag=1))
    c.until("Channel.Close")
    c.call(1, C.Channel.Open())
    c.send(1, C.Basic.Ack(delivery_tag=7))
    c.until("Channel.Close")
    c.call(1, C.Channel.Open())
    c.send(1, C.Basic.Reject(delivery_tag=3))
    c.until("Channel.Close")
    c.call(1, C.Channel.Open())
    c.send(1, C.Basic.Nack(delivery_tag=0, multiple=False))
    c.until("Channel.Close")
    c.close()


@scenario
def basic_ack_multiple_zero(r: Run) -> None:
    c = r.conn()
    q = r.name("q")
    declare_q(c, q, exclusive=True)
    fill(c, q, 3)
    for _ in range(3):
        get(c, q, no_ack=False)
    c.send(1, C.Basic.Ack(delivery_tag=0, multiple=True))
    c.call(1, C.Basic.Recover(requeue=True))
    get(c, q)
    c.close()


@scenario
def basic_nack_requeue_order(r: Run) -> None:
    c = r.conn()
    q = r.name("q")
    declare_q(c, q, exclusive=True)
    fill(c, q, 4)
    for _ in range(3):
        get(c, q, no_ack=False)
    c.send(1, C.Basic.Nack(delivery_tag=2, multiple=True, requeue=True))
    c.send(1, C.Basic.Reject(delivery_tag=3, requeue=True))
    for _ in range(5):
        get(c, q)
    c.close()


@scenario
def basic_reject_requeue_head(r: Run) -> None:
    c = r.conn()
    q = r.name("q")
    declare_q(c, q, exclusive=True)
    fill(c, q, 3)
    get(c, q, no_ack=False)
    get(c, q, no_ack=False)
    c.send(1, C.Basic.Reject(delivery_tag=2, requeue=True))
    c.send(1, C.Basic.Nack(delivery_tag=1, requeue=False))
    for _ in range(3):
        get(c, q)
    c.close()


@scenario
def basic_recover(r: Run) -> None:
    c = r.conn()
    q = r.name("q")
    declare_q(c, q, exclusive=True)
    fill(c, q, 2)
    get(c, q, no_ack=False)
    get(c, q, no_ack=False)
    c.call(1, C.Basic.Recover(requeue=True))
    get(c, q, no_ack=False)
    c.send(1, C.Basic.Ack(delivery_tag=3))
    get(c, q, no_ack=False)
    c.call(1, C.Basic.Recover(requeue=False))
    c.close()


@scenario
def basic_recover_consumer_redelivers(r: Run) -> None:
    c = r.conn()
    q = r.name("q")
    declare_q(c, q, exclusive=True)
    fill(c, q, 2)
    c.call(1, C.Basic.Consume(queue=q, consumer_tag="t"))
    deliveries(c, 2)
    c.call(1, C.Basic.Recover(requeue=True))
    deliveries(c, 2)
    c.close()


@scenario
def basic_recover_async(r: Run) -> None:
    c = r.conn()
    q = r.name("q")
    declare_q(c, q, exclusive=True)
    fill(c, q, 1)
    get(c, q, no_ack=False)
    c.send(1, C.Basic.RecoverAsync(requeue=True))
    get(c, q)
    c.close()


@scenario
def basic_qos_prefetch(r: Run) -> None:
    c = r.conn()
    q = r.name("q")
    declare_q(c, q, exclusive=True)
    fill(c, q, 5)
    c.call(1, C.Basic.Qos(prefetch_count=2))
    c.call(1, C.Basic.Consume(queue=q, consumer_tag="t"))
    deliveries(c, 2)
    c.send(1, C.Basic.Ack(delivery_tag=1))
    deliveries(c, 1)
    c.send(1, C.Basic.Ack(delivery_tag=3, multiple=True))
    deliveries(c, 2)
    c.close()


@scenario
def basic_qos_prefetch_size(r: Run) -> None:
    c = r.conn()
    c.call(1, C.Basic.Qos(prefetch_size=1000))
    c.close()


@scenario
def basic_qos_global(r: Run) -> None:
    c = r.conn()
    q1, q2 = r.name("q1"), r.name("q2")
    declare_q(c, q1, exclusive=True)
    declare_q(c, q2, exclusive=True)
    fill(c, q1, 2)
    fill(c, q2, 2)
    c.call(1, C.Basic.Qos(prefetch_count=1, global_=True))
    c.call(1, C.Basic.Consume(queue=q1, consumer_tag="t1"))
    deliveries(c, 1)
    c.call(1, C.Basic.Cancel(consumer_tag="t1"))
    c.call(1, C.Basic.Consume(queue=q2, consumer_tag="t2"))  # the channel's one credit is taken
    c.send(1, C.Basic.Ack(delivery_tag=1))
    deliveries(c, 1)
    c.close()


@scenario
def basic_cancel_notification_on_delete(r: Run) -> None:
    c, other = r.conn(), r.conn()
    q = r.name("q")
    declare_q(c, q)
    c.call(1, C.Basic.Consume(queue=q, consumer_tag="t"))
    other.call(1, C.Queue.Delete(queue=q))
    c.recv(1)
    c.call(1, C.Basic.Cancel(consumer_tag="t"))
    other.close()
    c.close()


@scenario
def basic_unacked_requeued_on_channel_close(r: Run) -> None:
    c = r.conn()
    q = r.name("q")
    declare_q(c, q, exclusive=True)
    fill(c, q, 2)
    c.call(2, C.Channel.Open())
    get(c, q, ch=2, no_ack=False)
    get(c, q, ch=2, no_ack=False)
    c.call(2, C.Channel.Close(200, "bye", 0, 0))
    get(c, q)
    get(c, q)
    c.close()


@scenario
def basic_priority_queue(r: Run) -> None:
    c = r.conn()
    q = r.name("q")
    declare_q(c, q, exclusive=True, arguments={"x-max-priority": 5})
    for p in (1, 9, 3, 0):
        c.publish(1, "", q, f"p{p}".encode(), C.Basic.Properties(priority=p))
    for _ in range(4):
        get(c, q)
    c.close()


# -- tx and confirm ------------------------------------------------------------------------------
@scenario
def tx_commit_rollback(r: Run) -> None:
    c = r.conn()
    q = r.name("q")
    declare_q(c, q, exclusive=True)
    c.call(1, C.Tx.Select())
    c.publish(1, "", q, b"committed")
    c.call(1, C.Queue.Declare(queue=q, passive=True))
    c.call(1, C.Tx.Commit())
    c.publish(1, "", q, b"rolled back")
    c.call(1, C.Tx.Rollback())
    get(c, q, no_ack=False)
    c.send(1, C.Basic.Ack(delivery_tag=1))
    c.call(1, C.Tx.Rollback())  # the ack is undone: the message stays unacked
    c.call(1, C.Queue.Declare(queue=q, passive=True))
    c.call(1, C.Basic.Recover(requeue=True))
    get(c, q)
    c.close()


@scenario
def tx_without_select(r: Run) -> None:
    c = r.conn()
    c.call(1, C.Tx.Commit())
    c.call(1, C.Channel.Open())
    c.call(1, C.Tx.Rollback())
    c.close()


@scenario
def tx_and_confirm_exclusive(r: Run) -> None:
    c = r.conn()
    c.call(1, C.Tx.Select())
    c.call(1, C.Confirm.Select())
    c.call(2, C.Channel.Open())
    c.call(2, C.Confirm.Select())
    c.call(2, C.Tx.Select())
    c.close()


@scenario
def confirm_sequence(r: Run) -> None:
    c = r.conn()
    q = r.name("q")
    declare_q(c, q, exclusive=True)
    c.call(1, C.Confirm.Select())
    c.call(1, C.Confirm.Select())  # twice is fine
    for i in range(3):
        c.publish(1, "", q, f"c{i}".encode())
        c.recv(1)
    c.send(1, C.Confirm.Select(nowait=True))
    c.publish(1, "", r.name("nowhere"), b"unroutable is confirmed too")
    c.recv(1)
    c.close()


@scenario
def confirm_tx_rollback_publish(r: Run) -> None:
    c = r.conn()
    q = r.name("q")
    declare_q(c, q, exclusive=True)
    c.call(1, C.Tx.Select())
    c.call(1, C.Basic.Qos(prefetch_count=1))
    c.publish(1, "", q, b"x")
    c.call(1, C.Tx.Commit())
    c.call(1, C.Queue.Declare(queue=q, passive=True))
    c.close()


@scenario
def queue_exclusive_unbind_from_other_connection(r: Run) -> None:
    owner, other = r.conn(), r.conn()
    q = r.name("q")
    declare_q(owner, q, exclusive=True)
    owner.call(1, C.Queue.Bind(queue=q, exchange="amq.direct", routing_key="k"))
    other.call(1, C.Queue.Unbind(queue=q, exchange="amq.direct", routing_key="k"))
    fill(owner, q, 0)
    owner.publish(1, "amq.direct", "k", b"still bound?")
    owner.call(1, C.Queue.Declare(queue=q, passive=True))
    other.close()
    owner.close()
