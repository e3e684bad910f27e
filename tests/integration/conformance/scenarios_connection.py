"""AMQP scenarios: connection negotiation, limits, framing errors, channels."""

from __future__ import annotations

from pamqp import commands as C

from .._raw import FRAME_BODY, FRAME_HEADER, FRAME_HEARTBEAT, FRAME_METHOD, frame_bytes, method_bytes
from .._raw import header_payload as hp
from ._steps import scenario
from ._wire import Run


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
    c.call(6, C.Channel.Open())  # channel-max counts open channels (two), not the number
    if not c.closed:
        c.close()


@scenario
def conn_channel_max_counts_open_channels(r: Run) -> None:
    c = r.conn(channel_max=2)
    c.call(2, C.Channel.Open())
    c.call(1, C.Channel.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0))
    c.call(40, C.Channel.Open())  # a number above channel_max, but only two open
    c.call(7, C.Channel.Open())  # a third open channel: 530
    if not c.closed:
        c.until("Connection.Close")


@scenario
def conn_channel_max_counts_a_method_on_a_new_channel(r: Run) -> None:
    c = r.conn(channel_max=1)
    c.send(2, C.Basic.Qos(prefetch_count=1))
    if not c.closed:
        c.until("Connection.Close")


@scenario
def conn_connection_method_on_a_channel(r: Run) -> None:
    c = r.conn()
    c.send(1, C.Connection.UpdateSecret(new_secret="guest", reason="refresh"))
    if not c.closed:
        c.until("Connection.Close")


@scenario
def conn_connection_close_on_a_channel(r: Run) -> None:
    c = r.conn()
    c.send(1, C.Connection.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0))
    if not c.closed:
        c.until("Connection.Close")


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




@scenario
def conn_missed_heartbeats(r: Run) -> None:
    """A client that negotiates heartbeat 1 s and then sends nothing is dropped."""
    c = r.conn(heartbeat=1)
    c.until("Connection.Close")
