"""MQTT's AMQP property lists: encoded once per shape, read once per distinct list, and the
same bytes pamqp would write (the cache changes the cost, never the message)."""

from __future__ import annotations

import pytest
from pamqp import commands

from broker import properties
from broker.mqtt import mapping
from broker.mqtt import props as PR


class _Encodes:
    """Counts the property encodes ``mapping`` asks ``broker.properties`` for."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = 0
        real = properties.encode

        def counted(p: commands.Basic.Properties) -> bytes:
            self.n += 1
            return real(p)

        monkeypatch.setattr(properties, "encode", counted)


def test_a_plain_publish_is_encoded_once_per_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    encodes = _Encodes(monkeypatch)
    shapes = [(qos, retain, origin) for qos in (0, 1, 2) for retain in (False, True)
              for origin in (None, "client-a")]
    first = {shape: mapping.amqp_props(*shape[:2], origin=shape[2]) for shape in shapes}
    for _ in range(200):
        for shape in shapes:
            assert mapping.amqp_props(shape[0], shape[1], {}, shape[2]) == first[shape]
    assert encodes.n <= len(shapes)  # 0 when an earlier test met them already


@pytest.mark.parametrize(("qos", "retain", "origin"), [(0, False, None), (1, True, "c"), (2, False, "c")])
def test_the_cached_list_is_what_pamqp_writes(qos: int, retain: bool, origin: str | None) -> None:
    headers: dict[str, object] = {mapping.QOS_HEADER: qos}
    if retain:
        headers[mapping.RETAIN_HEADER] = True
    if origin is not None:
        headers[mapping.ORIGIN_HEADER] = origin
    want = properties.encode(commands.Basic.Properties(delivery_mode=2 if qos else 1, headers=headers))
    assert mapping.amqp_props(qos, retain, None, origin) == want
    m = mapping.delivered(want, True)
    assert (m.qos, m.retain, m.origin, m.props) == (qos, retain, origin, {})
    assert mapping.delivered(want, True) is m  # read once


def test_mqtt5_properties_are_encoded_each_time(monkeypatch: pytest.MonkeyPatch) -> None:
    encodes = _Encodes(monkeypatch)
    for i in range(3):
        raw = mapping.amqp_props(1, False, {PR.USER_PROPERTY: [("k", str(i))]})
        assert properties.headers(raw)["k"] == str(i)
    assert encodes.n == 3


@pytest.mark.parametrize("data", [b"\xff\xfe binary", b"x" * 300, b"Yk\xd9\xd4\xd8\xea\xd5\xe4"],
                         ids=["not-utf8", "over-255", "fuzzed"])
def test_correlation_data_amqp_cannot_hold_as_an_id_rides_in_a_header(data: bytes) -> None:
    """MQTT 5 correlation data that is not UTF-8 or longer than a short string goes in the
    x-correlation-id header as bytes and comes back whole (found by the packet fuzzer: it raised)."""
    raw = mapping.amqp_props(1, False, {PR.CORRELATION_DATA: data})
    assert bytes(properties.headers(raw)[mapping.CORRELATION_HEADER]) == data
    assert properties.decode(raw).correlation_id is None
    assert mapping.delivered(raw, True).props[PR.CORRELATION_DATA] == data
