"""The pamqp half of the codec builds no attribute name per call (issue 31: memory after
deletes). pamqp looked each argument's type up as ``getattr(cls, '_' + attr)``; CPython's type
attribute cache kept the last of those strings per slot alive, and made at a peak (1,000
connections opening) a couple of thousand of them pinned the allocator's arenas after the
connections were gone. No sockets: the codec's encode and decode, traced."""

from __future__ import annotations

import gc
import tracemalloc

from pamqp import commands

from broker.amqp import codec

METHODS = [
    commands.Queue.Declare(queue="q.names", durable=True, arguments={"x-max-length": 10}),
    commands.Queue.Bind(queue="q.names", exchange="amq.topic", routing_key="a.b"),
    commands.Exchange.Declare(exchange="x.names", exchange_type="topic"),
    commands.Basic.Consume(queue="q.names", consumer_tag="c1"),
    commands.Basic.Qos(prefetch_count=100),
    commands.Channel.Close(reply_code=200, reply_text="ok", class_id=0, method_id=0),
    commands.Connection.Tune(channel_max=2047, frame_max=131072, heartbeat=60),
]


def _round_trips() -> None:
    for m in METHODS:
        frame = codec.encode_method(1, m)
        codec.decode_method(frame[7:-1])


def test_encode_and_decode_leave_no_names_behind() -> None:
    _round_trips()  # anything built once (per class and argument) is built now
    tracemalloc.start(4)
    try:
        gc.collect()
        before = tracemalloc.take_snapshot()
        for _ in range(50):
            _round_trips()
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    only_pamqp = [tracemalloc.Filter(True, "*pamqp/base.py")]
    grown = [s for s in after.filter_traces(only_pamqp).compare_to(before.filter_traces(only_pamqp), "lineno")
             if s.count_diff > 0]
    assert not grown, [str(s) for s in grown]
