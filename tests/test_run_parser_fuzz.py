"""The publish-run parser against the general frame path, on damaged and re-chunked input.

The run parser (``AMQPConnection._publish_run``) checks the frames of publishes that repeat
the last method frame inline, and leaves anything it does not take to the general path. A
stream of varied publishes (message-ids, timestamps, headers, bodies of different sizes, two
channels) is damaged at random octets and cut into random reads, then fed once with the fast
paths on and once with them off: what the publisher is told (every frame it is sent, closes
included) and what a consumer receives must be identical.
"""

from __future__ import annotations

import asyncio
import datetime
import tempfile
from pathlib import Path
from typing import Any

from _amqp_session import Client, close_node, make_node, publish_frames, pump
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pamqp import commands

message_st = st.tuples(
    st.sampled_from((1, 1, 1, 2)),  # channel (mostly one: runs)
    st.sampled_from(("none", "id", "full", "headers")),
    st.integers(0, 300),  # body size
)
case_st = st.fixed_dictionaries({
    "messages": st.lists(message_st, min_size=2, max_size=30),
    # (anywhere?, where, value): most damage lands on a frame's framing (type, channel, size,
    # end octet) or a header frame's class, weight, body size and property flags
    "flips": st.lists(st.tuples(st.sampled_from((False, False, False, True)), st.integers(0, 1 << 30),
                                st.integers(0, 255)), min_size=1, max_size=3),
    "cuts": st.lists(st.integers(0, 1 << 30), max_size=6),
})


def _props(kind: str, i: int) -> commands.Basic.Properties | None:
    if kind == "none":
        return None
    if kind == "id":
        return commands.Basic.Properties(message_id=f"m{i}" * (1 + i % 3))
    if kind == "headers":
        return commands.Basic.Properties(headers={"task": f"t{i % 5}", "n": i})
    return commands.Basic.Properties(
        content_type="application/json", message_id=f"{i:032x}",
        timestamp=datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC) + datetime.timedelta(seconds=i),
        headers={"task": f"tasks.t{i % 17}", "id": str(i), "retries": i % 3})


def _framing(stream: bytes) -> list[int]:
    """Positions of the octets that frame the frames of ``stream``."""
    out: list[int] = []
    pos = 0
    while pos + 7 <= len(stream):
        size = int.from_bytes(stream[pos + 3 : pos + 7])
        out += range(pos, pos + 7)  # type, channel, size
        if stream[pos] == 2:
            out += range(pos + 7, min(pos + 23, pos + 7 + size))  # class, weight, body size, flags
        pos += 7 + size
        out.append(pos)  # the end octet
        pos += 1
    return out


async def _play(node: Any, case: dict[str, Any], fast: bool) -> tuple[bytes, list[Any], int]:
    node.vhosts["/"].fast.on = fast
    pub = Client(node)
    con = Client(node)
    for c in (pub, con):
        c.session.fast_paths = fast
    pub.open(1)
    pub.open(2)
    pub.method(commands.Queue.Declare(queue="q"))
    con.open(1)
    con.method(commands.Basic.Consume(queue="q", consumer_tag="c", no_ack=True))
    pub.read()
    stream = bytearray(b"".join(publish_frames("", "q", bytes([i % 251]) * size, _props(kind, i), ch)
                                for i, (ch, kind, size) in enumerate(case["messages"])))
    framing = _framing(bytes(stream))
    for anywhere, at, value in case["flips"]:
        stream[at % len(stream) if anywhere else framing[at % len(framing)]] = value
    cuts = sorted({c % len(stream) for c in case["cuts"]} | {0, len(stream)})
    for a, b in zip(cuts, cuts[1:], strict=False):
        pub.send(bytes(stream[a:b]))
    await pump(node)
    told = bytes(pub.session.out)
    con.read()
    got = [(d.channel, d.tag, d.props, d.body) for d in con.seen.deliveries]
    return told, got, node.vhosts["/"].queues["q"].message_count if "q" in node.vhosts["/"].queues else -1


def _run(case: dict[str, Any], fast: bool) -> tuple[bytes, list[Any], int]:
    async def main() -> tuple[bytes, list[Any], int]:
        with tempfile.TemporaryDirectory() as tmp:
            node = make_node(Path(tmp), "--no-sync")
            try:
                return await _play(node, case, fast)
            finally:
                close_node(node)
    return asyncio.run(main())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case_st)
@example({"messages": [(1, k, 100 + i) for i, k in enumerate(("full", "id", "full", "headers", "none"))],
          "flips": [(False, 102, 7)], "cuts": []})  # a content header of class 1852 inside a run
def test_damaged_and_rechunked_publish_runs_get_the_general_paths_answer(case: dict[str, Any]) -> None:
    fast = _run(case, True)
    slow = _run(case, False)
    assert fast == slow
