"""The MQTT packet parser and encoders (broker/mqtt/packets.py): no sockets."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.mqtt import packets as P
from broker.mqtt import props as PR
from broker.mqtt.mapping import to_routing_key, to_topic
from broker.mqtt.retained import Retained, adopt, topic_matches, vhost_of
from broker.mqtt.session import split_username


def feed_all(data: bytes, chunk: int = 0, max_packet: int = 1 << 20) -> tuple[list[P.Packet], P.Parser]:
    p = P.Parser(max_packet)
    out: list[P.Packet] = []
    if chunk:
        for i in range(0, len(data), chunk):
            out += p.feed(data[i:i + chunk])
    else:
        out = p.feed(data)
    return out, p


CONNECT = P.Connect("MQTT", 4, False, 30, "dev-1", P.Will("dev/1/status", b"gone", 1, True), "u", b"pw")


@pytest.mark.parametrize("chunk", [0, 1, 3])
def test_packets_round_trip_whole_and_split(chunk: int) -> None:
    data = (P.encode_connect(CONNECT)
            + P.encode_publish("a/b", b"x" * 300, 1, True, True, 9)
            + P.encode_subscribe(P.Subscribe(5, (("a/+", 1), ("#", 0))))
            + P.encode_unsubscribe(P.Unsubscribe(6, ("a/+",)))
            + P.encode_packet_id(P.PUBACK, 7) + P.encode_packet_id(P.PUBREL, 8)
            + bytes((P.PINGREQ << 4, 0, P.DISCONNECT << 4, 0)))
    out, parser = feed_all(data, chunk)
    assert parser.error is None
    assert out == [CONNECT, P.Publish("a/b", b"x" * 300, 1, True, True, 9),
                   P.Subscribe(5, (("a/+", 1), ("#", 0))), P.Unsubscribe(6, ("a/+",)),
                   P.PacketId(P.PUBACK, 7), P.PacketId(P.PUBREL, 8), P.Bare(P.PINGREQ), P.Disconnect()]


def test_mqtt_3_1_connect() -> None:
    out, _ = feed_all(P.encode_connect(P.Connect("MQIsdp", 3, True, 0, "c", None, "u", b"p")))
    assert out[0] == P.Connect("MQIsdp", 3, True, 0, "c", None, "u", b"p")


CONNECT5 = P.Connect("MQTT", 5, False, 30, "d5", P.Will("w/t", b"bye", 1, False, {PR.WILL_DELAY: 5,
                     PR.USER_PROPERTY: [("a", "1"), ("a", "2")]}), None, b"token",
                     {PR.SESSION_EXPIRY: 3600, PR.RECEIVE_MAXIMUM: 20, PR.MAXIMUM_PACKET_SIZE: 4096})


@pytest.mark.parametrize("chunk", [0, 1])
def test_mqtt5_packets_round_trip(chunk: int) -> None:
    """After a level-5 CONNECT every packet is read as MQTT 5: properties, reason codes, options."""
    pub_props = {PR.TOPIC_ALIAS: 2, PR.CORRELATION_DATA: b"\x00c", PR.CONTENT_TYPE: "t"}
    sub = P.Subscribe(4, (("x/#", 1 | P.NO_LOCAL | 2 << 4),), {PR.SUBSCRIPTION_ID: 300})
    pub_props = {PR.TOPIC_ALIAS: 2, PR.CORRELATION_DATA: b"\x00c", PR.CONTENT_TYPE: "t"}
    sub = P.Subscribe(4, (("x/#", 1 | P.NO_LOCAL | 2 << 4),), {PR.SUBSCRIPTION_ID: 300})
    data = (P.encode_connect(CONNECT5)
            + P.encode_publish("", b"p", 1, False, False, 3, pub_props, v5=True)
            + P.encode_subscribe(sub, v5=True)
            + P.encode_unsubscribe(P.Unsubscribe(5, ("x/#",), {PR.USER_PROPERTY: [("k", "v")]}), v5=True)
            + P.encode_packet_id(P.PUBACK, 6) + P.encode_packet_id(P.PUBREC, 7, 0x10, {PR.REASON_STRING: "r"})
            + P.encode_disconnect(0x04, {PR.SESSION_EXPIRY: 0}) + bytes((P.AUTH << 4, 0)))
    out, parser = feed_all(data, chunk)
    assert parser.error is None, parser.error
    assert out == [CONNECT5,
                   P.Publish("", b"p", 1, False, False, 3, pub_props), sub,
                   P.Unsubscribe(5, ("x/#",), {PR.USER_PROPERTY: [("k", "v")]}),
                   P.PacketId(P.PUBACK, 6), P.PacketId(P.PUBREC, 7, 0x10, {PR.REASON_STRING: "r"}),
                   P.Disconnect(0x04, {PR.SESSION_EXPIRY: 0}), P.Auth()]
    assert parser.level == 5


V5_BAD = {
    "property not allowed in CONNECT": (PR.TOPIC_ALIAS, 1, P.RC_PROTOCOL_ERROR),
    "property twice": (PR.SESSION_EXPIRY, 2, P.RC_PROTOCOL_ERROR),
    "receive maximum 0": (PR.RECEIVE_MAXIMUM, 0, P.RC_PROTOCOL_ERROR),
}


@pytest.mark.parametrize("name", sorted(V5_BAD))
def test_mqtt5_bad_properties_are_protocol_errors(name: str) -> None:
    ident, value, code = V5_BAD[name]
    raw = PR.varint(ident) + (bytes((0, value)) if PR.TYPES[ident] == "h" else (0).to_bytes(4, "big"))
    if name == "property twice":
        raw = raw + raw
    if name == "property not allowed in CONNECT":
        raw = PR.varint(ident) + b"\x00\x01"
    body = b"\x00\x04MQTT\x05\x02\x00\x1e" + PR.varint(len(raw)) + raw + b"\x00\x01c"
    out, parser = feed_all(bytes((0x10,)) + PR.varint(len(body)) + body)
    assert out == [] and parser.error is not None and parser.error.code == code


def test_mqtt5_subscription_options_are_checked() -> None:
    head = P.encode_connect(P.Connect("MQTT", 5, True, 0, "c", None, "u", b"p"))
    for options in (0x03, 0x30, 0x40):  # QoS 3, retain handling 3, a reserved bit
        out, parser = feed_all(head + P.encode_subscribe(P.Subscribe(1, (("a", options),)), v5=True))
        assert len(out) == 1 and parser.error is not None, options


def test_a_topic_alias_makes_an_empty_topic_valid_only_in_mqtt5() -> None:
    v5 = P.encode_connect(P.Connect("MQTT", 5, True, 0, "c", None, "u", b"p"))
    _, parser = feed_all(v5 + P.encode_publish("", b"x", 0, False, False, 0, {}, v5=True))
    assert parser.error is not None and parser.error.code == P.RC_TOPIC_NAME_INVALID
    out, parser = feed_all(v5 + P.encode_publish("", b"x", 0, False, False, 0, {PR.TOPIC_ALIAS: 1}, v5=True))
    assert parser.error is None and len(out) == 2


BAD = {
    "reserved connect flag": bytes((0x10, 12)) + b"\x00\x04MQTT\x04\x03\x00\x3c\x00\x00",
    "wrong protocol name": bytes((0x10, 12)) + b"\x00\x04MQXT\x04\x02\x00\x3c\x00\x00",
    "publish qos 3": bytes((0x36, 5)) + b"\x00\x01a\x00\x01",
    "dup on qos 0": bytes((0x38, 3)) + b"\x00\x01a",
    "wildcard in topic name": bytes((0x30, 3)) + b"\x00\x01+",
    "packet id 0": bytes((0x32, 5)) + b"\x00\x01a\x00\x00",
    "subscribe wrong flags": bytes((0x80, 6)) + b"\x00\x01\x00\x01a\x00",
    "subscribe no filters": bytes((0x82, 2)) + b"\x00\x01",
    "subscribe qos 3": bytes((0x82, 6)) + b"\x00\x01\x00\x01a\x03",
    "misplaced #": bytes((0x82, 8)) + b"\x00\x01\x00\x03a#b\x00",
    "misplaced +": bytes((0x82, 8)) + b"\x00\x01\x00\x03a+/\x00",
    "string ends early": bytes((0x30, 3)) + b"\x00\x09a",
    "NUL in a string": bytes((0x30, 4)) + b"\x00\x02a\x00",
    "bad utf-8": bytes((0x30, 4)) + b"\x00\x02\xc3\x28",
    "surrogate": bytes((0x30, 5)) + b"\x00\x03\xed\xa0\x80",
    "pingreq with body": bytes((0xC0, 1)) + b"\x00",
    "puback with extra": bytes((0x40, 3)) + b"\x00\x01\x00",
    "connack from a client": bytes((0x20, 2)) + b"\x00\x00",
    "five-byte length": bytes((0x30, 0xFF, 0xFF, 0xFF, 0xFF, 0x01)),
    "type 0": bytes((0x00, 0)),
    "type 15": bytes((0xF0, 0)),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_malformed_input_sets_the_error_and_keeps_earlier_packets(name: str) -> None:
    good = P.encode_publish("ok", b"1", 0, False, False, 0)
    out, parser = feed_all(good + BAD[name])
    assert out == [P.Publish("ok", b"1", 0, False, False, 0)]
    assert isinstance(parser.error, P.MalformedPacket)
    assert parser.feed(good) == []  # nothing after the violation


def test_a_packet_over_the_limit_is_refused_before_it_is_buffered() -> None:
    p = P.Parser(1000)
    assert p.feed(bytes((0x30,)) + bytes((0xE8, 0x07))) == []  # announces 1000 bytes + 3 header
    assert p.error is not None and "over the limit" in str(p.error)
    assert len(p.buf) == 0


def test_need_more_bytes_is_an_empty_list() -> None:
    p = P.Parser(1 << 20)
    data = P.encode_publish("a", b"x" * 200, 0, False, False, 0)
    for i in range(len(data) - 1):
        assert p.feed(data[i:i + 1]) == []
    assert p.feed(data[-1:]) == [P.Publish("a", b"x" * 200, 0, False, False, 0)]
    assert p.error is None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.integers(min_value=1, max_value=40))
def test_random_bytes_never_raise(data: bytes, chunk: int) -> None:
    """Whatever arrives, the parser returns packets or sets its error: nothing else escapes."""
    feed_all(data, chunk, max_packet=4096)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.integers(min_value=1, max_value=40))
def test_random_bytes_after_an_mqtt5_connect_never_raise(data: bytes, chunk: int) -> None:
    v5 = P.encode_connect(P.Connect("MQTT", 5, True, 0, "c", None, "u", b"p"))
    out, _ = feed_all(v5 + data, chunk, max_packet=4096)
    assert out and isinstance(out[0], P.Connect)


@settings(max_examples=200, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00+#"), min_size=1,
               max_size=60), st.binary(max_size=100), st.integers(0, 1), st.integers(1, 65535))
def test_publish_encoding_round_trips(topic: str, payload: bytes, qos: int, pid: int) -> None:
    out, parser = feed_all(P.encode_publish(topic, payload, qos, False, False, pid if qos else 0))
    assert parser.error is None
    assert out == [P.Publish(topic, payload, qos, False, False, pid if qos else 0)]


def test_connack_suback_encodings() -> None:
    assert P.encode_connack(True, P.ACCEPTED) == b"\x20\x02\x01\x00"
    assert P.encode_connack(True, P.BAD_CREDENTIALS) == b"\x20\x02\x00\x04"  # never present on refusal
    assert P.encode_suback(10, [1, 0x80]) == b"\x90\x04\x00\x0a\x01\x80"
    assert P.encode_packet_id(P.PUBREL, 3) == b"\x62\x02\x00\x03"


def test_topics_map_to_routing_keys_as_rabbitmq_maps_them() -> None:
    assert to_routing_key("a/b.c/+/#") == "a.b/c.*.#"
    assert to_topic("a.b/c") == "a/b.c"
    assert to_topic(to_routing_key("x/y.z")) == "x/y.z"
    assert split_username("vh:alice", "/") == ("vh", "alice")
    assert split_username("alice", "/") == ("/", "alice")


@pytest.mark.parametrize(("f", "topic", "match"), [
    ("a/b", "a/b", True), ("a/+", "a/b", True), ("a/+", "a/b/c", False), ("a/#", "a", True),
    ("a/#", "a/b/c", True), ("#", "a/b", True), ("+/+", "/x", True), ("+", "/x", False),
    ("#", "$SYS/x", False), ("+/x", "$SYS/x", False), ("$SYS/#", "$SYS/x", True), ("a/+/c", "a//c", True),
])
def test_topic_matches_as_the_spec_says(f: str, topic: str, match: bool) -> None:
    assert topic_matches(f, topic) is match


class _Files:
    def __init__(self) -> None:
        self.d: dict[str, bytes] = {}

    def put(self, name: str, data: bytes) -> None:
        self.d[name] = data

    def delete(self, name: str) -> None:
        self.d.pop(name, None)

    def items(self):  # type: ignore[no-untyped-def]
        return iter(list(self.d.items()))


def test_retained_store_keeps_clears_bounds_and_reloads() -> None:
    files = _Files()
    r = Retained(lambda _v: files, max_messages=2)
    assert r.set("/", "a/b", 1, b"1") and r.set("v", "a/b", 0, b"2")
    assert not r.set("/", "a/c", 1, b"3")  # the bound: 2 messages on the node
    assert r.set("/", "a/b", 0, b"4")  # replacing one is always fine
    assert r.matching("/", "a/#") == [("a/b", 0, b"4")]
    files.d["junk"] = b"\x00"
    again = Retained(lambda _v: files, max_messages=2)  # what a restart or a new leader reads
    again.open("/")  # each vhost's messages read as it opens here (only its own files' are its)
    assert again.matching("v", "+/b") == [("a/b", 0, b"2")] and again.count == 2
    assert again.set("/", "a/b", 1, b"") and again.matching("/", "#") == [] and again.count == 1


def test_adopting_a_node_wide_directory_moves_only_vhosts_served_here_durably_first() -> None:
    """A data dir from before (retained.adopt): a vhost served here gets its files, written and
    made durable before the node-wide copies go; another vhost's stay where they were."""
    legacy, mine = _Files(), _Files()
    Retained(lambda _v: legacy, 10).set("/", "a", 1, b"x")
    Retained(lambda _v: legacy, 10).set("elsewhere", "b", 1, b"y")
    legacy.d["junk"] = b"\x00"
    seen: list[int] = []
    moved = adopt(legacy, lambda _v: mine, lambda v: v == "/", vhost_of,
                  lambda: seen.append(len(legacy.d)))
    assert moved == 1 and seen == [3]  # durable while both copies were there
    assert len(mine.d) == 1 and len(legacy.d) == 2
    assert Retained(lambda _v: mine, 10).matching("/", "#") == [("a", 1, b"x")]
