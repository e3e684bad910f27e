"""basic.publish's arguments are decoded once per distinct encoding on a connection (issue 31).

A client publishing to 1,000 queues through the default exchange, one routing key per queue in
turn (each on a channel of its own), must not decode its arguments again on every publish: the
per-connection cache holds that many keys (bounded in count and bytes). What clients see with
the cache and without it is covered by tests/test_publish_differential.py (fast paths on/off).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from _amqp_session import Client, close_node, make_node, publish_frames, pump
from pamqp import commands

from broker.amqp import connection

KEYS = 300  # more than the 256 the cache held before
REAL = ("k0", "k150", "k299")  # keys that are queues; the rest route nowhere


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    made: list[str] = []
    real = connection.PublishArgs

    class Counted(real):  # type: ignore[misc, valid-type]
        __slots__ = ()

        def __init__(self, exchange: str, routing_key: str, mandatory: bool) -> None:
            made.append(routing_key)
            super().__init__(exchange, routing_key, mandatory)

    monkeypatch.setattr(connection, "PublishArgs", Counted)
    return made


def test_many_keys_on_many_channels_decode_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        node = make_node(tmp_path)
        try:
            made = _counting(monkeypatch)
            c = Client(node)
            for ch in range(1, KEYS + 1):
                c.open(ch)
            for name in REAL:
                c.method(commands.Queue.Declare(queue=name))
            # one publish per channel, every key in turn, three times, all in one read
            c.send(b"".join(publish_frames("", f"k{i}", b"m%d.%d" % (r, i), ch=i + 1)
                            for r in range(3) for i in range(KEYS)))
            await pump(node)
            assert c.closes() == []
            assert sorted(made) == sorted(f"k{i}" for i in range(KEYS))  # main: every publish, 900
            vh = node.vhosts["/"]
            assert [vh.queues[name].message_count for name in REAL] == [3, 3, 3]
        finally:
            close_node(node)

    asyncio.run(main())


def test_cache_is_bounded_in_bytes(tmp_path: Path) -> None:
    async def main() -> None:
        node = make_node(tmp_path)
        try:
            c = Client(node)
            c.open(1)
            long = "x" * 240
            c.send(b"".join(publish_frames("", f"{long}{i}", b"m") for i in range(1500)))
            await pump(node)
            assert c.closes() == []
            cache: dict[bytes, Any] = c.session._pub_args
            charged = sum(3 * len(raw) + connection._PUBLISH_ARGS_ENTRY for raw in cache)
            assert charged == c.session._pub_args_bytes <= connection._PUBLISH_ARGS_BYTES
            assert len(cache) <= connection._PUBLISH_ARGS_CACHE
        finally:
            close_node(node)

    asyncio.run(main())
