"""``properties.encode`` writes exactly the bytes pamqp's ``Properties.marshal`` writes (the shovel
encodes every message a remote source delivers into this broker's store with it), for every value
pamqp writes as it came: not a float, which pamqp narrows to 32 bits, nor ``bytes``, which it
refuses (tests/test_header_values.py)."""

from __future__ import annotations

import datetime
import random

from pamqp import commands

from broker import properties

_SHORT = ("content_type", "content_encoding", "correlation_id", "reply_to", "expiration", "message_id",
          "message_type", "user_id", "app_id")


def _random_props(rng: random.Random) -> commands.Basic.Properties:
    p = commands.Basic.Properties()
    for name in _SHORT:
        if rng.random() < 0.4:
            value = rng.choice(["", "x", "text/plain", "é" * rng.randint(1, 20), f"id-{rng.randint(0, 9)}"])
            setattr(p, name, value)
    if rng.random() < 0.5:
        p.delivery_mode = rng.choice([1, 2])
    if rng.random() < 0.3:
        p.priority = rng.randint(0, 9)
    if rng.random() < 0.3:
        p.timestamp = datetime.datetime.fromtimestamp(rng.randint(0, 2**32), tz=datetime.UTC)
    if rng.random() < 0.4:
        p.headers = rng.choice([{}, {"a": 1},
                                {"x-death": [{"count": 2, "queue": "q"}], "t": True, "n": None}])
    return p


def test_encode_is_pamqps_marshal() -> None:
    rng = random.Random(29)
    for _ in range(2000):
        p = _random_props(rng)
        assert properties.encode(p) == bytes(p.marshal()), p


def test_encode_of_nothing_and_of_a_naive_timestamp() -> None:
    assert properties.encode(commands.Basic.Properties()) == properties.EMPTY
    p = commands.Basic.Properties(timestamp=datetime.datetime(2026, 11, 27, 13, 0))
    assert properties.encode(p) == bytes(p.marshal())
