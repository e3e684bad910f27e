"""AMQP scenarios: exchanges, queues and bindings, with every reply-code path."""

from __future__ import annotations

from pamqp import commands as C

from ._steps import declare_q, declare_x, deliveries, fill, get, scenario
from ._wire import Run


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


@scenario
def headers_any_and_with_x(r: Run) -> None:
    c = r.conn()
    q = r.name("q")
    declare_q(c, q, exclusive=True)
    c.call(1, C.Queue.Bind(queue=q, exchange="amq.headers", routing_key="any",
                           arguments={"x-match": "any", "a": 1, "b": 2}))
    c.call(1, C.Queue.Bind(queue=q, exchange="amq.headers", routing_key="x",
                           arguments={"x-match": "all-with-x", "x-k": "v"}))
    for body, headers in ((b"any-hit", {"b": 2}), (b"any-miss", {"a": "1"}),
                          (b"with-x-hit", {"x-k": "v"}), (b"typed-miss", {"a": True})):
        c.publish(1, "amq.headers", "", body, C.Basic.Properties(headers=headers))
    for _ in range(3):
        get(c, q)
    c.close()


@scenario
def topic_edge_patterns(r: Run) -> None:
    c = r.conn()
    q = r.name("q")
    declare_q(c, q, exclusive=True)
    for key in ("#", "a.#.b", "*.*", ""):
        c.call(1, C.Queue.Bind(queue=q, exchange="amq.topic",
                               routing_key=f"{r.tag}.{key}" if key else r.tag))
    for rk in ("", "x", "x.y", "a.b", "a..b", "a.x.y.b", ".", "z.z.z"):
        c.publish(1, "amq.topic", f"{r.tag}.{rk}" if rk else r.tag, rk.encode() or b"<empty>")
    for _ in range(9):
        get(c, q)
    c.close()


@scenario
def queue_delete_counts_and_server_named_exclusive(r: Run) -> None:
    owner, other = r.conn(), r.conn()
    q = r.name("q")
    declare_q(owner, q, exclusive=True)
    fill(owner, q, 3)
    owner.call(1, C.Queue.Delete(queue=q))
    owner.call(1, C.Queue.Declare(queue="", exclusive=True))
    generated = str(owner.last_fields["queue"])
    other.call(1, C.Queue.Declare(queue=generated, passive=True))
    other.close()
    owner.close()
