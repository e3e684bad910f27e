"""AMQP scenarios: publish, get, consume, acks, recover, qos, transactions and confirms."""

from __future__ import annotations

import time

from pamqp import commands as C

from .._raw import FRAME_HEADER, frame_bytes
from .._raw import header_payload as hp
from ._steps import declare_q, declare_x, deliveries, fill, get, scenario
from ._wire import Conn, Run


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
def basic_recover_async_without_requeue(r: Run) -> None:
    c = r.conn()
    q = r.name("q")
    declare_q(c, q, exclusive=True)
    fill(c, q, 1)
    get(c, q, no_ack=False)
    c.send(1, C.Basic.RecoverAsync(requeue=False))
    if not c.closed:
        c.until("Connection.Close")


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
    _until_ready(r, c, q, 2)
    get(c, q)
    get(c, q)
    c.close()


def _until_ready(r: Run, c: Conn, q: str, n: int) -> None:
    """Wait, unrecorded and bounded, until ``q`` holds ``n`` ready messages. RabbitMQ gives a
    closed channel's unacked messages back to their queues after its close-ok, asynchronously
    (the queue learns of the channel's end by a monitor), so a get right after the close-ok may
    find the queue empty on a loaded machine; Skred requeues them before the close-ok."""
    mark = len(r.transcript)
    for _ in range(250):
        rec = c.call(1, C.Queue.Declare(queue=q, passive=True))[0]
        if rec[2] == "Queue.DeclareOk" and rec[3].get("message_count") == n:
            break
        time.sleep(0.02)  # poll interval, bounded by the loop count
    del r.transcript[mark:]


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


# -- message features clients see in headers and order ---------------------------------------
@scenario
def dead_letter_on_reject_with_x_death(r: Run) -> None:
    c = r.conn()
    q, dlq = r.name("q"), r.name("dlq")
    declare_q(c, dlq, exclusive=True)
    declare_q(c, q, exclusive=True, arguments={"x-dead-letter-exchange": "",
                                               "x-dead-letter-routing-key": dlq})
    fill(c, q, 2)
    get(c, q, no_ack=False)
    c.send(1, C.Basic.Reject(delivery_tag=1, requeue=False))
    get(c, q, no_ack=False)
    c.send(1, C.Basic.Nack(delivery_tag=2, requeue=False))
    c.call(1, C.Basic.Consume(queue=dlq, consumer_tag="d", no_ack=True))
    deliveries(c, 2)
    c.close()


@scenario
def dead_letter_on_expiry(r: Run) -> None:
    c = r.conn()
    q, dlq = r.name("q"), r.name("dlq")
    declare_q(c, dlq, exclusive=True)
    c.call(1, C.Basic.Consume(queue=dlq, consumer_tag="d", no_ack=True))
    declare_q(c, q, exclusive=True, arguments={"x-message-ttl": 50, "x-dead-letter-exchange": "",
                                               "x-dead-letter-routing-key": dlq})
    c.publish(1, "", q, b"expires", C.Basic.Properties(message_id="m1"))
    c.publish(1, "", q, b"expires-too", C.Basic.Properties(expiration="10"))
    deliveries(c, 2)
    c.close()


@scenario
def max_length_drop_head_and_reject_publish(r: Run) -> None:
    c = r.conn()
    q1, q2 = r.name("drop"), r.name("reject")
    declare_q(c, q1, exclusive=True, arguments={"x-max-length": 2})
    declare_q(c, q2, exclusive=True, arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
    c.call(1, C.Confirm.Select())
    for i in range(3):
        c.publish(1, "", q1, f"d{i}".encode())
        c.recv(1)
    for i in range(2):
        c.publish(1, "", q2, f"r{i}".encode())
        c.recv(1)  # ack, then nack
    for qn in (q1, q1, q1, q2, q2):
        get(c, qn)
    c.close()


@scenario
def alternate_exchange(r: Run) -> None:
    c = r.conn()
    x, ae, q = r.name("x"), r.name("ae"), r.name("q")
    declare_x(c, ae, "fanout", auto_delete=True)
    declare_x(c, x, "direct", auto_delete=True, arguments={"alternate-exchange": ae})
    declare_q(c, q, exclusive=True)
    c.call(1, C.Queue.Bind(queue=q, exchange=ae))
    c.call(1, C.Confirm.Select())
    c.publish(1, x, "unrouted", b"to the alternate", mandatory=True)
    c.recv(1)  # ack, no basic.return: the alternate exchange routed it
    get(c, q)
    c.close()


@scenario
def direct_reply_to(r: Run) -> None:
    c = r.conn()
    q = r.name("rpc")
    declare_q(c, q, exclusive=True)
    c.call(1, C.Basic.Consume(queue="amq.rabbitmq.reply-to", consumer_tag="rt", no_ack=True))
    c.publish(1, "", q, b"request", C.Basic.Properties(reply_to="amq.rabbitmq.reply-to",
                                                         correlation_id="c1"))
    get(c, q)
    reply_to = str(c.last_props.get("reply_to", ""))
    c.publish(1, "", reply_to, b"response", C.Basic.Properties(correlation_id="c1"))
    deliveries(c, 1)
    c.call(2, C.Channel.Open())
    c.call(2, C.Basic.Consume(queue="amq.rabbitmq.reply-to", consumer_tag="x"))  # needs no_ack
    c.close()


@scenario
def consumer_priorities(r: Run) -> None:
    c = r.conn()
    q = r.name("q")
    declare_q(c, q, exclusive=True)
    c.call(1, C.Basic.Qos(prefetch_count=1))
    c.call(1, C.Basic.Consume(queue=q, consumer_tag="low", arguments={"x-priority": 1}))
    c.call(1, C.Basic.Consume(queue=q, consumer_tag="high", arguments={"x-priority": 10}))
    fill(c, q, 3)
    deliveries(c, 2)  # one each: high first, then low (high is at its prefetch)
    c.close()


@scenario
def single_active_consumer(r: Run) -> None:
    c = r.conn()
    q = r.name("q")
    declare_q(c, q, exclusive=True, arguments={"x-single-active-consumer": True})
    c.call(1, C.Basic.Consume(queue=q, consumer_tag="first", no_ack=True))
    c.call(1, C.Basic.Consume(queue=q, consumer_tag="second", no_ack=True))
    fill(c, q, 2)
    deliveries(c, 2)
    c.call(1, C.Basic.Cancel(consumer_tag="first"))
    fill(c, q, 1)
    deliveries(c, 1)
    c.close()


@scenario
def unacked_requeued_when_connection_closes(r: Run) -> None:
    c, other = r.conn(), r.conn()
    q = r.name("q")
    declare_q(other, q, auto_delete=False)
    fill(other, q, 2)
    c.call(1, C.Basic.Consume(queue=q, consumer_tag="t"))
    deliveries(c, 2)
    c.send(1, C.Basic.Ack(delivery_tag=1))
    c.close()
    get(other, q)
    get(other, q)
    other.call(1, C.Queue.Delete(queue=q))
    other.close()


@scenario
def ack_of_autoack_delivery_and_no_local(r: Run) -> None:
    c = r.conn()
    q = r.name("q")
    declare_q(c, q, exclusive=True)
    c.call(1, C.Basic.Consume(queue=q, consumer_tag="t", no_local=True, no_ack=True))
    c.publish(1, "", q, b"no_local is ignored by RabbitMQ")
    deliveries(c, 1)
    c.send(1, C.Basic.Ack(delivery_tag=1))
    c.until("Channel.Close")
    c.close()


@scenario
def qos_changed_while_consuming(r: Run) -> None:
    c = r.conn()
    q = r.name("q")
    declare_q(c, q, exclusive=True)
    fill(c, q, 4)
    c.call(1, C.Basic.Qos(prefetch_count=1))
    c.call(1, C.Basic.Consume(queue=q, consumer_tag="t"))
    deliveries(c, 1)
    c.call(1, C.Basic.Qos(prefetch_count=3))  # applies to consumers created after it (RabbitMQ)
    c.send(1, C.Basic.Ack(delivery_tag=1))
    deliveries(c, 1)
    c.call(1, C.Basic.Cancel(consumer_tag="t"))
    c.call(1, C.Basic.Recover(requeue=True))
    c.call(1, C.Basic.Consume(queue=q, consumer_tag="t2"))
    deliveries(c, 3)
    c.close()


@scenario
def tx_acks_and_multiple(r: Run) -> None:
    c = r.conn()
    q = r.name("q")
    declare_q(c, q, exclusive=True)
    fill(c, q, 3)
    c.call(1, C.Tx.Select())
    for _ in range(3):
        get(c, q, no_ack=False)
    c.send(1, C.Basic.Ack(delivery_tag=2, multiple=True))
    c.send(1, C.Basic.Reject(delivery_tag=3, requeue=True))
    c.call(1, C.Queue.Declare(queue=q, passive=True))  # nothing settled before commit
    c.call(1, C.Tx.Commit())
    c.call(1, C.Queue.Declare(queue=q, passive=True))
    get(c, q)
    c.close()


@scenario
def message_ttl_zero_and_per_message_expiry(r: Run) -> None:
    c = r.conn()
    q = r.name("q")
    declare_q(c, q, exclusive=True, arguments={"x-message-ttl": 0})
    c.publish(1, "", q, b"no consumer: expires at once")
    c.call(1, C.Queue.Declare(queue=q, passive=True))
    get(c, q)
    c.call(1, C.Basic.Consume(queue=q, consumer_tag="t", no_ack=True))
    c.publish(1, "", q, b"consumer waiting: delivered")
    deliveries(c, 1)
    c.publish(1, "", q, b"bad expiration", C.Basic.Properties(expiration="soon"))
    c.until("Channel.Close")
    c.close()


@scenario
def consume_and_cancel_nowait(r: Run) -> None:
    c = r.conn()
    q = r.name("q")
    declare_q(c, q, exclusive=True)
    fill(c, q, 1)
    c.send(1, C.Basic.Consume(queue=q, consumer_tag="t", no_ack=True, nowait=True))
    deliveries(c, 1)  # the delivery, no consume-ok
    c.send(1, C.Basic.Cancel(consumer_tag="t", nowait=True))
    c.call(1, C.Queue.Declare(queue=q, passive=True))  # no cancel-ok before this answer
    c.send(1, C.Basic.Consume(queue=r.name("missing"), nowait=True))
    c.until("Channel.Close")
    c.close()
